"""Tables: the schema, the cost that ranks rows, the dispatch table itself, the JSON winners
map, safe writes.

``schema`` (columns and provenance), ``cost`` (what a step costs its caller), ``frame``
(build and rank; pandas and pyarrow), ``files`` (read, write, upgrade), ``checks``
(validate), ``combine`` (merge, winners, summary, diff, the winners map as JSON),
``winners_map`` (the JSON map engines load without pandas), ``outputs`` (checked, atomic
writes). The pandas functions are reachable as ``mlatune.table.read`` and so on, loaded on
first use, so importing ``mlatune.table.winners_map`` or ``mlatune.table.schema`` (as the
dispatcher does) never imports pandas.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "frame": ("assign_ranks", "build", "coerce", "competing_rows", "key_strings",
              "provenances", "step_costs"),
    "files": ("FORMATS", "read", "read_versioned", "upgrade", "write"),
    "checks": ("validate",),
    "combine": ("diff", "merge", "summary", "winners", "winners_json", "write_json"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"mlatune.table.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
