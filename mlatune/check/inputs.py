"""Seeded random inputs for a problem, laid out as serving engines hold them.

Never zeros: zeros hide unwritten outputs and wrong indexing. Values are
standard normal times a per-tensor amplitude drawn from the seed; fp8 tensors
store ``value / scale`` with a per-tensor scale that is not 1, so a route that
forgets or swaps a scale fails its check.

Decode layout (one latent KV head, paged):
- ``q``: (batch * qlen, kernel_heads, d_qk), request-major, tokens in order;
- per DCP rank a ``KVShard``: ``kv_cache`` (pages, page_size, d_qk) holding
  that rank's round-robin share of every request (global token i lives on
  rank ``i % dcp_size`` at local index ``i // dcp_size``), a ``block_table``
  (batch, max_pages) int32 of shuffled page ids padded with -1, and the local
  ``seq_lens``. With dcp_size 1 there is one shard holding everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlatune.problem import DTYPES, FP8_DTYPES, MLAProblem

# Headroom, in standard deviations, that an fp8 scale leaves below the format's max.
_FP8_HEADROOM = 8.0
_CHUNK = 1 << 24  # elements generated at a time, to bound temporaries on huge caches


@dataclass(frozen=True)
class KVShard:
    rank: int
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(frozen=True)
class DecodeInputs:
    problem: MLAProblem
    q: torch.Tensor
    q_scale: torch.Tensor | None  # (1,) fp32, fp8 only
    kv_scale: torch.Tensor | None
    seq_lens: torch.Tensor  # (batch,) int32 global lengths
    shards: tuple[KVShard, ...]
    sm_scale: float | None = None  # the model's softmax scale; None: the problem's default

    # The reference reads these through the inputs so it needs nothing else.
    @property
    def qlen(self) -> int:
        return self.problem.qlen

    @property
    def dcp_size(self) -> int:
        return self.problem.dcp_size

    @property
    def causal(self) -> bool:
        return self.problem.causal

    @property
    def d_v(self) -> int:
        return self.problem.d_v

    @property
    def softmax_scale(self) -> float:
        return self.problem.softmax_scale if self.sm_scale is None else self.sm_scale


@dataclass(frozen=True)
class PrefillInputs:
    problem: MLAProblem
    q: torch.Tensor  # (total_q, heads, d_qk)
    k: torch.Tensor  # (total_k, heads, d_qk)
    v: torch.Tensor  # (total_k, heads, d_v)
    q_scale: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    cu_seqlens_q: torch.Tensor  # (batch + 1,) int32
    cu_seqlens_k: torch.Tensor
    sm_scale: float | None = None  # the model's softmax scale; None: the problem's default

    @property
    def causal(self) -> bool:
        return self.problem.causal

    @property
    def softmax_scale(self) -> float:
        return self.problem.softmax_scale if self.sm_scale is None else self.sm_scale


class _Rng:
    """One seed drives both the small host-side draws and the bulk device draws."""

    def __init__(self, seed: int, device: torch.device):
        self.host = torch.Generator().manual_seed(seed)
        self.device = torch.Generator(device=device).manual_seed(seed + 1)

    def amplitude(self) -> float:
        return float(0.5 + 1.5 * torch.rand((), generator=self.host))


def random_tensor(shape, dtype_name: str, rng: _Rng, device,
                  amp: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normal values times an amplitude (drawn unless given); fp8 returns (x / scale, scale)."""
    dtype = DTYPES[dtype_name]
    amp = rng.amplitude() if amp is None else amp
    out = torch.empty(shape, dtype=dtype, device=device)
    scale = None
    divisor = 1.0 / amp
    if dtype_name in FP8_DTYPES:
        fmax = torch.finfo(dtype).max
        scale = torch.tensor([amp * _FP8_HEADROOM / fmax], dtype=torch.float32, device=device)
        divisor = _FP8_HEADROOM / fmax  # value/scale = normal * fmax / headroom
    flat = out.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        x = torch.randn(n, generator=rng.device, device=device, dtype=torch.float32) / divisor
        if scale is not None:
            x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
        flat[start:start + n] = x.to(dtype)
    return out, scale


def draw_seq_lens(problem: MLAProblem, rng: _Rng, ragged: bool) -> torch.Tensor:
    """Per-request lengths: all kv_len, or ragged in [qlen, kv_len] with one at kv_len."""
    if not ragged:
        return torch.full((problem.batch,), problem.kv_len, dtype=torch.int32)
    lens = torch.randint(problem.qlen, problem.kv_len + 1, (problem.batch,), generator=rng.host)
    lens[torch.randint(0, problem.batch, (1,), generator=rng.host)] = problem.kv_len
    return lens.to(torch.int32)


def shard_lengths(seq_lens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Tokens of each request that round-robin sharding puts on ``rank``."""
    return ((seq_lens - rank + world - 1) // world).clamp(min=0).to(torch.int32)


def _paged_shard(problem: MLAProblem, rank: int, seq_lens: torch.Tensor, rng: _Rng, device,
                 amp: float) -> tuple[KVShard, torch.Tensor | None]:
    page = problem.page_size
    local = shard_lengths(seq_lens, rank, problem.dcp_size)
    pages_per_req = (local + page - 1) // page
    total_pages = max(int(pages_per_req.sum()), 1)
    cache, scale = random_tensor((total_pages, page, problem.d_qk), problem.kv_dtype, rng, device,
                                 amp)
    perm = torch.randperm(total_pages, generator=rng.host).to(torch.int32)
    width = max(int(pages_per_req.max()), 1)
    table = torch.full((problem.batch, width), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per_req.tolist()):
        table[b, :n] = perm[start:start + n]
        start += n
    return KVShard(rank, cache, table.to(device), local.to(device)), scale


def make_decode_inputs(problem: MLAProblem, seed: int = 0, device="cpu",
                       ragged: bool = False) -> DecodeInputs:
    if problem.phase != "decode":
        raise ValueError(f"make_decode_inputs needs a decode problem, got phase={problem.phase}")
    device = torch.device(device)
    rng = _Rng(seed, device)
    seq_lens = draw_seq_lens(problem, rng, ragged)
    q, q_scale = random_tensor((problem.batch * problem.qlen, problem.kernel_heads, problem.d_qk),
                               problem.q_dtype, rng, device)
    # One amplitude, hence one per-tensor fp8 scale, for the whole logical cache.
    kv_amp = rng.amplitude()
    shards, scales = zip(*(_paged_shard(problem, r, seq_lens, rng, device, kv_amp)
                           for r in range(problem.dcp_size)), strict=True)
    return DecodeInputs(problem, q, q_scale, scales[0], seq_lens.to(device), tuple(shards))


def make_prefill_inputs(problem: MLAProblem, seed: int = 0, device="cpu",
                        ragged: bool = False) -> PrefillInputs:
    if problem.phase != "prefill":
        raise ValueError(f"make_prefill_inputs needs a prefill problem, got phase={problem.phase}")
    device = torch.device(device)
    rng = _Rng(seed, device)
    prefix = problem.kv_len - problem.qlen
    if ragged:
        q_lens = torch.randint(1, problem.qlen + 1, (problem.batch,), generator=rng.host)
        q_lens[torch.randint(0, problem.batch, (1,), generator=rng.host)] = problem.qlen
    else:
        q_lens = torch.full((problem.batch,), problem.qlen)
    k_lens = q_lens + prefix
    cu_q = torch.zeros(problem.batch + 1, dtype=torch.int32)
    cu_k = torch.zeros(problem.batch + 1, dtype=torch.int32)
    cu_q[1:] = q_lens.cumsum(0)
    cu_k[1:] = k_lens.cumsum(0)
    h = problem.num_heads
    q, q_scale = random_tensor((int(cu_q[-1]), h, problem.d_qk), problem.q_dtype, rng, device)
    k, k_scale = random_tensor((int(cu_k[-1]), h, problem.d_qk), problem.kv_dtype, rng, device)
    v, v_scale = random_tensor((int(cu_k[-1]), h, problem.d_v), problem.kv_dtype, rng, device)
    return PrefillInputs(problem, q, k, v, q_scale, k_scale, v_scale, cu_q.to(device),
                         cu_k.to(device))


def make_inputs(problem: MLAProblem, seed: int = 0, device="cpu", ragged: bool = False):
    make = make_decode_inputs if problem.phase == "decode" else make_prefill_inputs
    return make(problem, seed, device, ragged)


def poison_(*tensors: torch.Tensor | None) -> None:
    """Fill outputs with NaN so that any element a route fails to write is caught."""
    for t in tensors:
        if t is not None:
            t.fill_(float("nan"))
