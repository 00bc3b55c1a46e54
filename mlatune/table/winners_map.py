"""The JSON winners map: a table's ok routes per problem key, and the routes that failed
there, for engines without pandas.

Written by ``mlatune export --format json`` (``table.winners_json``), read by
``Dispatcher.load`` and by any engine with a JSON parser::

    {"format": "mlatune-winners", "schema_version": 6, "key_fields": [...],
     "devices": [{"arch": "sm_90", "device_name": "NVIDIA H200", "cu_count": 132,
                  "provenance": [{...}],
                  "winners": {"<MLAProblem.key>": {"route": "...", "params": {...},
                                                   "time_us": 12.5, "plan_on": "device",
                                                   "capturable": true, "plan_us": 1.5,
                                                   "plan_host_us": 9.0,
                                                   "launch_host_us": 20.0,
                                                   "alternatives": [{...}, ...],
                                                   "failed": {"crashed": ["gluon/triton"]}}},
                  "all_failed": {"<MLAProblem.key>": {"timeout": ["a/x", "b/y"], ...}}}]}

A key is ``field=value`` pairs joined by ``|`` in ``key_fields`` order (bools
as 1/0). ``alternatives`` (absent with ``--winners-only``) lists the other ok
routes of the key, fastest first. ``schema_version`` is the table schema's:
each option carries the table's columns of the same names (mlatune.table.schema), a
cost not measured as null. A schema v1 map (options without the step fields)
is upgraded as it is read, as a v1 table is: step kinds declared by the
routes, costs null, ``converted_from`` "v1" in each provenance record. Schema v3 added
how a DCP row was timed: an option measured across processes carries ``"dcp_timing":
"measured"`` (absent otherwise, so a v2 map reads as it is), and a problem with measured
options lists only those (``schema.competing``: a simulated time leaves the collectives
out); the options in the order of the ranks. Schema v5 options carry the errors measured
against the reference (``ERROR_FIELDS``: ``rel_err``, ``max_abs_err``, ``lse_err``), null
where not measured; an option without them (an older map's) reads as not measured.

Failures: the table's rows that are not ok (``FAILED_STATUSES``), so a dispatcher
never takes a route from a neighbour or the rule where it failed, as with the
table itself. ``failed`` (in a winner entry, absent when nothing failed at that
key, kept with ``--winners-only``) and ``all_failed`` (per device: the keys where
no route was ok) map each status to the routes that ended so, statuses in
``STATUSES`` order, routes sorted. Maps written before mlatune recorded failures
lack both, and are read as holding none. The two fields do not bump
``schema_version``: a reader that predates them ignores them and answers as it
always did (without these skips, as from any map it could read), whereas a bump
would make it refuse every map exported from now on and dispatch by rule.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlatune.errors import TableError
from mlatune.problem import KEY_FIELDS, MLAProblem
from mlatune.steps import PLAN_PLACES, RouteFacts
from mlatune.table.schema import (
    ARCH_PATTERN,
    MIN_TIME_US,
    NEITHER_STATUSES,
    SCHEMA_VERSION,
    STATUSES,
    STEP_COST_COLUMNS,
    UNKNOWN_STEP_KIND,
    upgraded_provenance,
)

FORMAT = "mlatune-winners"
FAILED_STATUSES = tuple(s for s in STATUSES if s != "ok" and s not in NEITHER_STATUSES)
ERROR_FIELDS = ("rel_err", "max_abs_err", "lse_err")  # v5: the table's columns, null: NaN


@dataclass(frozen=True)
class WinnersMap:
    """A valid winners map and, per device (in document order), each key's problem."""

    document: dict[str, Any]
    problems: list[dict[str, MLAProblem]]


def read(path: Path, facts: RouteFacts | None = None) -> WinnersMap:
    """A winners map from a file, refused (TableError, one line) unless valid.

    Whatever a damaged file makes parsing or the checks raise (RecursionError from
    deep nesting, OverflowError from huge numbers, ...) is a TableError too."""
    try:
        return _read(path, facts)
    except TableError:
        raise
    except RecursionError:
        raise TableError(f"{path}: not a readable JSON winners map (nested too deeply)"
                         ) from None
    except Exception as exc:  # a damage no check foresaw: still the file's fault
        raise TableError(f"{path}: unreadable winners map ({_one_line(exc)})") from exc


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def is_winners_map(path: str | os.PathLike) -> bool:
    """Whether a file name is a winners map's: ``.json``, or ``.json.gz`` (gzip-compressed,
    how the bundled maps ship)."""
    return Path(path).name.lower().endswith((".json", ".json.gz"))


def _read(path: Path, facts: RouteFacts | None) -> WinnersMap:
    try:
        raw = path.read_bytes()
        document = json.loads(gzip.decompress(raw) if path.name.lower().endswith(".gz")
                              else raw, object_pairs_hook=_unique_keys)
    except OSError as exc:
        raise TableError(f"{path}: cannot read ({_one_line(exc)})") from None
    except (ValueError, EOFError, gzip.BadGzipFile) as exc:  # JSON, text or gzip damage
        raise TableError(f"{path}: not a readable JSON winners map ({_one_line(exc)})"
                         ) from None
    found, parsed = _check(document)
    if found:
        raise TableError(f"{path}: invalid winners map ({len(found)} problem"
                         f"{'s' if len(found) > 1 else ''}): " + "; ".join(found))
    if document["schema_version"] == 1:
        upgrade(document, facts)
    if facts is not None:
        current_options(document, parsed, facts)
        refused = _param_problems(document, facts)
        if refused:
            raise TableError(f"{path}: invalid winners map: route params its route cannot "
                             f"run: {refused}")
    return WinnersMap(document, parsed)


def _param_problems(document: Mapping[str, Any], facts: RouteFacts) -> str:
    """The options' parameter sets their route cannot run (``RouteFacts.param_problem``),
    a few named; "" where every one can."""
    found: dict[str, str] = {}
    for device in document["devices"]:
        for entry in device["winners"].values():
            for option in (entry, *entry.get("alternatives", ())):
                text = json.dumps(option["params"], sort_keys=True)
                label = f"{option['route']} {text}"
                if label not in found:
                    found[label] = facts.param_problem(option["route"], option["params"]) or ""
    bad = [f"{label}: {why}" for label, why in found.items() if why]
    return "; ".join(bad[:3]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")


def current_options(document: dict[str, Any], parsed: list[dict[str, MLAProblem]],
                    facts: RouteFacts) -> None:
    """Each option under the route its params belong to (``RouteFacts.route_of``) and in
    that route's current spelling, in place; an option naming a deleted kernel form (stale)
    is dropped, and a key left with none is no longer measured."""
    for device, problems in zip(document["devices"], parsed, strict=True):
        for key, entry in list(device["winners"].items()):
            options = [{k: v for k, v in o.items() if k not in ("alternatives", "failed")}
                       for o in (entry, *entry.get("alternatives", ()))]
            kept = []
            for option in options:
                route = facts.route_of(option["route"], option["params"])
                params = facts.upgrade_params(route, option["params"])
                if params is not None:
                    kept.append({**option, "route": route, "params": dict(params)})
            if not kept:
                del device["winners"][key]
                problems.pop(key, None)
                if "failed" in entry:
                    device["all_failed"][key] = entry["failed"]
                continue
            if len(kept) == len(options) and all(a == b for a, b in zip(kept, options,
                                                                         strict=True)):
                continue
            current = dict(kept[0])
            if "alternatives" in entry:
                current["alternatives"] = kept[1:]
            if "failed" in entry:
                current["failed"] = entry["failed"]
            device["winners"][key] = current


def upgrade(document: dict[str, Any], facts: RouteFacts | None = None) -> None:
    """A valid schema v1 map, upgraded in place to v2 (see the module docstring): step kinds
    from ``facts``, else unknown."""
    declared = facts.step_kind if facts else (lambda route, params: UNKNOWN_STEP_KIND)
    kinds: dict[tuple[str, str], tuple[str, bool]] = {}  # asked once per (route, params)
    for device in document["devices"]:
        device["provenance"] = [upgraded_provenance(p) if isinstance(p, dict) else p
                                for p in device["provenance"]]
        for winner in device["winners"].values():
            for option in (winner, *winner.get("alternatives", ())):
                pair = (option["route"], json.dumps(option["params"], sort_keys=True))
                if pair not in kinds:
                    kinds[pair] = declared(option["route"], option["params"])
                option["plan_on"], option["capturable"] = kinds[pair]
                option.update(dict.fromkeys(STEP_COST_COLUMNS))
    document["schema_version"] = SCHEMA_VERSION


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
    seen: dict[tuple, int] = {}
    for i, entry in enumerate(devices):
        parsed.append({})
        if not isinstance(entry, dict):
            found.append(f"devices[{i}] is not an object")
            continue
        identity = (entry.get("arch"), entry.get("device_name"), entry.get("cu_count"))
        if not (isinstance(identity[0], str) and isinstance(identity[1], str)
                and isinstance(identity[2], int) and not isinstance(identity[2], bool)):
            found.append(f"devices[{i}] lacks arch, device_name or cu_count")
        elif not ARCH_PATTERN.fullmatch(identity[0]) or not identity[1].strip() \
                or identity[2] < 1:
            found.append(f"devices[{i}]: arch {identity[0]!r} (sm_<n>, gfx<id> or cpu), "
                         f"device_name {identity[1]!r} (not blank) or cu_count {identity[2]} "
                         f"(at least 1) is not a device")
        elif identity in seen:
            found.append(f"devices[{i}] is devices[{seen[identity]}]'s device again "
                         f"({identity[1]}, {identity[0]}, {identity[2]} CUs): which one "
                         f"answers it is ambiguous")
        else:
            seen[identity] = i
        provenance = entry.get("provenance")
        if not isinstance(provenance, list) or not all(isinstance(p, dict) for p in provenance):
            found.append(f"devices[{i}] lacks its provenance (a list of objects)")
        entries = entry.get("winners")
        if not isinstance(entries, dict):
            found.append(f"devices[{i}] lacks its winners")
            continue
        bad = []
        for key, winner in entries.items():
            problem = _entry_problem(key, winner, version)
            if problem is None:
                bad.append(key)
            else:
                parsed[-1][key] = problem
        if bad:
            found.append(f"devices[{i}]: {len(bad)} invalid winner entries, e.g. "
                         f"{bad[0][:120]!r}")
        found += [f"devices[{i}]: {text}" for text in _all_failed_problems(entry, entries)]
    return found, parsed


def _all_failed_problems(entry: dict[str, Any], entries: dict[str, Any]) -> list[str]:
    """What is wrong with a device's ``all_failed`` (absent: a map from before failures)."""
    all_failed = entry.get("all_failed", {})
    if not isinstance(all_failed, dict):
        return ["all_failed is not an object"]
    bad = [key for key, failed in all_failed.items()
           if key in entries or not _valid_failed(failed, ()) or not _is_key(key)]
    if not bad:
        return []
    return [f"{len(bad)} invalid all_failed entries (or keys that also have a winner), "
            f"e.g. {bad[0][:120]!r}"]


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once (json's own keeps the last silently)."""
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {twice[:120]!r} given twice in one object")
    return found


def _is_key(key: str) -> bool:
    """Whether ``key`` is a problem's key as mlatune spells it (one spelling a problem: an
    entry under another, "num_heads=016", would be a second entry for it)."""
    try:
        return MLAProblem.from_key(key).key == key
    except (ValueError, TypeError, KeyError, ArithmeticError):  # huge numbers: Overflow
        return False


def _entry_problem(key: str, winner: Any, version: Any) -> MLAProblem | None:
    """The key's problem if the entry is valid, else None."""
    try:
        problem = MLAProblem.from_key(key)
    except (ValueError, TypeError, KeyError, ArithmeticError):  # huge numbers: Overflow
        return None
    if problem.key != key or not isinstance(winner, dict):  # (one spelling a problem)
        return None
    alternatives = winner.get("alternatives", [])
    stepped = version != 1  # v1 options lack the step fields (the upgrade adds them)
    valid = isinstance(alternatives, list) and all(
        _valid_option(o) and (not stepped or _valid_step(o)) for o in (winner, *alternatives))
    if valid and "failed" in winner:
        valid = _valid_failed(winner["failed"], {o["route"] for o in (winner, *alternatives)})
    return problem if valid else None


def _valid_failed(failed: Any, ok_routes: Collection[str]) -> bool:
    """A ``failed`` object: status -> routes, each route once per key and none of them
    ok there (a table has one row per key and route)."""
    if not isinstance(failed, dict) or not failed or not all(
            s in FAILED_STATUSES and isinstance(r, list) and r for s, r in failed.items()):
        return False
    routes = [r for listed in failed.values() for r in listed]
    if not all(isinstance(r, str) for r in routes):
        return False
    distinct = set(routes)
    return len(distinct) == len(routes) and distinct.isdisjoint(ok_routes)


def failures(failed: Mapping[str, list[str]]) -> list[tuple[str, str]]:
    """A valid ``failed`` object as (route, status) pairs, sorted."""
    return sorted((route, status) for status, routes in failed.items() for route in routes)


def failed_object(pairs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """(route, status) pairs as a ``failed`` object: statuses in STATUSES order, routes
    sorted, so equal failures are written alike."""
    by_status: dict[str, list[str]] = {}
    for route, status in pairs:
        by_status.setdefault(status, []).append(route)
    return {s: sorted(by_status[s]) for s in FAILED_STATUSES if s in by_status}


def _is_number(value: Any) -> bool:
    """A finite number a float can hold (JSON ints are unbounded: 1e400 as digits)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _valid_option(option: Any) -> bool:
    time_us = option.get("time_us") if isinstance(option, dict) else None
    return (isinstance(option, dict) and isinstance(option.get("route"), str)
            and isinstance(option.get("params"), dict)
            and _is_number(time_us) and time_us >= MIN_TIME_US
            and all(e is None or (_is_number(e) and e >= 0)
                    for e in (option.get(name) for name in ERROR_FIELDS)))


def _valid_step(option: dict[str, Any]) -> bool:
    """The step fields as a table's validate allows them for an ok row."""
    plan_on, capturable = option.get("plan_on"), option.get("capturable")
    costs = [option.get(name, "absent") for name in STEP_COST_COLUMNS]  # null: not measured
    return (plan_on in PLAN_PLACES and isinstance(capturable, bool)
            and not (plan_on == "host" and capturable)
            and all(c is None or (_is_number(c) and c >= 0) for c in costs)
            and not (plan_on == "none" and option["plan_us"] not in (None, 0)))
