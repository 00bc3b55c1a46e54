"""Dispatch table schema v6: the columns every table has, and what each holds.

One row per (device, problem, route). The key is the whole problem spelled
out, plus the device it was measured on. Provenance travels twice: as Parquet
file metadata and as constant columns, so a CSV stands alone too.

v2 added how an engine steps each route (``mlatune.routes.base.StepKind``): a
per-step plan (``plan_on``: "none", "device" or "host") and a launch, whether
both replay in one CUDA graph (``capturable``), and what the plan and the
launch cost (``STEP_COST_COLUMNS``). ``time_us`` is still the launch's device
time.

v3 adds how a DCP row (dcp_size > 1) was timed (``DCP_COLUMNS``): ``dcp_timing``
"simulated" (on one GPU: rank 0's attention plus the merge of every rank's partials)
or "measured" (the real step across dcp_size processes: q all-gather, attention,
output and LSE exchange, correction; the slowest rank's time); "" without DCP. A
measured row also holds its scheme, its communication time and the simulated time it
replaced. A simulated time leaves out the collectives, so it never competes with a
measured one (``competing``, the one rule the table, the dispatcher, the predictor and
the report apply): where a problem has measured rows only they compete, and its
simulated rows rank after them; the JSON winners map carries only the rows that compete.

v4 ranks a problem's ok rows by what a step costs the default caller
(``mlatune.table.cost``: the launch, its share of the plan and an eager caller's host plan)
where v1-v3 ranked them by the launch's time alone.

v5 adds ``lse_err``: the largest absolute error of the route's LSE against the reference.

v6 adds the provenance field ``hardware``: the figures of the GPU the rows were measured on
that decide kernel speed (``mlatune.hardware.Hardware`` as JSON: SMs, memory, bandwidth,
tensor throughput, clocks, a measured copy bandwidth), which the dispatcher's cost laws read
to carry a table to another GPU model; "" where not recorded.

Older tables are upgraded as they are read (``mlatune.table.read``): a v1 table's step
kinds come from the routes' declarations where the reader hands them over (``RouteFacts``)
and its costs are NaN (never measured); a v1 or v2 table's DCP rows are "simulated", the
other DCP columns empty; a v1-v4 table's ``lse_err`` is NaN (never measured); a v1-v5 table's
``hardware`` is "" (not recorded: the device's name stands for it); a v1-v3 table is ranked
again; ``schema_version`` becomes 6 and the provenance field ``converted_from`` names the
version a row was measured as ("" for a table measured as v6).
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any

from mlatune.arch import DeviceInfo, driver_version, library_versions
from mlatune.problem import KEY_FIELDS
from mlatune.steps import UNKNOWN_STEP_KIND  # noqa: F401  (rows no route declared)

SCHEMA_VERSION = 6

DEVICE_COLUMNS = ("arch", "device_name", "cu_count")
# The shortest time an ok row may hold: no launch takes under a nanosecond, and a ratio over
# a smaller (a denormal) overflows to inf where tables are compared or predicted from.
MIN_TIME_US = 1e-3
# The arch a table's device names: sm_<n>, gfx<id> or cpu (arch.vendor_of reads the prefix).
ARCH_PATTERN = re.compile(r"sm_[0-9]+[a-z]?|gfx[0-9a-f]+|cpu")
KEY_COLUMNS = DEVICE_COLUMNS + KEY_FIELDS
ROW_KEY = (*KEY_COLUMNS, "route")  # unique per table



class Status(StrEnum):
    """What became of a candidate: the one owner of these names (journal, table, report).
    A StrEnum, so each compares equal to, and is written as, its text."""

    OK = "ok"
    REJECTED_ACCURACY = "rejected_accuracy"
    CRASHED = "crashed"
    TIMEOUT = "timeout"
    UNSUPPORTED = "unsupported"  # a rule refuses the (problem, route): nothing ran
    # Its parameters name a kernel form that no longer exists: set as a table is read,
    # never served, neither ok nor failed (sweep the route again).
    STALE = "stale"
    # A prior table put the route far behind the problem's best (``mlatune sweep
    # --prune-from``): not run, neither ok nor failed.
    PRUNED = "pruned"
    CHECKED = "checked"  # compiling ahead: checked once, never journaled nor in a table


STATUSES = tuple(s.value for s in Status if s is not Status.CHECKED)  # a table's statuses
# Rows that neither answer a problem nor say a route failed there.
NEITHER_STATUSES = (Status.STALE.value, Status.PRUNED.value)
# A crashed candidate's reason where the sweep's process ran out of GPU memory: its checking
# inputs beside the route, which an engine's memory plan does not hold. Not measured there.
OUT_OF_MEMORY_REASON = "raised OutOfMemoryError"


def unmeasured(frame) -> Any:
    """Per row of a table frame, whether it says nothing of its route at its problem: never
    run (``NEITHER_STATUSES``) or out of memory in the sweep (a numpy bool array)."""
    status = frame["status"]
    out_of_memory = (status == Status.CRASHED.value) & \
        frame["reason"].fillna("").str.startswith(OUT_OF_MEMORY_REASON)
    return (status.isin(NEITHER_STATUSES) | out_of_memory).to_numpy(dtype=bool)


def reference_fallbacks(frame, not_measured, by: Sequence[str]) -> Any:
    """Per row, whether it is the reference's at a problem (rows alike in ``by``) where another
    route was not measured (``not_measured``, ``unmeasured``'s mask): the sweep's fallback
    there, not a measured competitor, so it answers no problem."""
    import numpy as np

    from mlatune.check.reference import ROUTE_ID

    reference = (frame["route"] == ROUTE_ID).to_numpy()
    if not (reference.any() and not_measured.any()):
        return np.zeros(len(frame), dtype=bool)
    index = frame.set_index(list(by)).index
    return reference & index.isin(index[not_measured])

# Column -> pandas dtype. Floats are NaN where a status has no measurement.
RESULT_COLUMNS: dict[str, str] = {
    "route": "string",
    "route_params": "string",  # JSON object: how to call the route (splits, tiles, ...)
    "status": "string",  # one of STATUSES
    "reason": "string",  # why not ok; "" when ok
    "time_us": "float64",  # median device time of one launch (graph replay when capturable)
    "time_us_p20": "float64",
    "time_us_p80": "float64",
    # GRAPH_TIMER (a CUDA graph's replay), "cuda_event" (eager, device events) or "wall";
    # for a DCP row measured across processes it says whether its step was graph-timed.
    "timer": "string",
    "rel_err": "float64",  # relative L2 error of the output against the reference
    "max_abs_err": "float64",
    # v5: the largest absolute error of the route's LSE over the checked cases; NaN where the
    # route returned no LSE or nothing was measured
    "lse_err": "float64",
    "tb_per_s": "float64",  # problem.min_bytes() / time
    "tflops": "float64",  # problem.flops() / time
    # 1 = winner among ok rows of the key (measured DCP rows first, then by time_us);
    # 0 for rows that are not ok
    "rank": "int64",
    # The step kind is the route's declaration for these params, so every row has it.
    "plan_on": "string",  # where the per-step plan runs: "none", "device" or "host"
    "capturable": "bool",  # plan and launch replay in one CUDA graph (never with "host")
    "plan_us": "float64",  # device time of one per-step plan; 0 when plan_on is "none"
    "plan_host_us": "float64",  # host wall time of one eager plan call ("host": a re-prepare)
    "launch_host_us": "float64",  # host wall time of one eager launch: an eager engine's CPU cost
    # v3: how a DCP row was timed (see the module docstring).
    "dcp_timing": "string",  # "" without DCP, else DCP_SIMULATED or DCP_MEASURED
    "dcp_scheme": "string",  # measured: one of DCP_SCHEMES; else ""
    "comm_us": "float64",  # measured: time_us minus the attention alone; else NaN
    "simulated_us": "float64",  # measured: the one-GPU simulation's time_us; else NaN
}
STEP_KIND_COLUMNS = ("plan_on", "capturable")
STEP_COST_COLUMNS = ("plan_us", "plan_host_us", "launch_host_us")
CONVERTED_FROM_V1 = "v1"
# How a measured DCP step merged its ranks' partials (all-gather + reduce-scatter, all-to-all).
DCP_SCHEMES = ("ag_rs", "a2a")
DCP_COLUMNS = ("dcp_timing", "dcp_scheme", "comm_us", "simulated_us")
DCP_SIMULATED = "simulated"
DCP_MEASURED = "measured"
DCP_TIMINGS = ("", DCP_SIMULATED, DCP_MEASURED)
GRAPH_TIMER = "cuda_graph"

KEY_TYPES: dict[str, str] = {
    "arch": "string",
    "device_name": "string",
    "cu_count": "int64",
    "phase": "string",
    "num_heads": "int64",
    "qlen": "int64",
    "q_dtype": "string",
    "kv_dtype": "string",
    "causal": "bool",
    "dcp_size": "int64",
    "page_size": "int64",
    "batch": "int64",
    "kv_len": "int64",
    "d_qk": "int64",
    "d_v": "int64",
}


@dataclass(frozen=True)
class Provenance:
    schema_version: int
    mlatune_version: str
    torch_version: str
    triton_version: str
    backend_versions: str  # JSON object of every library version that matters
    driver: str
    created_utc: str
    spec_sha256: str
    # "" for a table measured under this schema; "v1" or "v2" for one upgraded from that
    # schema (see the module docstring for what upgrading fills in).
    converted_from: str = ""
    hardware: str = ""  # mlatune.hardware.Hardware as JSON; "": not recorded

    @classmethod
    def here(cls, spec_sha256: str = "", hardware: str = "") -> Provenance:
        versions = library_versions()
        return cls(
            schema_version=SCHEMA_VERSION,
            mlatune_version=versions["mlatune"] or "",
            torch_version=versions["torch"] or "",
            triton_version=versions["triton"] or "",
            backend_versions=json.dumps(versions, sort_keys=True),
            driver=driver_version(),
            created_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            spec_sha256=spec_sha256,
            hardware=hardware,
        )

    def as_dict(self) -> dict:
        return asdict(self)


PROVENANCE_TYPES: dict[str, str] = {
    "schema_version": "int64",
    "mlatune_version": "string",
    "torch_version": "string",
    "triton_version": "string",
    "backend_versions": "string",
    "driver": "string",
    "created_utc": "string",
    "spec_sha256": "string",
    "converted_from": "string",
    "hardware": "string",
}

COLUMN_TYPES: dict[str, str] = {**KEY_TYPES, **RESULT_COLUMNS, **PROVENANCE_TYPES}
COLUMNS = tuple(COLUMN_TYPES)


def device_key(device: DeviceInfo) -> dict:
    return {"arch": device.arch, "device_name": device.name, "cu_count": device.cu_count}


def is_measured(dcp_timing: object) -> bool:
    """Whether a row or record with this ``dcp_timing`` was timed across processes."""
    return dcp_timing == DCP_MEASURED


def competing(groups: Sequence[Hashable], measured: Sequence[bool]) -> list[bool]:
    """Which rows compete, given each row's group and whether it was timed across
    processes: in a group with a measured row only the measured rows do; a group with
    none keeps every row. The group is a problem for the rows that answer it, a bucket
    (every key field but batch and kv_len) for the rows a predictor learns from: a
    simulated time leaves the collectives out, so it is never set against a measured one."""
    with_measured = {g for g, m in zip(groups, measured, strict=True) if m}
    if not with_measured:
        return [True] * len(groups)
    return [bool(m) or g not in with_measured for g, m in zip(groups, measured, strict=True)]


def default_dcp_timing(dcp_size: int) -> str:
    """A row's dcp_timing when nothing says it was measured across processes."""
    return DCP_SIMULATED if dcp_size > 1 else ""


def upgraded_provenance(provenance: Mapping, version: int = 1) -> dict:
    """A schema ``version`` provenance record as the upgraded table carries it."""
    return {**provenance, "schema_version": SCHEMA_VERSION,
            "converted_from": provenance.get("converted_from") or f"v{version}",
            "hardware": provenance.get("hardware") or ""}
