"""Merge DCP ranks' partial attention (out, natural-log LSE) into the full result.

Each rank attends a disjoint (round-robin) share of the keys; the full output
is the LSE-weighted mean of the ranks' outputs and the full LSE their
logsumexp. A rank that saw no key of a row has LSE -inf and weight 0 (its output
there is not read); a row no rank saw gets output 0 and LSE -inf, as in
``mlatune.lse.combine``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlatune.kernels.lse import LOG2E, combine_finish, combine_step


@triton.jit(do_not_specialize=["ranks", "n_rows", "heads"])
def merge_kernel(outs_ptr, lses_ptr, out_ptr, lse_ptr, ranks, n_rows, heads,
                 stride_or, stride_ot, stride_oh, stride_lr, stride_lt, stride_lh,
                 stride_dt, stride_dh, stride_et, stride_eh,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                 WRITE_LSE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = offs < n_rows
    tok = (offs // heads).to(tl.int64)
    head = offs % heads
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    lse_ptrs = lses_ptr + tok * stride_lt + head * stride_lh
    out_ptrs = outs_ptr + (tok * stride_ot + head * stride_oh)[:, None] + d[None, :]
    for _ in range(0, ranks):
        x = tl.load(lse_ptrs, mask=ok, other=float("-inf")).to(tl.float32) * LOG2E
        o = tl.load(out_ptrs, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        # Pointers advance a rank per step: 64-bit offsets without a 64-bit loop index.
        lse_ptrs += stride_lr
        out_ptrs += stride_or
        m_i, den, acc = combine_step(m_i, den, acc, x, o)
    res, lse = combine_finish(m_i, den, acc)
    tl.store(out_ptr + (tok * stride_dt + head * stride_dh)[:, None] + d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(lse_ptr + tok * stride_et + head * stride_eh, lse, mask=ok)


def merge_partials_into(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor | None = None, block_r: int = 4) -> None:
    """Merge ranks' partials ``outs`` (R, T, H, D) and ``lses`` (R, T, H) into ``out`` (T, H, D)
    and, when given, ``lse`` (T, H): preallocated, written in place, CUDA-graph safe."""
    ranks, tokens, heads, dim = outs.shape
    if lses.shape != (ranks, tokens, heads) or out.shape != (tokens, heads, dim):
        raise ValueError(f"shapes do not match: outs {tuple(outs.shape)}, "
                         f"lses {tuple(lses.shape)}, out {tuple(out.shape)}")
    if outs.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the last dim of outs and out must be contiguous")
    if lse is not None and lse.shape != (tokens, heads):
        raise ValueError(f"lse shape {tuple(lse.shape)} != {(tokens, heads)}")
    n_rows = tokens * heads
    lse_t = out if lse is None else lse
    lse_strides = (0, 0) if lse is None else (lse.stride(0), lse.stride(1))
    merge_kernel[(triton.cdiv(n_rows, block_r),)](
        outs, lses, out, lse_t, ranks, n_rows, heads,
        outs.stride(0), outs.stride(1), outs.stride(2),
        lses.stride(0), lses.stride(1), lses.stride(2),
        out.stride(0), out.stride(1), *lse_strides,
        D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_R=block_r,
        WRITE_LSE=lse is not None, num_warps=4)
