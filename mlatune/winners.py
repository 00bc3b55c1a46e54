"""The JSON winners map: a table's ok routes per problem key, for engines without pandas.

Written by ``mlatune export --format json`` (``table.winners_json``), read by
``Dispatcher.load`` and by any engine with a JSON parser::

    {"format": "mlatune-winners", "schema_version": 1, "key_fields": [...],
     "devices": [{"arch": "sm_90", "device_name": "NVIDIA H200", "cu_count": 132,
                  "provenance": [{...}],
                  "winners": {"<MLAProblem.key>": {"route": "...", "params": {...},
                                                   "time_us": 12.5,
                                                   "alternatives": [{...}, ...]}}}]}

A key is ``field=value`` pairs joined by ``|`` in ``key_fields`` order (bools
as 1/0). ``alternatives`` (absent with ``--winners-only``) lists the other ok
routes of the key, fastest first.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlatune.errors import TableError
from mlatune.problem import KEY_FIELDS, MLAProblem
from mlatune.schema import SCHEMA_VERSION

FORMAT = "mlatune-winners"


def parse_key(key: str) -> dict[str, str]:
    """``MLAProblem.key`` text back into its field values (as text)."""
    try:
        fields = dict(part.split("=", 1) for part in key.split("|"))
    except ValueError:
        fields = {}
    if tuple(fields) != KEY_FIELDS:
        raise ValueError(f"not a problem key: {key[:80]!r}")
    return fields


def problem_of(key: str) -> MLAProblem:
    return MLAProblem.from_key_dict(parse_key(key))


@dataclass(frozen=True)
class WinnersMap:
    """A valid winners map and, per device (in document order), each key's problem."""

    document: dict[str, Any]
    problems: list[dict[str, MLAProblem]]


def read(path: Path) -> WinnersMap:
    """A winners map from a file, refused (TableError, one line) unless valid."""
    try:
        document = json.loads(path.read_bytes())
    except OSError as exc:
        raise TableError(f"{path}: cannot read ({type(exc).__name__}: {exc})") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise TableError(f"{path}: not a readable JSON winners map ({exc})") from None
    found, parsed = _check(document)
    if found:
        raise TableError(f"{path}: invalid winners map ({len(found)} problem"
                         f"{'s' if len(found) > 1 else ''}): " + "; ".join(found))
    return WinnersMap(document, parsed)


def problems(document: Any) -> list[str]:
    """Every problem with a winners map, one line each."""
    return _check(document)[0]


def _check(document: Any) -> tuple[list[str], list[dict[str, MLAProblem]]]:
    """The problems, and each device's key -> MLAProblem (built once, for the dispatcher)."""
    if not isinstance(document, dict):
        return ["the top level is not an object"], []
    found: list[str] = []
    parsed: list[dict[str, MLAProblem]] = []
    if document.get("format") != FORMAT:
        found.append(f"format is {document.get('format')!r}, expected {FORMAT!r}")
    version = document.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        found.append(f"schema_version {version!r} is not a version number")
    elif version > SCHEMA_VERSION:
        found.append(f"schema_version {version} is newer than this mlatune reads "
                     f"({SCHEMA_VERSION}); upgrade mlatune")
    if document.get("key_fields") != list(KEY_FIELDS):
        found.append("key_fields differ from this mlatune's problem key")
    devices = document.get("devices")
    if not isinstance(devices, list) or not devices:
        return [*found, "devices is missing or empty"], parsed
    for i, entry in enumerate(devices):
        parsed.append({})
        if not isinstance(entry, dict):
            found.append(f"devices[{i}] is not an object")
            continue
        if not (isinstance(entry.get("arch"), str) and isinstance(entry.get("device_name"), str)
                and isinstance(entry.get("cu_count"), int)):
            found.append(f"devices[{i}] lacks arch, device_name or cu_count")
        if not isinstance(entry.get("provenance"), list):
            found.append(f"devices[{i}] lacks its provenance")
        entries = entry.get("winners")
        if not isinstance(entries, dict):
            found.append(f"devices[{i}] lacks its winners")
            continue
        bad = []
        for key, winner in entries.items():
            problem = _entry_problem(key, winner)
            if problem is None:
                bad.append(key)
            else:
                parsed[-1][key] = problem
        if bad:
            found.append(f"devices[{i}]: {len(bad)} invalid winner entries, e.g. "
                         f"{bad[0][:120]!r}")
    return found, parsed


def _entry_problem(key: str, winner: Any) -> MLAProblem | None:
    """The key's problem if the entry is valid, else None."""
    try:
        problem = problem_of(key)
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(winner, dict):
        return None
    alternatives = winner.get("alternatives", [])
    valid = isinstance(alternatives, list) and all(
        _valid_option(o) for o in (winner, *alternatives))
    return problem if valid else None


def _valid_option(option: Any) -> bool:
    time_us = option.get("time_us") if isinstance(option, dict) else None
    return (isinstance(option, dict) and isinstance(option.get("route"), str)
            and isinstance(option.get("params"), dict)
            and isinstance(time_us, (int, float)) and not isinstance(time_us, bool)
            and math.isfinite(time_us) and time_us > 0)
