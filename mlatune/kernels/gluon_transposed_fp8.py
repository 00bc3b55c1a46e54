"""The transposed Gluon decode over an fp8 cache with fp8 MMAs (EXPERIMENTAL: not a route).

Measured once on the H200 (2026-12-01, session 10 call 7, ``benchmarks/gluon_check.py``), in
the form before the split's last tile zeroed its stale rows (every tile then masked its V^T
bytes instead): right everywhere (smoke 16/16, NaN stale slots, 1 and 5 splits; rel_l2
0.028-0.048, FlashMLA's fp8 path 0.028-0.049), but slower than the widening kernels: 352.5
us at (128, 16, 8192, 1) against 327.1 (``gluon_transposed_ws``) and FlashMLA's 249.9. The
transpose runs in the MMA warpgroup between S's issue and its wait, in series with
everything else. The current form is compiled (tests), not yet run on a GPU; nor is the
warp-specialized form below it (``transposed_fp8_ws_kernel``, ``decode_launcher(ws=True)``):
a loader partition (TMA), a transposer partition (V^T into two buffers, stale rows masked in
a split's last tile) and the MMA warpgroup (q's quantization, S^T, the softmax, O^T), so the
transpose overlaps the MMAs; the ring slot is released by both readers (an mbarrier of two
arrivals); 3 ring stages at 16 rows, 2 at 32 (shared memory: 205 and 197 KB).

Why: ``gluon_transposed`` and ``gluon_transposed_ws`` widen each fp8 tile to 16 bits in
shared memory and run 16-bit MMAs. On the H200 that moves about 321 KB a 64-key tile through
shared memory, at least 1.43 us a tile at its 128 B a cycle, more than the 1.34 us a tile
that 0.6x the bf16 time allows (``benchmarks/results/README.md``, session 10). Here nothing is
widened: both products are fp8 wgmmas (k32), about 190 KB a tile.
- q is quantized once per program, each query row by its own scale (amax / 448 over its 576
  dims), into fp8 shared memory; S^T = K Q8^T then carries one factor a column (the row's
  scale, the cache's, the softmax scale), applied before the softmax. The accuracy is that
  of a quantized q (``check.accuracy.QUANTIZED_Q``), as FlashMLA's fp8 path, which quantizes
  q per tensor.
- Hopper's fp8 wgmma takes both operands K-major. O^T = V^T P^T needs V^T with the tile's
  keys contiguous: while S's MMAs run (asynchronously), the warpgroup copies the tile's V
  (its first 512 dims) transposed into a [512, 64] buffer, four keys by four dims a thread
  (a register transpose of bytes); the split's last tile has its stale V rows zeroed first
  (a real cache holds NaN there).
- P (in [0, 1]) is scaled by 2^P_SHIFT before its cast to e4m3 (max 448), so values down
  to 2^-17 survive; the sum of the unscaled P normalizes O, and the epilogue divides the
  shift out with the cache's V scale.
Everything else (one warpgroup, the TMA ring, splits, the merge, the epilogue, LSE) is
``gluon_transposed``'s. Shared memory: Q (16-bit, then fp8), the fp8 ring (3 x 36 KiB),
V^T (32 KiB), P^T.
"""

from __future__ import annotations

from collections.abc import Callable

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

from mlatune.kernels import gluon_hopper_plan as plan
from mlatune.kernels import gluon_transposed as base
from mlatune.kernels.gluon_common import (
    aot_compile_kernel,
    issue_kv,
    last_keys,
    online_softmax,
    program_keys,
    tma_descriptors,
    zero_stale_rows,
)
from mlatune.kernels.gluon_hopper_plan import BLOCK_N, PAGE_SIZE

STAGES = gl.constexpr(3)
P_SHIFT = gl.constexpr(8)  # P times 2^8 before e4m3 (largest 448): the largest power that fits
E4M3_MAX = gl.constexpr(448.0)

__all__ = ["aot_compile", "decode_launcher", "transposed_fp8_kernel", "transposed_fp8_ws_kernel",
           "ws_stages"]


@gluon.jit
def _q_buffers(qn_desc, qr_desc, fp8: gl.constexpr):
    """Shared memory for Q's two parts as they land (16-bit) and quantized (fp8)."""
    BR: gl.constexpr = qn_desc.block_type.shape[0]
    DN: gl.constexpr = qn_desc.block_type.shape[1]
    DR: gl.constexpr = qr_desc.block_type.shape[1]
    q_nope = gl.allocate_shared_memory(qn_desc.dtype, [BR, DN], qn_desc.layout)
    q_rope = gl.allocate_shared_memory(qr_desc.dtype, [BR, DR], qr_desc.layout)
    q8_nope = gl.allocate_shared_memory(fp8, [BR, DN],
                                        gl.NVMMASharedLayout.get_default_for([BR, DN], fp8))
    q8_rope = gl.allocate_shared_memory(fp8, [BR, DR],
                                        gl.NVMMASharedLayout.get_default_for([BR, DR], fp8))
    return q_nope, q_rope, q8_nope, q8_rope


@gluon.jit
def _quantize_q(q_nope, q_rope, q8_nope, q8_rope, col_layout: gl.constexpr,
                num_warps: gl.constexpr):
    """Each query row of Q (16-bit, in shared memory) as e4m3 by its own scale (amax over its
    576 dims / 448, 1 for a zero row) into the fp8 buffers; returns the scales."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    xn = q_nope.load(layout).to(gl.float32)
    xr = q_rope.load(layout).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(xn), axis=1), gl.max(gl.abs(xr), axis=1))
    scale = gl.where(amax > 0.0, amax / E4M3_MAX, gl.full_like(amax, 1.0))
    inv = gl.expand_dims(1.0 / scale, 1)
    q8_nope.store((xn * inv).to(q8_nope.dtype))
    q8_rope.store((xr * inv).to(q8_rope.dtype))
    fence_async_shared()  # generic-proxy writes read by wgmma
    gl.thread_barrier()
    return gl.convert_layout(scale, col_layout)


# V's transpose: a thread holds 4 keys x 4 dims blocks. The lanes and warps are the same in
# both layouts (8 lanes along dims, 4 along keys; 4 warps along dims); only the register
# order differs: dims first to load (4 contiguous bytes of a key's row), keys first to store
# (4 contiguous bytes of a dim's row in V^T), so the conversion between them stays in each
# thread's registers (byte permutes, no shuffles). [64 keys, 512 dims] ...
_V_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [16, 0], [32, 0], [0, 128], [0, 256]],
    lane_bases=[[0, 4], [0, 8], [0, 16], [4, 0], [8, 0]],
    warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[64, 512]))
# ... and [512 dims, 64 keys].
_VT_STORE = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [0, 16], [0, 32], [128, 0], [256, 0]],
    lane_bases=[[4, 0], [8, 0], [16, 0], [0, 4], [0, 8]],
    warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[512, 64]))


@gluon.jit
def _transpose_v(kn, vt):
    """The tile's V (keys x 512 dims, fp8) into ``vt`` as dims x keys, keys contiguous (4
    warps). Each thread moves 4 keys x 4 dims at a time: four 4-byte loads, a byte
    transpose in registers, four 4-byte stores."""
    v = kn.load(_V_LOAD).to(gl.int8, bitcast=True)
    vt.store(gl.convert_layout(gl.permute(v, (1, 0)), _VT_STORE).to(vt.dtype, bitcast=True))


@gluon.jit
def _transpose_v_masked(kn, vt, valid):
    """``_transpose_v`` with rows >= valid as zeros (a split's last tile: the cache holds NaN
    past a request's length), for a reader that must not write the ring slot."""
    v = kn.load(_V_LOAD).to(gl.int8, bitcast=True)
    keys = gl.arange(0, kn.shape[0], layout=gl.SliceLayout(1, _V_LOAD))
    v = gl.where(gl.expand_dims(keys < valid, 1), v, gl.zeros_like(v))
    vt.store(gl.convert_layout(gl.permute(v, (1, 0)), _VT_STORE).to(vt.dtype, bitcast=True))


@gluon.jit
def _tile(q8_nope, q8_rope, kn, kr, vt, p_buf, n0, end, last_pos, keys, qk_cols, m_i, l_i,
          acc, s_layout: gl.constexpr, num_warps: gl.constexpr):
    """One tile: S^T = K Q8^T (fp8) with V transposed meanwhile, the softmax over its keys,
    O^T = O^T * alpha + V^T P8^T (fp8)."""
    BN: gl.constexpr = kn.shape[0]
    BR: gl.constexpr = q8_nope.shape[0]
    s = gl.zeros([BN, BR], gl.float32, layout=s_layout)
    s = warpgroup_mma(kn, q8_nope.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(kr, q8_rope.permute((1, 0)), s, is_async=True)
    _transpose_v(kn, vt)  # while S's MMAs run
    fence_async_shared()  # V^T (generic-proxy writes) is read by wgmma
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    p, m_i, l_i, alpha = online_softmax(s * gl.expand_dims(qk_cols, 0), n0, end, last_pos,
                                        keys, m_i, l_i, 0)
    p8 = (p * (2.0 ** P_SHIFT)).to(p_buf.dtype)
    p_buf.store(gl.permute(p8, (1, 0)))
    fence_async_shared()
    gl.thread_barrier()  # every warp's V^T and P^T are in
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, s_layout)), 0)
    acc = warpgroup_mma(vt, p_buf.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    gl.thread_barrier()  # the MMAs are done with the slot, V^T and P^T: refill them
    return acc, m_i, l_i


@gluon.jit(do_not_specialize=["num_splits", "qlen", "heads"])
def transposed_fp8_kernel(qn_desc, qr_desc, kn_desc, kr_desc,  # TMA: q's and the cache's parts
                          bt_ptr, seq_lens_ptr, kv_scale_ptr, out_ptr, lse_ptr,
                          part_out_ptr, part_lse_ptr, counter_ptr,
                          num_splits, qlen, heads, qk_scale,
                          stride_bt, stride_o_tok, stride_o_head, stride_lse_tok,
                          stride_po_slot, stride_po_row, stride_pl_slot,
                          CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr,
                          MERGE: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
    BR: gl.constexpr = qn_desc.block_type.shape[0]
    BN: gl.constexpr = kn_desc.block_type.shape[0]
    DN: gl.constexpr = kn_desc.block_type.shape[1]
    DR: gl.constexpr = kr_desc.block_type.shape[1]
    fp8: gl.constexpr = kn_desc.dtype
    rb, split, b, seq_len, start, end, n_tiles = program_keys(
        seq_lens_ptr, num_splits, qlen, heads, BR, BN, CAUSAL, PDL)
    q_nope, q_rope, q8_nope, q8_rope = _q_buffers(qn_desc, qr_desc, fp8)
    k_nope = gl.allocate_shared_memory(fp8, [STAGES, BN, DN], kn_desc.layout)
    k_rope = gl.allocate_shared_memory(fp8, [STAGES, BN, DR], kr_desc.layout)
    vt = gl.allocate_shared_memory(fp8, [DN, BN],
                                   gl.NVMMASharedLayout.get_default_for([DN, BN], fp8))
    p_buf = gl.allocate_shared_memory(fp8, [BR, BN],
                                      gl.NVMMASharedLayout.get_default_for([BR, BN], fp8))
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    bt_row = base._start_copies((qn_desc, qr_desc, kn_desc, kr_desc), (q_nope, q_rope),
                                (k_nope, k_rope), q_bar, ready,
                                bt_ptr + b.to(gl.int64) * stride_bt, b * qlen * heads + rb * BR,
                                start, n_tiles, PAGE)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BR, 32])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    last_pos = last_keys(rb, seq_len, qlen, heads, BR, col_s, CAUSAL)
    keys = gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
    kv_scale = gl.load(kv_scale_ptr)
    m_i = gl.full([BR], float("-inf"), gl.float32, layout=col_s)
    l_i = gl.full([BR], 0.0, gl.float32, layout=col_s)
    acc = gl.zeros([DN, BR], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    q_scales = _quantize_q(q_nope, q_rope, q8_nope, q8_rope, col_s, num_warps)
    qk_cols = q_scales * (qk_scale * kv_scale)
    for i in range(n_tiles):
        nxt = i + STAGES - 1
        fence_async_shared()  # the slot was read and written (stale rows) generically
        issue_kv(kn_desc, kr_desc, k_nope.index(nxt % STAGES), k_rope.index(nxt % STAGES),
                  ready.index(nxt % STAGES), bt_row, start + nxt * BN, nxt < n_tiles, PAGE)
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        n0 = start + i * BN
        if n0 + BN > end:  # the split's last tile: stale V rows (NaN in a real cache) to 0
            zero_stale_rows(k_nope.index(slot), end - n0, num_warps)
        acc, m_i, l_i = _tile(q8_nope, q8_rope, k_nope.index(slot), k_rope.index(slot), vt,
                              p_buf, n0, end, last_pos, keys, qk_cols, m_i, l_i,
                              acc, s_layout, num_warps)

    ints = (rb, b, split, num_splits, qlen, heads, stride_o_tok, stride_o_head, stride_lse_tok,
            stride_po_slot, stride_po_row, stride_pl_slot)
    ptrs = (out_ptr, lse_ptr, part_out_ptr, part_lse_ptr)
    base._epilogue(acc, m_i, l_i, kv_scale * (2.0 ** -P_SHIFT), ptrs, ints, s_layout, DIRECT,
                   num_warps)
    if MERGE:
        base._merge_if_last(ptrs, counter_ptr, ints, BR, DN, num_warps)


# Warp-specialized form: the transpose in a partition of its own ---------------------------

WS_MAXNREG = 168  # 12 warps: the two worker partitions rise to theirs, the loader gets the rest
WS_MMA_REGS = gl.constexpr(240)
WS_TRANSPOSE_REGS = gl.constexpr(232)


@gluon.jit
def _ws_loader(descs, q_bufs, ring, bars, bt_row, q_row, start, n_tiles, PAGE: gl.constexpr):
    """Q once, then each tile into its ring slot once both readers have released it."""
    qn_desc, qr_desc, kn_desc, kr_desc = descs
    q_nope, q_rope = q_bufs
    k_nope, k_rope = ring
    q_bar, ready, k_empty = bars
    S: gl.constexpr = k_nope.shape[0]
    BN: gl.constexpr = k_nope.shape[1]
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, q_nope)
    tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, q_rope)
    for t in range(n_tiles):
        slot = t % S
        # A fresh barrier counts as phase 1 complete: the first wait on each slot passes.
        mbarrier.wait(k_empty.index(slot), ((t // S) & 1) ^ 1)
        fence_async_shared()  # the transposer read the slot through the generic proxy
        issue_kv(kn_desc, kr_desc, k_nope.index(slot), k_rope.index(slot), ready.index(slot),
                  bt_row, start + t * BN, t < n_tiles, PAGE)


@gluon.jit
def _ws_transposer(ring, vts, bars, start, end, n_tiles):
    """Each tile's V^T into one of two buffers (stale rows as zeros in a split's last tile),
    handed to the MMA warpgroup; the ring slot released for this reader."""
    k_nope = ring[0]
    ready, k_empty, vt_ready, vt_empty = bars
    S: gl.constexpr = k_nope.shape[0]
    BN: gl.constexpr = k_nope.shape[1]
    for t in range(n_tiles):
        slot = t % S
        j = t % 2
        mbarrier.wait(ready.index(slot), (t // S) & 1)
        mbarrier.wait(vt_empty.index(j), ((t // 2) & 1) ^ 1)
        valid = end - (start + t * BN)
        if valid < BN:
            _transpose_v_masked(k_nope.index(slot), vts.index(j), valid)
        else:
            _transpose_v(k_nope.index(slot), vts.index(j))
        fence_async_shared()  # V^T (generic-proxy writes) is read by wgmma
        gl.thread_barrier()  # the partition's four warps are done with V^T and the slot
        mbarrier.arrive(vt_ready.index(j))
        mbarrier.arrive(k_empty.index(slot))


@gluon.jit
def _ws_mma(q_bufs, q8_bufs, ring, vts, p_buf, bars, ptrs, counter_ptr, ints, seq_len, start,
            end, n_tiles, qk, kv_scale, CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
            MERGE: gl.constexpr):
    """q quantized, then per tile S^T (fp8), the softmax, O^T += V^T P^T (fp8); the epilogue."""
    q_nope, q_rope = q_bufs
    q8_nope, q8_rope = q8_bufs
    k_nope, k_rope = ring
    q_bar, ready, k_empty, vt_ready, vt_empty = bars
    rb, qlen, heads = ints[0], ints[4], ints[5]
    S: gl.constexpr = k_nope.shape[0]
    BN: gl.constexpr = k_nope.shape[1]
    DN: gl.constexpr = k_nope.shape[2]
    BR: gl.constexpr = q8_nope.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BR, 32])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    last_pos = last_keys(rb, seq_len, qlen, heads, BR, col_s, CAUSAL)
    keys = gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BR], float("-inf"), gl.float32, layout=col_s)
    l_i = gl.full([BR], 0.0, gl.float32, layout=col_s)
    acc = gl.zeros([DN, BR], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    qk_cols = _quantize_q(q_nope, q_rope, q8_nope, q8_rope, col_s, 4) * qk
    for t in range(n_tiles):
        slot = t % S
        j = t % 2
        n0 = start + t * BN
        mbarrier.wait(ready.index(slot), (t // S) & 1)
        s = gl.zeros([BN, BR], gl.float32, layout=s_layout)
        s = warpgroup_mma(k_nope.index(slot), q8_nope.permute((1, 0)), s, use_acc=False,
                          is_async=True)
        s = warpgroup_mma(k_rope.index(slot), q8_rope.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        mbarrier.arrive(k_empty.index(slot))  # S is done with the slot
        p, m_i, l_i, alpha = online_softmax(s * gl.expand_dims(qk_cols, 0), n0, end, last_pos,
                                            keys, m_i, l_i, 0)
        p_buf.store(gl.permute((p * (2.0 ** P_SHIFT)).to(p_buf.dtype), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()  # every warp's P^T is in
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, s_layout)), 0)
        mbarrier.wait(vt_ready.index(j), (t // 2) & 1)
        acc = warpgroup_mma(vts.index(j), p_buf.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()  # P^T and V^T are free
        mbarrier.arrive(vt_empty.index(j))
    base._epilogue(acc, m_i, l_i, kv_scale * (2.0 ** -P_SHIFT), ptrs, ints, s_layout, DIRECT, 4)
    if MERGE:
        base._merge_if_last(ptrs, counter_ptr, ints, BR, DN, 4)


@gluon.jit(do_not_specialize=["num_splits", "qlen", "heads"])
def transposed_fp8_ws_kernel(qn_desc, qr_desc, kn_desc, kr_desc,
                             bt_ptr, seq_lens_ptr, kv_scale_ptr, out_ptr, lse_ptr,
                             part_out_ptr, part_lse_ptr, counter_ptr,
                             num_splits, qlen, heads, qk_scale,
                             stride_bt, stride_o_tok, stride_o_head, stride_lse_tok,
                             stride_po_slot, stride_po_row, stride_pl_slot,
                             CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr,
                             STAGES_WS: gl.constexpr, MERGE: gl.constexpr, PDL: gl.constexpr,
                             num_warps: gl.constexpr):
    BR: gl.constexpr = qn_desc.block_type.shape[0]
    BN: gl.constexpr = kn_desc.block_type.shape[0]
    DN: gl.constexpr = kn_desc.block_type.shape[1]
    DR: gl.constexpr = kr_desc.block_type.shape[1]
    fp8: gl.constexpr = kn_desc.dtype
    rb, split, b, seq_len, start, end, n_tiles = program_keys(
        seq_lens_ptr, num_splits, qlen, heads, BR, BN, CAUSAL, PDL)
    q_nope, q_rope, q8_nope, q8_rope = _q_buffers(qn_desc, qr_desc, fp8)
    k_nope = gl.allocate_shared_memory(fp8, [STAGES_WS, BN, DN], kn_desc.layout)
    k_rope = gl.allocate_shared_memory(fp8, [STAGES_WS, BN, DR], kr_desc.layout)
    vts = gl.allocate_shared_memory(fp8, [2, DN, BN],
                                    gl.NVMMASharedLayout.get_default_for([DN, BN], fp8))
    p_buf = gl.allocate_shared_memory(fp8, [BR, BN],
                                      gl.NVMMASharedLayout.get_default_for([BR, BN], fp8))
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES_WS, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES_WS, 1], bar_layout)
    vt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    vt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES_WS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # the MMA warpgroup and the transposer
    for i in gl.static_range(2):
        mbarrier.init(vt_ready.index(i), count=1)
        mbarrier.init(vt_empty.index(i), count=1)
    fence_async_shared()

    kv_scale = gl.load(kv_scale_ptr)
    ring = (k_nope, k_rope)
    ints = (rb, b, split, num_splits, qlen, heads, stride_o_tok, stride_o_head, stride_lse_tok,
            stride_po_slot, stride_po_row, stride_pl_slot)
    ptrs = (out_ptr, lse_ptr, part_out_ptr, part_lse_ptr)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    gl.warp_specialize([
        (_ws_loader, ((qn_desc, qr_desc, kn_desc, kr_desc), (q_nope, q_rope), ring,
                      (q_bar, ready, k_empty), bt_row, b * qlen * heads + rb * BR, start,
                      n_tiles, PAGE)),
        (_ws_mma, ((q_nope, q_rope), (q8_nope, q8_rope), ring, vts, p_buf,
                   (q_bar, ready, k_empty, vt_ready, vt_empty), ptrs, counter_ptr, ints,
                   seq_len, start, end, n_tiles, qk_scale * kv_scale, kv_scale, CAUSAL, DIRECT,
                   MERGE)),
        (_ws_transposer, (ring, vts, (ready, k_empty, vt_ready, vt_empty), start, end,
                          n_tiles)),
    ], [4, 4], [WS_MMA_REGS, WS_TRANSPOSE_REGS])


def ws_stages(rows: int) -> int:
    """Ring depth beside Q (16-bit and fp8), two V^T buffers and P^T: 3 at 16 rows, 2 at 32."""
    return 3 if rows <= 16 else 2


# Host side -------------------------------------------------------------------------------

def decode_launcher(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                    kv_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, num_splits: int | None = None,
                    max_seq_len: int | None = None, merge: str = base.MERGE, pdl: bool = False,
                    ws: bool = False
                    ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """``gluon_transposed.decode_launcher`` for this kernel: an fp8 e4m3 cache only, q
    quantized per row inside the kernel (its accuracy: ``QUANTIZED_Q``). ``ws``: the
    warp-specialized form (the transpose in a partition of its own)."""
    if kv_cache.dtype not in base.FP8_CACHES:
        raise ValueError(f"the fp8-MMA transposed decode reads an fp8 cache only, got "
                         f"{kv_cache.dtype}")
    batch, heads = seq_lens.shape[0], q.shape[1]
    base._check_call(q, out, lse, batch * qlen, num_splits, base.WIDEN_COLS, merge)
    why = base.check_supported(q, kv_cache, block_table, seq_lens, kv_scale)
    if why is not None:
        raise ValueError(f"gluon transposed MLA decode (fp8 MMAs): {why}")
    rows = plan.transposed_rows(qlen * heads)
    meta = dict(CAUSAL=causal and qlen > 1, PAGE=PAGE_SIZE, num_warps=base.NUM_WARPS)
    kernel = transposed_fp8_kernel
    if ws:
        kernel = transposed_fp8_ws_kernel
        meta.update(STAGES_WS=ws_stages(rows), maxnreg=WS_MAXNREG)
    descs = tma_descriptors(q, kv_cache, rows)
    return base.launch(kernel, descs, q, block_table, seq_lens, kv_scale, out, lse, qlen=qlen,
                       sm_scale=sm_scale, num_splits=num_splits, max_seq_len=max_seq_len,
                       merge=merge, meta=meta, pdl=pdl)


def aot_compile(dtype: str = "bf16", *, rows: int = 16, direct: bool = True,
                causal: bool = True, merge: str = base.MERGE, arch: int = 90, ws: bool = False):
    """Compile ``transposed_fp8_kernel`` (``ws``: ``transposed_fp8_ws_kernel``; a ``dtype``
    q over an fp8 cache) for ``sm_<arch>`` without a GPU; returns triton's CompiledKernel."""
    br = plan.transposed_rows(rows)
    constants = dict(CAUSAL=causal, DIRECT=direct, PAGE=PAGE_SIZE,
                     MERGE=not direct and merge != "reduce", PDL=False,
                     num_warps=base.NUM_WARPS)
    kernel, extra = transposed_fp8_kernel, {}
    if ws:
        kernel, extra = transposed_fp8_ws_kernel, dict(maxnreg=WS_MAXNREG)
        constants["STAGES_WS"] = ws_stages(br)
    return aot_compile_kernel(kernel, constants, base._blocks(dtype, "fp8", br, BLOCK_N),
                              base._pointers(dtype), arch=arch, num_warps=base.NUM_WARPS,
                              **extra)
