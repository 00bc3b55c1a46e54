"""Segmented DCP verify, stage 1: every verify token is a single-query row group.

The seed's segmented route: with decode context parallelism, verify token t
of a request attends global positions [0, L - qlen + t]; on rank r that is a
prefix of the rank's round-robin shard whose length (the row length) the host
computes once per batch (``row_lengths``). The kernel then needs no causal
logic at all: row group ``b * qlen + t`` attends the first ``row_lens[...]``
local keys of request b. Keys are walked in ``num_segments`` segments, each a
whole number of tiles; the cache is addressed in subpages of one tile (the
largest power of two <= 128 dividing the page size), so every tile lies in one
subpage. Each segment writes its partial: normalized output and base-2 LSE;
``reduce.reduce_kernel`` merges them.

Folded (``fold``): row group ``b`` holds all qlen x heads rows of request b,
so the tokens share each KV tile (one 64-row MMA tile at 16 heads x 4 tokens
instead of four 16-row ones); a row block walks the window of its last token,
each row masked to its own window, and segments cut the longest window.

Per step the route refills the row lengths and the subpage table from the
current lengths and block table with ``segmented_plan_launcher``: one small
kernel, no host sync or allocation, so the step replays from a CUDA graph.
``row_lengths`` and ``subpage_table`` are its readable torch references.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mlatune.check.inputs import shard_lengths
from mlatune.kernels.attend import (
    LOG2E,
    attend_rows,
    load_q_rows,
    qk_scale_and_v_scale,
)
from mlatune.kernels.split_kv import TileConfig, dtype_flags

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
                     seg_out_ptr, seg_lse_ptr,
                     num_segments, qlen, q_heads, sm_scale_log2,
                     stride_q_tok, stride_q_head, stride_kv_page, stride_kv_tok, stride_bt,
                     stride_so_slot, stride_so_row, stride_sl_slot,
                     D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_FP8: tl.constexpr,
                     HAS_Q_SCALE: tl.constexpr, HAS_KV_SCALE: tl.constexpr,
                     KV_TWICE: tl.constexpr, FOLD: tl.constexpr):
    # Unfolded: program (head block, segment, b * qlen + t) holds heads of token t.
    # Folded: program (row block, segment, b) holds rows t * q_heads + h of all b's tokens,
    # which share the walk over the window of the block's last token, each row masked
    # to its own window; segments cut the request's longest window.
    rb = tl.program_id(0)
    segment = tl.program_id(1)
    group = tl.program_id(2)
    offs_m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    if FOLD:
        b = group
        rows = qlen * q_heads
        tok_base = b * qlen
        tok = tl.minimum(offs_m, rows - 1) // q_heads
        row_len = tl.load(row_lens_ptr + tok_base + tok)
        n_group = tl.load(row_lens_ptr + tok_base + qlen - 1)
        n_keys = tl.load(row_lens_ptr + tok_base
                         + (tl.minimum(rows, rb * BLOCK_M + BLOCK_M) - 1) // q_heads)
    else:
        b = group // qlen
        rows = q_heads
        tok_base = group
        n_keys = tl.load(row_lens_ptr + group)
        n_group = n_keys
        row_len = tl.zeros([BLOCK_M], dtype=tl.int32) + n_keys
    chunk = tl.cdiv(tl.cdiv(n_group, num_segments), BLOCK_N) * BLOCK_N
    start = segment * chunk
    end = tl.minimum(start + chunk, n_keys)

    q_nope, q_rope = load_q_rows(q_ptr, tok_base, offs_m, rows, q_heads, 1, q_heads,
                                 stride_q_tok, stride_q_head, D_NOPE, D_ROPE, Q_FP8)
    qk_scale, v_scale = qk_scale_and_v_scale(sm_scale_log2, q_scale_ptr, kv_scale_ptr,
                                             HAS_Q_SCALE, HAS_KV_SCALE)
    # A row's length is its whole window: every key below it is allowed.
    acc, m_i, l_i = attend_rows(q_nope, q_rope, qk_scale, row_len - 1, kv_ptr,
                                bt_ptr + b.to(tl.int64) * stride_bt, start, end, 0, 1,
                                stride_kv_page, stride_kv_tok, D_NOPE, D_ROPE, PAGE_SIZE,
                                BLOCK_M, BLOCK_N, KV_TWICE)
    has_keys = l_i > 0.0
    inv = tl.where(has_keys, v_scale / tl.where(has_keys, l_i, 1.0), 0.0)
    slot = (group * num_segments + segment).to(tl.int64)
    ok = offs_m < rows
    d = tl.arange(0, D_NOPE)
    tl.store(seg_out_ptr + slot * stride_so_slot + offs_m[:, None] * stride_so_row + d[None, :],
             acc * inv[:, None], mask=ok[:, None])
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(seg_lse_ptr + slot * stride_sl_slot + offs_m, lse, mask=ok)


def segmented_launcher(q: torch.Tensor, kv_subpages: torch.Tensor, subpage_table: torch.Tensor,
                       row_lens: torch.Tensor, q_scale: torch.Tensor | None,
                       kv_scale: torch.Tensor | None, *, qlen: int, sm_scale: float,
                       tiles: TileConfig, num_segments: int, seg_out: torch.Tensor,
                       seg_lse: torch.Tensor, fold: bool = False) -> Callable[[], None]:
    """A zero-argument launch of ``segmented_kernel``.

    ``kv_subpages`` is the cache viewed as (subpages, tile, d_qk); partial
    buffers are (row groups * num_segments, rows[, d_v]): row groups are the
    tokens (b * qlen + t) with q_heads rows each, or with ``fold`` the requests
    with qlen * q_heads rows each.
    """
    q_heads = q.shape[1]
    d_v = seg_out.shape[-1]
    rows, groups = (qlen * q_heads, row_lens.shape[0] // qlen) if fold \
        else (q_heads, row_lens.shape[0])
    grid = (triton.cdiv(rows, tiles.block_m), num_segments, groups)
    args = (q, kv_subpages, subpage_table, row_lens, q if q_scale is None else q_scale,
            q if kv_scale is None else kv_scale, seg_out, seg_lse,
            num_segments, qlen, q_heads, sm_scale * LOG2E,
            q.stride(0), q.stride(1), kv_subpages.stride(0), kv_subpages.stride(1),
            subpage_table.stride(0), seg_out.stride(0), seg_out.stride(1), seg_lse.stride(0))
    meta = dict(D_NOPE=d_v, D_ROPE=q.shape[-1] - d_v, PAGE_SIZE=kv_subpages.shape[1],
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, FOLD=fold,
                **dtype_flags(q, q_scale, kv_scale, tiles))

    def launch() -> None:
        segmented_kernel[grid](*args, **meta)

    return launch


# Subpage-table entries one plan program writes: a few per thread of 4 warps.
PLAN_BLOCK_W = 1024


@triton.jit(do_not_specialize=["qlen", "rank", "world", "pages", "stride_lens", "stride_bt"])
def segmented_plan_kernel(seq_lens_ptr, bt_ptr, row_lens_ptr, table_ptr,
                          qlen, rank, world, pages, stride_lens, stride_bt,
                          PER_PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr):
    # Program (b, c): request b's subpage-table columns [c * BLOCK_W, (c + 1) * BLOCK_W);
    # the c == 0 program also writes b's qlen row lengths.
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    if chunk == 0:
        _store_row_lens(seq_lens_ptr, row_lens_ptr, b, qlen, rank, world, stride_lens, BLOCK_Q)
    width = pages * PER_PAGE
    cols = chunk * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = cols < width
    page_ids = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + cols // PER_PAGE, mask=ok)
    subpages = tl.where(page_ids < 0, -1, page_ids * PER_PAGE + cols % PER_PAGE)
    tl.store(table_ptr + b.to(tl.int64) * width + cols, subpages, mask=ok)


@triton.jit
def _store_row_lens(seq_lens_ptr, row_lens_ptr, b, qlen, rank, world, stride_lens,
                    BLOCK_Q: tl.constexpr):
    """``row_lengths`` for request b: token t sees global keys [0, L - qlen + t], of
    which this rank holds the positions p = rank (mod world)."""
    t = tl.arange(0, BLOCK_Q)
    length = tl.load(seq_lens_ptr + b.to(tl.int64) * stride_lens)
    visible = length - qlen + t + 1  # <= 0 for a window before the start: no keys
    # cdiv(visible - rank, world) for visible > rank, written so that no sum can wrap.
    local = tl.where(visible > rank, (visible - 1 - rank) // world + 1, 0)
    tl.store(row_lens_ptr + b.to(tl.int64) * qlen + t, local, mask=t < qlen)


def segmented_plan_launcher(seq_lens: torch.Tensor, block_table: torch.Tensor, *, qlen: int,
                            rank: int, world: int, page_size: int, tile: int,
                            row_lens: torch.Tensor,
                            subpage_table_out: torch.Tensor) -> Callable[[], None]:
    """A zero-argument launch of ``segmented_plan_kernel``: writes
    ``row_lengths(seq_lens, qlen, rank, world)`` into ``row_lens`` and
    ``subpage_table(block_table, page_size, tile)`` into ``subpage_table_out``.

    Reads the inputs' current contents at every launch, with no host sync or
    allocation, so it can be captured in a CUDA graph and replayed after
    ``seq_lens`` and ``block_table`` are rewritten in place. Grid: one program per
    request and ``PLAN_BLOCK_W`` table columns.
    """
    batch, pages = _check_plan_args(seq_lens, block_table, qlen, rank, world, page_size, tile,
                                    row_lens, subpage_table_out)
    per_page = page_size // tile
    grid = (batch, max(1, triton.cdiv(pages * per_page, PLAN_BLOCK_W)))
    args = (seq_lens, block_table, row_lens, subpage_table_out, qlen, rank, world, pages,
            seq_lens.stride(0), block_table.stride(0))
    meta = dict(PER_PAGE=per_page, BLOCK_Q=triton.next_power_of_2(qlen), BLOCK_W=PLAN_BLOCK_W,
                num_warps=4)

    def launch() -> None:
        segmented_plan_kernel[grid](*args, **meta)  # batch 0: an empty grid, no launch

    return launch


def _check_plan_args(seq_lens: torch.Tensor, block_table: torch.Tensor, qlen: int, rank: int,
                     world: int, page_size: int, tile: int, row_lens: torch.Tensor,
                     table: torch.Tensor) -> tuple[int, int]:
    """(batch, pages) of valid plan arguments; ValueError otherwise."""
    tensors = (seq_lens, block_table, row_lens, table)
    if any(t.dtype != torch.int32 for t in tensors):
        raise ValueError("seq_lens, block_table and the plan buffers must be int32")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("seq_lens, block_table and the plan buffers must be on one device")
    if qlen < 1 or not 0 <= rank < world or tile < 1 or page_size % tile:
        raise ValueError(f"need qlen >= 1, 0 <= rank < world and a tile dividing the page, "
                         f"got {qlen}, {rank}, {world}, {tile}, {page_size}")
    if seq_lens.dim() != 1 or block_table.dim() != 2 \
            or block_table.shape[0] != seq_lens.shape[0] or block_table.stride(1) != 1:
        raise ValueError(f"need seq_lens (batch,) and block_table (batch, pages) with unit "
                         f"column stride, got {tuple(seq_lens.shape)}, {tuple(block_table.shape)}")
    batch, pages = block_table.shape
    want = (batch, pages * (page_size // tile))
    if row_lens.shape != (batch * qlen,) or table.shape != want \
            or not (row_lens.is_contiguous() and table.is_contiguous()):
        raise ValueError(f"row_lens and subpage_table_out must be contiguous ({batch * qlen},) "
                         f"and {want}, got {tuple(row_lens.shape)}, {tuple(table.shape)}")
    return batch, pages
