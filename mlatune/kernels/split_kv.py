"""Split-KV stage 1: each program attends one block of query rows over one KV split.

Two schedules share the per-item body:
- ``split_kv_kernel``: grid (row blocks, splits, requests); split ``s`` of a
  request covers a BLOCK_N-aligned ``1/num_splits`` of its local keys, the same
  boundaries for every row block so that row blocks of one split, launched
  next to each other, share the split's pages in L2. With one split it can
  write the final output directly (``DIRECT``) and skip the reduce.
- ``persistent_kernel``: grid (row blocks, workers); worker ``w`` walks the
  (request, key range, partial slot) items the device planner gave it
  (``plan.persistent_plan_launcher``), so uneven requests spread evenly over the SMs.

Partials are normalized outputs (fp32, value descale applied) and base-2 LSEs,
indexed ``[slot, row]``; ``reduce.reduce_kernel`` merges a request's slots.
Problem sizes (batch, lengths, heads, qlen, rank, world) are runtime arguments,
so one compiled kernel serves every problem of the same tile configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mlatune.kernels.attend import (
    LOG2E,
    attend_rows,
    load_q_rows,
    normalize,
    qk_scale_and_v_scale,
    store_final_rows,
)

# Problem sizes stay runtime values: no recompiles when they happen to be 1 or a
# multiple of 16 (strides keep Triton's divisibility specialization).
_SIZE_ARGS = ["qlen", "q_heads", "row_heads", "head_rep", "rank", "world"]


@dataclass(frozen=True)
class RowLayout:
    """How a request's query heads become kernel rows (see ``attend``'s docstring)."""

    qlen: int
    q_heads: int
    row_heads: int  # layout heads per token (padded count, or q_heads)
    head_rep: int  # > 1: repeat_interleave padding

    @property
    def rows(self) -> int:
        return self.qlen * self.row_heads


@triton.jit
def _stage1_item(q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, q_scale_ptr, kv_scale_ptr,
                 part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
                 b, rb, start, end_req, slot,
                 qlen, q_heads, row_heads, head_rep, rank, world, sm_scale_log2,
                 stride_q_tok, stride_q_head, stride_kv_page, stride_kv_tok, stride_bt,
                 stride_po_slot, stride_po_row, stride_pl_slot,
                 stride_o_tok, stride_o_head, stride_lse_tok,
                 D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 Q_FP8: tl.constexpr, HAS_Q_SCALE: tl.constexpr, HAS_KV_SCALE: tl.constexpr,
                 DIRECT: tl.constexpr, WRITE_LSE: tl.constexpr, KV_TWICE: tl.constexpr):
    rows = qlen * row_heads
    offs_m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    seq_len = tl.load(seq_lens_ptr + b)
    if CAUSAL:
        # Token t of the verify block sees global positions <= seq_len - qlen + t.
        last_pos = seq_len - qlen + offs_m // row_heads
        block_last = seq_len - qlen + (tl.minimum(rows, rb * BLOCK_M + BLOCK_M) - 1) // row_heads
    else:
        last_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)
        block_last = seq_len - 1
    # Local keys any row of this block can see (global position rank + j * world).
    n_keys = tl.where(block_last >= rank, (block_last - rank) // world + 1, 0)
    end = tl.minimum(end_req, n_keys)

    q_nope, q_rope = load_q_rows(q_ptr, b * qlen, offs_m, rows, row_heads, head_rep, q_heads,
                                 stride_q_tok, stride_q_head, D_NOPE, D_ROPE, Q_FP8)
    qk_scale, v_scale = qk_scale_and_v_scale(sm_scale_log2, q_scale_ptr, kv_scale_ptr,
                                             HAS_Q_SCALE, HAS_KV_SCALE)
    acc, m_i, l_i = attend_rows(q_nope, q_rope, qk_scale, last_pos, kv_ptr,
                                bt_ptr + b.to(tl.int64) * stride_bt, start, end, rank, world,
                                stride_kv_page, stride_kv_tok, D_NOPE, D_ROPE, PAGE_SIZE,
                                BLOCK_M, BLOCK_N, KV_TWICE)
    o, lse2 = normalize(acc, m_i, l_i, v_scale)
    if DIRECT:
        store_final_rows(out_ptr, lse_ptr, o, lse2, b * qlen, offs_m, rows, row_heads, head_rep,
                         q_heads, stride_o_tok, stride_o_head, stride_lse_tok, D_NOPE, WRITE_LSE)
    else:
        row_ok = offs_m < rows
        d = tl.arange(0, D_NOPE)
        slot64 = slot.to(tl.int64)
        po = part_out_ptr + slot64 * stride_po_slot + offs_m[:, None] * stride_po_row + d[None, :]
        tl.store(po, o, mask=row_ok[:, None])
        tl.store(part_lse_ptr + slot64 * stride_pl_slot + offs_m, lse2, mask=row_ok)


@triton.jit(do_not_specialize=[*_SIZE_ARGS, "num_splits"])
def split_kv_kernel(q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, q_scale_ptr, kv_scale_ptr,
                    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
                    num_splits, qlen, q_heads, row_heads, head_rep, rank, world, sm_scale_log2,
                    stride_q_tok, stride_q_head, stride_kv_page, stride_kv_tok, stride_bt,
                    stride_po_slot, stride_po_row, stride_pl_slot,
                    stride_o_tok, stride_o_head, stride_lse_tok,
                    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    Q_FP8: tl.constexpr, HAS_Q_SCALE: tl.constexpr,
                    HAS_KV_SCALE: tl.constexpr, DIRECT: tl.constexpr,
                    WRITE_LSE: tl.constexpr, KV_TWICE: tl.constexpr):
    rb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    # Split boundaries come from the request's local length (its last token's window).
    last = tl.load(seq_lens_ptr + b) - 1
    n_req = tl.where(last >= rank, (last - rank) // world + 1, 0)
    chunk = tl.cdiv(tl.cdiv(n_req, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n_req)
    _stage1_item(q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, q_scale_ptr, kv_scale_ptr,
                 part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
                 b, rb, start, end, b * num_splits + split,
                 qlen, q_heads, row_heads, head_rep, rank, world, sm_scale_log2,
                 stride_q_tok, stride_q_head, stride_kv_page, stride_kv_tok, stride_bt,
                 stride_po_slot, stride_po_row, stride_pl_slot,
                 stride_o_tok, stride_o_head, stride_lse_tok,
                 D_NOPE, D_ROPE, PAGE_SIZE, BLOCK_M, BLOCK_N, CAUSAL, Q_FP8, HAS_Q_SCALE,
                 HAS_KV_SCALE, DIRECT, WRITE_LSE, KV_TWICE)


@triton.jit(do_not_specialize=_SIZE_ARGS)
def persistent_kernel(q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, q_scale_ptr, kv_scale_ptr,
                      part_out_ptr, part_lse_ptr, work_ptr, work_indptr_ptr,
                      qlen, q_heads, row_heads, head_rep, rank, world, sm_scale_log2,
                      stride_q_tok, stride_q_head, stride_kv_page, stride_kv_tok, stride_bt,
                      stride_po_slot, stride_po_row, stride_pl_slot,
                      D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                      Q_FP8: tl.constexpr, HAS_Q_SCALE: tl.constexpr,
                      HAS_KV_SCALE: tl.constexpr, KV_TWICE: tl.constexpr):
    rb = tl.program_id(0)
    worker = tl.program_id(1)
    first = tl.load(work_indptr_ptr + worker)
    last = tl.load(work_indptr_ptr + worker + 1)
    for item in range(first, last):
        b = tl.load(work_ptr + item * 4)
        start = tl.load(work_ptr + item * 4 + 1)
        end = tl.load(work_ptr + item * 4 + 2)
        slot = tl.load(work_ptr + item * 4 + 3)
        _stage1_item(q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, q_scale_ptr, kv_scale_ptr,
                     part_out_ptr, part_lse_ptr, part_out_ptr, part_lse_ptr,
                     b, rb, start, end, slot,
                     qlen, q_heads, row_heads, head_rep, rank, world, sm_scale_log2,
                     stride_q_tok, stride_q_head, stride_kv_page, stride_kv_tok, stride_bt,
                     stride_po_slot, stride_po_row, stride_pl_slot, 0, 0, 0,
                     D_NOPE, D_ROPE, PAGE_SIZE, BLOCK_M, BLOCK_N, CAUSAL, Q_FP8, HAS_Q_SCALE,
                     HAS_KV_SCALE, False, False, KV_TWICE)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    kv_twice: bool = False  # see attend.attend_keys


def _common_args(q, kv_cache, block_table, seq_lens, q_scale, kv_scale, layout: RowLayout,
                 rank: int, world: int, sm_scale: float):
    """Positional arguments every stage-1 kernel takes, in kernel order, split in two."""
    pointers = (q, kv_cache, block_table, seq_lens,
                q if q_scale is None else q_scale, q if kv_scale is None else kv_scale)
    sizes = (layout.qlen, layout.q_heads, layout.row_heads, layout.head_rep, rank, world,
             sm_scale * LOG2E, q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
             block_table.stride(0))
    return pointers, sizes


def dtype_flags(q, q_scale, kv_scale, tiles: TileConfig) -> dict:
    """Constexprs and launch options every decode stage 1 takes from dtypes and tiles."""
    return dict(Q_FP8=q.element_size() == 1, HAS_Q_SCALE=q_scale is not None,
                HAS_KV_SCALE=kv_scale is not None, KV_TWICE=tiles.kv_twice,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def split_kv_launcher(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, q_scale: torch.Tensor | None,
                      kv_scale: torch.Tensor | None, *, layout: RowLayout, rank: int,
                      world: int, causal: bool, sm_scale: float, tiles: TileConfig,
                      num_splits: int, part_out: torch.Tensor | None = None,
                      part_lse: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None) -> Callable[[], None]:
    """A zero-argument launch of ``split_kv_kernel``.

    With partial buffers (slots = batch * num_splits, rows, d_v) it writes
    partials; without them (one split only) it writes ``out`` (tokens, heads,
    d_v) and ``lse`` (when given) directly.
    """
    direct = part_out is None
    if direct and (num_splits != 1 or out is None):
        raise ValueError("writing the output directly needs num_splits == 1 and out")
    pointers, sizes = _common_args(q, kv_cache, block_table, seq_lens, q_scale, kv_scale, layout,
                                   rank, world, sm_scale)
    if direct:
        lse_or_dummy = out if lse is None else lse
        buffers = (out, lse_or_dummy, out, lse_or_dummy)
        strides = (0, 0, 0, out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0))
        d_v = out.shape[-1]
    else:
        buffers = (part_out, part_lse, part_out, part_lse)
        strides = (part_out.stride(0), part_out.stride(1), part_lse.stride(0), 0, 0, 0)
        d_v = part_out.shape[-1]
    grid = (triton.cdiv(layout.rows, tiles.block_m), num_splits, seq_lens.shape[0])
    args = (*pointers, *buffers, num_splits, *sizes, *strides)
    meta = dict(D_NOPE=d_v, D_ROPE=q.shape[-1] - d_v, PAGE_SIZE=kv_cache.shape[1],
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CAUSAL=causal, DIRECT=direct,
                WRITE_LSE=direct and lse is not None,
                **dtype_flags(q, q_scale, kv_scale, tiles))

    def launch() -> None:
        split_kv_kernel[grid](*args, **meta)

    return launch


def persistent_launcher(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, q_scale: torch.Tensor | None,
                        kv_scale: torch.Tensor | None, *, layout: RowLayout, rank: int,
                        world: int, causal: bool, sm_scale: float, tiles: TileConfig,
                        work: torch.Tensor, work_indptr: torch.Tensor, part_out: torch.Tensor,
                        part_lse: torch.Tensor) -> Callable[[], None]:
    """A zero-argument launch of ``persistent_kernel`` over a planned work list."""
    pointers, sizes = _common_args(q, kv_cache, block_table, seq_lens, q_scale, kv_scale, layout,
                                   rank, world, sm_scale)
    workers = work_indptr.shape[0] - 1
    grid = (triton.cdiv(layout.rows, tiles.block_m), workers)
    args = (*pointers, part_out, part_lse, work, work_indptr, *sizes,
            part_out.stride(0), part_out.stride(1), part_lse.stride(0))
    d_v = part_out.shape[-1]
    meta = dict(D_NOPE=d_v, D_ROPE=q.shape[-1] - d_v, PAGE_SIZE=kv_cache.shape[1],
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CAUSAL=causal,
                **dtype_flags(q, q_scale, kv_scale, tiles))

    def launch() -> None:
        persistent_kernel[grid](*args, **meta)

    return launch
