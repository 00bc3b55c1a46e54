"""A DCP step timed from a CUDA graph: the whole step captured once, its replay timed.

An engine replays its decode step from a CUDA graph, so the host's launch gaps between
the q all-gather, the attention, the exchange and the correction are not what it pays.
Here every rank captures its step (``mlatune.dcp.DcpStep`` without the per-step plan, as
the eager timing) in one graph: the collectives (NCCL can be captured; gloo cannot), the
route's launch and the combine's temporaries (from the graph's own pool). The replay is
checked against the reference before it is timed (``mlatune.dcp.time_slowest`` around
``replay``: the slowest rank's median, cold L2). A route whose launch is not graph-safe
(a host plan every step) is timed eagerly.

A measured record says how it was timed in the table's ``timer`` column (the one owner):
``cuda_graph`` for a replay, ``cuda_event`` for an eager step on a GPU, ``wall`` on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mlatune.dcp import DcpStep, time_slowest
from mlatune.table.schema import GRAPH_TIMER

__all__ = ["EAGER_TIMERS", "GRAPH_TIMER", "REFUSAL", "capturable", "capture", "refusal",
           "time_replay"]

EAGER_TIMERS = {"cuda": "cuda_event", "cpu": "wall"}
REFUSAL = ("timing the DCP step from a CUDA graph needs GPUs and the NCCL backend (gloo "
           "collectives cannot be captured); without GPUs the step is timed eagerly: drop "
           "the graph option")


def refusal(device: torch.device, backend: str | None = None) -> str:
    """Why a group on ``device`` with ``backend`` (the default group's when None) cannot
    time its steps from a graph; "" when it can."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return REFUSAL
    backend = backend or dist.get_backend()
    return "" if backend == "nccl" else REFUSAL


def capture(call: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``call`` (a step without its plan, or the attention alone) captured in a graph on
    this rank; a call with collectives: every rank of the group calls this together (the
    warm-up runs them). Warmed up on a side stream first, as capture asks; "thread_local":
    the process group's watchdog thread may query its events meanwhile."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        call()
    torch.cuda.synchronize()
    return graph


def time_replay(graph: torch.cuda.CUDAGraph, device: torch.device, reps: int, warmup: int
                ) -> float:
    """The slowest rank's median replay time in microseconds."""
    return time_slowest(graph.replay, device, reps, warmup)


def capturable(step: DcpStep) -> bool:
    """Whether this step can be captured: its route's launch is graph-safe (the same
    route on every rank, so every rank answers alike)."""
    return bool(step.prepared.graph_safe)
