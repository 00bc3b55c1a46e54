"""Torch reference for every MLA computation a route can be asked to do.

Everything reduces to one masked softmax attention, ``attend``, over keys that
carry their *global* positions: a causal window is then the same rule whether
the keys are a whole request, one DCP rank's round-robin shard, or a prefill
sequence. Written for clarity before speed, in fp32 by default (fp64 in
tests), on whatever device the inputs live on. Decode requests go through
``attend`` together, a bounded number at a time, padded to the longest of a
call (a batch is a few calls, not one per request); prefill runs one request
at a time.

Conventions shared with the routes:
- a query block of ``qlen`` tokens sits at the end of its request: token t
  attends global key positions ``[0, kv_len - qlen + t]`` when causal, all
  ``kv_len`` otherwise; a request of length 0 (an engine's padding of a graph
  bucket) attends no key, and neither does a token of a request shorter than
  qlen whose causal window ends before key 0 (FlashMLA's and FlashInfer's
  convention);
- LSE is the natural log of the softmax denominator (scores already scaled);
  a row that attends no key has output 0 and LSE -inf; a NaN in the inputs gives NaN
  in every output row (and LSE) it reaches, never a quiet 0;
- fp8 tensors hold ``x / scale``; the reference computes on ``fp8 * scale``.
"""

from __future__ import annotations

import torch

from mlatune.check.inputs import DecodeInputs, KVShard, PrefillInputs
from mlatune.lse import combine

# The route that serves this reference (mlatune.routes.torch_ref): every problem's last
# resort, and in a table the sweep's fallback where every route it ran failed.
ROUTE_ID = "reference/torch"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_pos: torch.Tensor,
    last_pos: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention for one request, or a batch of requests.

    q: (..., T, H, D); k: (..., N, Hk, D) and v: (..., N, Hk, Dv) with Hk 1
    (shared latent head) or H; key_pos: (..., N) global positions of the keys
    (past every ``last_pos`` for padding); last_pos: (..., T) the last global
    position each query token may attend. The leading dims (if any) are
    requests; (N,) or (T,) serve them all. Returns out (..., T, H, Dv) and lse
    (..., T, H) in q's dtype.
    """
    *lead, T, H, _ = q.shape
    N = k.shape[-3]
    if N == 0:
        out = q.new_zeros(*lead, T, H, v.shape[-1])
        return out, q.new_full((*lead, T, H), float("-inf"))
    # scores: (..., T, H, N). With one shared latent head (MLA decode) every (token,
    # head) row meets the same keys: one matmul, instead of reading the keys once per head.
    if k.shape[-2] == 1:
        scores = (q.reshape(*lead, T * H, -1) @ k[..., 0, :].transpose(-1, -2)).view(
            *lead, T, H, N)
    else:
        scores = torch.einsum("...thd,...nhd->...thn", q, k)
    allowed = key_pos[..., None, :] <= last_pos[..., None]  # (..., T, N)
    # In place from here: the scores are the largest tensor (T x H x N per request).
    scores.mul_(scale).masked_fill_(~allowed[..., None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (..., T, H)
    # exp(-inf - (-inf)) is NaN for empty rows (LSE -inf): those rows have no weights at
    # all. Only they are zeroed: a NaN from the inputs must reach the output, not vanish.
    probs = scores.sub_(lse[..., None]).exp_().masked_fill_(torch.isneginf(lse)[..., None], 0.0)
    bad = ~torch.isfinite(v)
    if bad.any():  # one pass over v; only inputs holding NaN/inf pay for the masking
        return _weigh_values(probs, v.masked_fill(bad, 0.0), bad, allowed), lse
    return _weigh_values(probs, v), lse


def _weigh_values(probs: torch.Tensor, v: torch.Tensor, bad: torch.Tensor | None = None,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    """probs (..., T, H, N) times v (..., N, Hk, Dv). Where ``bad`` marks the non-finite
    values (zeroed in ``v``), an output element is NaN iff an ``allowed`` key (..., T, N)
    brings one: a masked key's weight 0 times NaN would otherwise poison rows that never
    attend it (earlier tokens of a causal block, padding from another request's pages)."""
    *lead, T, H, N = probs.shape
    if v.shape[-2] == 1:
        out = (probs.view(*lead, T * H, N) @ v[..., 0, :]).view(*lead, T, H, -1)
    else:
        out = torch.einsum("...thn,...nhd->...thd", probs, v)
    if bad is not None and allowed is not None:
        reached = torch.einsum("...tn,...nhd->...thd", allowed.to(v.dtype), bad.to(v.dtype))
        out.masked_fill_(reached > 0, float("nan"))
    return out


def dequantize(x: torch.Tensor, scale: torch.Tensor | float | None, dtype: torch.dtype):
    y = x.to(dtype)
    if scale is not None:
        y = y * (scale.to(dtype) if isinstance(scale, torch.Tensor) else scale)
    return y


# Requests attended together are cut so that one call's largest tensors (its scores,
# and its keys in fp32) each stay near this many elements, 1 GiB in fp32; with the
# temporaries of logsumexp and the scaled keys a call peaks at a few GB. On the CPU
# calls that stay in cache are several times faster.
_ELEMENTS_PER_CALL = 1 << 28
_CPU_ELEMENTS_PER_CALL = 1 << 22
_PAST_EVERY_WINDOW = 1 << 62  # the global position given to padding keys


def _gather_pages(cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """The first ``length`` tokens of each request (rows of ``block_table``) from a
    paged cache (pages, page, D): (requests, length, D); past a request's own
    pages, tokens of some page."""
    page_size = cache.shape[1]
    n_pages = -(-length // page_size)
    # fp8 gathered as bytes: indexing fp8 tensors is not implemented on every device.
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    # Past a shorter request's own pages its table holds anything (-1 padding, or ids past
    # the cache as FlashMLA's tests write them): any page will do there (masked).
    ids = block_table[:, :n_pages].long().clamp_(0, cache.shape[0] - 1)
    pages = raw[ids].view(cache.dtype)
    return pages.reshape(block_table.shape[0], -1, cache.shape[-1])[:, :length]


def decode_shard(
    inputs: DecodeInputs, shard: KVShard, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial output and LSE of one rank: all query tokens over its shard.

    Shard token j of a request is global position ``rank + j * world``; the
    causal window is taken on global positions. Output (B*qlen, kernel_heads, Dv).
    """
    qlen, world, batch = inputs.qlen, inputs.dcp_size, inputs.problem.batch
    q = dequantize(inputs.q, inputs.q_scale, dtype)
    heads = q.shape[1]
    q = q.view(batch, qlen, heads, -1)
    out = q.new_empty(batch, qlen, heads, inputs.d_v)
    lse = q.new_empty(batch, qlen, heads)
    # Requests go through attend together, longest first, each call's keys padded to
    # its first request's length (padding placed past every window): a ragged batch
    # costs a few calls, not one per request. Pages are dequantized per call, so a
    # large cache is never copied whole in fp32.
    global_lens, local_lens = inputs.seq_lens.tolist(), shard.seq_lens.tolist()
    order = sorted(range(batch), key=lambda b: -local_lens[b])
    tokens = torch.arange(qlen, device=q.device)
    width = max(qlen * heads, shard.kv_cache.shape[-1])
    budget = (min(_ELEMENTS_PER_CALL, _CPU_ELEMENTS_PER_CALL) if q.device.type == "cpu"
              else _ELEMENTS_PER_CALL)
    start = 0
    while start < batch:
        requests = order[start:start + max(1, budget // max(1, local_lens[order[start]] * width))]
        start += len(requests)
        index = torch.tensor(requests, device=q.device)
        n_keys = local_lens[requests[0]]
        lengths = torch.tensor([[global_lens[b], local_lens[b]] for b in requests],
                               device=q.device)
        last = (lengths[:, :1] - qlen + tokens if inputs.causal
                else (lengths[:, :1] - 1).expand(-1, qlen))
        j = torch.arange(n_keys, device=q.device)
        key_pos = (shard.rank + world * j).masked_fill(j >= lengths[:, 1:], _PAST_EVERY_WINDOW)
        pages = _gather_pages(shard.kv_cache, shard.block_table[index], n_keys)
        kv = dequantize(pages, inputs.kv_scale, dtype)[..., None, :]  # (R, N, 1, D)
        out[index], lse[index] = attend(q[index], kv, kv[..., : inputs.d_v], key_pos,
                                        last, inputs.softmax_scale)
    return out.view(batch * qlen, heads, -1), lse.view(batch * qlen, heads)


def decode(
    inputs: DecodeInputs, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full (all ranks merged) decode/verify output and LSE."""
    parts = [decode_shard(inputs, shard, dtype) for shard in inputs.shards]
    if len(parts) == 1:
        return parts[0]
    return combine([o for o, _ in parts], [lse for _, lse in parts])


def prefill(
    inputs: PrefillInputs, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-absorbed varlen prefill: per-head q/k (d_qk) and v (d_v)."""
    q = dequantize(inputs.q, inputs.q_scale, dtype)
    k = dequantize(inputs.k, inputs.k_scale, dtype)
    v = dequantize(inputs.v, inputs.v_scale, dtype)
    cu_q, cu_k = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        tokens = torch.arange(q_len, device=q.device)
        last = k_len - q_len + tokens if inputs.causal else torch.full_like(tokens, k_len - 1)
        out, lse = attend(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]],
                          torch.arange(k_len, device=q.device), last, inputs.softmax_scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def run(inputs: DecodeInputs | PrefillInputs, dtype: torch.dtype = torch.float32):
    """Reference (out, lse) for any inputs."""
    return decode(inputs, dtype) if isinstance(inputs, DecodeInputs) else prefill(inputs, dtype)
