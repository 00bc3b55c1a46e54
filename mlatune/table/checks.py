"""What makes a table valid: its columns and their types, values each column allows, one
schema version, ranks that agree with the step costs, whole problems, and provenance.

A table may hold several devices (a merge of runs on several GPUs) and several runs per
device, but all rows of one device come from one software environment (every provenance
field but the ``RUN_FIELDS`` equal): timings taken under different torch or driver versions
do not rank against each other.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd

from mlatune.problem import BUCKET_FIELDS, KEY_FIELDS, SIZE_LIMIT, MLAProblem
from mlatune.steps import PLAN_PLACES, RouteFacts
from mlatune.table.cost import DEFAULT_CALLER
from mlatune.table.frame import _has_type, _simulated_tier, step_costs
from mlatune.table.schema import (
    ARCH_PATTERN,
    COLUMN_TYPES,
    COLUMNS,
    DCP_MEASURED,
    DCP_SCHEMES,
    DCP_TIMINGS,
    DEVICE_COLUMNS,
    KEY_COLUMNS,
    MIN_TIME_US,
    PROVENANCE_TYPES,
    SCHEMA_VERSION,
    STATUSES,
    STEP_COST_COLUMNS,
)

# Provenance fields that may differ between runs on one device; the rest must not.
# (hardware: its measured copy bandwidth moves from run to run.)
RUN_FIELDS = ("created_utc", "spec_sha256", "converted_from", "hardware")
ENVIRONMENT_FIELDS = tuple(f for f in PROVENANCE_TYPES if f not in RUN_FIELDS)
_ROUTE_ID = re.compile(r"^[a-z0-9][a-z0-9-]*/[a-z0-9][a-z0-9-]*$")
_EXAMPLES = 3  # values quoted per problem: enough to find them, short enough for one line



def _examples(values: pd.Series | Sequence) -> str:
    shown = list(dict.fromkeys(map(repr, list(values))))
    more = f", ... ({len(shown)} distinct)" if len(shown) > _EXAMPLES else ""
    return ", ".join(shown[:_EXAMPLES]) + more



def validate(frame: pd.DataFrame) -> list[str]:
    """Every problem with a table, each one line; empty when the table is valid."""
    return _validate(frame, set())



def _validate(frame: pd.DataFrame, unparsed: set[str]) -> list[str]:
    """Every problem of ``frame``, one line each (``unparsed``: CSV columns that did not
    parse as their type)."""
    problems = _column_problems(frame)
    if problems and (frame.columns.duplicated().any() or len(frame) == 0):
        return problems
    good = _good_columns(frame, unparsed, problems)

    def have(*names: str) -> bool:
        return all(n in good for n in names)

    problems += _value_problems(frame, have)
    # One dense id per (device, problem), shared by the row-level checks below.
    key_id = frame.groupby(list(KEY_COLUMNS), sort=False).ngroup().to_numpy() \
        if have(*KEY_COLUMNS) else None
    if key_id is not None and have("route"):
        problems += _repeat_problems(frame, key_id)
    if key_id is not None and have("status", "rank", "time_us", "route", "dcp_timing"):
        problems += _rank_problems(frame, key_id)
    problems += _step_problems(frame, have)
    problems += _dcp_problems(frame, have)
    if have(*PROVENANCE_TYPES, *DEVICE_COLUMNS):
        problems += _provenance_problems(frame)
    if key_id is not None:
        problems += _problem_problems(frame, key_id)
    return problems


def param_problems(frame: pd.DataFrame, facts: RouteFacts) -> list[str]:
    """The ok rows' parameter sets their route cannot run (``RouteFacts.param_problem``),
    one line per distinct (route, set), a few shown; a row there would fail or allocate past
    the device at its first call, so the table is refused."""
    if frame.empty or not {"route", "route_params", "status"} <= set(frame.columns):
        return []
    ok = frame[frame["status"] == "ok"]
    found = []
    for route, text in ok[["route", "route_params"]].drop_duplicates().itertuples(
            index=False, name=None):
        try:
            params = json.loads(text)
        except (TypeError, ValueError):  # not JSON: _value_problems names it
            continue
        why = facts.param_problem(str(route), params) if isinstance(params, dict) else None
        if why:
            found.append(f"{route} {text}: {why}")
    if not found:
        return []
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return [f"route_params its route cannot run: {'; '.join(found[:3])}{more}"]


def _column_problems(frame: pd.DataFrame) -> list[str]:
    """Missing, unexpected or repeated columns, or no rows."""
    problems = []
    missing = [c for c in COLUMNS if c not in frame.columns]
    extra = [_printable(c) for c in frame.columns if c not in COLUMN_TYPES]
    if missing:
        problems.append(f"missing columns: {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected columns: {', '.join(extra)}")
    if frame.columns.duplicated().any():
        problems.append("duplicate column names")
    elif len(frame) == 0:
        problems.append("the table has no rows")
    return problems


def _good_columns(frame: pd.DataFrame, unparsed: set[str], problems: list[str]) -> set[str]:
    """The columns present, of the right type and without missing values (problems with
    the others appended to ``problems``)."""
    good = set()
    for name, kind in COLUMN_TYPES.items():
        if name not in frame or name in unparsed:
            continue
        if not _has_type(frame[name], kind):
            problems.append(f"column {name} has dtype {frame[name].dtype}, expected {kind}")
            continue
        if kind != "float64":  # NaN is how a float says "not measured"
            nulls = int(frame[name].isna().sum())
            if nulls:
                problems.append(f"column {name} has {nulls} missing values")
                continue
        good.add(name)
    return good


def _value_problems(frame: pd.DataFrame, have: Callable[..., bool]) -> list[str]:
    """Values a column does not allow: versions, statuses, route ids, params, ok times."""
    problems = []
    if have("schema_version"):
        problems += _version_problems(sorted(set(frame["schema_version"].tolist())))
    if have("status"):
        unknown = ~frame["status"].isin(STATUSES)
        if unknown.any():
            problems.append(f"unknown status {_examples(frame['status'][unknown])} "
                            f"(expected one of {', '.join(STATUSES)})")
    if have("route"):
        bad = [r for r in pd.unique(frame["route"]) if not _ROUTE_ID.match(r)]
        if bad:
            problems.append(f"route ids not shaped '<family>/<backend>': {_examples(bad)}")
    if have("route_params"):
        bad = [p for p in pd.unique(frame["route_params"]) if not _is_json_object(p)]
        if bad:
            problems.append(f"route_params that are not JSON objects: {_examples(bad)}")
    if have("status", "time_us"):
        times = frame["time_us"]
        bad_time = (frame["status"] == "ok") & ~(np.isfinite(times) & (times >= MIN_TIME_US))
        if bad_time.any():
            problems.append(f"{int(bad_time.sum())} ok rows lack a finite time_us of at least "
                            f"{MIN_TIME_US:g} us: {_examples(times[bad_time])}")
    for name in ("rel_err", "max_abs_err", "lse_err"):  # NaN: not measured (no LSE)
        if have("status", name):
            errors = frame[name]
            bad = (frame["status"] == "ok") & (np.isinf(errors) | (errors < 0))
            if bad.any():
                problems.append(f"{int(bad.sum())} ok rows with an infinite or negative "
                                f"{name}: {_examples(errors[bad])}")
    return problems + _device_problems(frame, have) + _run_record_problems(frame, have)


def _device_problems(frame: pd.DataFrame, have: Callable[..., bool]) -> list[str]:
    """A device a dispatcher can match: an arch of a known shape, a name, a unit count."""
    problems = []
    if have("arch"):
        bad = [a for a in pd.unique(frame["arch"]) if not ARCH_PATTERN.fullmatch(a)]
        if bad:
            problems.append(f"arch not shaped sm_<n>, gfx<id> or cpu: {_examples(bad)}")
    if have("device_name"):
        blank = frame["device_name"].str.strip() == ""
        if blank.any():
            problems.append(f"{int(blank.sum())} rows with an empty device_name")
    if have("cu_count"):
        few = frame["cu_count"] < 1
        if few.any():
            problems.append(f"cu_count below 1: {_examples(frame['cu_count'][few])}")
    return problems


def _run_record_problems(frame: pd.DataFrame, have: Callable[..., bool]) -> list[str]:
    """Provenance texts that say what they hold: JSON objects (or empty where the record
    predates them) and an ISO 8601 creation time."""
    problems = []
    for name in ("backend_versions", "hardware"):
        if have(name):
            bad = [t for t in pd.unique(frame[name]) if t and not _is_json_object(t)]
            if bad:
                problems.append(f"{name} that are not JSON objects: {_examples(bad)}")
    if have("created_utc"):
        bad = [t for t in pd.unique(frame["created_utc"]) if t and not _is_iso_time(t)]
        if bad:
            problems.append(f"created_utc not an ISO 8601 time: {_examples(bad)}")
    return problems


def _is_iso_time(text: str) -> bool:
    try:
        datetime.fromisoformat(text)
    except ValueError:
        return False
    return True


def _version_problems(versions: list[int]) -> list[str]:
    """One schema version, not newer than this mlatune's."""
    problems = []
    future = [v for v in versions if v > SCHEMA_VERSION]
    if future:
        problems.append(f"schema_version {future[-1]} is newer than this mlatune reads "
                        f"({SCHEMA_VERSION}); upgrade mlatune")
    if any(v < 1 for v in versions):
        problems.append(f"schema_version must be >= 1, got {versions[0]}")
    elif any(v < SCHEMA_VERSION for v in versions):
        # A file of one older version is upgraded as it is read; this is a mix.
        problems.append(f"schema_version {versions[0]} rows in a schema v{SCHEMA_VERSION} "
                        f"table (only a whole older table is upgraded)")
    return problems


def _repeat_problems(frame: pd.DataFrame, key_id: np.ndarray) -> list[str]:
    """Rows that repeat a (device, problem, route) key."""
    route_code = pd.factorize(frame["route"])[0]
    dup = pd.Series(key_id * (route_code.max() + 1) + route_code).duplicated(keep=False)
    if not dup.any():
        return []
    first = frame[dup.to_numpy()].iloc[0]
    return [f"{int(dup.sum())} rows repeat a (device, problem, route) key, e.g. route "
            f"{first['route']} at {first['arch']} {_row_key_text(first)}"]


def _step_problems(frame: pd.DataFrame, have: Callable[..., bool]) -> list[str]:
    """The step kind is one StepKind allows; costs are durations, or NaN (not measured)."""
    problems = []
    if have("plan_on"):
        unknown = ~frame["plan_on"].isin(PLAN_PLACES)
        if unknown.any():
            problems.append(f"unknown plan_on {_examples(frame['plan_on'][unknown])} "
                            f"(expected one of {', '.join(PLAN_PLACES)})")
    if have("plan_on", "capturable"):
        host_captured = (frame["plan_on"] == "host") & frame["capturable"]
        if host_captured.any():
            problems.append(f"{int(host_captured.sum())} rows planned on the host are "
                            f"capturable (a host plan cannot be captured)")
    if have("status", "plan_on", "plan_us"):
        plan_us = frame["plan_us"]
        planless = (frame["status"] == "ok") & (frame["plan_on"] == "none") \
            & plan_us.notna() & (plan_us != 0)
        if planless.any():
            problems.append(f"{int(planless.sum())} ok rows with plan_on 'none' have a "
                            f"plan_us other than 0, e.g. {_examples(plan_us[planless])}")
    for name in STEP_COST_COLUMNS:
        if have(name):
            cost = frame[name]
            bad = cost.notna() & ~(np.isfinite(cost) & (cost >= 0))
            if bad.any():
                problems.append(f"column {name} has {int(bad.sum())} values that are not a "
                                f"finite duration >= 0 or NaN, e.g. {_examples(cost[bad])}")
    return problems



def _dcp_problems(frame: pd.DataFrame, have: Callable[..., bool]) -> list[str]:
    """dcp_timing says how a DCP row was timed, and only a DCP row has one; only a
    measured row has a scheme."""

    problems = []
    if have("dcp_timing"):
        unknown = ~frame["dcp_timing"].isin(DCP_TIMINGS)
        if unknown.any():
            problems.append(f"unknown dcp_timing {_examples(frame['dcp_timing'][unknown])} "
                            f"(expected one of {', '.join(map(repr, DCP_TIMINGS))})")
        elif have("dcp_size"):
            wrong = (frame["dcp_timing"] == "") != (frame["dcp_size"] == 1)
            if wrong.any():
                problems.append(f"{int(wrong.sum())} rows have a dcp_timing that does not fit "
                                f"their dcp_size ('' exactly where dcp_size is 1)")
    if have("dcp_timing", "dcp_scheme"):
        measured = frame["dcp_timing"] == DCP_MEASURED
        bad = measured & ~frame["dcp_scheme"].isin(DCP_SCHEMES) \
            | ~measured & (frame["dcp_scheme"] != "")
        if bad.any():
            problems.append(f"{int(bad.sum())} rows have a dcp_scheme that does not fit their "
                            f"dcp_timing (one of {', '.join(DCP_SCHEMES)} exactly where measured), "
                            f"e.g. {_examples(frame['dcp_scheme'][bad])}")
    return problems



def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False



def _row_key_text(row: Mapping[str, Any]) -> str:
    return " ".join(f"{f}={row[f]}" for f in KEY_FIELDS)



def _rank_problems(frame: pd.DataFrame, key_id: np.ndarray) -> list[str]:
    problems = []
    ok = (frame["status"] == "ok").to_numpy()
    rank = frame["rank"].to_numpy()
    not_ok_winners = (rank == 1) & ~ok
    if not_ok_winners.any():
        row = frame[not_ok_winners].iloc[0]
        problems.append(f"{int(not_ok_winners.sum())} winners (rank 1) are not ok, e.g. "
                        f"{row['route']} with status {row['status']}")
    ranked_not_ok = ~ok & (rank != 0) & (rank != 1)
    if ranked_not_ok.any():
        problems.append(f"{int(ranked_not_ok.sum())} rows that are not ok have a rank other "
                        f"than 0")
    if (ok & (rank < 1)).any():
        problems.append(f"{int((ok & (rank < 1)).sum())} ok rows have no rank (rank < 1)")
    # Among the ok rows of a key, ranks are 1..n, measured DCP rows first, then by the default
    # caller's step cost. Which routes share a host plan is the routes' to say, so a rank is
    # refused only where no sharing could explain it: its least cost (host plan shared) above
    # the next row's most (not shared).
    keys, ranks = key_id[ok], rank[ok]
    rows = frame[ok]
    costed = all(c in frame for c in ("plan_on", "plan_us", "plan_host_us"))
    least = step_costs(rows, DEFAULT_CALLER, set(rows["route"])) if costed else None
    most = step_costs(rows, DEFAULT_CALLER, ()) if costed else None
    tiers = _simulated_tier(frame).to_numpy()[ok]
    order = np.lexsort((ranks, keys))
    keys, ranks, tiers = keys[order], ranks[order], tiers[order]
    starts = np.r_[True, keys[1:] != keys[:-1]]
    position = np.arange(len(keys))
    expected = position - np.maximum.accumulate(np.where(starts, position, 0)) + 1
    if (ranks != expected).any():
        problems.append("ranks of the ok rows of some keys are not 1, 2, ... n")
    else:
        same_tier = tiers[1:] == tiers[:-1]
        dearer = ~starts[1:] & same_tier & (most[order][1:] < least[order][:-1]) \
            if costed else np.zeros(len(same_tier), dtype=bool)
        if dearer.any():
            problems.append(f"{int(dearer.sum())} ranks contradict the step costs (a higher "
                            f"rank is cheaper)")
        measured_later = ~starts[1:] & (tiers[1:] < tiers[:-1])
        if measured_later.any():
            problems.append(f"{int(measured_later.sum())} measured DCP rows rank after "
                            f"simulated ones of their problem")
    return problems



def _provenance_problems(frame: pd.DataFrame) -> list[str]:
    if all(frame[f].nunique() == 1 for f in ENVIRONMENT_FIELDS):
        return []  # one environment for the whole table: nothing can be mixed
    problems = []
    per_device = frame.groupby(list(DEVICE_COLUMNS), sort=True)[list(ENVIRONMENT_FIELDS)]
    for device, row in per_device.nunique().iterrows():
        mixed = [f for f in ENVIRONMENT_FIELDS if row[f] > 1]
        if mixed:
            values = pd.unique(frame.loc[(frame["arch"] == device[0])
                                         & (frame["device_name"] == device[1])
                                         & (frame["cu_count"] == device[2]), mixed[0]])
            problems.append(f"mixed provenance for {device[0]} {device[1]}: "
                            f"{', '.join(mixed)} differ ({mixed[0]}: {_examples(values)})")
    return problems



def _problem_problems(frame: pd.DataFrame, key_id: np.ndarray) -> list[str]:
    """Rows whose key is not a valid MLAProblem.

    Speed matters (a dispatcher validates at model load), so each distinct
    bucket is checked once by MLAProblem itself, and the two continuous axes
    column-wise: batch and kv_len positive and qlen <= kv_len are the only
    rules that involve them (a test holds this equal to MLAProblem's own).
    """
    problems = []
    first = np.unique(key_id, return_index=True)[1]  # one row per problem
    keys = frame[list(KEY_FIELDS)].iloc[first]
    batch, kv_len, qlen = keys["batch"], keys["kv_len"], keys["qlen"]
    for name, column in (("batch", batch), ("kv_len", kv_len)):
        bad = (column <= 0) | (column > SIZE_LIMIT)
        if bad.any():
            problems.append(f"invalid problem in {int(bad.sum())} keys: {name} must be a "
                            f"positive integer at most {SIZE_LIMIT} (2**31 - 1), got "
                            f"{_examples(column[bad])}")
    too_long = (qlen > kv_len) & (kv_len > 0)
    if too_long.any():
        row = keys[too_long].iloc[0]
        problems.append(f"invalid problem in {int(too_long.sum())} keys: qlen must not exceed "
                        f"kv_len, e.g. qlen={row['qlen']} kv_len={row['kv_len']}")
    buckets = keys[list(BUCKET_FIELDS)].drop_duplicates()
    for values in buckets.itertuples(index=False, name=None):
        row = dict(zip(BUCKET_FIELDS, values, strict=True))
        try:
            MLAProblem.from_key_dict({**row, "batch": 1, "kv_len": max(int(row["qlen"]), 1)})
        except (ValueError, TypeError) as exc:
            where = " ".join(f"{k}={v}" for k, v in row.items())
            problems.append(f"invalid problem at {where}: {exc}".replace("\n", " "))
    return problems


def _printable(name: object) -> str:
    """A column name as a message shows it: as is, or quoted where it holds control
    characters (a terminal escape from a file never reaches the terminal raw)."""
    text = str(name)
    return text if text.isprintable() else repr(text)
