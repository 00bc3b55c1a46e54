"""The sweep's typed records: what a worker gets (``Task``), what it answers (``Result``),
what the journal holds for each candidate (``Record``, one JSON line), the statuses
(``Status``, owned by ``mlatune.table.schema``), and the journal's records folded into
table rows (``table_rows``).

A ``Record`` reads every journal line written so far (``Record.from_json``: fields a
line lacks stay None, fields this code does not know are kept in ``extra``) and writes
the same line back (``to_json``). Everything that groups records by problem asks
``problem_key``, the problem's canonical ``MLAProblem.key``, as the table's rows and the
dispatcher do; tools that read a journal as raw dicts (``journal.read``) get the same
answer from ``problem_key``/``problem_of``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any

from mlatune.arch import DeviceInfo
from mlatune.problem import MLAProblem
from mlatune.routes import FACTS, plan_sharing
from mlatune.table.cost import DEFAULT_CALLER, Caller, caller_cost
from mlatune.table.schema import NEITHER_STATUSES, Status, device_key, is_measured

__all__ = ["COST_PARTS", "KILLED_FROM_OUTSIDE", "Measured", "Record", "Result", "Status", "Task",
           "as_record", "at_home", "killed_from_outside", "present", "problem_key", "problem_of",
           "split_line", "step_cost_of", "step_us", "table_rows"]

# Where a worker's time went (Record fields the worker reports); the rest of elapsed_s,
# from handing a candidate over to its result, is "other" (transfer, a crash or timeout).
COST_PARTS = ("setup_s", "first_check_s", "check_s", "bench_s")
# How a crashed result's reason starts when its worker was killed by a signal a route does not
# send itself (sweep.pool): no verdict on the route, so a resumed sweep runs it once more.
KILLED_FROM_OUTSIDE = "worker killed from outside"


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


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What a worker measures of one candidate: what became of it (``status``,
    ``reason``), its errors, the launch's timing, the engine's step beyond the launch and
    where the worker's time went. None: not measured (a failure measured nothing; an
    older journal did not record it). ``Result`` and ``Record`` both hold these."""

    status: Status
    reason: str = ""
    # accuracy against the reference
    rel_err: float | None = None
    max_abs_err: float | None = None
    lse_err: float | None = None  # None also where the route returned no LSE
    # timing of the launch (worker.evaluate's _timing_fields)
    time_us: float | None = None
    time_us_p20: float | None = None
    time_us_p80: float | None = None
    timer: str | None = None
    reps: int | None = None
    raced: bool | None = None
    tb_per_s: float | None = None
    tflops: float | None = None
    # the engine's step beyond the launch (schema v2)
    plan_on: str | None = None
    capturable: bool | None = None
    plan_us: float | None = None
    plan_host_us: float | None = None
    launch_host_us: float | None = None
    # where the worker's time went (COST_PARTS)
    setup_s: float | None = None
    first_check_s: float | None = None
    check_s: float | None = None
    bench_s: float | None = None

    def cost(self, part: str) -> float:
        """The worker's seconds on a part of ``COST_PARTS`` (0 where not measured)."""
        return getattr(self, part) or 0.0


@dataclass(frozen=True, kw_only=True)
class Result(Measured):
    """What a worker answers for one task (``worker.evaluate``), sent back over the pipe
    as JSON and made a ``Record`` by the pool (``Candidate.record(**result.fields())``).
    ``route_params``: what the route reports it ran with (replaces the candidate's own).
    ``restart``: the worker's CUDA context is lost; the pool starts a fresh process (never
    journaled)."""

    route_params: str | None = None
    restart: bool = False

    def to_json(self) -> dict[str, Any]:
        """For the pipe: the fields measured (not None), ``restart`` where set."""
        line = {**self.fields(), "status": self.status.value}
        return {**line, "restart": True} if self.restart else line

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Result:
        return cls(**{**data, "status": Status(data["status"])})

    def fields(self) -> dict[str, Any]:
        """The record's fields the worker measured (not None; ``restart`` left out)."""
        return present(self, _RESULT_FIELDS)


_RESULT_FIELDS = tuple(f.name for f in fields(Result) if f.name != "restart")


@dataclass(frozen=True, kw_only=True)
class Record(Measured):
    """One candidate's result line in a journal: which candidate (``id``; the problem's
    ``key`` fields, ``route``, ``route_params`` as JSON), what was measured of it
    (``Measured``), and how long it took in all, where and when it ran and, for DCP,
    how the step was timed. None: the line does not have the field."""

    id: str = ""
    key: dict[str, Any] = field(default_factory=dict)
    route: str = ""
    route_params: str = "{}"
    # the whole of the candidate's time (COST_PARTS and the rest), where and when it ran
    elapsed_s: float | None = None
    device: str | None = None
    finished_at: float | None = None
    # DCP timing (schema v3)
    dcp_timing: str | None = None
    dcp_scheme: str | None = None
    comm_us: float | None = None
    simulated_us: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # fields this code does not know

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        """A journal line (its ``kind`` left out); ValueError for a status no one knows."""
        known, extra = split_line(data, _FIELDS)
        return cls(**{**known, "status": Status(data["status"])}, extra=extra)

    def to_json(self) -> dict[str, Any]:
        """The line's fields: those it has (not None) and the unknown ones it came with."""
        return {**present(self, _FIELDS), "status": self.status.value, **self.extra}

    @cached_property
    def problem(self) -> MLAProblem:
        return MLAProblem.from_key_dict(self.key)

    @property
    def problem_key(self) -> str:
        """The record's problem, as every table and dispatcher names it."""
        return self.problem.key

    @property
    def worker_s(self) -> float:
        """The worker's seconds on it (``COST_PARTS``; 0 where a line has none)."""
        return sum(self.cost(part) for part in COST_PARTS)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def measured_dcp(self) -> bool:
        """A DCP step measured across processes (not the one-GPU simulation)."""
        return is_measured(self.dcp_timing)

    @property
    def step_us(self) -> float:
        """What its step costs the default caller (``table.cost``): what a route's row, the
        table's rank and the dispatcher rank by."""
        return step_cost_of(self, self.route)


_FIELDS = tuple(f.name for f in fields(Record) if f.name != "extra")


def split_line(data: Mapping[str, Any], names: tuple[str, ...]
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A JSON line's fields: (those named, the others but its ``kind``)."""
    known = {k: v for k, v in data.items() if k in names}
    return known, {k: v for k, v in data.items() if k not in names and k != "kind"}


def present(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """``obj``'s fields of ``names`` that it has (not None)."""
    return {name: value for name in names if (value := getattr(obj, name)) is not None}


def as_record(record: Record | Mapping[str, Any]) -> Record:
    """A record, from a raw journal line too (tools that read ``journal.read``)."""
    return record if isinstance(record, Record) else Record.from_json(record)


def killed_from_outside(record: Record) -> bool:
    """Whether a record says its worker was killed from outside (``KILLED_FROM_OUTSIDE``)."""
    return record.status == Status.CRASHED and str(record.reason or "").startswith(
        KILLED_FROM_OUTSIDE)


def problem_of(record: Record | Mapping[str, Any]) -> MLAProblem:
    return record.problem if isinstance(record, Record) else MLAProblem.from_key_dict(
        record["key"])


def problem_key(record: Record | Mapping[str, Any]) -> str:
    """The record's problem, as every table and dispatcher names it (``MLAProblem.key``)."""
    return problem_of(record).key


def step_us(record: Record | Mapping[str, Any]) -> float:
    return as_record(record).step_us


def table_rows(records: Iterable[Record | Mapping[str, Any]], device: DeviceInfo
               ) -> list[dict[str, Any]]:
    """One row per (problem, route): its fastest ok parameters, else why it failed. A record
    counts for the route its parameters belong to now (``Route.route_of``: a kernel form
    that became a route of its own). Where a DCP route was measured across processes, the
    row is the measured step's (whatever its status: it says what the real step does), its
    simulated time kept beside it."""
    runs: dict[tuple[str, str], list[Record]] = {}
    for r in map(at_home, map(as_record, records)):
        runs.setdefault((r.problem_key, r.route), []).append(r)
    return [_row(_best(group), device) for group in runs.values()]


def at_home(record: Record) -> Record:
    """The record under the route its parameter set belongs to now (``Route.route_of``), its
    parameters as run; as it is where they are no JSON object."""
    try:
        params = json.loads(record.route_params)
    except (TypeError, ValueError):
        return record
    if not isinstance(params, dict):
        return record
    home = FACTS.route_of(record.route, params)
    return record if home == record.route else replace(record, route=home)


def _best(runs: list[Record]) -> Record:
    measured = [r for r in runs if r.measured_dcp]
    best = None
    for r in measured or runs:
        if best is None or _better(r, best):
            best = r
    assert best is not None
    return best


_ROW_NUMBERS = ("time_us", "time_us_p20", "time_us_p80", "rel_err", "max_abs_err", "lse_err",
                "tb_per_s", "tflops", "plan_us", "plan_host_us", "launch_host_us", "comm_us",
                "simulated_us")
# Absent from a record: the table derives them (the route's step kind; simulated).
_ROW_DERIVED = ("plan_on", "capturable", "dcp_timing", "dcp_scheme")


def _row(r: Record, device: DeviceInfo) -> dict[str, Any]:
    row = {**device_key(device), **r.key, "route": r.route, "route_params": r.route_params,
           "status": r.status.value, "reason": r.reason}
    for col in _ROW_NUMBERS:
        value = getattr(r, col)
        row[col] = math.nan if value is None else value
    row["timer"] = r.timer or ""
    row.update({col: getattr(r, col) for col in _ROW_DERIVED if getattr(r, col) is not None})
    return row


def step_cost_of(measured: Measured, route_id: str, caller: Caller = DEFAULT_CALLER) -> float:
    """``table.cost.step_cost`` of a measurement for ``caller`` (NaN without a launch time;
    costs not measured count as 0)."""
    def number(value: float | None) -> float:
        return math.nan if value is None else value

    return float(caller_cost(caller, number(measured.time_us), measured.plan_on or "none",
                             number(measured.plan_us), number(measured.plan_host_us),
                             route_id in plan_sharing()))


def _better(new: Record, held: Record) -> bool:
    """A route's row keeps its parameters of the cheapest step for the default caller; with
    none ok, a failure before a set that did not run (pruned, stale), so the row says it."""
    if new.ok:
        return not held.ok or new.step_us < held.step_us
    return not held.ok and held.status in NEITHER_STATUSES and \
        new.status not in NEITHER_STATUSES
