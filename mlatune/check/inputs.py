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

The model-like family (``make_model_like_inputs``) checks what standard normal data hides,
as a trained model's activations are not isotropic: q and the latent cache (prefill: q, k
and v) have a handful of outlier channels 10-30x wider than the rest, the rope dims (the
last d_qk - d_v) log-normal widths and Student-t values (heavy tails); a few keys per
request (the first, a sink; the last all its query tokens see; one between) hold most of
each query's softmax mass; lengths are ragged in the longer half of what the problem
allows, but for one of the shortest. fp8 tensors take the per-tensor scale above, from the
widest channel's spread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlatune.problem import DTYPES, FP8_DTYPES, MLAProblem

# Headroom, in standard deviations, that an fp8 scale leaves below the format's max.
_FP8_HEADROOM = 8.0
_CHUNK = 1 << 24  # elements generated at a time, to bound temporaries on huge caches
# The model-like family (make_model_like_inputs): what its draws are made of.
_OUTLIER_CHANNELS = 4  # latent channels of q, of the cache (and of prefill's k and v) ...
_OUTLIER_GAIN = (10.0, 30.0)  # ... this many times wider than the others
_ROPE_LOG_SPREAD = 0.5  # rope channels' widths: log-normal with this sigma
_ROPE_DF = 3  # rope values: Student-t with this many degrees of freedom (heavy tails)
_HEAVY_KEYS = 3  # keys per request that dominate its attention: the first, the last, one
_SCORE_STD = (1.0, 3.0)  # the spread of a query's scores over the other keys, drawn in this
# A heavy key's score over the others' mean: log(length) + std^2 / 2 (where all the others'
# softmax weight adds up to one key's) plus a value drawn in this range per (token, head).
_RAISE = (-2.0, 0.0)


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


Fill = Callable[[tuple[int, ...]], tuple[torch.Tensor, torch.Tensor | None]]


class _Rng:
    """One seed drives both the small host-side draws and the bulk device draws."""

    def __init__(self, seed: int, device: torch.device):
        self.host = torch.Generator().manual_seed(seed)
        self.device = torch.Generator(device=device).manual_seed(seed + 1)

    def amplitude(self) -> float:
        return float(0.5 + 1.5 * torch.rand((), generator=self.host))


def fp8_scale(spread: float, dtype_name: str, device) -> torch.Tensor:
    """The per-tensor scale (1,) fp32 that stores ``_FP8_HEADROOM`` times ``spread`` (the
    widest channel's standard deviation) at the fp8 format's largest value."""
    fmax = torch.finfo(DTYPES[dtype_name]).max
    return torch.tensor([spread * _FP8_HEADROOM / fmax], dtype=torch.float32, device=device)


def random_tensor(shape, dtype_name: str, rng: _Rng, device,
                  amp: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normal values times an amplitude (drawn unless given); fp8 returns (x / scale, scale)."""
    dtype = DTYPES[dtype_name]
    amp = rng.amplitude() if amp is None else amp
    out = torch.empty(shape, dtype=dtype, device=device)
    scale = None
    divisor = 1.0 / amp
    if dtype_name in FP8_DTYPES:
        scale = fp8_scale(amp, dtype_name, device)
        divisor = _FP8_HEADROOM / torch.finfo(dtype).max  # value/scale = normal * fmax / headroom
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
                 fill: Fill) -> tuple[KVShard, torch.Tensor | None]:
    """One rank's paged cache, its values from ``fill(shape)``."""
    page = problem.page_size
    local = shard_lengths(seq_lens, rank, problem.dcp_size)
    pages_per_req = (local + page - 1) // page
    total_pages = max(int(pages_per_req.sum()), 1)
    cache, scale = fill((total_pages, page, problem.d_qk))
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

    def fill(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return random_tensor(shape, problem.kv_dtype, rng, device, kv_amp)

    shards, scales = zip(*(_paged_shard(problem, r, seq_lens, rng, device, fill)
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


def make_model_like_inputs(problem: MLAProblem, seed: int = 0, device="cpu"
                           ) -> DecodeInputs | PrefillInputs:
    """The model-like family's inputs for ``problem`` (see the module docstring): ragged
    lengths in the longer half of what the problem allows."""
    make = _model_like_decode if problem.phase == "decode" else _model_like_prefill
    return make(problem, torch.device(device), _Rng(seed, torch.device(device)))


def _model_like_decode(problem: MLAProblem, device: torch.device, rng: _Rng) -> DecodeInputs:
    seq_lens = _long_lengths(problem.batch, problem.qlen, problem.kv_len, rng)
    d, d_v = problem.d_qk, problem.d_v
    kv_gains, kv_amp = _channel_gains(d, d_v, rng), rng.amplitude()

    def fill(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _stored(_drawn(shape, kv_gains, d_v, kv_amp, rng, device), problem.kv_dtype,
                       kv_amp * float(kv_gains.max()))

    shards, scales = zip(*(_paged_shard(problem, r, seq_lens, rng, device, fill)
                           for r in range(problem.dcp_size)), strict=True)
    heavy = _heavy_positions(seq_lens - problem.qlen, rng)
    keys = _cache_rows(shards, problem, heavy, scales[0])[:, :, None]  # (B, K, 1, d)
    q_gains = _channel_gains(d, d_v, rng)
    request = torch.arange(problem.batch, device=device).repeat_interleave(problem.qlen)
    q, q_scale = _peaked_queries(problem, (len(request), problem.kernel_heads, d), q_gains,
                                 kv_gains, kv_amp, keys, request, seq_lens.to(device), rng)
    return DecodeInputs(problem, q, q_scale, scales[0], seq_lens.to(device), tuple(shards))


def _model_like_prefill(problem: MLAProblem, device: torch.device, rng: _Rng
                        ) -> PrefillInputs:
    q_lens = _long_lengths(problem.batch, 1, problem.qlen, rng)
    prefix = problem.kv_len - problem.qlen
    cu_q = torch.zeros(problem.batch + 1, dtype=torch.int32)
    cu_k = torch.zeros(problem.batch + 1, dtype=torch.int32)
    cu_q[1:] = q_lens.cumsum(0)
    cu_k[1:] = (q_lens + prefix).cumsum(0)
    h, d, d_v = problem.num_heads, problem.d_qk, problem.d_v
    k_gains, v_gains = _channel_gains(d, d_v, rng), _channel_gains(d_v, d_v, rng)
    k_amp, v_amp = rng.amplitude(), rng.amplitude()
    k, k_scale = _stored(_drawn((int(cu_k[-1]), h, d), k_gains, d_v, k_amp, rng, device),
                         problem.kv_dtype, k_amp * float(k_gains.max()))
    v, v_scale = _stored(_drawn((int(cu_k[-1]), h, d_v), v_gains, d_v, v_amp, rng, device),
                         problem.kv_dtype, v_amp * float(v_gains.max()))
    # Every query token of a request sees its prefix, where the heavy keys are.
    heavy = _heavy_positions(torch.full((problem.batch,), prefix), rng)
    keys = _rows(k, (cu_k[:-1, None] + heavy).to(device))  # (B, K, h, d)
    keys = keys if k_scale is None else keys * k_scale
    request = torch.arange(problem.batch, device=device).repeat_interleave(q_lens.to(device))
    q, q_scale = _peaked_queries(problem, (len(request), h, d), _channel_gains(d, d_v, rng),
                                 k_gains, k_amp, keys, request, (q_lens + prefix).to(device),
                                 rng)
    return PrefillInputs(problem, q, k, v, q_scale, k_scale, v_scale, cu_q.to(device),
                         cu_k.to(device))


def _long_lengths(batch: int, shortest: int, longest: int, rng: _Rng) -> torch.Tensor:
    """Ragged lengths in the longer half of [shortest, longest], one of them ``longest``
    and, in a batch of three or more, one ``shortest`` (the edge ragged indexing meets)."""
    low = max(shortest, (longest + 1) // 2)
    lens = torch.randint(low, longest + 1, (batch,), generator=rng.host)
    picked = torch.randperm(batch, generator=rng.host)
    lens[picked[0]] = longest
    if batch >= 3:
        lens[picked[1]] = shortest
    return lens.to(torch.int32)


def _channel_gains(width: int, d_v: int, rng: _Rng) -> torch.Tensor:
    """Each channel's width: 1, but ``_OUTLIER_CHANNELS`` latent (first ``d_v``) channels
    10-30x wider and the rope channels (from ``d_v`` on) log-normal."""
    gains = torch.ones(width)
    gains[d_v:] = torch.exp(_ROPE_LOG_SPREAD * torch.randn(width - d_v, generator=rng.host))
    outliers = torch.randperm(min(width, d_v), generator=rng.host)[:_OUTLIER_CHANNELS]
    low, high = _OUTLIER_GAIN
    gains[outliers] = low + (high - low) * torch.rand(len(outliers), generator=rng.host)
    return gains


def _drawn(shape: tuple[int, ...], gains: torch.Tensor, rope_from: int, amp: float, rng: _Rng,
           device) -> torch.Tensor:
    """fp32 values of ``shape`` (channels last): unit-variance normal, Student-t from channel
    ``rope_from`` on, times ``amp`` and each channel's gain."""
    width = shape[-1]
    out = torch.empty(shape, dtype=torch.float32, device=device)
    rows = out.view(-1, width)
    scale = (amp * gains).to(device)
    step = max(1, _CHUNK // width)
    for start in range(0, rows.shape[0], step):
        n = min(step, rows.shape[0] - start)
        x = torch.randn(n, width, generator=rng.device, device=device)
        if rope_from < width:  # t = z / sqrt(chi2 / df), / sqrt(df / (df - 2)) for unit variance
            chi2 = torch.randn(n, width - rope_from, _ROPE_DF, generator=rng.device,
                               device=device).square_().sum(-1)
            x[:, rope_from:] *= torch.rsqrt(chi2 / (_ROPE_DF - 2))
        rows[start:start + n] = x.mul_(scale)
    return out


def _stored(values: torch.Tensor, dtype_name: str, spread: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``values`` in the dtype; fp8 as ``values / scale`` with the per-tensor scale of
    the normal family (``fp8_scale`` of the widest channel's spread), clamped to the format."""
    dtype = DTYPES[dtype_name]
    if dtype_name not in FP8_DTYPES:
        return values.to(dtype), None
    scale = fp8_scale(spread, dtype_name, values.device)
    fmax = torch.finfo(dtype).max
    return (values / scale).clamp_(-fmax, fmax).to(dtype), scale


def _heavy_positions(last_seen: torch.Tensor, rng: _Rng) -> torch.Tensor:
    """(batch, _HEAVY_KEYS) key positions per request, each attended by every query token
    of the request: 0 (a sink), ``last_seen`` (the latest such key: a request's end is
    where an off-by-one reads) and random ones in between."""
    draws = torch.rand(len(last_seen), _HEAVY_KEYS, generator=rng.host)
    positions = (draws * (last_seen[:, None] + 1)).long()
    positions[:, 0] = 0
    positions[:, 1] = last_seen
    return positions


def _cache_rows(shards: tuple[KVShard, ...], problem: MLAProblem, positions: torch.Tensor,
                scale: torch.Tensor | None) -> torch.Tensor:
    """The dequantized cache rows (batch, K, d_qk) fp32 at each request's global token
    ``positions`` (batch, K), wherever sharding and paging put them."""
    cache = shards[0].kv_cache
    rows = torch.empty(*positions.shape, problem.d_qk, dtype=torch.float32, device=cache.device)
    for shard in shards:
        request, k = (positions % problem.dcp_size == shard.rank).nonzero(as_tuple=True)
        local = (positions[request, k] // problem.dcp_size).to(cache.device)
        request, k = request.to(cache.device), k.to(cache.device)
        pages = shard.block_table[request, local // problem.page_size].long()
        rows[request, k] = _rows(shard.kv_cache, pages, local % problem.page_size)
    return rows if scale is None else rows * scale


def _rows(t: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` in fp32; fp8 gathered as bytes (indexing fp8 tensors is not implemented
    on every device)."""
    if t.element_size() != 1:
        return t[index].float()
    return t.view(torch.uint8)[index].view(t.dtype).float()


def _peaked_queries(problem: MLAProblem, shape: tuple[int, int, int], gains: torch.Tensor,
                    key_gains: torch.Tensor, key_amp: float, keys: torch.Tensor,
                    request: torch.Tensor, lengths: torch.Tensor, rng: _Rng
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries (tokens, heads, d) whose scores over ordinary keys spread by a std drawn in
    ``_SCORE_STD``, raised on their request's heavy ``keys`` (batch, K, 1 or heads, d) by
    about the log of its length, so that those keys hold most of the softmax mass.

    The raise is along each key whitened by the keys' channel widths, so it barely moves
    the scores of the other keys."""
    score_std = float(_SCORE_STD[0] + (_SCORE_STD[1] - _SCORE_STD[0])
                      * torch.rand((), generator=rng.host))
    scale = problem.softmax_scale
    amp = score_std / (scale * key_amp * float((gains * key_gains).square().sum().sqrt()))
    q = _drawn(shape, gains, problem.d_v, amp, rng, keys.device)
    whitened = keys / key_gains.to(keys.device).square()
    strength = (keys * whitened).sum(-1)  # (batch, K, 1 or heads)
    jitter = torch.rand((*shape[:2], keys.shape[1]), generator=rng.device, device=q.device)
    low, high = _RAISE
    margin = (lengths.float().log()[request, None, None] + score_std ** 2 / 2 + low
              + (high - low) * jitter)
    for k in range(keys.shape[1]):
        q += (margin[..., k] / (scale * strength[request, k]))[..., None] * whitened[request, k]
    return _stored(q, problem.q_dtype, amp * float(gains.max()))


def poison_(*tensors: torch.Tensor | None) -> None:
    """Fill outputs with NaN so that any element a route fails to write is caught."""
    for t in tensors:
        if t is not None:
            t.fill_(float("nan"))
