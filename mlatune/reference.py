"""Torch reference for every MLA computation a route can be asked to do.

Everything reduces to one masked softmax attention, ``attend``, over keys that
carry their *global* positions: a causal window is then the same rule whether
the keys are a whole request, one DCP rank's round-robin shard, or a prefill
sequence. Written for clarity, not speed: one request at a time, in fp32 by
default (fp64 in tests), on whatever device the inputs live on.

Conventions shared with the routes:
- a query block of ``qlen`` tokens sits at the end of its request: token t
  attends global key positions ``[0, kv_len - qlen + t]`` when causal, all
  ``kv_len`` otherwise;
- LSE is the natural log of the softmax denominator (scores already scaled);
  a row that attends no key has output 0 and LSE -inf;
- fp8 tensors hold ``x / scale``; the reference computes on ``fp8 * scale``.
"""

from __future__ import annotations

import torch

from mlatune.inputs import DecodeInputs, KVShard, PrefillInputs


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_pos: torch.Tensor,
    last_pos: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention for one request.

    q: (T, H, D); k: (N, Hk, D) and v: (N, Hk, Dv) with Hk 1 (shared latent
    head) or H; key_pos: (N,) global positions of the keys; last_pos: (T,) the
    last global position each query token may attend. Returns out (T, H, Dv)
    and lse (T, H) in q's dtype.
    """
    T, H, _ = q.shape
    N = k.shape[0]
    if N == 0:
        out = q.new_zeros(T, H, v.shape[-1])
        return out, q.new_full((T, H), float("-inf"))
    # scores: (T, H, N). With one shared latent head (MLA decode) every (token, head)
    # row meets the same keys: one matmul, instead of reading the keys once per head.
    if k.shape[1] == 1:
        scores = (q.reshape(T * H, -1) @ k[:, 0].T).view(T, H, N)
    else:
        scores = torch.einsum("thd,nhd->thn", q, k)
    allowed = key_pos[None, :] <= last_pos[:, None]  # (T, N)
    # In place from here: the scores are the largest tensor (T x H x N).
    scores.mul_(scale).masked_fill_(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (T, H)
    # exp(-inf - (-inf)) is NaN for empty rows; those rows have no weights at all
    probs = scores.sub_(lse[..., None]).exp_().nan_to_num_(0.0)
    if v.shape[1] == 1:
        out = (probs.view(T * H, N) @ v[:, 0]).view(T, H, -1)
    else:
        out = torch.einsum("thn,nhd->thd", probs, v)
    return out, lse


def merge_partials(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets by their LSEs (DCP's merge)."""
    lse_stack = torch.stack(lses)  # (R, T, H)
    lse = torch.logsumexp(lse_stack, dim=0)
    weights = torch.exp(lse_stack - lse[None]).nan_to_num(0.0)  # all-(-inf) rows -> 0
    out = (weights[..., None] * torch.stack(outs)).sum(dim=0)
    return out, lse


def dequantize(x: torch.Tensor, scale: torch.Tensor | float | None, dtype: torch.dtype):
    y = x.to(dtype)
    if scale is not None:
        y = y * (scale.to(dtype) if isinstance(scale, torch.Tensor) else scale)
    return y


def _gather_pages(cache: torch.Tensor, block_table_row: torch.Tensor, length: int):
    """The first ``length`` tokens of one request from a paged cache (pages, page, D)."""
    page_size = cache.shape[1]
    n_pages = -(-length // page_size)
    # fp8 gathered as bytes: indexing fp8 tensors is not implemented on every device.
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    pages = raw[block_table_row[:n_pages].long()].view(cache.dtype)  # (n_pages, page, D)
    return pages.reshape(-1, cache.shape[-1])[:length]


def decode_shard(
    inputs: DecodeInputs, shard: KVShard, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial output and LSE of one rank: all query tokens over its shard.

    Shard token j of a request is global position ``rank + j * world``; the
    causal window is taken on global positions. Output (B*qlen, kernel_heads, Dv).
    """
    qlen, world = inputs.qlen, inputs.dcp_size
    q = dequantize(inputs.q, inputs.q_scale, dtype)
    outs, lses = [], []
    # Lengths read once (no device sync per request); each request's pages are
    # dequantized alone, so a large cache is never copied whole in fp32.
    for b, (global_len, local_len) in enumerate(zip(inputs.seq_lens.tolist(),
                                                    shard.seq_lens.tolist(), strict=True)):
        pages = _gather_pages(shard.kv_cache, shard.block_table[b], local_len)
        kv = dequantize(pages, inputs.kv_scale, dtype)[:, None, :]  # (N, 1, D)
        key_pos = shard.rank + world * torch.arange(local_len, device=kv.device)
        tokens = torch.arange(qlen, device=kv.device)
        last = global_len - qlen + tokens if inputs.causal else torch.full_like(
            tokens, global_len - 1)
        out, lse = attend(q[b * qlen:(b + 1) * qlen], kv, kv[..., : inputs.d_v], key_pos, last,
                          inputs.softmax_scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def decode(
    inputs: DecodeInputs, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full (all ranks merged) decode/verify output and LSE."""
    parts = [decode_shard(inputs, shard, dtype) for shard in inputs.shards]
    if len(parts) == 1:
        return parts[0]
    return merge_partials([o for o, _ in parts], [lse for _, lse in parts])


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
