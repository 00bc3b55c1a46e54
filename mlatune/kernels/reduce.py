"""Merge a row's split (or segment) partials into the final output and natural-log LSE.

Partials are normalized outputs ``[slot, row, d_v]`` with base-2 statistics,
either one LSE per ``[slot, row]`` (split-KV) or the unreduced pair (max,
expsum) of the segmented kernel, whose LSE is ``max + log2(expsum)``. Row group
``g`` owns slots ``split_indptr[g]:split_indptr[g + 1]`` (none at all when it
has no keys: its rows get output 0 and LSE -inf). Output row (token t, head h)
of group g reads layout row ``t * row_heads + h * head_rep``: that slices the
padded heads off (see ``attend``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mlatune.kernels.attend import LN2


@triton.jit(do_not_specialize=["tokens_per_group", "q_heads", "row_heads", "head_rep"])
def reduce_kernel(part_out_ptr, part_a_ptr, part_b_ptr, split_indptr_ptr, out_ptr, lse_ptr,
                  tokens_per_group, q_heads, row_heads, head_rep,
                  stride_po_slot, stride_po_row, stride_pa_slot,
                  stride_o_tok, stride_o_head, stride_lse_tok,
                  D_V: tl.constexpr, BLOCK_R: tl.constexpr, MAX_EXPSUM: tl.constexpr,
                  WRITE_LSE: tl.constexpr):
    group = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = offs < tokens_per_group * q_heads
    tok = offs // q_heads
    head = offs % q_heads
    row = tok * row_heads + head * head_rep
    d = tl.arange(0, D_V)
    first = tl.load(split_indptr_ptr + group).to(tl.int64)
    last = tl.load(split_indptr_ptr + group + 1).to(tl.int64)
    # Pointers advance by one slot per step: 64-bit arithmetic without 64-bit loop indices.
    stat_ptrs = part_a_ptr + first * stride_pa_slot + row
    sum_ptrs = part_b_ptr + first * stride_pa_slot + row
    out_ptrs = part_out_ptr + first * stride_po_slot + row[:, None] * stride_po_row + d[None, :]
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, D_V], dtype=tl.float32)
    for _ in range(first, last):
        if MAX_EXPSUM:
            mx = tl.load(stat_ptrs, mask=ok, other=float("-inf"))
            expsum = tl.load(sum_ptrs, mask=ok, other=0.0)
            x = tl.where(expsum > 0.0, mx + tl.log2(tl.where(expsum > 0.0, expsum, 1.0)),
                         float("-inf"))
        else:
            x = tl.load(stat_ptrs, mask=ok, other=float("-inf"))
        o = tl.load(out_ptrs, mask=ok[:, None], other=0.0)
        stat_ptrs += stride_pa_slot
        sum_ptrs += stride_pa_slot
        out_ptrs += stride_po_slot
        m_new = tl.maximum(m_i, x)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - shift)
        w = tl.exp2(x - shift)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m_i = m_new
    has_keys = den > 0.0
    safe_den = tl.where(has_keys, den, 1.0)
    res = tl.where(has_keys[:, None], acc / safe_den[:, None], 0.0)
    out_tok = (group * tokens_per_group + tok).to(tl.int64)
    tl.store(out_ptr + (out_tok * stride_o_tok + head * stride_o_head)[:, None] + d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    if WRITE_LSE:
        lse = tl.where(has_keys, (m_i + tl.log2(safe_den)) * LN2, float("-inf"))
        tl.store(lse_ptr + out_tok * stride_lse_tok + head, lse, mask=ok)


def reduce_launcher(part_out: torch.Tensor, part_lse: torch.Tensor,
                    part_expsum: torch.Tensor | None, split_indptr: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, *, tokens_per_group: int,
                    q_heads: int, row_heads: int, head_rep: int,
                    block_r: int = 8) -> Callable[[], None]:
    """A zero-argument launch of ``reduce_kernel``.

    ``part_lse`` holds base-2 LSEs, or maxima when ``part_expsum`` is given.
    ``out`` is (groups * tokens_per_group, q_heads, d_v).
    """
    groups = split_indptr.shape[0] - 1
    grid = (triton.cdiv(tokens_per_group * q_heads, block_r), groups)
    args = (part_out, part_lse, part_lse if part_expsum is None else part_expsum, split_indptr,
            out, out if lse is None else lse, tokens_per_group, q_heads, row_heads, head_rep,
            part_out.stride(0), part_out.stride(1), part_lse.stride(0),
            out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0))
    meta = dict(D_V=out.shape[-1], BLOCK_R=block_r, MAX_EXPSUM=part_expsum is not None,
                WRITE_LSE=lse is not None, num_warps=4)

    def launch() -> None:
        reduce_kernel[grid](*args, **meta)

    return launch
