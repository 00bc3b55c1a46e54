"""Dispatch table schema v1: the columns every table has, and what each holds.

One row per (device, problem, route). The key is the whole problem spelled
out, plus the device it was measured on. Provenance travels twice: as Parquet
file metadata and as constant columns, so a CSV stands alone too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from mlatune.arch import DeviceInfo, driver_version, library_versions
from mlatune.problem import KEY_FIELDS

SCHEMA_VERSION = 1

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
    "time_us": "float64",  # median
    "time_us_p20": "float64",
    "time_us_p80": "float64",
    "timer": "string",  # "cuda_graph", "cuda_event" or "wall"
    "rel_err": "float64",  # relative L2 error of the output against the reference
    "max_abs_err": "float64",
    "tb_per_s": "float64",  # problem.min_bytes() / time
    "tflops": "float64",  # problem.flops() / time
    "rank": "int64",  # 1 = winner among ok rows of the key; 0 for rows that are not ok
}

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
}

COLUMN_TYPES: dict[str, str] = {**KEY_TYPES, **RESULT_COLUMNS, **PROVENANCE_TYPES}
COLUMNS = tuple(COLUMN_TYPES)


def device_key(device: DeviceInfo) -> dict:
    return {"arch": device.arch, "device_name": device.name, "cu_count": device.cu_count}
