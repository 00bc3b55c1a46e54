"""Tables combined and summed up: merged runs, each key's winners, summaries, diffs, and
the JSON winners map an engine loads without pandas (format in ``table.winners_map``).
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from mlatune.errors import TableError
from mlatune.problem import KEY_FIELDS
from mlatune.table import winners_map
from mlatune.table.checks import validate
from mlatune.table.cost import DEFAULT_CALLER, Caller
from mlatune.table.frame import (
    _dtype,
    _simulated_tier,
    assign_ranks,
    competing_rows,
    key_strings,
    provenances,
    step_costs,
)
from mlatune.table.outputs import atomic_write
from mlatune.table.schema import (
    COLUMNS,
    DCP_MEASURED,
    DEVICE_COLUMNS,
    KEY_COLUMNS,
    NEITHER_STATUSES,
    ROW_KEY,
    SCHEMA_VERSION,
    STEP_COST_COLUMNS,
    STEP_KIND_COLUMNS,
    reference_fallbacks,
    unmeasured,
)

# A row's measured errors, which an option carries (null: not measured): an accuracy
# policy admits an option by its recorded error too (mlatune.check.policy).
_ERROR_COLUMNS = ("rel_err", "max_abs_err", "lse_err")


def merge(tables: Sequence[pd.DataFrame], sharing: Collection[str] = ()) -> pd.DataFrame:
    """One table from several (runs, GPUs): per (device, problem, route) the best row
    (a DCP row measured across processes before a simulated one, whatever its status: it
    says what the real step does; then an ok row before any other, then the cheapest step
    for the default caller (``cost``); otherwise the newest), re-ranked. ``sharing``: the
    routes whose host plan the calls of one step share."""
    if not tables:
        raise TableError("merge needs at least one table")
    for i, table in enumerate(tables):
        problems = validate(table)
        if problems:
            raise TableError(f"table {i} is invalid: " + "; ".join(problems))
    both = pd.concat([t[list(COLUMNS)] for t in tables], ignore_index=True)
    both["_not_ok"] = both["status"] != "ok"
    both["_not_run"] = both["status"].isin(NEITHER_STATUSES)  # a failure says more
    both["_tier"] = _simulated_tier(both)
    both["_cost"] = step_costs(both, DEFAULT_CALLER, sharing)
    both = both.sort_values(["_tier", "_not_ok", "_not_run", "_cost", "created_utc"],
                            ascending=[True, True, True, True, False], kind="stable",
                            na_position="last")
    best = both.drop_duplicates(list(ROW_KEY), keep="first")
    merged = assign_ranks(best[list(COLUMNS)], DEFAULT_CALLER, sharing)
    problems = validate(merged)
    if problems:
        raise TableError("the merged table would be invalid: " + "; ".join(problems))
    return merged



def winners(frame: pd.DataFrame, caller: Caller = DEFAULT_CALLER,
            sharing: Collection[str] = ()) -> pd.DataFrame:
    """Each key's cheapest ok row for ``caller`` (``assign_ranks``)."""
    ranked = assign_ranks(frame, caller, sharing)
    return ranked[ranked["rank"] == 1].reset_index(drop=True)



def summary(frame: pd.DataFrame, sharing: Collection[str] = ()) -> pd.DataFrame:
    """Per (device, problem): winner, runner-up, and the margin between them.

    ``winner_us`` and ``runner_up_us`` are what a step of each costs the default caller
    (``step_costs``, the measure the ranks order by; ``sharing``: the routes whose host plan
    the calls of a step share). ``margin`` is runner-up cost / winner cost - 1 (0.25: the
    runner-up is 25% dearer); NaN without a runner-up. Keys with no ok row have winner "".
    """
    keys = frame[list(KEY_COLUMNS)].drop_duplicates()
    # A measured winner's runner-up is measured too: a simulated one is no comparison.
    ranked = frame.loc[frame["rank"].isin([1, 2]) & competing_rows(frame)]
    ranked = ranked[[*KEY_COLUMNS, "rank", "route", "route_params"]].assign(
        cost_us=step_costs(ranked, DEFAULT_CALLER, sharing))
    first = ranked[ranked["rank"] == 1].drop(columns="rank").rename(
        columns={"route": "winner", "cost_us": "winner_us", "route_params": "winner_params"})
    second = ranked[ranked["rank"] == 2].drop(columns=["rank", "route_params"]).rename(
        columns={"route": "runner_up", "cost_us": "runner_up_us"})
    counts = frame.groupby(list(KEY_COLUMNS), sort=False).agg(
        routes=("route", "size"), ok_routes=("status", lambda s: int((s == "ok").sum())))
    out = keys.merge(first, on=list(KEY_COLUMNS), how="left").merge(
        second, on=list(KEY_COLUMNS), how="left").merge(
        counts.reset_index(), on=list(KEY_COLUMNS), how="left")
    for name in ("winner", "runner_up", "winner_params"):
        out[name] = out[name].astype(_dtype("string")).fillna("")
    out["margin"] = out["runner_up_us"] / out["winner_us"] - 1.0
    return out.sort_values(list(KEY_COLUMNS), kind="stable").reset_index(drop=True)



def diff(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int]]:
    """Winners that differ between two tables, and counts of what matched.

    Per (device, problem) in both: A's and B's winner and time, and
    ``change`` = B's winner time / A's winner time - 1 (negative: B is faster).
    A key differs when its winning route or its params changed.
    """
    cols = [*KEY_COLUMNS, "route", "route_params", "time_us"]
    wa, wb = winners(a)[cols], winners(b)[cols]
    joined = wa.merge(wb, on=list(KEY_COLUMNS), how="outer", suffixes=("_a", "_b"),
                      indicator=True)
    both = joined[joined["_merge"] == "both"]
    changed = both[(both["route_a"] != both["route_b"])
                   | (both["route_params_a"] != both["route_params_b"])].copy()
    changed["change"] = changed["time_us_b"] / changed["time_us_a"] - 1.0
    counts = {
        "same": int(len(both) - len(changed)),
        "changed": len(changed),
        "only_a": int((joined["_merge"] == "left_only").sum()),
        "only_b": int((joined["_merge"] == "right_only").sum()),
    }
    changed = changed.drop(columns="_merge").sort_values(list(KEY_COLUMNS), kind="stable")
    return changed.reset_index(drop=True), counts



def winners_json(frame: pd.DataFrame, winners_only: bool = False) -> dict[str, Any]:
    """The winners map of a valid table (see mlatune.table.winners_map for the format): per device
    each key's ok routes that compete (``competing_rows``) and, kept even with
    ``winners_only``, the routes that failed."""
    frame = frame[competing_rows(frame) | (frame["status"] != "ok")]
    frame = frame.sort_values([*KEY_COLUMNS, "rank", "route"], kind="stable")
    devices = []
    for device, rows in frame.groupby(list(DEVICE_COLUMNS), sort=True):
        entries, all_failed = _device_winners(rows, winners_only)
        devices.append({
            "arch": str(device[0]), "device_name": str(device[1]), "cu_count": int(device[2]),
            "provenance": provenances(rows), "winners": entries, "all_failed": all_failed})
    return {"format": winners_map.FORMAT, "schema_version": SCHEMA_VERSION,
            "key_fields": list(KEY_FIELDS), "devices": devices}



def _device_winners(rows: pd.DataFrame, winners_only: bool
                    ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, list[str]]]]:
    """One device's winner entries (key order, winner first) and its keys with no ok row."""
    not_measured = unmeasured(rows)
    ok = (rows["status"] == "ok").to_numpy() & ~reference_fallbacks(rows, not_measured,
                                                                   KEY_COLUMNS)
    chosen = rows[ok & (rows["rank"] == 1).to_numpy()] if winners_only else rows[ok]
    entries: dict[str, dict[str, Any]] = {}
    for key, option in zip(key_strings(chosen), _options(chosen), strict=True):
        if key not in entries:
            entries[key] = option if winners_only else {**option, "alternatives": []}
        else:
            entries[key]["alternatives"].append(option)
    failed: dict[str, list[tuple[str, str]]] = {}
    bad = rows[(rows["status"] != "ok").to_numpy() & ~not_measured]
    for key, route, status in zip(key_strings(bad), bad["route"].tolist(),
                                  bad["status"].tolist(), strict=True):
        failed.setdefault(key, []).append((str(route), str(status)))
    all_failed = {}
    for key, pairs in failed.items():
        target = entries.get(key)
        if target is None:
            all_failed[key] = winners_map.failed_object(pairs)
        else:
            target["failed"] = winners_map.failed_object(pairs)
    return entries, all_failed



def _options(rows: pd.DataFrame) -> Iterable[dict[str, Any]]:
    """Each row as a winners-map option; a cost not measured (NaN) as null."""
    numbers = [*STEP_COST_COLUMNS, *_ERROR_COLUMNS]
    columns = ["route", "route_params", "time_us", "dcp_timing", *STEP_KIND_COLUMNS, *numbers]
    for route, params, time_us, timing, plan_on, capturable, *values in rows[columns].itertuples(
            index=False, name=None):
        yield {"route": str(route), "params": json.loads(params), "time_us": float(time_us),
               "plan_on": str(plan_on), "capturable": bool(capturable),
               **{name: None if math.isnan(v) else float(v)
                  for name, v in zip(numbers, values, strict=True)},
               **({"dcp_timing": DCP_MEASURED} if timing == DCP_MEASURED else {})}



def write_json(document: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """A winners map written atomically; gzip-compressed where the name ends in .gz (with
    no timestamp in the gzip header, so one map is one file, byte for byte)."""
    path = Path(path)
    text = json.dumps(document, separators=(",", ":"), sort_keys=False, allow_nan=False)
    data = text.encode() + b"\n"
    if path.name.lower().endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    atomic_write(path, lambda h: h.write(data))
    return path
