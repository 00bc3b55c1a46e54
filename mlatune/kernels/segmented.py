"""Segmented DCP verify, stage 1: every verify token is a single-query row group.

The seed's segmented route: with decode context parallelism, verify token t
of a request attends global positions [0, L - qlen + t]; on rank r that is a
prefix of the rank's round-robin shard whose length (the row length) the host
computes once per batch (``row_lengths``). The kernel then needs no causal
logic at all: row group ``b * qlen + t`` attends the first ``row_lens[...]``
local keys of request b. Keys are walked in ``num_segments`` segments, each a
whole number of tiles; the cache is addressed in subpages of one tile (the
largest power of two <= 128 dividing the page size), so every tile lies in one
subpage. Each segment writes its unreduced partial: normalized output, the
base-2 score max and the exp-sum; ``reduce.reduce_kernel`` merges them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mlatune.inputs import shard_lengths
from mlatune.kernels.attend import LOG2E, attend_keys, load_q_rows, qk_scale_and_v_scale
from mlatune.kernels.split_kv import TileConfig

MAX_TILE = 128


def segment_tile(page_size: int) -> int:
    """Largest power of two <= 128 that divides the page size (pages are powers of two)."""
    return min(MAX_TILE, page_size & -page_size)


def subpage_table(block_table: torch.Tensor, page_size: int, tile: int) -> torch.Tensor:
    """The block table re-expressed in subpages of ``tile`` keys (-1 padding kept)."""
    per_page = page_size // tile
    offsets = torch.arange(per_page, dtype=block_table.dtype, device=block_table.device)
    table = block_table[:, :, None] * per_page + offsets
    table = torch.where(block_table[:, :, None] < 0, -1, table)
    return table.flatten(1).contiguous()


def row_lengths(seq_lens: torch.Tensor, qlen: int, rank: int, world: int) -> torch.Tensor:
    """Local keys each verify row attends: its global causal window, then this rank's share.

    The window is cut on global positions before sharding: the keys token t
    drops lie on qlen - 1 - t different ranks, not one from each.
    """
    tokens = torch.arange(1, qlen + 1, device=seq_lens.device, dtype=seq_lens.dtype)
    visible = (seq_lens[:, None] - qlen + tokens).clamp(min=0)
    return shard_lengths(visible, rank, world).flatten().contiguous()


@triton.jit(do_not_specialize=["num_segments", "qlen", "q_heads"])
def segmented_kernel(q_ptr, kv_ptr, bt_ptr, row_lens_ptr, q_scale_ptr, kv_scale_ptr,
                     seg_out_ptr, seg_max_ptr, seg_sum_ptr,
                     num_segments, qlen, q_heads, sm_scale_log2,
                     stride_q_tok, stride_q_head, stride_kv_page, stride_kv_tok, stride_bt,
                     stride_so_slot, stride_so_row, stride_sm_slot,
                     D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_FP8: tl.constexpr,
                     HAS_Q_SCALE: tl.constexpr, HAS_KV_SCALE: tl.constexpr,
                     KV_TWICE: tl.constexpr):
    hb = tl.program_id(0)
    segment = tl.program_id(1)
    row = tl.program_id(2)  # b * qlen + t: the token's row in q
    b = row // qlen
    n_keys = tl.load(row_lens_ptr + row)
    chunk = tl.cdiv(tl.cdiv(n_keys, num_segments), BLOCK_N) * BLOCK_N
    start = segment * chunk
    end = tl.minimum(start + chunk, n_keys)

    offs_m = hb * BLOCK_M + tl.arange(0, BLOCK_M)
    q_nope, q_rope = load_q_rows(q_ptr, row, offs_m, q_heads, q_heads, 1, q_heads,
                                 stride_q_tok, stride_q_head, D_NOPE, D_ROPE, Q_FP8)
    qk_scale, v_scale = qk_scale_and_v_scale(sm_scale_log2, q_scale_ptr, kv_scale_ptr,
                                             HAS_Q_SCALE, HAS_KV_SCALE)
    acc = tl.zeros([BLOCK_M, D_NOPE], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # The row length is the whole window: every key below it is allowed.
    last_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (n_keys - 1)
    acc, m_i, l_i = attend_keys(acc, m_i, l_i, q_nope, q_rope, last_pos, kv_ptr,
                                bt_ptr + b.to(tl.int64) * stride_bt, start, end, 0, 1, qk_scale,
                                stride_kv_page, stride_kv_tok, D_NOPE, D_ROPE, PAGE_SIZE, BLOCK_N,
                                KV_TWICE)
    has_keys = l_i > 0.0
    inv = tl.where(has_keys, v_scale / tl.where(has_keys, l_i, 1.0), 0.0)
    slot = (row * num_segments + segment).to(tl.int64)
    ok = offs_m < q_heads
    d = tl.arange(0, D_NOPE)
    tl.store(seg_out_ptr + slot * stride_so_slot + offs_m[:, None] * stride_so_row + d[None, :],
             acc * inv[:, None], mask=ok[:, None])
    tl.store(seg_max_ptr + slot * stride_sm_slot + offs_m, m_i, mask=ok)
    tl.store(seg_sum_ptr + slot * stride_sm_slot + offs_m, l_i, mask=ok)


def segmented_launcher(q: torch.Tensor, kv_subpages: torch.Tensor, subpage_table: torch.Tensor,
                       row_lens: torch.Tensor, q_scale: torch.Tensor | None,
                       kv_scale: torch.Tensor | None, *, qlen: int, sm_scale: float,
                       tiles: TileConfig, num_segments: int, seg_out: torch.Tensor,
                       seg_max: torch.Tensor, seg_sum: torch.Tensor) -> Callable[[], None]:
    """A zero-argument launch of ``segmented_kernel``.

    ``kv_subpages`` is the cache viewed as (subpages, tile, d_qk); partial
    buffers are (rows * num_segments, q_heads[, d_v]).
    """
    q_heads = q.shape[1]
    d_v = seg_out.shape[-1]
    grid = (triton.cdiv(q_heads, tiles.block_m), num_segments, row_lens.shape[0])
    args = (q, kv_subpages, subpage_table, row_lens, q if q_scale is None else q_scale,
            q if kv_scale is None else kv_scale, seg_out, seg_max, seg_sum,
            num_segments, qlen, q_heads, sm_scale * LOG2E,
            q.stride(0), q.stride(1), kv_subpages.stride(0), kv_subpages.stride(1),
            subpage_table.stride(0), seg_out.stride(0), seg_out.stride(1), seg_max.stride(0))
    meta = dict(D_NOPE=d_v, D_ROPE=q.shape[-1] - d_v, PAGE_SIZE=kv_subpages.shape[1],
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, Q_FP8=q.element_size() == 1,
                HAS_Q_SCALE=q_scale is not None, HAS_KV_SCALE=kv_scale is not None,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                KV_TWICE=tiles.kv_twice)

    def launch() -> None:
        segmented_kernel[grid](*args, **meta)

    return launch
