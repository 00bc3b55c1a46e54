"""Journal records as the table reads them: one problem identity (``problem_key``), a
record's step cost, and the journal's records folded into table rows (``table_rows``).

A record is the dict a worker or the DCP stage returns, with the candidate's ``id``,
``key`` (the problem's fields), ``route`` and ``route_params``; the journal stores it as
one JSON line. Everything that groups records by problem asks ``problem_key``, the
problem's canonical ``MLAProblem.key``, as the table's rows and the dispatcher do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlatune.arch import DeviceInfo
from mlatune.problem import MLAProblem
from mlatune.table.schema import Status, device_key, is_measured

__all__ = ["Status", "Task", "problem_key", "problem_of", "step_us", "table_rows"]


@dataclass(frozen=True)
class Task:
    """What a worker process gets for one candidate: plain data, never tensors (it makes
    its own inputs from the seed). ``check_only``: stop after the first accuracy check
    (compiling ahead)."""

    problem: MLAProblem
    route: str
    params: dict[str, Any]
    seed: int
    budget: dict[str, Any]
    tolerances: dict[str, float] | None = None
    check_only: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"problem": self.problem.as_dict(), "route": self.route, "params": self.params,
                "seed": self.seed, "budget": self.budget, "tolerances": self.tolerances,
                "check_only": self.check_only}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Task:
        return cls(MLAProblem(**data["problem"]), data["route"], data["params"], data["seed"],
                   data["budget"], data.get("tolerances"), bool(data.get("check_only")))


def problem_of(record: Mapping[str, Any]) -> MLAProblem:
    return MLAProblem.from_key_dict(record["key"])


def problem_key(record: Mapping[str, Any]) -> str:
    """The record's problem, as every table and dispatcher names it (``MLAProblem.key``)."""
    return problem_of(record).key


def table_rows(records: list[dict[str, Any]], device: DeviceInfo) -> list[dict[str, Any]]:
    """One row per (problem, route): its fastest ok parameters, else why it failed. Where a
    DCP route was measured across processes, the row is the measured step's (whatever its
    status: it says what the real step does), its simulated time kept beside it."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        runs.setdefault((problem_key(r), r["route"]), []).append(r)
    return [_row(_best(group), device) for group in runs.values()]


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    measured = [r for r in runs if is_measured(r.get("dcp_timing"))]
    best = None
    for r in measured or runs:
        if best is None or _better(r, best):
            best = r
    assert best is not None
    return best


def _row(r: dict[str, Any], device: DeviceInfo) -> dict[str, Any]:
    row = {**device_key(device), **r["key"], "route": r["route"],
           "route_params": r["route_params"], "status": r["status"],
           "reason": r.get("reason", "")}
    for col in ("time_us", "time_us_p20", "time_us_p80", "rel_err", "max_abs_err",
                "tb_per_s", "tflops", "plan_us", "plan_host_us", "launch_host_us",
                "comm_us", "simulated_us"):
        row[col] = r.get(col, math.nan)
    row["timer"] = r.get("timer", "")
    for col in ("plan_on", "capturable", "dcp_timing", "dcp_scheme"):
        if col in r:  # absent: the table derives them (the route's step kind; simulated)
            row[col] = r[col]
    return row


def _better(new: dict[str, Any], held: dict[str, Any]) -> bool:
    """A route's row keeps its parameters of the cheapest step: launch plus device plan."""
    if new["status"] == "ok":
        return held["status"] != "ok" or step_us(new) < step_us(held)
    return False


def step_us(record: dict[str, Any]) -> float:
    plan = record.get("plan_us", 0.0)
    return record["time_us"] + (0.0 if plan is None or math.isnan(plan) else plan)
