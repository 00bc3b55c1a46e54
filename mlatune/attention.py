"""One call for an engine: MLA decode/verify on a paged latent cache, route chosen for you.

``decode`` builds the problem from the tensors, asks the dispatcher which
route serves it, prepares that route and runs it. The plan is kept per tensor
set (data pointers, dtypes, shapes, strides) and problem bucket (every key
field but batch and kv_len, which the tensors' shapes and ``max_kv_len`` give):
repeated calls with an engine's persistent buffers, whose contents change
between steps, find their plan in a dict.

- ``max_kv_len`` grows every decode step, so plans are not keyed on it: a plan
  serves every ``max_kv_len`` up to the next power of two above the one it was
  made for (the route chosen for the actual length, checked to support the
  problem at that power of two, which it is prepared for). Crossing a power of
  two re-plans. Reusing is safe because a plan that does not read the lengths
  on the host (below) takes every length from the device at launch: split-KV
  kernels cut each request's keys by its own length, whatever the number of
  splits.
- A plan that read the length *contents* when prepared (``Prepared.
  plan_reads_lengths``: padded/triton persistent, segmented/triton, the AITER
  decode routes) would be stale once the engine rewrites ``seq_lens`` in place,
  so its route is prepared again on every call, from the current lengths. That
  costs what preparing costs (a host read of the lengths, which synchronises
  with the GPU, the host planning, fresh buffers) on every step, as these
  routes paid before whenever ``max_kv_len`` moved; such plans are not for
  CUDA-graph capture.
- With dcp_size > 1 this rank's shard lengths are derived from the global
  ``seq_lens`` before the route is prepared and again on every call.
- ``return_lse=True`` takes the first route, in the dispatcher's order, whose
  plan returns an LSE (some, like AITER's Gluon decode, return none).

The returned ``out`` (and ``lse``) are the plan's own buffers: the next call
with the same tensors and shapes overwrites them (as a CUDA-graph engine
expects), except for a plan prepared again (above), which returns new ones.
Clone them to keep a result across calls.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from mlatune.dispatch import Choice, Dispatcher
from mlatune.inputs import DecodeInputs, KVShard
from mlatune.problem import DTYPES, MLAProblem, next_power_of_two
from mlatune.routes import Prepared, Route

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Plans kept per dispatcher; a plan holds the caller's tensors alive, so the set is bounded.
PLAN_LIMIT = 1024

_plans: weakref.WeakKeyDictionary[Dispatcher, dict[tuple, _Plan]] = weakref.WeakKeyDictionary()
_default: list[Dispatcher] = []


@dataclass
class _Plan:
    problem: MLAProblem  # kv_len: the power of two up to which this plan serves max_kv_len
    choice: Choice
    route: Route
    inputs: DecodeInputs  # what the route is prepared from (again, if it reads the lengths)
    prepared: Prepared
    local_lens: torch.Tensor | None  # this rank's shard lengths, refreshed per call (DCP)
    rank: int


def default_dispatcher() -> Dispatcher:
    """``Dispatcher.from_bundled()``, made once per process on first use."""
    if not _default:
        _default.append(Dispatcher.from_bundled())
    return _default[0]


def _ptr(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _fill_local_lens(local_lens: torch.Tensor, seq_lens: torch.Tensor, rank: int,
                     world: int) -> None:
    """Round-robin share of each request on ``rank``: ceil((len - rank) / world), in place
    (``mlatune.inputs.shard_lengths`` without allocating)."""
    local_lens.copy_(seq_lens).add_(world - 1 - rank)
    local_lens.div_(world, rounding_mode="floor").clamp_(min=0)


def decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    qlen: int = 1,
    causal: bool = True,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    dcp_rank: int = 0,
    dcp_size: int = 1,
    max_kv_len: int | None = None,
    kv_lora_rank: int = 512,
    return_lse: bool = False,
    dispatcher: Dispatcher | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA decode (qlen 1) or speculative verify (qlen > 1) for one DCP rank.

    q: (batch * qlen, num_heads * dcp_size, kv_lora_rank + rope_dim), request-major;
    kv_cache: (pages, page_size, d_qk) or (pages, page_size, 1, d_qk), this rank's
    shard; block_table: (batch, max_pages) int32 page ids of this rank's shard;
    seq_lens: (batch,) int32 *global* KV lengths (the new tokens included; with
    dcp_size > 1 each rank's share is derived from them). ``max_kv_len`` is
    max(seq_lens): pass it when the engine knows it, since reading it from a
    GPU tensor synchronises. fp8 tensors take their per-tensor scales.

    Returns out (batch * qlen, num_heads * dcp_size, kv_lora_rank) and, with
    ``return_lse``, lse (batch * qlen, num_heads * dcp_size) fp32; with
    dcp_size > 1 both are this rank's partials, merged by the caller.
    """
    dispatcher = dispatcher or default_dispatcher()
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[3])
    if max_kv_len is None:
        max_kv_len = int(seq_lens.max())
    # The bucket (dtypes, page size and rope width come with the tensors) and the tensor
    # set; not max_kv_len, which a plan serves up to its power of two (module docstring).
    cache_key = (num_heads, qlen, causal, dcp_rank, dcp_size, kv_lora_rank,
                 return_lse, _ptr(q), _ptr(kv_cache), _ptr(block_table), _ptr(seq_lens),
                 _ptr(kv_scale), _ptr(q_scale))
    plans = _plans.get(dispatcher)
    if plans is None:
        plans = _plans.setdefault(dispatcher, {})
    plan = plans.get(cache_key)
    if plan is None or plan.problem.kv_len != next_power_of_two(max_kv_len):
        plan = _make_plan(q, kv_cache, block_table, seq_lens, num_heads=num_heads, qlen=qlen,
                          causal=causal, kv_scale=kv_scale, q_scale=q_scale, dcp_rank=dcp_rank,
                          dcp_size=dcp_size, max_kv_len=max_kv_len, kv_lora_rank=kv_lora_rank,
                          return_lse=return_lse, dispatcher=dispatcher)
        if len(plans) >= PLAN_LIMIT and cache_key not in plans:
            plans.clear()
        plans[cache_key] = plan
    else:
        if plan.local_lens is not None:
            _fill_local_lens(plan.local_lens, seq_lens, dcp_rank, dcp_size)
        if plan.prepared.plan_reads_lengths:  # planned from the lengths: plan them again
            plan.prepared = plan.route.prepare(plan.problem, plan.inputs, rank=dcp_rank,
                                               params=dict(plan.choice.params),
                                               want_lse=return_lse)
    plan.prepared.run()
    if return_lse:
        return plan.prepared.out, plan.prepared.lse
    return plan.prepared.out


def _make_plan(q, kv_cache, block_table, seq_lens, *, num_heads, qlen, causal, kv_scale,
               q_scale, dcp_rank, dcp_size, max_kv_len, kv_lora_rank, return_lse,
               dispatcher) -> _Plan:
    """Check the tensors against each other, build the problem, pick and prepare a route.

    The route is chosen for ``max_kv_len`` and prepared for its power of two (it must
    support that too); with ``return_lse`` the first route whose plan has an LSE.
    """
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be (pages, page_size, d_qk), got {tuple(kv_cache.shape)}")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name} dtype {t.dtype} is not one of {sorted(DTYPES)}")
    batch = block_table.shape[0]
    d_qk = kv_cache.shape[-1]
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be ({batch},) like block_table's rows, "
                         f"got {tuple(seq_lens.shape)}")
    want_q = (batch * qlen, num_heads * dcp_size, d_qk)
    if tuple(q.shape) != want_q:
        raise ValueError(f"q must be (batch * qlen, num_heads * dcp_size, d_qk) = {want_q}, "
                         f"got {tuple(q.shape)}")
    if not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank {dcp_rank} is not in [0, {dcp_size})")
    problem = MLAProblem(
        phase="decode", num_heads=num_heads, qlen=qlen, q_dtype=_DTYPE_NAMES[q.dtype],
        kv_dtype=_DTYPE_NAMES[kv_cache.dtype], batch=batch, kv_len=max_kv_len,
        dcp_size=dcp_size, causal=causal, page_size=kv_cache.shape[1],
        kv_lora_rank=kv_lora_rank, rope_dim=d_qk - kv_lora_rank)
    capped = problem.with_(kv_len=next_power_of_two(max_kv_len))
    local_lens = None
    if dcp_size > 1:  # this rank's lengths, filled before any route plans from them
        local_lens = torch.empty_like(seq_lens)
        _fill_local_lens(local_lens, seq_lens, dcp_rank, dcp_size)
    shard = KVShard(dcp_rank, kv_cache, block_table, seq_lens if local_lens is None
                    else local_lens)
    # This rank holds only its own shard; the other slots stay empty so a route
    # that reached for another rank's cache would fail loudly, not read garbage.
    shards = tuple(shard if r == dcp_rank else None for r in range(dcp_size))
    inputs = DecodeInputs(capped, q, q_scale, kv_scale, seq_lens, shards)  # type: ignore[arg-type]
    for choice in dispatcher.alternatives(capped, first=dispatcher.select(problem)):
        route = dispatcher.route(choice.route_id)
        prepared = route.prepare(capped, inputs, rank=dcp_rank, params=dict(choice.params),
                                 want_lse=return_lse)
        if not return_lse or prepared.lse is not None:
            return _Plan(capped, choice, route, inputs, prepared, local_lens, dcp_rank)
    raise RuntimeError(f"return_lse=True: no route that serves {problem.key} returns an LSE")


def plans_of(dispatcher: Dispatcher | None = None) -> dict[tuple, _Plan]:
    """The cached plans of a dispatcher (for tests and diagnostics)."""
    return _plans.get(dispatcher or default_dispatcher(), {})
