"""Persistent varlen flash-attention forward for non-absorbed MLA prefill (Triton).

Per head, q and k are ``d_qk`` wide (192 for DeepSeek: 128 "nope" + 64 rope
dims) and v is ``d_v`` wide (128). Triton blocks must be powers of two, so the
q.k dot is split into two dots over the two power-of-two parts of d_qk
(128 + 64) rather than padded to 256, which would waste a third of the QK
work. Causal attention is bottom-right aligned (query token t of a request
with a prefix of P keys sees keys [0, P + t]).

Scheduling is persistent: the grid is one program per SM and each program
loops over the work items that ``prefill_plan.plan_work`` gave it (query tiles
of one request and one head, or a key range of one). Items of split tiles write
partial (output, LSE) rows to slots that ``_merge_partials_kernel`` combines.

q, k and v may be bf16/fp16 or fp8 (e4m3fn, or e4m3fnuz on AMD) with
per-tensor scales. With fp8 both dots are fp8 MMAs: the q and k scales fold into
the softmax scale and the v scale into the output (a per-tensor scale is the same
for every tile, so applying it once per tile's scores and once to the output is
exact), and the probabilities, scaled by a power of two into e4m3's range, are
rounded to v's fp8 type for the P.V dot, as fp8 attention kernels do. Over an fp8
k/v with a 16-bit q (``KV_UPCAST``) the k and v tiles are converted to q's type as
they are loaded and both dots run in 16 bits.

Hopper's fp8 wgmma takes its B operand only K-major, which for P.V means v with
its keys contiguous: from v as given, Triton stages every v tile through
registers, a synchronous load each key step. ``KernelConfig.v_transposed`` copies
v once per call into a (heads, d_v, keys) buffer (``_transpose_v_kernel``) that
the loop then streams with async copies.
The output is written in ``out``'s dtype, the LSE in fp32 as a natural log.
All sizes are runtime arguments, so one compiled kernel serves every batch,
length and head count of a (dtype, block config) pair.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mlatune.kernels.attend import LN2
from mlatune.kernels.lse import LOG2E, combine_finish, combine_step
from mlatune.kernels.prefill_plan import (
    MERGE_INFO_COLUMNS,
    WORK_INFO_COLUMNS,
    WorkPlan,
    plan_work,
    split_head_dim,
    v_key_offsets,
    v_transpose_tiles,
)

_MERGE_BLOCK_ROWS = 64
V_ALIGN = 16  # keys: a request's start in a transposed v (16-byte vector loads of fp8)
_TRANSPOSE_BLOCK = 64  # keys per program of the transpose kernel


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows per sub-block (a work tile is several sub-blocks)
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    # v stored transposed (keys contiguous) for the P.V dot: Hopper's fp8 wgmma takes
    # its B operand only K-major, and without this Triton loads each v tile
    # synchronously through registers (not pipelined).
    v_transposed: bool = False
    grouped: bool = False  # plan the tiles head-grouped where they are many (L2 reuse)

    def as_params(self) -> dict[str, int | bool]:
        return {"block_m": self.block_m, "block_n": self.block_n,
                "num_warps": self.num_warps, "num_stages": self.num_stages,
                "v_transposed": self.v_transposed, "grouped": self.grouped}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_to_3_mantissa_bits(x):
    """Round positive fp32 to e4m3's 3 mantissa bits (to nearest even), in fp32.

    Used only under the Triton interpreter, whose fp32 -> fp8 cast drops the
    carry when rounding overflows the mantissa (127.5 becomes 64, not 128). Once
    rounded here, that cast is exact. GPUs convert in hardware and skip this.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _online_softmax(raw, qk_scale, l_i, m_i, p_dtype: tl.constexpr, MASKED: tl.constexpr,
                    ROUND_P_FIRST: tl.constexpr, P_SHIFT: tl.constexpr):
    """One key block's softmax update (log2 domain) from its unscaled scores: the new
    l and max, the block's probabilities in ``p_dtype`` for the P.V dot, and the
    factor alpha that the output accumulator is to be rescaled by before that dot.

    The scale (> 0) goes into the max and, fused, into the exponent's argument: one
    FFMA an element instead of a multiply and a subtraction.

    The probabilities are scaled by 2**P_SHIFT: fp8's normal range starts at 2**-6,
    and a [0, 1] P would round its small entries coarsely or to 0. The power of two
    is exact and cancels in acc / l, since l sums the same scaled values.
    """
    m_new = tl.maximum(m_i, tl.max(raw, 1) * qk_scale)
    m_ref = m_new
    if MASKED:
        # A row that has seen no key yet keeps max -inf; subtract 0 instead of -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(raw * qk_scale - (m_ref - P_SHIFT)[:, None])
    alpha = tl.exp2(m_i - m_ref)
    p_rounded = p
    if ROUND_P_FIRST:
        p_rounded = _round_to_3_mantissa_bits(p)
    l_i = l_i * alpha + tl.sum(p, 1)
    return l_i, m_new, p_rounded.to(p_dtype), alpha


@triton.jit
def _mask_scores(scores, keys, q_pos, prefix, kv_stop, CAUSAL: tl.constexpr):
    """-inf where a key is past the range or, causal, after the row's own position
    (one compare an element: against each row's last key)."""
    if CAUSAL:
        allowed = keys[None, :] <= tl.minimum(prefix + q_pos, kv_stop - 1)[:, None]
    else:
        allowed = (keys < kv_stop)[None, :]
    return tl.where(allowed, scores, float("-inf"))


@triton.jit
def _attend_keys(acc, l_i, m_i, q_a, q_b, k_base, v_base, q_pos, prefix, kv_start, kv_stop,
                 stride_k_row, stride_v_key, stride_v_dim, qk_scale,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                 D_A: tl.constexpr, D_B: tl.constexpr, D_V: tl.constexpr,
                 ROUND_P_FIRST: tl.constexpr, KV_UPCAST: tl.constexpr,
                 P_SHIFT: tl.constexpr, V_ALIGN: tl.constexpr):
    """Online softmax over keys [kv_start, kv_stop) in BLOCK_N steps (log2 domain).

    MASKED=False is the hot loop over key blocks every row sees whole; MASKED=True
    handles the causal diagonal and the last partial block. v is addressed through
    (key, dim) strides: rows of v, or v transposed (key stride 1), which fp8 needs.
    A transposed v is masked in groups of V_ALIGN keys, so that its loads stay
    vector loads (Triton pipelines only those): the keys past the range that this
    reads are the request's own or the transposed buffer's zero padding, and P is 0
    for them.
    """
    offs_n = tl.arange(0, BLOCK_N)
    # Offsets within one key block: 32-bit and loop-invariant (fewer live registers);
    # the block's 64-bit start goes into the scalar base pointer.
    kt_a_offs = offs_n[None, :] * stride_k_row + tl.arange(0, D_A)[:, None]  # k transposed
    kt_b_offs = offs_n[None, :] * stride_k_row + (D_A + tl.arange(0, D_B))[:, None]
    v_offs = offs_n[:, None] * stride_v_key + tl.arange(0, D_V)[None, :] * stride_v_dim
    v_group = offs_n // V_ALIGN * V_ALIGN
    for start_n in range(kv_start, kv_stop, BLOCK_N):
        keys = start_n + offs_n
        k_block = k_base + tl.cast(start_n, tl.int64) * stride_k_row
        v_block = v_base + tl.cast(start_n, tl.int64) * stride_v_key
        kt_a_ptrs = k_block + kt_a_offs
        kt_b_ptrs = k_block + kt_b_offs
        v_ptrs = v_block + v_offs
        if MASKED:
            in_range = keys < kv_stop
            kt_a = tl.load(kt_a_ptrs, mask=in_range[None, :], other=0.0)
            kt_b = tl.load(kt_b_ptrs, mask=in_range[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=(start_n + v_group < kv_stop)[:, None], other=0.0)
        else:
            kt_a = tl.load(kt_a_ptrs)
            kt_b = tl.load(kt_b_ptrs)
            v = tl.load(v_ptrs)
        if KV_UPCAST:
            kt_a = kt_a.to(q_a.dtype)
            kt_b = kt_b.to(q_a.dtype)
            v = v.to(q_a.dtype)
        scores = tl.dot(q_a, kt_a)
        scores = tl.dot(q_b, kt_b, scores)
        if MASKED:
            scores = _mask_scores(scores, keys, q_pos, prefix, kv_stop, CAUSAL)
        l_i, m_i, p_low, alpha = _online_softmax(scores, qk_scale, l_i, m_i, v.dtype, MASKED,
                                                 ROUND_P_FIRST, P_SHIFT)
        acc = tl.dot(p_low, v, acc * alpha[:, None])
    return acc, l_i, m_i


@triton.jit
def _prefill_persistent_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    q_scale_ptr, k_scale_ptr, v_scale_ptr, work_indptr_ptr, work_info_ptr,
    sm_scale_log2,  # softmax scale times log2(e): the kernel works with exp2
    stride_q_row, stride_q_head, stride_k_row, stride_k_head,
    stride_v_key, stride_v_dim, stride_v_head,
    stride_o_row, stride_o_head, stride_lse_row,
    HAS_SCALES: tl.constexpr, CAUSAL: tl.constexpr,
    D_A: tl.constexpr, D_B: tl.constexpr, D_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_Q: tl.constexpr,
    ROUND_P_FIRST: tl.constexpr, INFO_COLUMNS: tl.constexpr, KV_UPCAST: tl.constexpr,
    P_SHIFT: tl.constexpr, V_ALIGN: tl.constexpr,
):
    if HAS_SCALES:
        qk_scale = sm_scale_log2 * tl.load(q_scale_ptr) * tl.load(k_scale_ptr)
        out_scale = tl.load(v_scale_ptr)
    else:
        qk_scale = sm_scale_log2
        out_scale = 1.0
    offs_a = tl.arange(0, D_A)
    offs_b = D_A + tl.arange(0, D_B)
    offs_v = tl.arange(0, D_V)
    pid = tl.program_id(0)
    first_item = tl.load(work_indptr_ptr + pid)
    last_item = tl.load(work_indptr_ptr + pid + 1)
    for item in range(first_item, last_item):
        # Columns as in prefill_plan.WorkItem.
        info = work_info_ptr + item * INFO_COLUMNS
        q_row0 = tl.load(info + 0)
        q_pos0 = tl.load(info + 1)
        q_rows = tl.load(info + 2)
        k_row0 = tl.load(info + 3)
        prefix = tl.load(info + 4)
        kv_lo = tl.load(info + 5)
        kv_hi = tl.load(info + 6)
        head = tl.load(info + 7).to(tl.int64)  # 64-bit: head * stride can pass 2**31
        slot = tl.load(info + 8)
        # Aligned when v is transposed (keys contiguous): 16-byte vector loads.
        v_row0 = tl.multiple_of(tl.load(info + 9), V_ALIGN)
        kv_lo = tl.multiple_of(kv_lo, BLOCK_N)  # the plan splits at whole key blocks
        k_base = k_ptr + k_row0.to(tl.int64) * stride_k_row + head * stride_k_head
        v_base = v_ptr + v_row0.to(tl.int64) * stride_v_key + head * stride_v_head
        for m0 in range(0, q_rows, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)  # rows within the tile
            row_ok = offs_m < q_rows
            q_pos = q_pos0 + offs_m
            rows = (q_row0 + offs_m).to(tl.int64)
            q_ptrs = q_ptr + rows[:, None] * stride_q_row + head * stride_q_head
            q_a = tl.load(q_ptrs + offs_a[None, :], mask=row_ok[:, None], other=0.0)
            q_b = tl.load(q_ptrs + offs_b[None, :], mask=row_ok[:, None], other=0.0)
            if CAUSAL:
                last_row = tl.minimum(m0 + BLOCK_M, q_rows) - 1
                kv_stop = tl.minimum(kv_hi, prefix + q_pos0 + last_row + 1)
                seen_by_all = tl.minimum(kv_stop, prefix + q_pos0 + m0 + 1)
            else:
                kv_stop = kv_hi
                seen_by_all = kv_hi
            # Whole blocks every row sees need no mask; the rest of the range does.
            full_stop = kv_lo + tl.maximum(seen_by_all - kv_lo, 0) // BLOCK_N * BLOCK_N
            acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            acc, l_i, m_i = _attend_keys(
                acc, l_i, m_i, q_a, q_b, k_base, v_base, q_pos, prefix, kv_lo, full_stop,
                stride_k_row, stride_v_key, stride_v_dim, qk_scale, False, CAUSAL,
                BLOCK_N, D_A, D_B, D_V, ROUND_P_FIRST, KV_UPCAST, P_SHIFT, V_ALIGN)
            acc, l_i, m_i = _attend_keys(
                acc, l_i, m_i, q_a, q_b, k_base, v_base, q_pos, prefix, full_stop, kv_stop,
                stride_k_row, stride_v_key, stride_v_dim, qk_scale, True, CAUSAL,
                BLOCK_N, D_A, D_B, D_V, ROUND_P_FIRST, KV_UPCAST, P_SHIFT, V_ALIGN)
            # Rows with no key in this item's range (only in a split tile's piece)
            # get output 0 and LSE -inf, which the merge weighs as nothing.
            has_keys = l_i > 0.0
            l_safe = tl.where(has_keys, l_i, 1.0)
            o = acc * (out_scale / l_safe)[:, None]
            # Scores are in log2 units: times ln 2 for a natural-log LSE; l is the sum
            # of the probabilities scaled by 2**P_SHIFT.
            lse = tl.where(has_keys, (m_i + tl.log2(l_safe) - P_SHIFT) * LN2,
                           float("-inf"))
            if slot < 0:
                o_ptrs = (out_ptr + rows[:, None] * stride_o_row + head * stride_o_head
                          + offs_v[None, :])
                tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
                tl.store(lse_ptr + rows * stride_lse_row + head, lse, mask=row_ok)
            else:
                part_rows = slot.to(tl.int64) * TILE_Q + offs_m
                tl.store(part_out_ptr + part_rows[:, None] * D_V + offs_v[None, :], o,
                         mask=row_ok[:, None])
                tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)


@triton.jit
def _transpose_v_kernel(v_ptr, vt_ptr, tiles_ptr, stride_v_row, stride_v_head,
                        stride_vt_head, stride_vt_dim,
                        D_V: tl.constexpr, BLOCK_K: tl.constexpr, V_ALIGN: tl.constexpr,
                        PERMUTE_32: tl.constexpr = False, WHOLE_TILES: tl.constexpr = False):
    """vt[h, d, col0 + t] = v[row0 + t, h, d] for one (tile, head): v with its keys as
    the contiguous dimension, as Hopper's fp8 wgmma needs v (its B operand, K-major).
    ``PERMUTE_32``: key t at column (t4, t2, t1, t3, t0) within its 32 (``transposed_v``).
    ``WHOLE_TILES``: each request's columns end on a tile boundary, so a tile's keys past
    its request are stored as zeros (its own padding), unmasked: the stores can be vectors."""
    tile = tiles_ptr + tl.program_id(0) * 3  # columns as in prefill_plan.v_transpose_tiles
    row0 = tl.load(tile).to(tl.int64)
    col0 = tl.multiple_of(tl.load(tile + 1), V_ALIGN).to(tl.int64)
    rows = tl.load(tile + 2)
    head = tl.program_id(1).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, D_V)
    ok = (offs_t < rows)[:, None]
    src = v_ptr + (row0 + offs_t)[:, None] * stride_v_row + head * stride_v_head + offs_d[None, :]
    cols = offs_t
    if PERMUTE_32:
        cols = (offs_t & ~31) | (offs_t & 16) | ((offs_t & 6) << 1) | ((offs_t & 8) >> 2) \
            | (offs_t & 1)
    dst = (vt_ptr + head * stride_vt_head + offs_d[None, :] * stride_vt_dim
           + (col0 + cols)[:, None])
    if WHOLE_TILES:
        tl.store(dst, tl.load(src, mask=ok, other=0.0))
    else:
        tl.store(dst, tl.load(src, mask=ok), mask=ok)


@triton.jit
def _merge_partials_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, merge_info_ptr,
    stride_o_row, stride_o_head, stride_lse_row,
    D_V: tl.constexpr, TILE_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    INFO_COLUMNS: tl.constexpr,
):
    """Combine the partial slots of one split tile (rows in BLOCK_R chunks) by their
    natural-log LSEs (``lse.combine_step`` in base 2)."""
    # Columns as in prefill_plan.MergeItem.
    info = merge_info_ptr + tl.program_id(0) * INFO_COLUMNS
    q_row0 = tl.load(info + 0)
    q_rows = tl.load(info + 1)
    head = tl.load(info + 2).to(tl.int64)
    slot0 = tl.load(info + 3)
    n_slots = tl.load(info + 4)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_v = tl.arange(0, D_V)
    row_ok = offs_r < q_rows
    m2 = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, D_V], dtype=tl.float32)
    for j in range(0, n_slots):
        part_rows = (slot0 + j).to(tl.int64) * TILE_Q + offs_r
        lse_j = tl.load(part_lse_ptr + part_rows, mask=row_ok, other=float("-inf"))
        o_j = tl.load(part_out_ptr + part_rows[:, None] * D_V + offs_v[None, :],
                      mask=row_ok[:, None], other=0.0)
        m2, den, acc = combine_step(m2, den, acc, lse_j * LOG2E, o_j)
    res, lse = combine_finish(m2, den, acc)
    rows = (q_row0 + offs_r).to(tl.int64)
    o_ptrs = out_ptr + rows[:, None] * stride_o_row + head * stride_o_head + offs_v[None, :]
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + rows * stride_lse_row + head, lse, mask=row_ok)


def fp8_p_shift(dtype: torch.dtype) -> int:
    """log2 of the factor P is scaled by before its cast to fp8: the largest that keeps
    1.0 * 2**shift finite (e4m3fn reaches 448, e4m3fnuz 240)."""
    return 8 if torch.finfo(dtype).max >= 256 else 7


def _int_table(rows: list[tuple[int, ...]], width: int, device: torch.device) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.int32) if rows else torch.zeros(0, width, dtype=torch.int32)
    return t.reshape(-1, width).contiguous().to(device)


Launch = tuple[tuple[int, ...], tuple, dict]  # a Triton launch: grid, arguments, meta


@dataclass(frozen=True)
class PlanTables:
    """A plan on the device: its work and merge tables, and the split tiles' partial
    (output, LSE) slots, ``tile_q`` rows each (one at least, so the kernels get a pointer)."""

    work_indptr: torch.Tensor
    work_info: torch.Tensor
    merge_info: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor

    @classmethod
    def of(cls, plan: WorkPlan, tile_q: int, d_v: int, device: torch.device) -> PlanTables:
        slots = max(plan.num_partials, 1)
        return cls(torch.from_numpy(plan.work_indptr).to(device),
                   torch.from_numpy(plan.work_info).to(device),
                   torch.from_numpy(plan.merge_info).to(device),
                   torch.empty(slots * tile_q, d_v, dtype=torch.float32, device=device),
                   torch.empty(slots * tile_q, dtype=torch.float32, device=device))

    def merge_launch(self, plan: WorkPlan, out: torch.Tensor, lse: torch.Tensor,
                     tile_q: int) -> Launch | None:
        """``_merge_partials_kernel``'s launch over the split tiles, None without any."""
        if not len(plan.merge_info):
            return None
        block_r = min(_MERGE_BLOCK_ROWS, triton.next_power_of_2(tile_q))
        return ((len(plan.merge_info), triton.cdiv(tile_q, block_r)),
                (self.part_out, self.part_lse, out, lse, self.merge_info,
                 out.stride(0), out.stride(1), lse.stride(0)),
                dict(D_V=out.shape[2], TILE_Q=tile_q, BLOCK_R=block_r,
                     INFO_COLUMNS=MERGE_INFO_COLUMNS, num_warps=4))


def transposed_v(v: torch.Tensor, seq_lens_k: list[int], align: int, min_cols: int = 0,
                 permute_keys: bool = False) -> tuple[torch.Tensor, Launch | None]:
    """A (heads, d_v, keys) buffer for v with each request's keys from a multiple of
    ``align`` (``v_key_offsets``; at least ``min_cols`` columns), and the launch of
    ``_transpose_v_kernel`` that fills it from ``v`` (None for no keys). ``permute_keys``
    (align a multiple of 32): within each 32 keys, key k goes to column (k4, k2, k1, k3, k0)
    (bits of k), the order in which a wgmma accumulator holds a row's keys (the Gluon fp8
    prefill's P, ``gluon_prefill_fp8._keys_as_operand``)."""
    if permute_keys and align % 32:
        raise ValueError(f"permuted keys need requests aligned to 32 keys, got {align}")
    heads, d_v = v.shape[1], v.shape[2]
    cols = max(v_key_offsets(seq_lens_k, align)[-1], min_cols)
    # Zeros: the padding between requests is read (as keys past the range, whose P is 0)
    # and written, if at all, with zeros (WHOLE_TILES).
    vt = torch.zeros(heads, d_v, cols, dtype=v.dtype, device=v.device)
    tiles = _int_table(v_transpose_tiles(seq_lens_k, align, _TRANSPOSE_BLOCK), 3, v.device)
    if not len(tiles):
        return vt, None
    return vt, ((len(tiles), heads),
                (v, vt, tiles, v.stride(0), v.stride(1), vt.stride(0), vt.stride(1)),
                # Tiles start at the request's column plus multiples of the block.
                dict(D_V=d_v, BLOCK_K=_TRANSPOSE_BLOCK,
                     V_ALIGN=math.gcd(align, _TRANSPOSE_BLOCK), PERMUTE_32=permute_keys,
                     WHOLE_TILES=align % _TRANSPOSE_BLOCK == 0, num_warps=4))


def run_launch(kernel, launch: Launch | None) -> None:
    if launch is not None:
        grid, args, meta = launch
        kernel[grid](*args, **meta)


class PersistentPrefill:
    """One varlen batch planned and allocated: calling it only launches the kernels.

    q: (total_q, H, d_qk), k: (total_k, H, d_qk), v: (total_k, H, d_v), out
    (total_q, H, d_v) and lse (total_q, H), each with a contiguous last dimension
    (any token and head strides). ``out`` and ``lse`` are written in full on
    every call. With ``config.v_transposed`` every call first copies v into a
    transposed buffer (heads, d_v, keys) of this object's, requests at aligned
    starts, and the attention kernel reads that.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, seq_lens_q: list[int], seq_lens_k: list[int], *,
                 causal: bool, sm_scale: float, scales: tuple[torch.Tensor, ...] | None,
                 config: KernelConfig, num_programs: int, tile_q: int = 256,
                 min_split: int = 256):
        heads, d_qk, d_v = q.shape[1], q.shape[2], v.shape[2]
        parts = split_head_dim(d_qk)
        if parts is None:
            raise ValueError(f"d_qk {d_qk} is not a sum of two powers of two >= 16")
        if any(t.stride(-1) != 1 for t in (q, k, v, out, lse)):
            raise ValueError("q, k, v, out and lse need a contiguous last dimension")
        v_align = V_ALIGN if config.v_transposed else 1
        self.plan: WorkPlan = plan_work(seq_lens_q, seq_lens_k, heads, num_programs,
                                        tile_q=tile_q, block_m=config.block_m, causal=causal,
                                        split_align=config.block_n, min_split=min_split,
                                        v_align=v_align, grouped=config.grouped)
        device = q.device
        self._transpose: Launch | None = None
        v_kernel = v
        if config.v_transposed:
            v_kernel, self._transpose = transposed_v(v, seq_lens_k, V_ALIGN)
        # (key, dim) strides of the v the kernel reads.
        v_strides = (v_kernel.stride(2), v_kernel.stride(1)) if config.v_transposed else (
            v.stride(0), 1)
        tables = PlanTables.of(self.plan, tile_q, d_v, device)
        placeholder = torch.ones(1, dtype=torch.float32, device=device)
        q_scale, k_scale, v_scale = scales if scales is not None else (placeholder,) * 3
        self._main_grid = (num_programs,)
        self._main_args = (
            q, k, v_kernel, out, lse, tables.part_out, tables.part_lse, q_scale, k_scale,
            v_scale, tables.work_indptr, tables.work_info, sm_scale * math.log2(math.e),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            *v_strides, v_kernel.stride(0) if config.v_transposed else v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
        )
        upcast = k.dtype != q.dtype
        fp8_p = v.dtype.itemsize == 1 and not upcast
        self._main_meta = dict(
            HAS_SCALES=scales is not None, CAUSAL=causal, D_A=parts[0], D_B=parts[1], D_V=d_v,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, TILE_Q=tile_q,
            ROUND_P_FIRST=fp8_p and _interpreting(), INFO_COLUMNS=WORK_INFO_COLUMNS,
            KV_UPCAST=upcast, P_SHIFT=fp8_p_shift(v.dtype) if fp8_p else 0, V_ALIGN=v_align,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        self._merge = tables.merge_launch(self.plan, out, lse, tile_q)
        # Keep every buffer the launches read alive as long as this object.
        self._buffers = (tables, placeholder)

    def __call__(self) -> None:
        run_launch(_transpose_v_kernel, self._transpose)
        _prefill_persistent_kernel[self._main_grid](*self._main_args, **self._main_meta)
        run_launch(_merge_partials_kernel, self._merge)
