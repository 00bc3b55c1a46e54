"""An fp8 prefill for Hopper in Gluon: both products fp8 wgmmas, warp-specialized.

The Triton kernel behind ``fp8-ps/triton`` (``prefill.PersistentPrefill``) waits for each
dot before the softmax, so the tensor cores idle while it runs; here they do not
(docs/kernels/gluon_prefill_fp8.md has the figures). As in FlashAttention-3:
- a loader partition (TMA): each 128-row query block's q (double-buffered, so the next
  block's lands during this one's keys), then 128-key tiles of k (its 128 + 64 dims as two
  boxes) and of v transposed (keys contiguous: Hopper's fp8 wgmma takes B only K-major) into
  a ring of ``STAGES`` slots;
- two MMA warpgroups, 64 query rows each, over the same tiles, taking turns at the tensor
  cores (``_pingpong_tiles``): at its turn a warpgroup issues S = Q K^T of tile t and
  O += P V of tile t-1 (both fp8), then runs tile t's online softmax (base 2, the scales
  folded into one multiply-add) while the other's products run; P, times 2^P_SHIFT and
  rounded to e4m3, stays in registers as the A operand of P V. The transposed v holds each
  32 keys in the order the wgmma accumulator holds a row's keys (``_keys_as_operand``), so
  P becomes that operand without shuffles.
The work (which query tile of which head, which key range, where split tiles' partials go)
is ``prefill_plan.plan_work``'s, as for the Triton kernel, and the same merge kernel
combines split tiles. v is transposed once per call (``prefill._transpose_v_kernel``) into
this launcher's buffer, each request at a multiple of 128 keys, so no key tile crosses into
another request's keys (the padding is zeros, and P is 0 there).
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlatune.kernels.gluon_common import (
    LN2,
    aot_compile_kernel,
    compile_options,
    gluon_available,
    no_shift,
    nvmma_layout,
)
from mlatune.kernels.gluon_hopper import _issue_scores  # S = Q K^T of a tile's two parts
from mlatune.kernels.prefill import (
    PlanTables,
    _merge_partials_kernel,
    _transpose_v_kernel,
    fp8_p_shift,
    run_launch,
    transposed_v,
)
from mlatune.kernels.prefill_plan import WORK_INFO_COLUMNS, WorkPlan, plan_work

D_A, D_B, D_V = 128, 64, 128  # q.k over 128 + 64 dims (DeepSeek's nope and rope), v's width
WG_ROWS = 64  # query rows of one MMA warpgroup (wgmma's M)
BLOCK_M = 2 * WG_ROWS  # a query block: both warpgroups
BLOCK_N = 128  # keys a tile
V_ALIGN = BLOCK_N  # each request's first key in the transposed v: no tile crosses requests
STAGES = 3  # ring slots of (k, v^T) tiles beside two query blocks (40 KB a slot, 24 a block)
NUM_WARPS = 4  # the loader (the default partition); each MMA warpgroup is 4 more
MAXNREG = 168  # 12 warps: the MMA warpgroups rise to theirs, the loader keeps the rest
MMA_REGS = gl.constexpr(240)
# A warpgroup's wgmma accumulators: S (64 rows x a key tile) and O (64 rows x v's width).
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 32]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, D_V, 32]))
FP8 = (torch.float8_e4m3fn, )

__all__ = ["GluonPrefill", "aot_compile", "prefill_fp8_kernel"]


@gluon.jit
def _work_item(work_info_ptr, item, INFO_COLUMNS: gl.constexpr):
    """One row of the plan's work table (columns as ``prefill_plan.WorkItem``)."""
    info = work_info_ptr + item * INFO_COLUMNS
    return (gl.load(info + 0), gl.load(info + 1), gl.load(info + 2), gl.load(info + 3),
            gl.load(info + 4), gl.load(info + 5), gl.load(info + 6), gl.load(info + 7),
            gl.load(info + 8), gl.load(info + 9))


@gluon.jit
def _block_keys(m0, q_rows, q_pos0, prefix, kv_lo, kv_hi, CAUSAL: gl.constexpr,
                BM: gl.constexpr, BN: gl.constexpr):
    """The query block at row ``m0`` of its tile: its key bound (causal: its last row's) and
    the tiles from ``kv_lo`` up to it."""
    kv_stop = kv_hi
    if CAUSAL:
        kv_stop = gl.minimum(kv_hi, prefix + q_pos0 + gl.minimum(m0 + BM, q_rows))
    return kv_stop, gl.cdiv(gl.maximum(kv_stop - kv_lo, 0), BN)


@gluon.jit
def _loader(descs, q_bufs, ring, bars, work_indptr_ptr, work_info_ptr,
            CAUSAL: gl.constexpr, INFO_COLUMNS: gl.constexpr):
    """Each query block's q into one of two buffers (a half for each warpgroup), then its key
    tiles into the ring, each slot once both warpgroups have released it."""
    qa_desc, qb_desc, ka_desc, kb_desc, vt_desc = descs
    q_a, q_b = q_bufs
    k_a, k_b, vt = ring
    q_ready, q_empty, kv_ready, kv_empty = bars[0], bars[1], bars[2], bars[3]
    S: gl.constexpr = k_a.shape[0]
    BN: gl.constexpr = k_a.shape[1]
    R: gl.constexpr = q_a.shape[1]
    DQK: gl.constexpr = q_a.shape[2] + q_b.shape[2]
    DV: gl.constexpr = vt.shape[1]
    q_bytes: gl.constexpr = 2 * (qa_desc.block_type.nbytes + qb_desc.block_type.nbytes)
    kv_bytes: gl.constexpr = (ka_desc.block_type.nbytes + kb_desc.block_type.nbytes
                              + vt_desc.block_type.nbytes)
    pid = gl.program_id(0)
    it = 0  # key tiles loaded so far (the ring's position)
    qb = 0  # query blocks loaded so far
    for item in range(gl.load(work_indptr_ptr + pid), gl.load(work_indptr_ptr + pid + 1)):
        q_row0, q_pos0, q_rows, k_row0, prefix, kv_lo, kv_hi, head, _, v_row0 = \
            _work_item(work_info_ptr, item, INFO_COLUMNS)
        for m0 in range(0, q_rows, 2 * R):
            _, n_tiles = _block_keys(m0, q_rows, q_pos0, prefix, kv_lo, kv_hi, CAUSAL, 2 * R, BN)
            qs = qb % 2
            # A fresh barrier counts as phase 1 complete: the first wait on each passes.
            mbarrier.wait(q_empty.index(qs), ((qb // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qs), q_bytes)
            for w in gl.static_range(2):
                row = q_row0 + m0 + w * R
                tma.async_copy_global_to_shared(qa_desc, [row, head * DQK], q_ready.index(qs),
                                                q_a.index(2 * qs + w))
                tma.async_copy_global_to_shared(qb_desc, [row, head * DQK + q_a.shape[2]],
                                                q_ready.index(qs), q_b.index(2 * qs + w))
            for t in range(n_tiles):
                s = (it + t) % S
                mbarrier.wait(kv_empty.index(s), (((it + t) // S) & 1) ^ 1)
                key = kv_lo + t * BN
                mbarrier.expect(kv_ready.index(s), kv_bytes)
                tma.async_copy_global_to_shared(ka_desc, [k_row0 + key, head * DQK],
                                                kv_ready.index(s), k_a.index(s))
                tma.async_copy_global_to_shared(kb_desc, [k_row0 + key, head * DQK + k_a.shape[2]],
                                                kv_ready.index(s), k_b.index(s))
                tma.async_copy_global_to_shared(vt_desc, [head * DV, v_row0 + key],
                                                kv_ready.index(s), vt.index(s))
            it += n_tiles
            qb += 1


@gluon.jit
def _softmax(s, qk_scale, m_i, l_i, key0, last_key, MASKED: gl.constexpr,
             P_SHIFT: gl.constexpr):
    """One tile's online softmax (base 2) from raw scores: (P times 2^P_SHIFT, the rows' new
    max, new sum of the shifted P, alpha). Masked: keys past a row's ``last_key`` get 0 (the
    tile's keys start at ``key0``).

    The scale (> 0) goes into the max and, fused, into the exponent's argument (one FFMA an
    element); the shift by P_SHIFT (P's small values kept in e4m3's normal range) too: it
    cancels in O / l, and the LSE takes it out.
    """
    if MASKED:
        # Made here: made once before the loop, it would hold 32 registers a thread.
        keys = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        allowed = gl.expand_dims(keys, 0) <= gl.expand_dims(last_key - key0, 1)
        s = gl.where(allowed, s, gl.full_like(s, float("-inf")))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_ref = no_shift(m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_ref - P_SHIFT, 1))
    alpha = gl.exp2(m_i - m_ref)
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _tile_softmax(s, qk_scale, m_i, l_i, key0, bounds, P_SHIFT: gl.constexpr):
    """``_softmax`` of the tile whose keys start at ``key0``: masked only on the causal
    diagonal or the range's last tile (``bounds``: the block's first key, the end of the
    tiles all rows see whole, each row's last key)."""
    full_stop, last_key = bounds[1], bounds[2]
    if key0 + s.shape[1] > full_stop:
        p, m_i, l_i, alpha = _softmax(s, qk_scale, m_i, l_i, key0, last_key, True, P_SHIFT)
    else:
        p, m_i, l_i, alpha = _softmax(s, qk_scale, m_i, l_i, key0, last_key, False, P_SHIFT)
    return p, m_i, l_i, alpha


@gluon.jit
def _epilogue(acc, m_i, l_i, out_scale, rows, row_ok, dst, where, P_SHIFT: gl.constexpr,
              o_layout: gl.constexpr):
    """A warpgroup's 64 rows (``rows`` of the work item ``where``: its first query row, head
    and slot): O / l times v's scale and LSE (natural log) into out and lse, or (a split
    tile's piece) into its partial slot, fp32."""
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, stride_o_row, stride_o_head, \
        stride_lse_row, TILE_Q = dst
    q_row0, head, slot = where
    DV: gl.constexpr = acc.shape[1]
    has_keys = l_i > 0.0
    l_safe = gl.where(has_keys, l_i, gl.full_like(l_i, 1.0))
    o = acc * gl.expand_dims(gl.convert_layout(out_scale / l_safe, gl.SliceLayout(1, o_layout)),
                             1)
    lse = gl.where(has_keys, (m_i + gl.log2(l_safe) - P_SHIFT) * LN2,
                   gl.full_like(l_i, float("-inf")))
    o_rows = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
    o_ok = gl.expand_dims(gl.convert_layout(row_ok, gl.SliceLayout(1, o_layout)), 1)
    d = gl.expand_dims(gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout)), 0)
    # The LSE from a flat layout: triton 3.6 does not lower a store from the wgmma's.
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    lse = gl.convert_layout(lse, flat)
    f_rows = gl.convert_layout(rows, flat)
    f_ok = gl.convert_layout(row_ok, flat)
    if slot < 0:
        tok = (q_row0 + o_rows).to(gl.int64)
        gl.store(out_ptr + gl.expand_dims(tok * stride_o_row + head * stride_o_head, 1) + d,
                 o.to(out_ptr.dtype.element_ty), mask=o_ok)
        gl.store(lse_ptr + (q_row0 + f_rows).to(gl.int64) * stride_lse_row + head, lse,
                 mask=f_ok)
    else:
        part = slot.to(gl.int64) * TILE_Q
        gl.store(part_out_ptr + gl.expand_dims((part + o_rows) * DV, 1) + d, o, mask=o_ok)
        gl.store(part_lse_ptr + part + f_rows, lse, mask=f_ok)


@gluon.jit
def _keys_as_operand(p):
    """P's columns reordered within each 32 keys as v^T's are when ``transposed_v`` permutes
    them: column j holds key (j4, j1, j3, j2, j0) (bits of j), which is where the wgmma
    accumulator holds that key, so the change to the A operand's layout stays in registers."""
    R: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    x = gl.reshape(p, [R, N // 32, 2, 2, 2, 2, 2])  # key bits (k4, k3, k2, k1, k0)
    return gl.reshape(gl.permute(x, (0, 1, 2, 4, 5, 3, 6)), [R, N])


@gluon.jit
def _take_turn(turns, W: gl.constexpr, k):
    """Wait for warpgroup ``W``'s ``k``-th turn at the tensor cores (warpgroup 0 goes first:
    a fresh barrier passes a wait on phase 1)."""
    mbarrier.wait(turns.index(W), (k & 1) ^ (1 - W))


@gluon.jit
def _pv_operand(p, vt, o_layout: gl.constexpr):
    """P (fp32, times 2^P_SHIFT) as the fp8 A operand of O += P V, its keys in v^T's order
    (the layout change stays in registers)."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    return gl.convert_layout(_keys_as_operand(p.to(vt.dtype)), p_layout, assert_trivial=True)


@gluon.jit
def _pingpong_tiles(W: gl.constexpr, g0, n_tiles, k0, state, block, turns,
                    P_SHIFT: gl.constexpr):
    """A query block's key tiles for warpgroup ``W`` in FlashAttention-3's order: at its turn
    it issues tile t's S and tile t-1's P V back to back and hands the turn over, so the other
    warpgroup's products run while this one does tile t's softmax (``n_tiles`` + 1 turns from
    the ``k0``-th; ``g0``: the block's first tile through the ring). P crosses the loop's end
    in fp32 and becomes fp8 at the turn: 8-bit values carried by the loop are unpacked and
    repacked a byte at a time (about 110 instructions a tile in the SASS)."""
    acc, m_i, l_i = state
    q_half, ring, bars, bounds, qk_scale = block
    k_a, k_b, vt = ring
    kv_ready, kv_empty = bars
    S: gl.constexpr = k_a.shape[0]
    BN: gl.constexpr = k_a.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    s_layout: gl.constexpr = S_LAYOUT
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    mbarrier.wait(kv_ready.index(g0 % S), (g0 // S) & 1)
    _take_turn(turns, W, k0)
    s = _issue_scores(q_half[0], q_half[1], k_a.index(g0 % S), k_b.index(g0 % S), s_layout)
    mbarrier.arrive(turns.index(1 - W))
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    p, m_i, l_i, alpha = _tile_softmax(s, qk_scale, m_i, l_i, bounds[0], bounds, P_SHIFT)
    for t in range(1, n_tiles):
        g = g0 + t
        mbarrier.wait(kv_ready.index(g % S), (g // S) & 1)
        _take_turn(turns, W, k0 + t)
        s = _issue_scores(q_half[0], q_half[1], k_a.index(g % S), k_b.index(g % S), s_layout)
        p8 = _pv_operand(p, vt, o_layout)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        acc = warpgroup_mma(p8, vt.index((g - 1) % S).permute((1, 0)), acc, is_async=True)
        mbarrier.arrive(turns.index(1 - W))
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S done, P V in flight
        p, m_i, l_i, alpha = _tile_softmax(s, qk_scale, m_i, l_i, bounds[0] + t * BN,
                                           bounds, P_SHIFT)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index((g - 1) % S))  # (triton 3.6 puts a bar.sync of the
        # warpgroup before the one thread's arrive: every warp is past P V)
    g = g0 + n_tiles - 1
    _take_turn(turns, W, k0 + n_tiles)
    p8 = _pv_operand(p, vt, o_layout)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    acc = warpgroup_mma(p8, vt.index(g % S).permute((1, 0)), acc, is_async=True)
    mbarrier.arrive(turns.index(1 - W))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(kv_empty.index(g % S))
    return acc, m_i, l_i


@gluon.jit
def _row_bounds(W: gl.constexpr, R: gl.constexpr, m0, q_pos0, prefix, kv_lo, kv_stop,
                layout: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr):
    """Warpgroup ``W``'s rows of the query block at ``m0`` (within the tile), each row's last
    visible key, and the end of the key tiles all its rows see whole (no mask needed)."""
    rows = m0 + W * R + gl.arange(0, R, layout=layout)
    last_key = gl.full([R], 0, gl.int32, layout=layout) + (kv_stop - 1)
    seen_by_all = kv_stop
    if CAUSAL:
        last_key = gl.minimum(last_key, prefix + q_pos0 + rows)
        seen_by_all = gl.minimum(kv_stop, prefix + q_pos0 + m0 + W * R + 1)
    return rows, last_key, kv_lo + gl.maximum(seen_by_all - kv_lo, 0) // BN * BN


@gluon.jit
def _mma_warpgroup(W: gl.constexpr, q_bufs, ring, bars, work_indptr_ptr, work_info_ptr,
                   scale_ptrs, qk_scale, dst, CAUSAL: gl.constexpr, HAS_SCALES: gl.constexpr,
                   INFO_COLUMNS: gl.constexpr, P_SHIFT: gl.constexpr):
    """Warpgroup ``W``'s 64 rows of every query block: its key tiles (``_pingpong_tiles``),
    then the epilogue."""
    q_a, q_b = q_bufs
    k_a, vt = ring[0], ring[2]
    q_ready, q_empty, kv_ready, kv_empty, turns = bars
    q_scale_ptr, k_scale_ptr, v_scale_ptr = scale_ptrs
    BN: gl.constexpr = k_a.shape[1]
    R: gl.constexpr = q_a.shape[1]
    DV: gl.constexpr = vt.shape[1]
    s_layout: gl.constexpr = S_LAYOUT
    o_layout: gl.constexpr = O_LAYOUT
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    # O / l needs no 2^-P_SHIFT: l sums the same shifted P that O accumulates.
    if HAS_SCALES:
        qk_scale = qk_scale * gl.load(q_scale_ptr) * gl.load(k_scale_ptr)
        out_scale = gl.load(v_scale_ptr)
    else:
        out_scale = 1.0
    pid = gl.program_id(0)
    it = 0
    qb = 0
    turn = 0  # this warpgroup's turns at the tensor cores so far
    for item in range(gl.load(work_indptr_ptr + pid), gl.load(work_indptr_ptr + pid + 1)):
        q_row0, q_pos0, q_rows, _, prefix, kv_lo, kv_hi, head, slot, _ = \
            _work_item(work_info_ptr, item, INFO_COLUMNS)
        for m0 in range(0, q_rows, 2 * R):
            kv_stop, n_tiles = _block_keys(m0, q_rows, q_pos0, prefix, kv_lo, kv_hi, CAUSAL,
                                           2 * R, BN)
            rows, last_key, full_stop = _row_bounds(W, R, m0, q_pos0, prefix, kv_lo, kv_stop,
                                                    row_s, CAUSAL, BN)
            bounds = (kv_lo, full_stop, last_key)
            qs = qb % 2
            q_half = (q_a.index(2 * qs + W), q_b.index(2 * qs + W))
            mbarrier.wait(q_ready.index(qs), (qb // 2) & 1)
            m_i = gl.full([R], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.full([R], 0.0, gl.float32, layout=row_s)
            acc = gl.zeros([R, DV], gl.float32, layout=o_layout)
            block = (q_half, ring, (kv_ready, kv_empty), bounds, qk_scale)
            if n_tiles > 0:
                acc, m_i, l_i = _pingpong_tiles(W, it, n_tiles, turn, (acc, m_i, l_i), block,
                                                turns, P_SHIFT)
                turn += n_tiles + 1
            gl.thread_barrier()
            mbarrier.arrive(q_empty.index(qs))  # this half of the block's q is read
            _epilogue(acc, m_i, l_i, out_scale, rows, rows < q_rows, dst, (q_row0, head, slot),
                      P_SHIFT, o_layout)
            it += n_tiles
            qb += 1


@gluon.jit
def prefill_fp8_kernel(qa_desc, qb_desc, ka_desc, kb_desc, vt_desc,  # TMA: q's, k's parts, v^T
                       out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                       q_scale_ptr, k_scale_ptr, v_scale_ptr, work_indptr_ptr, work_info_ptr,
                       qk_scale,  # softmax scale times log2(e): the kernel works with exp2
                       stride_o_row, stride_o_head, stride_lse_row,
                       CAUSAL: gl.constexpr, HAS_SCALES: gl.constexpr, TILE_Q: gl.constexpr,
                       STAGES: gl.constexpr, INFO_COLUMNS: gl.constexpr,
                       P_SHIFT: gl.constexpr, num_warps: gl.constexpr):
    R: gl.constexpr = qa_desc.block_type.shape[0]
    BN: gl.constexpr = ka_desc.block_type.shape[0]
    fp8: gl.constexpr = ka_desc.dtype
    # Two query blocks, each as two 64-row halves: [block * 2 + warpgroup, rows, dims].
    q_a = gl.allocate_shared_memory(fp8, [4, R, qa_desc.block_type.shape[1]], qa_desc.layout)
    q_b = gl.allocate_shared_memory(fp8, [4, R, qb_desc.block_type.shape[1]], qb_desc.layout)
    k_a = gl.allocate_shared_memory(fp8, [STAGES, BN, ka_desc.block_type.shape[1]],
                                    ka_desc.layout)
    k_b = gl.allocate_shared_memory(fp8, [STAGES, BN, kb_desc.block_type.shape[1]],
                                    kb_desc.layout)
    vt = gl.allocate_shared_memory(fp8, [STAGES, vt_desc.block_type.shape[0], BN],
                                   vt_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)  # whose turn
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both MMA warpgroups
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()

    q_bufs = (q_a, q_b)
    ring = (k_a, k_b, vt)
    bars = (q_ready, q_empty, kv_ready, kv_empty, turns)
    scales = (q_scale_ptr, k_scale_ptr, v_scale_ptr)
    dst = (out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, stride_o_row, stride_o_head,
           stride_lse_row, TILE_Q)
    gl.warp_specialize([
        (_loader, ((qa_desc, qb_desc, ka_desc, kb_desc, vt_desc), q_bufs, ring, bars,
                   work_indptr_ptr, work_info_ptr, CAUSAL, INFO_COLUMNS)),
        (_mma_warpgroup, (0, q_bufs, ring, bars, work_indptr_ptr, work_info_ptr, scales,
                          qk_scale, dst, CAUSAL, HAS_SCALES, INFO_COLUMNS, P_SHIFT)),
        (_mma_warpgroup, (1, q_bufs, ring, bars, work_indptr_ptr, work_info_ptr, scales,
                          qk_scale, dst, CAUSAL, HAS_SCALES, INFO_COLUMNS, P_SHIFT)),
    ], [4, 4], [MMA_REGS, MMA_REGS])


# Host side -------------------------------------------------------------------------------

def _descriptor(t: torch.Tensor, shape: list[int], row_stride: int, block: list[int]
                ) -> TensorDescriptor:
    """A TMA descriptor of fp8 ``t`` seen as a 2-D [rows, columns] table, ``block`` boxes."""
    return TensorDescriptor(t, shape, [row_stride, 1], block, nvmma_layout(block, t.dtype))


def check_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why this kernel cannot take these tensors, or None."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in FP8:
        return f"q, k and v must all be float8_e4m3fn, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[2] != D_A + D_B or v.shape[2] != D_V:
        return f"d_qk must be {D_A + D_B} and d_v {D_V}, got {q.shape[2]} and {v.shape[2]}"
    for name, t in (("q", q), ("k", k)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.stride(0) % 16:
            return (f"{name} needs contiguous heads and dims and a token stride of a multiple "
                    f"of 16 bytes (TMA), got strides {tuple(t.stride())}")
        if t.data_ptr() % 16:
            return f"{name} must start at a 16-byte aligned address (TMA)"
    return None


class GluonPrefill:
    """``prefill.PersistentPrefill``'s contract with this kernel: one varlen batch planned and
    allocated (fp8 q, k, v with per-tensor scales; d_qk 192, d_v 128); calling it transposes
    v into this object's buffer, runs the kernel and merges split tiles. ``out`` and ``lse``
    are written in full on every call."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, seq_lens_q: list[int], seq_lens_k: list[int], *,
                 causal: bool, sm_scale: float, scales: tuple[torch.Tensor, ...] | None,
                 num_programs: int, tile_q: int = 256, min_split: int = 256,
                 grouped: bool = False, stages: int = STAGES):
        ok, why = gluon_available()
        if not ok:
            raise ValueError(f"gluon fp8 prefill: {why}")
        why = check_supported(q, k, v)
        if why is not None:
            raise ValueError(f"gluon fp8 prefill: {why}")
        if out.stride(-1) != 1 or lse.stride(-1) != 1:
            raise ValueError("out and lse need a contiguous last dimension")
        if not 2 <= stages <= 4:  # 1 deadlocks (tile t+1 is awaited before t is released)
            raise ValueError(f"stages must be 2, 3 or 4 (shared memory), got {stages}")
        heads = q.shape[1]
        self.plan: WorkPlan = plan_work(seq_lens_q, seq_lens_k, heads, num_programs,
                                        tile_q=tile_q, block_m=BLOCK_M, causal=causal,
                                        split_align=BLOCK_N, min_split=min_split,
                                        v_align=V_ALIGN, grouped=grouped)
        vt, self._transpose = transposed_v(v, seq_lens_k, V_ALIGN, min_cols=BLOCK_N,
                                           permute_keys=True)
        descs = (
            _descriptor(q, [q.shape[0], heads * q.shape[2]], q.stride(0), [WG_ROWS, D_A]),
            _descriptor(q, [q.shape[0], heads * q.shape[2]], q.stride(0), [WG_ROWS, D_B]),
            _descriptor(k, [k.shape[0], heads * k.shape[2]], k.stride(0), [BLOCK_N, D_A]),
            _descriptor(k, [k.shape[0], heads * k.shape[2]], k.stride(0), [BLOCK_N, D_B]),
            _descriptor(vt, [heads * D_V, vt.shape[2]], vt.stride(1), [D_V, BLOCK_N]),
        )
        tables = PlanTables.of(self.plan, tile_q, D_V, q.device)
        ones = torch.ones(1, dtype=torch.float32, device=q.device)
        q_scale, k_scale, v_scale = scales if scales is not None else (ones,) * 3
        self._grid = (num_programs, )
        self._args = (*descs, out, lse, tables.part_out, tables.part_lse, q_scale, k_scale,
                      v_scale, tables.work_indptr, tables.work_info, sm_scale * math.log2(math.e),
                      out.stride(0), out.stride(1), lse.stride(0))
        self._meta = dict(CAUSAL=causal, HAS_SCALES=scales is not None, TILE_Q=tile_q,
                          STAGES=stages, INFO_COLUMNS=WORK_INFO_COLUMNS,
                          P_SHIFT=fp8_p_shift(v.dtype), **compile_options(NUM_WARPS, MAXNREG))
        self._merge = tables.merge_launch(self.plan, out, lse, tile_q)
        # Keep every buffer the launches read alive as long as this object.
        self._buffers = (vt, tables, ones)

    def __call__(self) -> None:
        run_launch(_transpose_v_kernel, self._transpose)
        prefill_fp8_kernel[self._grid](*self._args, **self._meta)
        run_launch(_merge_partials_kernel, self._merge)


def aot_compile(*, causal: bool = True, has_scales: bool = True, tile_q: int = 256,
                stages: int = STAGES, out_dtype: str = "bf16", arch: int = 90):
    """Compile ``prefill_fp8_kernel`` for ``sm_<arch>`` without a GPU; returns triton's
    CompiledKernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``)."""
    constants = dict(CAUSAL=causal, HAS_SCALES=has_scales, TILE_Q=tile_q, STAGES=stages,
                     INFO_COLUMNS=WORK_INFO_COLUMNS, P_SHIFT=fp8_p_shift(torch.float8_e4m3fn),
                     num_warps=NUM_WARPS)
    blocks = dict(qa_desc=("fp8", WG_ROWS, D_A), qb_desc=("fp8", WG_ROWS, D_B),
                  ka_desc=("fp8", BLOCK_N, D_A), kb_desc=("fp8", BLOCK_N, D_B),
                  vt_desc=("fp8", D_V, BLOCK_N))
    pointers = dict(out_ptr=out_dtype, lse_ptr="fp32", part_out_ptr="fp32",
                    part_lse_ptr="fp32", q_scale_ptr="fp32", k_scale_ptr="fp32",
                    v_scale_ptr="fp32", work_indptr_ptr="i32", work_info_ptr="i32")
    return aot_compile_kernel(prefill_fp8_kernel, constants, blocks, pointers, arch=arch,
                              num_warps=NUM_WARPS, maxnreg=MAXNREG)
