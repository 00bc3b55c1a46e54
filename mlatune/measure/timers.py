"""Timing a prepared route: warm-up, cold L2, CUDA-graph replay, median and spread.

Each repetition is timed on its own between device events, after a write of a
buffer larger than L2 has evicted the route's data: in a model, one layer's KV
cache is long gone from L2 by the time that layer runs again. Routes that can
be captured are replayed from a CUDA graph, so launch gaps are not timed.
Repetitions stop once the running median has settled, or early when a
candidate is plainly losing: after ``race_reps`` repetitions its median is more
than ``race_ratio`` times the best time already measured for the problem (its
ranking is then certain and more repetitions only cost GPU time). Without a
GPU a wall-clock timer keeps the pipeline running end to end.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlatune.table.schema import GRAPH_TIMER

_L2_FLUSH_BYTES = 256 << 20  # > the H200's 60 MB and MI300's 256 MB infinity cache
# Repetitions between two looks at whether the median has settled; with a cold L2
# the spread is small (about 1% between the 20th and 80th percentiles on the H200),
# so 10 repetitions usually suffice.
_SETTLE_STEP = 5
# Device work host_us may queue behind its timed calls when it knows their device time.
_HOST_DEVICE_BUDGET_S = 0.01


@dataclass(frozen=True)
class Budget:
    # Untimed runs (a capture's side-stream run and first replay count as two); the
    # sweep's accuracy checks have already run the route twice.
    warmup: int = 1
    min_reps: int = 10
    max_reps: int = 200
    max_seconds: float = 2.0  # per candidate, timed reps only
    settle: float = 0.005  # stop when _SETTLE_STEP more reps move the median less than this
    race_reps: int = 5  # reps after which a plain loser stops
    # "Plain loser": median above this x the problem's best (5-rep medians with a cold
    # L2 agree within about 1%); 0: off.
    race_ratio: float = 1.25


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    reps: int
    timer: str  # GRAPH_TIMER, "cuda_event" or "wall" (the table's timer column)
    raced: bool = False  # stopped after race_reps: plainly slower than the problem's best


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_us: list[float], timer: str, raced: bool = False) -> Timing:
    ordered = sorted(samples_us)
    return Timing(statistics.median(ordered), _quantile(ordered, 0.2), _quantile(ordered, 0.8),
                  len(ordered), timer, raced)


def _repeat(one_rep: Callable[[], float], budget: Budget, best_us: float, timer: str) -> Timing:
    """Call ``one_rep`` (returns microseconds) until the median settles, the budget
    ends or the candidate has plainly lost to ``best_us``."""
    give_up_us = budget.race_ratio * best_us if budget.race_ratio > 0 else math.inf
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < budget.max_reps:
        samples.append(one_rep())
        n = len(samples)
        if n == budget.race_reps and statistics.median(samples) > give_up_us:
            return summarize(samples, timer, raced=True)
        if n >= max(budget.min_reps, 2 * _SETTLE_STEP) and n % _SETTLE_STEP == 0:
            before, now = statistics.median(samples[:-_SETTLE_STEP]), statistics.median(samples)
            if abs(now - before) <= budget.settle * now:
                break
        if time.perf_counter() - start > budget.max_seconds and n >= min(3, budget.min_reps):
            break
    return summarize(samples, timer)


def measure(run: Callable[[], None], device: torch.device | str, budget: Budget = Budget(),
            graph_safe: bool = True, best_us: float = math.inf) -> Timing:
    """Time ``run`` on ``device``; everything it needs must already be allocated.

    ``best_us`` is the best time measured so far for the same problem (for racing).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return _measure_wall(run, budget, best_us)
    flush = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.float32, device=device)
    launch, timer, untimed = run, "cuda_event", 0
    if graph_safe:
        graph = capture_graph(run, device)  # runs the route once and replays it once
        if graph is not None:
            launch, timer, untimed = graph.replay, GRAPH_TIMER, 2
    for _ in range(budget.warmup - untimed):
        launch()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def one_rep() -> float:
        flush.fill_(1.0)
        start.record()
        launch()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    return _repeat(one_rep, budget, best_us, timer)


def capture_graph(run: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph | None:
    """A CUDA graph of one ``run``, or None when the route cannot be captured.

    Not ``torch.cuda.graph()``: it empties the allocator's cache on entry, so that
    every candidate of a sweep would pay cudaMalloc and cudaFree again for its
    buffers and the L2 flush buffer.
    """
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            run()  # warm up on the capture stream, as torch recommends
            graph.capture_begin()
            try:
                run()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize(device)
        return graph
    except Exception:  # capture is an optimisation; eager timing is still right
        torch.cuda.synchronize(device)
        return None


def host_us(call: Callable[[], None], device: torch.device | str, reps: int = 20,
            max_seconds: float = 0.25, device_us: float = 0.0, warm: bool = False) -> float:
    """Host time of one eager ``call`` in microseconds: the mean of up to ``reps``
    back-to-back calls (fewer past ``max_seconds``), device work left to run
    asynchronously. What an engine's CPU pays per step.

    ``device_us``, when known, is one call's device time: the calls are queued faster
    than the device runs them and the final sync waits for all of them, so reps are
    cut to about ``_HOST_DEVICE_BUDGET_S`` of device work (2 at least). In the H200
    sweep of 2026-11-30 that wait was 850 of its 1,838 worker seconds. ``warm``: the
    call has already run, so no first call is needed to keep anything lazy out.
    """
    device = torch.device(device)
    if device_us > 0:
        reps = max(2, min(reps, int(_HOST_DEVICE_BUDGET_S * 1e6 / device_us)))
    if not warm:
        call()  # anything lazy (a first-call compile or load) stays out
        _sync(device)
    calls, start = 0, time.perf_counter()
    while calls < reps and (calls == 0 or time.perf_counter() - start < max_seconds):
        call()
        calls += 1
    spent = time.perf_counter() - start
    _sync(device)
    return spent / calls * 1e6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_wall(run: Callable[[], None], budget: Budget, best_us: float) -> Timing:
    for _ in range(budget.warmup):
        run()

    def one_rep() -> float:
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6

    return _repeat(one_rep, budget, best_us, "wall")
