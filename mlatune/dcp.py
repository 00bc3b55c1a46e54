"""A decode-context-parallel (DCP) step across the ranks of a torch.distributed group.

vLLM's DCP step, one process per GPU: each rank holds the queries of its own heads and a
round-robin shard of every request's KV (global token i on rank i % world). Per step:

1. the queries are all-gathered across the group: every rank attends with all the
   group's heads (the problem's ``kernel_heads`` = heads x world, rank-major);
2. attention over the rank's shard with LSE, by any route that returns one;
3. the partial outputs are combined by heads, one of two ways (vLLM's DCP backends):
   - ``ag_rs``: the LSEs are all-gathered, each partial is rescaled to the global LSE and
     the outputs are reduce-scattered by heads (three collectives in the step);
   - ``a2a``: the partial outputs and LSEs go all-to-all by heads and each rank merges
     the ones for its heads (two collectives in the step; the LSEs ride along).

Each rank ends with the output and LSE of its own heads over every request's whole KV.
The collectives run on whatever backend the group has: NCCL on GPUs, gloo on the CPU (the
tests run 2, 4 and 8 CPU processes). The step's inputs, gathered queries and outputs
are allocated once, at prepare; the combine's temporaries come from the caching
allocator each call (a CUDA graph of the step fixes them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlatune.check.inputs import DecodeInputs, KVShard
from mlatune.lse import combine
from mlatune.problem import MLAProblem
from mlatune.routes import Prepared, Route
from mlatune.table.schema import DCP_SCHEMES

SCHEMES = DCP_SCHEMES
_L2_FLUSH_BYTES = 256 << 20  # as the sweep's timing (bench): every repetition on a cold L2


def merge_ranks_into(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor | None = None) -> None:
    """Merge DCP ranks' partial attention by their LSEs (the step's ``a2a`` combine, and the
    sweep's one-GPU simulation of it): out = sum_r exp(lse_r - lse) * outs[r], lse =
    logsumexp_r lses[r]; -inf ranks add 0. ``outs`` (R, T, H, D) and ``lses`` (R, T, H)
    stack the ranks' partials. On a GPU the Triton merge kernel (one launch, no allocation,
    graph safe); elsewhere the reference's merge."""
    if outs.is_cuda:
        from mlatune.kernels.merge import merge_partials_into  # triton: on the GPU path only

        merge_partials_into(outs, lses, out, lse)
        return
    merged, total = combine(list(outs.float()), list(lses.float()))
    out.copy_(merged)
    if lse is not None:
        lse.copy_(total)


@dataclass
class DcpStep:
    """One rank's prepared DCP step; calling it runs the step on what the tensors hold."""

    scheme: str
    rank: int
    world: int
    group: dist.ProcessGroup | None
    q_local: torch.Tensor  # (T, H, D): this rank's heads, the caller's buffer
    gathered: torch.Tensor  # (W, T, H, D): every rank's queries
    q_all: torch.Tensor  # (T, W * H, D): what the route attends with
    prepared: Prepared  # attention over this rank's shard, all heads, with LSE
    out: torch.Tensor  # (T, H, d_v) fp32: this rank's heads over the whole KV
    lse: torch.Tensor  # (T, H) fp32

    def __call__(self, plan: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The step; ``plan=False`` leaves out the route's per-step plan, as every layer
        of an engine step after the first does (the layers share one plan)."""
        # As bytes: no reduction, and gloo (NCCL before 2.24) has no fp8 type.
        _all_gather(self.gathered.view(-1, *self.q_local.shape[1:]).view(torch.uint8),
                    self.q_local.view(torch.uint8), self.group)
        t, h = self.q_local.shape[:2]
        self.q_all.view(t, self.world, h, -1).copy_(self.gathered.permute(1, 0, 2, 3))
        (self.prepared.step if plan else self.prepared.run)()
        (_ag_rs if self.scheme == "ag_rs" else _a2a)(self)
        return self.out, self.lse


def _all_gather(out: torch.Tensor, part: torch.Tensor, group) -> None:
    """Every rank's ``part`` concatenated along dim 0 into ``out`` (torch >= 2.12 names it
    all_gather_single; the H200s' torch 2.11 has only all_gather_into_tensor)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, part, group=group)


def _by_rank(x: torch.Tensor, world: int) -> torch.Tensor:
    """(T, W * H, ...) -> (W, T, H, ...): each rank's heads together, rank-major."""
    t, wh = x.shape[:2]
    return x.view(t, world, wh // world, *x.shape[2:]).transpose(0, 1).contiguous()


def _ag_rs(step: DcpStep) -> None:
    """All-gather the LSEs, rescale to the global LSE, reduce-scatter the outputs."""
    partial_lse = step.prepared.lse.float()
    lses = torch.empty(step.world, *partial_lse.shape, device=partial_lse.device)
    _all_gather(lses.view(-1, *partial_lse.shape[1:]), partial_lse, step.group)
    total = torch.logsumexp(lses, dim=0)  # -inf where no rank holds a key
    weight = torch.exp(partial_lse - total).nan_to_num_(0.0)  # 0 for empty partials
    # An empty partial's output is not read: a kernel may leave anything there.
    scaled = (step.prepared.out.float() * weight[..., None]).masked_fill_(
        torch.isneginf(partial_lse)[..., None], 0.0)
    scaled = _by_rank(scaled, step.world)
    dist.reduce_scatter_tensor(step.out, scaled.view(-1, *step.out.shape[1:]),
                               group=step.group)
    step.lse.copy_(_by_rank(total, step.world)[step.rank])


def _a2a(step: DcpStep) -> None:
    """All-to-all the partials by heads; merge the ones for this rank's heads."""
    outs = _by_rank(step.prepared.out.float(), step.world)  # (W, T, H, d_v)
    lses = _by_rank(step.prepared.lse.float(), step.world)  # (W, T, H)
    got_outs, got_lses = torch.empty_like(outs), torch.empty_like(lses)
    dist.all_to_all_single(got_outs, outs, group=step.group)
    dist.all_to_all_single(got_lses, lses, group=step.group)
    merge_ranks_into(got_outs, got_lses, step.out, step.lse)


def prepare_dcp_step(route: Route, problem: MLAProblem, q_local: torch.Tensor, shard: KVShard,
                     seq_lens: torch.Tensor, *, scheme: str = "ag_rs",
                     params: dict | None = None, group: dist.ProcessGroup | None = None,
                     q_scale: torch.Tensor | None = None,
                     kv_scale: torch.Tensor | None = None,
                     softmax_scale: float | None = None) -> DcpStep:
    """This rank's step: ``route`` (it must return an LSE) with ``params`` over ``shard``
    (this rank's round-robin share; its ``seq_lens`` the rank's lengths), ``seq_lens`` the
    requests' global lengths, ``q_local`` this rank's heads' queries."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if problem.dcp_size != world or shard.rank != rank:
        raise ValueError(f"a DCP-{problem.dcp_size} problem and shard {shard.rank} on rank "
                         f"{rank} of a group of {world}")
    t, h, d = q_local.shape
    gathered = q_local.new_empty(world, t, h, d)
    q_all = q_local.new_empty(t, world * h, d)
    shards = tuple(shard if r == rank else None for r in range(world))
    inputs = DecodeInputs(problem, q_all, q_scale, kv_scale, seq_lens, shards,  # type: ignore[arg-type]
                          sm_scale=softmax_scale)
    prepared = route.prepare(problem, inputs, rank=rank, params=params, want_lse=True)
    if prepared.lse is None:
        raise ValueError(f"{route.id} returns no LSE: it cannot serve a DCP shard")
    out = torch.empty(t, h, problem.d_v, dtype=torch.float32, device=q_local.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q_local.device)
    return DcpStep(scheme, rank, world, group, q_local, gathered, q_all, prepared, out, lse)


def local_heads(rank: int, num_heads: int) -> slice:
    """Rank ``rank``'s heads among the group's ``kernel_heads`` (rank-major)."""
    return slice(rank * num_heads, (rank + 1) * num_heads)


def time_slowest(call: Callable[[], object], device: torch.device, reps: int,
                 warmup: int = 1, group: dist.ProcessGroup | None = None) -> float:
    """The slowest rank's median time of ``call`` in microseconds, eager, each repetition
    started together (a barrier) on a cold L2; device events on a GPU, wall time on the
    CPU. Every rank of ``group`` must call it with the same ``reps``."""
    flush = torch.empty(_L2_FLUSH_BYTES // 4, device=device) if device.type == "cuda" else None
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.fill_(1.0)
        dist.barrier(group=group)
        times.append(_time_one(call, device))
    slowest = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest)


def _time_one(call: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3
