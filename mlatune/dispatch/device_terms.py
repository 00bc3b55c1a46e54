"""A route's step at a problem, in device terms: the law terms ``mlatune.dispatch.laws`` fits.

Per (problem, route, parameters, device) seven terms, each in microseconds or a count:

- 1: the fixed cost of a launch;
- DRAM: the bytes the step must move (``MLAProblem.min_bytes``) over the DRAM bandwidth;
- walk: the bytes the busiest SM streams in turn, at the SM's clock. What an SM walks is
  ``W`` of ``Route.launch_geometry`` (the KV tokens it walks in turn, waves and whole tiles
  included; balanced where a route declares no geometry). With the SMs full, walk and DRAM
  move together and the fit cannot part them; with few programs the busiest SM's walk
  is long while the DRAM bytes are few: what a route shows there tells a step limited by
  the bandwidth from one limited by each SM's own pace;
- compute: the FLOPs of that walk over the SM's share of the tensor throughput, each
  program's query rows padded to the route's block rows (heads x qlen as the kernel pads
  them);
- requests: the batch, and programs: ``C`` of the geometry (programs per SM), both scaled by
  the SM clock (fixed work per request and per program runs at the clock);
- convert: the cache elements of that walk a kernel widens to q's dtype before its MMAs (an
  fp8 cache under a 16-bit q), at the clock: such a walk costs per element, not per byte, so
  the walk term alone makes an fp8 cache twice as cheap as it is for a kernel that converts.

Figures a ``Hardware`` lacks are nominal (``NOMINAL``): a law fitted and evaluated on one
device does not depend on them; only a transfer between two devices reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from mlatune.arch import DeviceInfo, vendor_of
from mlatune.hardware import Hardware
from mlatune.problem import MLAProblem, dtype_size
from mlatune.routes import Route
from mlatune.routes.geometry import LaunchGeometry

TERMS = 7  # 1, DRAM, walk, compute, requests, programs, convert
WALK_BYTES_PER_US = 1e4  # the walk term's unit: an SM streaming at 10 GB/s at the reference clock
NOMINAL = {"bandwidth_gbs": 1000.0, "tensor_tflops": 100.0, "sm_clock_mhz": 1000.0}
PAD_ROWS = 16  # a route without a declared tile: its rows padded to the least MMA tile
TILE_ROWS = 64  # the vendor launches' rows a program (FlashMLA, FlashInfer's tiles)


@dataclass(frozen=True)
class Device:
    """What the terms read of a ``Hardware``, in the units they use."""

    cus: int
    bytes_per_us: float
    flops_per_us: float
    clock_scale: float  # reference clock over this one: fixed work's time factor
    info: DeviceInfo  # the stand-in a route's split rule is asked with


def device(hardware: Hardware) -> Device:
    """The terms' view of ``hardware`` (peak bandwidth: two devices compare alike)."""
    bandwidth = hardware.bandwidth_gbs or NOMINAL["bandwidth_gbs"]
    tflops = hardware.tensor_tflops or NOMINAL["tensor_tflops"]
    clock = hardware.sm_clock_mhz or NOMINAL["sm_clock_mhz"]
    cus = max(1, int(hardware.sm_count or 1))
    info = DeviceInfo(hardware.arch, hardware.name, vendor_of(hardware.arch), cus, 0, -1)
    return Device(cus, bandwidth * 1e3, tflops * 1e6, NOMINAL["sm_clock_mhz"] / clock, info)


def knows(hardware: Hardware) -> bool:
    """Whether ``hardware`` has the figures a transfer reads (bandwidth and throughput)."""
    return bool(hardware.bandwidth_gbs) and bool(hardware.tensor_tflops)


def recipe_of(route: Route | None, params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters less the sized ones (the split the launch sizes for the problem)."""
    sized = route.sized_params if route is not None else ()
    return {k: v for k, v in params.items() if k not in sized}


def geometry(route: Route | None, problem: MLAProblem, recipe: Mapping[str, Any],
             cus: int) -> LaunchGeometry | None:
    """The recipe's launch geometry at ``problem``; None: balanced (none declared or it
    cannot be worked out there)."""
    if route is None or problem.phase != "decode":
        return None
    try:
        return route.launch_geometry(problem, recipe, cus)
    except Exception:  # a layout the route cannot work out here: taken as balanced
        return None


def program_rows(launch: LaunchGeometry | None, problem: MLAProblem, cus: int) -> float:
    """The query rows one program computes, padding included."""
    if launch is None:
        rows = problem.qlen * problem.kernel_heads
        return float(-(-rows // PAD_ROWS) * PAD_ROWS)
    tile = getattr(launch, "tile", None)
    if tile is not None:
        return float(tile["block_m"])
    clusters = getattr(launch, "clusters", None)  # two-CTA clusters walk one chunk
    return float(TILE_ROWS * max(1, round(cus / clusters))) if clusters else float(TILE_ROWS)


@lru_cache(maxsize=1 << 12)
def _sizes(problem: MLAProblem) -> tuple[float, int, bool]:
    """(``min_bytes``, a cache token's bytes, whether the cache is widened to q's dtype):
    what the terms read of the problem alone, once per problem (a table's rows come a
    route at a time per problem)."""
    kv_item = dtype_size(problem.kv_dtype)
    return problem.min_bytes(), problem.d_qk * kv_item, kv_item < dtype_size(problem.q_dtype)


def terms(problem: MLAProblem, route: Route | None, params: Mapping[str, Any],
          dev: Device, split: int | None = None) -> np.ndarray:
    """The law terms of ``route`` run with ``params`` at ``problem`` on ``dev``; ``split``:
    the split to size with (default: as ``params`` say, else the route's rule)."""
    launch = geometry(route, problem, recipe_of(route, params), dev.cus)
    min_bytes, token_bytes, widened = _sizes(problem)
    per_token = 2.0 * (problem.d_qk + problem.d_v)  # FLOPs a query row spends on a key
    if launch is None:
        walked = problem.batch * problem.shard_len / dev.cus
        programs = problem.batch / dev.cus
        compute = problem.flops() if problem.phase != "decode" else \
            walked * dev.cus * program_rows(None, problem, dev.cus) * per_token
    else:
        if launch.key is not None and split is None:
            split = params.get(launch.key)
            if split is None:
                split = launch.split(problem, dev.info)
        walked, programs = launch.features(problem, split, dev.cus)
        compute = walked * dev.cus * program_rows(launch, problem, dev.cus) * per_token
    return np.array([1.0, min_bytes / dev.bytes_per_us,
                     walked * token_bytes * dev.clock_scale / WALK_BYTES_PER_US,
                     compute / dev.flops_per_us,
                     problem.batch * dev.clock_scale, programs * dev.clock_scale,
                     widened * walked * problem.d_qk * dev.clock_scale / WALK_BYTES_PER_US])
