"""Dispatch table schema v2: the columns every table has, and what each holds.

One row per (device, problem, route). The key is the whole problem spelled
out, plus the device it was measured on. Provenance travels twice: as Parquet
file metadata and as constant columns, so a CSV stands alone too.

v2 adds how an engine steps each route (``mlatune.routes.base.StepKind``): a
per-step plan (``plan_on``: "none", "device" or "host") and a launch, whether
both replay in one CUDA graph (``capturable``), and what the plan and the
launch cost (``STEP_COST_COLUMNS``). ``time_us`` is still the launch's device
time. A v1 table is upgraded as it is read (``mlatune.table.read``): its step
kinds come from the routes' declarations (``declared_step_kind``), its costs
are NaN (never measured), ``schema_version`` becomes 2 and the provenance field
``converted_from`` says "v1" ("" for a table measured as v2).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from mlatune.arch import DeviceInfo, driver_version, library_versions
from mlatune.problem import KEY_FIELDS

SCHEMA_VERSION = 2

DEVICE_COLUMNS = ("arch", "device_name", "cu_count")
KEY_COLUMNS = DEVICE_COLUMNS + KEY_FIELDS
ROW_KEY = (*KEY_COLUMNS, "route")  # unique per table

STATUSES = ("ok", "rejected_accuracy", "crashed", "timeout", "unsupported")

# Column -> pandas dtype. Floats are NaN where a status has no measurement.
RESULT_COLUMNS: dict[str, str] = {
    "route": "string",
    "route_params": "string",  # JSON object: how to call the route (splits, tiles, ...)
    "status": "string",  # one of STATUSES
    "reason": "string",  # why not ok; "" when ok
    "time_us": "float64",  # median device time of one launch (graph replay when capturable)
    "time_us_p20": "float64",
    "time_us_p80": "float64",
    "timer": "string",  # "cuda_graph", "cuda_event" or "wall"
    "rel_err": "float64",  # relative L2 error of the output against the reference
    "max_abs_err": "float64",
    "tb_per_s": "float64",  # problem.min_bytes() / time
    "tflops": "float64",  # problem.flops() / time
    "rank": "int64",  # 1 = winner among ok rows of the key; 0 for rows that are not ok
    # The step kind is the route's declaration for these params, so every row has it.
    "plan_on": "string",  # where the per-step plan runs: "none", "device" or "host"
    "capturable": "bool",  # plan and launch replay in one CUDA graph (never with "host")
    "plan_us": "float64",  # device time of one per-step plan; 0 when plan_on is "none"
    "plan_host_us": "float64",  # host wall time of one eager plan call ("host": a re-prepare)
    "launch_host_us": "float64",  # host wall time of one eager launch: an eager engine's CPU cost
}
STEP_KIND_COLUMNS = ("plan_on", "capturable")
STEP_COST_COLUMNS = ("plan_us", "plan_host_us", "launch_host_us")
# A route not registered here (a plugin not loaded) is taken as the least usable
# kind, so it is never picked where a capturable step is required.
UNKNOWN_STEP_KIND = ("host", False)
CONVERTED_FROM_V1 = "v1"

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
    # "" for a table measured under this schema; "v1" for one upgraded from schema v1
    # (step kinds declared, not measured; per-step costs NaN).
    converted_from: str = ""

    @classmethod
    def here(cls, spec_sha256: str = "") -> Provenance:
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
}

COLUMN_TYPES: dict[str, str] = {**KEY_TYPES, **RESULT_COLUMNS, **PROVENANCE_TYPES}
COLUMNS = tuple(COLUMN_TYPES)


def device_key(device: DeviceInfo) -> dict:
    return {"arch": device.arch, "device_name": device.name, "cu_count": device.cu_count}


def declared_step_kind(route_id: str, params: Mapping | str) -> tuple[str, bool]:
    """(plan_on, capturable) that ``route_id`` declares for ``params`` (a dict or its JSON);
    UNKNOWN_STEP_KIND for a route not registered here or params that are not an object."""
    from mlatune.routes import get, step_kind_of  # the registry only when a kind is derived

    try:
        route = get(route_id)
        params = json.loads(params) if isinstance(params, str) else params
    except (KeyError, ValueError):
        return UNKNOWN_STEP_KIND
    if not isinstance(params, Mapping):
        return UNKNOWN_STEP_KIND
    kind = step_kind_of(route, dict(params))
    return kind.plan_on, kind.capturable


def upgraded_provenance(provenance: Mapping) -> dict:
    """A schema v1 provenance record as the upgraded table carries it."""
    return {**provenance, "schema_version": SCHEMA_VERSION, "converted_from": CONVERTED_FROM_V1}
