"""Small dispatch tables for tests, built from real MLAProblem keys, and test-only routes."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable

import pandas as pd

from mlatune import routes, table
from mlatune.arch import DeviceInfo
from mlatune.problem import MLAProblem
from mlatune.routes import YES, Route, no
from mlatune.table.schema import SCHEMA_VERSION, Provenance, device_key

H200 = DeviceInfo("sm_90", "NVIDIA H200", "nvidia", 132, 141 * 2**30, 0)
MI355 = DeviceInfo("gfx950", "AMD Instinct MI355X", "amd", 256, 288 * 2**30, 0)
PROVENANCE = Provenance(
    schema_version=SCHEMA_VERSION, mlatune_version="0.1.0", torch_version="2.13.0",
    triton_version="3.4.0", backend_versions=json.dumps({"torch": "2.13.0"}),
    driver="cuda-driver-12.8", created_utc="2026-01-01T00:00:00Z", spec_sha256="ab" * 32)


def result_row(problem: MLAProblem, route: str, time_us: float | None, *,
               device: DeviceInfo = H200, status: str | None = None,
               params: dict | None = None, reason: str = "") -> dict:
    """One measured (problem, route): ok with a time, or ``status`` without one."""
    status = status or ("ok" if time_us is not None else "crashed")
    t = time_us if status == "ok" else math.nan
    return {
        **device_key(device), **problem.key_dict(), "route": route,
        "route_params": json.dumps(params or {}, sort_keys=True), "status": status,
        "reason": reason if status != "ok" else "", "time_us": t, "time_us_p20": t * 0.97,
        "time_us_p80": t * 1.04, "timer": "cuda_graph", "rel_err": 2e-3, "max_abs_err": 1e-2,
        "lse_err": 4e-3,
        "tb_per_s": math.nan if math.isnan(t) else problem.min_bytes() / t / 1e6,
        "tflops": math.nan if math.isnan(t) else problem.flops() / t / 1e6,
    }


def grid_rows(buckets: Iterable[MLAProblem], batches: Iterable[int], kv_lens: Iterable[int],
              timings: dict[str, Callable[[MLAProblem], float | None]], *,
              device: DeviceInfo = H200) -> list[dict]:
    """Every bucket x batch x kv_len, each route timed by its function (None: crashed)."""
    rows = []
    for base in buckets:
        for batch in batches:
            for kv_len in kv_lens:
                problem = base.with_(batch=batch, kv_len=kv_len)
                rows += [result_row(problem, route, time(problem), device=device)
                         for route, time in timings.items()]
    return rows


def make_table(rows: list[dict], provenance: Provenance = PROVENANCE) -> pd.DataFrame:
    return table.build(rows, provenance, facts=routes.FACTS)


# Timings whose winner changes with the shape, so lookups can be told apart.
def small_batch_fast(p: MLAProblem) -> float:
    return 2.0 + p.batch * p.kv_len / 1e3


def large_batch_fast(p: MLAProblem) -> float:
    return 40.0 + p.batch * p.kv_len / 4e3


def reference_slow(p: MLAProblem) -> float:
    return 500.0 + p.batch * p.kv_len / 10.0


class FakeRoute(Route):
    """A test-only route: supports what ``accepts`` says, computes with the reference route,
    and records every prepare call."""

    def __init__(self, route_id: str, accepts: Callable[[MLAProblem], bool] = lambda p: True):
        self.id = route_id
        self.accepts = accepts
        self.prepared: list[tuple[MLAProblem, dict]] = []

    def supports(self, problem, device):
        return YES if self.accepts(problem) else no(f"{self.id} refuses batch {problem.batch}")

    def param_space(self, problem, device):
        return [{}]

    def prepare(self, problem, inputs, *, rank=0, params=None, want_lse=True):
        self.prepared.append((problem, dict(params or {})))
        return routes.get("reference/torch").prepare(problem, inputs, rank=rank, params=params,
                                                     want_lse=want_lse)
