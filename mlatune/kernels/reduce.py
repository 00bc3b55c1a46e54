"""Merge a row's split (or segment) partials into the final output and natural-log LSE.

Partials are normalized outputs ``[slot, row, d_v]`` with one base-2 LSE per
``[slot, row]`` (a split's or a segment's). Row group ``g`` owns slots
``split_indptr[g]:split_indptr[g + 1]`` (none at all when it has no keys: its rows
get output 0 and LSE -inf; with ``ONE_IN_PLACE``, a group of exactly one slot was
written in place by its kernel, and is left as it is).
Output row (token t, head h) of group g reads layout row ``t * row_heads + h *
head_rep``: that slices the padded heads off (see ``attend``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from mlatune.kernels.lse import combine_finish

# From this many rows (all groups'), the balanced form's reduce (``one_in_place``: groups of
# one or two slots, mostly) takes 4 rows a program, not 1 (docs/kernels/reduce_merge.md).
BALANCED_ROWS_4 = 16384


@triton.jit(do_not_specialize=["tokens_per_group", "q_heads", "row_heads", "head_rep"])
def reduce_kernel(part_out_ptr, part_lse_ptr, split_indptr_ptr, out_ptr, lse_ptr,
                  tokens_per_group, q_heads, row_heads, head_rep,
                  stride_po_slot, stride_po_row, stride_pl_slot,
                  stride_o_tok, stride_o_head, stride_lse_tok,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SLOT_BLOCK: tl.constexpr,
                  WRITE_LSE: tl.constexpr,
                  WAIT_PRIMARY: tl.constexpr = False, SLOTS: tl.constexpr = 0,
                  ONE_IN_PLACE: tl.constexpr = False):
    # Grid (row blocks, value-dim blocks, groups): enough programs that a batch
    # of one request is not a handful of programs walking all slots serially.
    # SLOTS > 0: every group has that many (uniform splits): no indptr read. Slots that
    # fit one slot block have their LSEs and outputs loaded together (``_one_pass``: one
    # round trip, not two after the indptr's).
    if WAIT_PRIMARY:  # launched early (programmatic dependent launch): wait for the partials
        gdc_wait()
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    group = tl.program_id(2)
    ok = offs < tokens_per_group * q_heads
    tok = offs // q_heads
    head = offs % q_heads
    row = tok * row_heads + head * head_rep
    if SLOTS > 0:
        first = group.to(tl.int64) * SLOTS
        count = SLOTS
    else:
        first = tl.load(split_indptr_ptr + group).to(tl.int64)
        count = tl.load(split_indptr_ptr + group + 1) - first
        if ONE_IN_PLACE:  # the kernel wrote a group of one slot's rows itself: leave them
            ok = ok & ((offs * 0 + count) != 1)
    if count <= SLOT_BLOCK:  # (uniform slots: decided at compile time)
        m_i, den, acc = _one_pass(part_out_ptr, part_lse_ptr, first, count, row, d, ok,
                                  stride_po_slot, stride_po_row, stride_pl_slot, SLOT_BLOCK)
    else:
        m_i, den, acc = _two_passes(part_out_ptr, part_lse_ptr, first, count, row, d, ok,
                                    stride_po_slot, stride_po_row, stride_pl_slot, SLOT_BLOCK)
    res, lse = combine_finish(m_i, den, acc)
    out_tok = (group * tokens_per_group + tok).to(tl.int64)
    tl.store(out_ptr + (out_tok * stride_o_tok + head * stride_o_head)[:, None] + d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    if WRITE_LSE:
        # One value-dim block writes the LSE.
        tl.store(lse_ptr + out_tok * stride_lse_tok + head, lse,
                 mask=ok & ((offs * 0 + tl.program_id(1)) == 0))


@triton.jit
def _one_pass(part_out_ptr, part_lse_ptr, first, count, row, d, ok, stride_po_slot,
              stride_po_row, stride_pl_slot, SLOT_BLOCK: tl.constexpr):
    """(max, denominator, weighted sum) of ``count`` (at most SLOT_BLOCK) slots from
    ``first``: the LSEs and outputs loaded together (one memory round trip)."""
    block = tl.arange(0, SLOT_BLOCK)
    slot = first + block
    smask = (block < count)[:, None] & ok[None, :]
    x = tl.load(part_lse_ptr + slot[:, None] * stride_pl_slot + row[None, :], mask=smask,
                other=float("-inf"))
    o = tl.load(part_out_ptr + (slot[:, None, None] * stride_po_slot
                                + row[None, :, None] * stride_po_row + d[None, None, :]),
                mask=smask[:, :, None], other=0.0)
    m_i = tl.max(x, 0)
    w = tl.exp2(x - tl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
    return m_i, tl.sum(w, 0), tl.sum(w[:, :, None] * o, 0)


@triton.jit
def _two_passes(part_out_ptr, part_lse_ptr, first, count, row, d, ok, stride_po_slot,
                stride_po_row, stride_pl_slot, SLOT_BLOCK: tl.constexpr):
    """``_one_pass`` over any slot count: the max and denominator first, online, SLOT_BLOCK
    slots at a time (a device-planned schedule knows only a bound), then the weighted sum
    of the outputs."""
    block = tl.arange(0, SLOT_BLOCK)
    m_i = tl.full([row.shape[0]], float("-inf"), tl.float32)
    den = tl.zeros_like(m_i)
    for s0 in range(0, count, SLOT_BLOCK):
        off = (first + s0 + block)[:, None] * stride_pl_slot + row[None, :]
        smask = ((s0 + block) < count)[:, None] & ok[None, :]
        x = tl.load(part_lse_ptr + off, mask=smask, other=float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 0))
        shift_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        den = den * tl.exp2(m_i - shift_new) + tl.sum(tl.exp2(x - shift_new[None, :]), 0)
        m_i = m_new
    shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    acc = tl.zeros([row.shape[0], d.shape[0]], dtype=tl.float32)
    for s0 in range(0, count, SLOT_BLOCK):
        slot = first + s0 + block
        smask = ((s0 + block) < count)[:, None] & ok[None, :]
        xs = tl.load(part_lse_ptr + slot[:, None] * stride_pl_slot + row[None, :],
                     mask=smask, other=float("-inf"))
        w = tl.exp2(xs - shift[None, :])
        o = tl.load(part_out_ptr + (slot[:, None, None] * stride_po_slot
                                    + row[None, :, None] * stride_po_row + d[None, None, :]),
                    mask=smask[:, :, None], other=0.0)
        acc += tl.sum(w[:, :, None] * o, 0)
    return m_i, den, acc


def reduce_launcher(part_out: torch.Tensor, part_lse: torch.Tensor, split_indptr: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, *, tokens_per_group: int,
                    q_heads: int, row_heads: int, head_rep: int, max_slots: int,
                    blocks: tuple[int, int] | None = None, pdl: bool = False,
                    uniform: bool = False, one_in_place: bool = False) -> Callable[[], None]:
    """A zero-argument launch of ``reduce_kernel``.

    ``pdl``: launched as a programmatic dependent of the kernel launched just before it on
    the same stream (sm_90+), so its launch overlaps that kernel's tail; it waits for that
    kernel's writes before reading the partials (ignored off the GPU).

    ``part_lse`` holds the slots' base-2 LSEs (-inf: a slot that saw no key of the row).
    ``out`` is (groups * tokens_per_group, q_heads, d_v); ``max_slots``, the
    slots a group usually has (any count is right), sizes the slot block;
    ``blocks`` (rows, value dims per program) overrides the size-based choice.
    ``uniform``: every group has exactly ``max_slots`` slots (``split_indptr`` is then not
    read; the kernel is compiled for that count).
    ``one_in_place``: a group of exactly one slot had its rows written into ``out`` and
    ``lse`` by the kernel that writes the partials (its slot is not read; not with
    ``uniform``).
    """
    groups = split_indptr.shape[0] - 1
    d_v = out.shape[-1]
    rows = groups * tokens_per_group * q_heads
    # Few rows (one request's heads, many slots): small blocks, many programs; from 256 rows
    # a program a row, all its value dims (16-byte loads, every slot's in flight at once);
    # the balanced form's many rows of few slots, 4 rows a program
    # (docs/kernels/reduce_merge.md has the comparisons). The CPU interpreter runs programs
    # one by one: there, the fewest.
    if blocks is not None:
        block_r, block_d = blocks
    elif not out.is_cuda:
        block_r, block_d = 16, d_v
    else:
        block_r, block_d = (2, 64) if rows < 256 else (1, 512)
        if one_in_place and rows >= BALANCED_ROWS_4:
            block_r = 4  # the balanced form's partials (docs/kernels/reduce_merge.md)
    block_d = min(block_d, d_v)
    if d_v % block_d:
        raise ValueError(f"d_v {d_v} must be a multiple of {block_d}")
    grid = (triton.cdiv(tokens_per_group * q_heads, block_r), d_v // block_d, groups)
    args = (part_out, part_lse, split_indptr, out, out if lse is None else lse,
            tokens_per_group, q_heads, row_heads, head_rep,
            part_out.stride(0), part_out.stride(1), part_lse.stride(0),
            out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0))
    if uniform and int(max_slots) < 1:
        raise ValueError(f"uniform slots need max_slots >= 1, got {max_slots}")
    if uniform and one_in_place:
        raise ValueError("one_in_place reads each group's slot count: not with uniform")
    meta = dict(BLOCK_R=block_r, BLOCK_D=block_d, SLOTS=int(max_slots) if uniform else 0,
                SLOT_BLOCK=min(triton.next_power_of_2(max(max_slots, 1)), 16),
                WRITE_LSE=lse is not None, num_warps=4,
                ONE_IN_PLACE=one_in_place,
                **({"WAIT_PRIMARY": True, "launch_pdl": True} if pdl and out.is_cuda else {}))

    def launch() -> None:
        reduce_kernel[grid](*args, **meta)

    return launch
