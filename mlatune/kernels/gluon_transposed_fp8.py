"""The transposed Gluon decode over an fp8 cache with fp8 MMAs: the "mma8" form, which the
route ``transposed-mma8/gluon`` runs. Its history: docs/kernels/gluon_transposed.md.

Nothing is widened: both products are fp8 wgmmas (k32). Three partitions
(``gl.warp_specialize``): a loader (TMA: q once, the cache tiles into a ring), a transposer
(each tile's V^T into its half of one buffer) and the MMA warpgroup (q's quantization, S^T,
the softmax, O^T, the epilogue); a ring slot is released by both readers (an mbarrier of two
arrivals).
- q: each query row under one scale (amax over its 576 dims / 448) as two e4m3 terms, the
  rounded row and what the rounding left out, stacked one above the other in one operand, so
  S^T = K (Q8 + Q8lo)^T is one wgmma of N 2 BR a k-step whose column halves are added in
  registers (``_fold``); q keeps about a 16-bit q's precision. One factor a column (the
  row's scale, the cache's, the softmax scale) is applied in the softmax.
- The softmax of raw scores: the tile's max over keys across the four warps in one barrier
  (``gluon_common.key_max``), the bounds applied only on a tile that reaches one, the column
  scales folded into the exponent's FMA; P's row sums kept per element and summed once after
  the last tile.
- P (in [0, 1]) is scaled by 2^P_SHIFT before its cast to e4m3, so values down to 2^-17
  survive; the epilogue divides the shift out with the cache's V scale. P in e4m3 keeps the
  output error near 1e-2: the route declares these sets ``Rounding.P_FP8``.
- Hopper's fp8 wgmma takes both operands K-major, so V^T (keys contiguous) is built by the
  transposer through registers (byte permutes), stale rows of a split's last tile as zeros;
  both tiles' V^T share one buffer of 128-byte rows, each key renamed to a slot (P^T's rows
  alike), so its loads and stores are free of bank conflicts (tests/bank_model.py).
Everything else (splits, the merge, the epilogue, LSE) is ``gluon_transposed``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton import constexpr_function
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
    TILE_KEYS,
    aot_compile_kernel,
    compile_options,
    first_masked_key,
    issue_kv,
    last_keys,
    program_keys,
    slim_step_across_warps,
    tma_descriptors,
)
from mlatune.kernels.gluon_hopper_plan import kv_box_rows

P_SHIFT = gl.constexpr(8)  # P times 2^8 before e4m3 (largest 448): the largest power that fits
E4M3_MAX = gl.constexpr(448.0)

__all__ = ["aot_compile", "decode_launcher", "ring_stages", "transposed_fp8_kernel"]


@gluon.jit
def _q_buffers(qn_desc, qr_desc, fp8: gl.constexpr):
    """Shared memory for Q's two parts as they land (16-bit) and quantized: ((nope, rope),
    (nope, rope) as [1, 2 rows, dims]: the two e4m3 terms one above the other, ``_term``)."""
    BR: gl.constexpr = qn_desc.block_type.shape[0]
    DN: gl.constexpr = qn_desc.block_type.shape[1]
    DR: gl.constexpr = qr_desc.block_type.shape[1]
    q_nope = gl.allocate_shared_memory(qn_desc.dtype, [BR, DN], qn_desc.layout)
    q_rope = gl.allocate_shared_memory(qr_desc.dtype, [BR, DR], qr_desc.layout)
    R: gl.constexpr = 2 * BR
    q8_nope = gl.allocate_shared_memory(fp8, [1, R, DN],
                                        gl.NVMMASharedLayout.get_default_for([R, DN], fp8))
    q8_rope = gl.allocate_shared_memory(fp8, [1, R, DR],
                                        gl.NVMMASharedLayout.get_default_for([R, DR], fp8))
    return (q_nope, q_rope), (q8_nope, q8_rope)


@gluon.jit
def _term(terms, k: gl.constexpr, BR: gl.constexpr):
    """Term k's [BR, dims] of a quantized Q buffer: rows [k BR, (k + 1) BR)."""
    return terms.index(0).slice(k * BR, BR, dim=0)


@gluon.jit
def _quantize_cols(x_buf, terms, inv, layout: gl.constexpr, C0: gl.constexpr,
                   WIDTH: gl.constexpr):
    """Columns [C0, C0 + WIDTH) of Q (16-bit, ``x_buf``) times their rows' ``inv`` scale as
    the two e4m3 terms: the rounded values, then what rounding left out."""
    BR: gl.constexpr = x_buf.shape[0]
    x = x_buf.slice(C0, WIDTH, dim=1).load(layout).to(gl.float32) * inv
    hi = x.to(terms.dtype)
    _term(terms, 0, BR).slice(C0, WIDTH, dim=1).store(hi)
    lo = (x - hi.to(gl.float32)).to(terms.dtype)
    _term(terms, 1, BR).slice(C0, WIDTH, dim=1).store(lo)


@gluon.jit
def _quantize_q(q_bufs, q8_bufs, col_layout: gl.constexpr, num_warps: gl.constexpr):
    """Q (16-bit, in shared memory) as two e4m3 terms per query row, under one scale a row
    (amax over its 576 dims / 448, 1 for a zero row): the rounded row, then what the rounding
    left out, itself rounded, so their sum holds about a 16-bit q's precision. Returns the
    row scales."""
    q_nope, q_rope = q_bufs
    q8_nope, q8_rope = q8_bufs
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    amax = gl.maximum(gl.max(gl.abs(q_nope.load(layout).to(gl.float32)), axis=1),
                      gl.max(gl.abs(q_rope.load(layout).to(gl.float32)), axis=1))
    scale = gl.where(amax > 0.0, amax / E4M3_MAX, gl.full_like(amax, 1.0))
    inv = gl.expand_dims(1.0 / scale, 1)
    CHUNK: gl.constexpr = q_rope.shape[1]  # the nope part a chunk at a time (registers)
    _quantize_cols(q_rope, q8_rope, inv, layout, 0, CHUNK)
    for c in gl.static_range(q_nope.shape[1] // CHUNK):
        _quantize_cols(q_nope, q8_nope, inv, layout, c * CHUNK, CHUNK)
    fence_async_shared()  # generic-proxy writes read by wgmma
    gl.thread_barrier()
    return gl.convert_layout(scale, col_layout)


# V^T is one [512 dims, 128 key slots] buffer (128-byte rows, 128-byte swizzle), tile t's keys
# in slots [64 (t % 2), +64), key k at slot 16 (k % 4) + k // 4 of its half (``_key_slots``;
# P^T's rows alike, so the product is the same). A thread loads 4 dims of a key (4 bytes) and
# stores 16 slots of a dim (16 bytes); the lanes that change a load's bank (keys 1-2 through
# the K tile's swizzle, dims 4, 8, 64) also change a store's (keys 1-2 are slot bits 4-5; dim
# 4 flips V^T's swizzle), so neither side conflicts by the bank model (tests/bank_model.py).
# [64 keys, 512 dims] ...
_V_LOAD_WIDE = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [4, 0], [8, 0], [16, 0], [32, 0], [0, 16], [0, 32]],
    lane_bases=[[1, 0], [2, 0], [0, 4], [0, 8], [0, 64]],
    warp_bases=[[0, 128], [0, 256]], block_bases=[], shape=[64, 512]))
# ... and [512 dims, 64 slots]: the same threads' elements, the slots first in registers.
_VT_STORE_WIDE = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 0], [16, 0], [32, 0]],
    lane_bases=[[0, 16], [0, 32], [4, 0], [8, 0], [64, 0]],
    warp_bases=[[128, 0], [256, 0]], block_bases=[], shape=[512, 64]))
VT_WIDE_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                                   rank=2))


@gluon.jit
def _transpose_v(kn, vt, valid, MASKED: gl.constexpr):
    """The tile's V (keys x 512 dims, fp8) into ``vt`` as dims x key slots, slots contiguous
    (4 warps); ``MASKED``: rows >= valid as zeros (a split's last tile: the cache holds NaN
    past a request's length; this reader must not write the ring slot). The two layouts share
    lanes and warps, so the conversion is byte permutes in each thread's registers."""
    v = kn.load(_V_LOAD_WIDE).to(gl.int8, bitcast=True)
    if MASKED:
        keys = gl.arange(0, kn.shape[0], layout=gl.SliceLayout(1, _V_LOAD_WIDE))
        v = gl.where(gl.expand_dims(keys < valid, 1), v, gl.zeros_like(v))
    v = _key_slots(v)
    vt.store(gl.convert_layout(gl.permute(v, (1, 0)), _VT_STORE_WIDE).to(vt.dtype,
                                                                         bitcast=True))


@gluon.jit
def _key_slots(x):
    """[keys, n] -> [slots, n]: key k to slot 16 (k % 4) + k // 4, a relabeling of which
    element each thread holds (no data moves)."""
    BN: gl.constexpr = x.shape[0]
    x = gl.reshape(x, [BN // 4, 4, x.shape[1]])
    return gl.reshape(gl.permute(x, (1, 0, 2)), [BN, x.shape[2]])


@gluon.jit
def _transpose_into(kn, vts, j, valid, MASKED: gl.constexpr):
    """Tile j % 2's V^T into its half of the key slots of ``vts`` ([dims, 2 tiles' keys])."""
    BN: gl.constexpr = kn.shape[0]
    if j == 0:
        _transpose_v(kn, vts.slice(0, BN, dim=1), valid, MASKED)
    else:
        _transpose_v(kn, vts.slice(BN, BN, dim=1), valid, MASKED)


@gluon.jit
def _o_step(vts, j, p_t, acc, s_next):
    """O^T += V^T P^T with tile j % 2's half of V^T, then the wait for it and the next tile's
    S^T: (S^T, O^T). (Inside the branch on j: an async product's accumulator cannot leave
    one.)"""
    BN: gl.constexpr = p_t.shape[0]
    if j == 0:
        acc = warpgroup_mma(vts.slice(0, BN, dim=1), p_t, acc, is_async=True)
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc))
    else:
        acc = warpgroup_mma(vts.slice(BN, BN, dim=1), p_t, acc, is_async=True)
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc))
    return s, acc


# The partitions ---------------------------------------------------------------------------

MAXNREG = 168  # 12 warps: the two worker partitions rise to theirs, the loader gets the rest
WS_MMA_REGS = gl.constexpr(240)
WS_TRANSPOSE_REGS = gl.constexpr(232)


@gluon.jit
def _ws_loader(descs, q_bufs, ring, bars, tables, q_row, start, n_tiles, PAGE: gl.constexpr):
    """Q once, then each tile into its ring slot once both readers have released it
    (``tables``: the request's block-table row and last page, ``issue_kv``)."""
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
                 tables[0], start + t * BN, tables[1], t < n_tiles, PAGE)


@gluon.jit
def _ws_transposer(ring, vts, bars, start, end, n_tiles):
    """Each tile's V^T into its half of the V^T buffer (stale rows as zeros in a split's last
    tile), handed to the MMA warpgroup; the ring slot released for this reader."""
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
            _transpose_into(k_nope.index(slot), vts, j, valid, True)
        else:
            _transpose_into(k_nope.index(slot), vts, j, valid, False)
        fence_async_shared()  # V^T (generic-proxy writes) is read by wgmma
        gl.thread_barrier()  # the partition's four warps are done with V^T and the slot
        mbarrier.arrive(vt_ready.index(j))
        mbarrier.arrive(k_empty.index(slot))


@gluon.jit
def _issue_s(k_nope, k_rope, q8_nope, q8_rope, s_layout: gl.constexpr):
    """S^T = K Q8^T over the tile in one ring slot, both e4m3 terms of q at once (one group
    of wgmmas a part, of N 2 BR, each term in its own columns: ``_fold``), issued, not waited
    on."""
    BN: gl.constexpr = k_nope.shape[0]
    SN: gl.constexpr = q8_nope.shape[1]
    s = gl.zeros([BN, SN], gl.float32, layout=s_layout)
    s = warpgroup_mma(k_nope, q8_nope.index(0).permute((1, 0)), s, use_acc=False,
                      is_async=True)
    return warpgroup_mma(k_rope, q8_rope.index(0).permute((1, 0)), s, is_async=True)


@gluon.jit
def _fold(s, BR: gl.constexpr, layout: gl.constexpr):
    """S^T [keys, BR] from the accumulator [keys, 2 BR]: its two column halves (q's two terms)
    added. A thread holds columns c and c + BR alike (the wgmma accumulator's columns 8i + 2
    (lane % 4) + {0, 1}, i a register's bits), so the sum stays in registers."""
    hi, lo = gl.split(gl.permute(gl.reshape(s, [s.shape[0], 2, BR]), (0, 2, 1)))
    return gl.convert_layout(hi + lo, layout)


@constexpr_function
def _mma_layout(cols):
    """The wgmma accumulator layout of a [64, cols] (S^T) or [512, cols] (O^T) product."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, cols, 32])


@gluon.jit
def _ws_mma(q_bufs, q8_bufs, ring, vts, p_buf, bars, ptrs, counter_ptr, ints, seq_len, start,
            end, n_tiles, qk, kv_scale, CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
            MERGE: gl.constexpr):
    """q quantized, then per tile S^T (fp8), the softmax, O^T += V^T P^T (fp8); the epilogue.
    P's row sums are kept per element ([keys, rows], rescaled like O^T) and summed over the
    keys once at the end, so a tile's softmax crosses the warps once (for its max). Tile t+1's
    S^T is issued before tile t's softmax and runs beside it and beside tile t's O^T product;
    the warpgroup waits for both at the tile's end (an accumulator in flight across the
    loop's back edge would make ptxas serialize the wgmmas)."""
    k_nope, k_rope = ring
    q_bar, ready, k_empty, vt_ready, vt_empty = bars
    rb, qlen, heads = ints[0], ints[4], ints[5]
    S: gl.constexpr = k_nope.shape[0]
    BN: gl.constexpr = k_nope.shape[1]
    DN: gl.constexpr = k_nope.shape[2]
    BR: gl.constexpr = q_bufs[0].shape[0]
    o_layout: gl.constexpr = _mma_layout(BR)
    s_layout: gl.constexpr = o_layout  # S^T's (and the softmax's): the same for N = BR
    SN: gl.constexpr = q8_bufs[0].shape[1]  # S^T's accumulator columns: 2 BR (two terms)
    acc_s_layout: gl.constexpr = _mma_layout(SN)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    last_pos = last_keys(rb, seq_len, qlen, heads, BR, col_s, CAUSAL)
    keys = gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BR], float("-inf"), gl.float32, layout=col_s)
    l_acc = gl.zeros([BN, BR], gl.float32, layout=s_layout)  # P's sums, per key slot
    acc = gl.zeros([DN, BR], gl.float32, layout=o_layout)
    # each warp's max over its keys, a row per warp
    warp_maxes = gl.allocate_shared_memory(gl.float32, [4, BR], gl.SwizzledSharedLayout(
        1, 1, 1, [1, 0]))
    mbarrier.wait(q_bar, 0)
    qk_vec = _quantize_q(q_bufs, q8_bufs, col_s, 4) * qk
    mask_from = first_masked_key(end, last_pos)
    s = gl.zeros([BN, SN], gl.float32, layout=acc_s_layout)
    if n_tiles > 0:  # (a split past its request's length has no tiles)
        mbarrier.wait(ready.index(0), 0)
        s = _issue_s(k_nope.index(0), k_rope.index(0), *q8_bufs, acc_s_layout)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        gl.thread_barrier()  # every warp is past the wait (one thread arrives)
        mbarrier.arrive(k_empty.index(0))
    for t in range(n_tiles):
        j = t % 2
        nxt = (t + 1) % S
        more = t + 1 < n_tiles
        if more:
            mbarrier.wait(ready.index(nxt), ((t + 1) // S) & 1)
        # The next tile's S^T runs beside this tile's softmax (after the last tile: a
        # product of the slot's old bytes, never read, so the issue count stays fixed).
        s_next = _issue_s(k_nope.index(nxt), k_rope.index(nxt), *q8_bufs, acc_s_layout)
        p, m_i, alpha = slim_step_across_warps(_fold(s, BR, s_layout), qk_vec, start + t * BN,
                                               end, last_pos, keys, m_i, warp_maxes, mask_from)
        l_acc = l_acc * gl.expand_dims(alpha, 0) + p
        p8 = _key_slots((p * (2.0 ** P_SHIFT)).to(p_buf.dtype))  # P^T's rows in V^T's slots
        p_buf.store(gl.permute(p8, (1, 0)))
        fence_async_shared()
        gl.thread_barrier()  # every warp's P^T is in
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, o_layout)), 0)
        mbarrier.wait(vt_ready.index(j), (t // 2) & 1)
        s, acc = _o_step(vts, j, p_buf.permute((1, 0)), acc, s_next)
        gl.thread_barrier()  # every warp is past both: P^T and V^T free
        mbarrier.arrive(vt_empty.index(j))
        if more:
            mbarrier.arrive(k_empty.index(nxt))
    l_i = gl.sum(l_acc, axis=0)
    base._epilogue(acc, m_i, l_i, kv_scale * (2.0 ** -P_SHIFT), ptrs, ints, o_layout, DIRECT, 4)
    if MERGE:
        base._merge_if_last(ptrs, counter_ptr, ints, BR, DN, 4)


@gluon.jit(do_not_specialize=["num_splits", "qlen", "heads"])
def transposed_fp8_kernel(qn_desc, qr_desc, kn_desc, kr_desc,  # TMA: q's and the cache's parts
                          bt_ptr, seq_lens_ptr, kv_scale_ptr, out_ptr, lse_ptr,
                          part_out_ptr, part_lse_ptr, counter_ptr,
                          num_splits, qlen, heads, qk_scale,
                          stride_bt, stride_o_tok, stride_o_head, stride_lse_tok,
                          stride_po_slot, stride_po_row, stride_pl_slot,
                          kv_ptr, stride_kv,  # the cache's rows (read by TMA alone here)
                          CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr,
                          STAGES: gl.constexpr, MERGE: gl.constexpr, PDL: gl.constexpr,
                          num_warps: gl.constexpr):
    BN: gl.constexpr = TILE_KEYS
    DN: gl.constexpr = kn_desc.block_type.shape[1]
    DR: gl.constexpr = kr_desc.block_type.shape[1]
    BR: gl.constexpr = qn_desc.block_type.shape[0]
    fp8: gl.constexpr = kn_desc.dtype
    rb, split, b, seq_len, start, end, n_tiles = program_keys(
        seq_lens_ptr, num_splits, qlen, heads, BR, BN, CAUSAL, PDL)
    q_bufs, q8_bufs = _q_buffers(qn_desc, qr_desc, fp8)
    k_nope = gl.allocate_shared_memory(fp8, [STAGES, BN, DN], kn_desc.layout)
    k_rope = gl.allocate_shared_memory(fp8, [STAGES, BN, DR], kr_desc.layout)
    vts = gl.allocate_shared_memory(fp8, [DN, 2 * BN], VT_WIDE_LAYOUT)
    p_buf = gl.allocate_shared_memory(fp8, [BR, BN],
                                      gl.NVMMASharedLayout.get_default_for([BR, BN], fp8))
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    vt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    vt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
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
        (_ws_loader, ((qn_desc, qr_desc, kn_desc, kr_desc), q_bufs, ring,
                      (q_bar, ready, k_empty), (bt_row, (seq_len - 1) // PAGE),
                      b * qlen * heads + rb * BR, start, n_tiles, PAGE)),
        (_ws_mma, (q_bufs, q8_bufs, ring, vts, p_buf, (q_bar, ready, k_empty, vt_ready, vt_empty),
                   ptrs, counter_ptr, ints, seq_len, start, end, n_tiles,
                   qk_scale * kv_scale, kv_scale, CAUSAL, DIRECT, MERGE)),
        (_ws_transposer, (ring, vts, (ready, k_empty, vt_ready, vt_empty), start, end,
                          n_tiles)),
    ], [4, 4], [WS_MMA_REGS, WS_TRANSPOSE_REGS])


def ring_stages(rows: int) -> int:
    """Ring depth beside Q (16-bit, and its two e4m3 terms), V^T and P^T: 3 at 16 rows, 2 at
    32 (214 and 216 KB of shared memory)."""
    return 3 if rows <= 16 else 2


# Host side -------------------------------------------------------------------------------

def decode_launcher(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                    kv_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, num_splits: int | None = None,
                    max_seq_len: int | None = None
                    ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """``gluon_transposed.decode_launcher`` for this kernel: an fp8 e4m3 cache only, a
    positive ``sm_scale`` (folded into the exponent); ``num_splits`` None: ``pick_splits``
    with ``FP8_MMA_PROGRAM_COST``."""
    if kv_cache.dtype not in base.FP8_CACHES:
        raise ValueError(f"the fp8-MMA transposed decode reads an fp8 cache only, got "
                         f"{kv_cache.dtype}")
    if not sm_scale > 0:  # the max is taken of the unscaled scores
        raise ValueError(f"the fp8-MMA decode folds the softmax scale into the exponent: "
                         f"sm_scale > 0 only, got {sm_scale}")
    batch, heads = seq_lens.shape[0], q.shape[1]
    base._check_call(q, out, lse, batch * qlen, num_splits)
    why = base.check_supported(q, kv_cache, block_table, seq_lens, kv_scale, fp8_mma=True)
    if why is not None:
        raise ValueError(f"gluon transposed MLA decode (fp8 MMAs): {why}")
    rows = plan.transposed_rows(qlen * heads)
    page = kv_cache.shape[1]
    meta = dict(CAUSAL=causal and qlen > 1, PAGE=page, STAGES=ring_stages(rows),
                **compile_options(base.NUM_WARPS, MAXNREG))
    descs = tma_descriptors(q, kv_cache, rows, kv_box_rows(page))
    return base.launch(transposed_fp8_kernel, descs, q, kv_cache, block_table, seq_lens,
                       kv_scale, out, lse, qlen=qlen, sm_scale=sm_scale, num_splits=num_splits,
                       max_seq_len=max_seq_len, meta=meta,
                       per_program=plan.FP8_MMA_PROGRAM_COST)


def aot_compile(dtype: str = "bf16", *, rows: int = 16, direct: bool = True,
                causal: bool = True, merge: bool = True, page: int = 64, arch: int = 90):
    """Compile ``transposed_fp8_kernel`` (a ``dtype`` q over an fp8 cache of ``page``-token
    pages) for ``sm_<arch>`` without a GPU (split builds as ``gluon_transposed.aot_compile``);
    returns triton's CompiledKernel."""
    br = plan.transposed_rows(rows)
    constants = dict(CAUSAL=causal, DIRECT=direct, PAGE=page, STAGES=ring_stages(br),
                     **base.split_constants(direct, merge), num_warps=base.NUM_WARPS)
    return aot_compile_kernel(transposed_fp8_kernel, constants,
                              base._blocks(dtype, "fp8", br, kv_box_rows(page)),
                              base._pointers(dtype, "fp8"),
                              arch=arch, num_warps=base.NUM_WARPS, maxnreg=MAXNREG)
