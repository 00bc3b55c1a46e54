"""Rows that attend no key, written as the reference has them: output 0 and LSE -inf.

A query row attends no key when its request has length 0, or when it is a token of a
causal verify block that lies before its request's first key (token t of qlen sees keys
``[0, length - qlen + t]``). mlatune's own kernels write such rows as 0 and -inf; a vendor
kernel leaves what it leaves there (FlashMLA: NaN output, +inf LSE). ``clear_empty_rows``
rewrites only those rows, from the lengths on the device: one program per query token and
block of heads, which returns at once where its token has a key. No host read and no
allocation, so a CUDA graph replays it with the lengths rewritten in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HEADS_PER_PROGRAM = 16  # a program stores 16 heads x 512 values: 64 a thread of 4 warps


@triton.jit(do_not_specialize=["qlen", "heads", "rank"])
def clear_empty_rows_kernel(lens_ptr, out_ptr, lse_ptr, qlen, heads, rank,
                            stride_o_tok, stride_o_head, stride_lse_tok, stride_lse_head,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                            CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr):
    row = tl.program_id(0)  # query token b * qlen + t
    length = tl.load(lens_ptr + row // qlen)
    last = length - qlen + row % qlen if CAUSAL else length - 1  # the token's last key
    if last < rank:  # the rank's first key is at position ``rank``
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        ok = h < heads
        ptrs = out_ptr + row.to(tl.int64) * stride_o_tok + h[:, None] * stride_o_head + d[None, :]
        zeros = tl.zeros([BLOCK_H, BLOCK_D], dtype=out_ptr.dtype.element_ty)
        tl.store(ptrs, zeros, mask=ok[:, None] & (d < D)[None, :])
        if WRITE_LSE:
            tl.store(lse_ptr + row.to(tl.int64) * stride_lse_tok + h * stride_lse_head,
                     tl.full([BLOCK_H], float("-inf"), tl.float32), mask=ok)


def clear_empty_rows(lens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, *,
                     qlen: int, causal: bool, rank: int = 0) -> None:
    """Write 0 into ``out`` (batch * qlen, heads, d_v) and -inf into ``lse`` (batch * qlen,
    heads; None: none) at the rows that attend no key, given the lengths ``lens`` (batch,)
    int32 whose keys the kernel that wrote them attended and whether its mask was causal:
    a DCP rank's shard lengths, or the global lengths with the ``rank`` whose round-robin
    share (positions rank, rank + world, ...) it attended. Launches one kernel; reads
    nothing on the host."""
    rows, heads, d_v = out.shape
    if lens.dtype != torch.int32 or lens.dim() != 1 or rows != lens.shape[0] * qlen:
        raise ValueError(f"lens must be (batch,) int32 with out's {rows} rows = batch x qlen "
                         f"{qlen}, got {tuple(lens.shape)} {lens.dtype}")
    if out.stride(-1) != 1 or (lse is not None and tuple(lse.shape) != (rows, heads)):
        raise ValueError("out needs a unit last stride and lse out's (rows, heads)")
    if rows == 0:
        return
    block_h = min(HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
    grid = (rows, triton.cdiv(heads, block_h))
    lse_args = (0, 0) if lse is None else (lse.stride(0), lse.stride(1))
    clear_empty_rows_kernel[grid](
        lens, out, out if lse is None else lse, qlen, heads, rank, out.stride(0), out.stride(1),
        *lse_args, D=d_v, BLOCK_D=triton.next_power_of_2(d_v), BLOCK_H=block_h,
        CAUSAL=causal, WRITE_LSE=lse is not None, num_warps=4)
