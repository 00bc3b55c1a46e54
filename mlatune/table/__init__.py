"""Tables: the schema, the dispatch table itself, the JSON winners map, safe writes.

``schema`` (columns and provenance), ``frame`` (build, write, read, validate,
merge, summary, diff; pandas and pyarrow), ``winners_map`` (the JSON map engines
load without pandas), ``outputs`` (checked, atomic writes). ``frame``'s public
functions are reachable as ``mlatune.table.read`` and so on, loaded on first
use, so importing ``mlatune.table.winners_map`` or ``mlatune.table.schema``
(as the dispatcher does) never imports pandas.
"""

from __future__ import annotations

import importlib
from typing import Any

_FRAME = ("FORMATS", "assign_ranks", "build", "coerce", "competing_rows", "diff",
          "key_strings", "merge", "provenances", "read", "read_versioned", "summary",
          "validate", "winners", "winners_json", "write", "write_json")
__all__ = list(_FRAME)


def __getattr__(name: str) -> Any:
    if name in _FRAME:
        return getattr(importlib.import_module("mlatune.table.frame"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FRAME})
