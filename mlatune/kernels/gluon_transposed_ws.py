"""The transposed Gluon decode over an fp8 cache, its MMAs in q's 16-bit dtype: the "mma16"
form of ``transposed/gluon`` over an fp8 e4m3 cache. Its history: docs/kernels/gluon_transposed.md.

Each tile lands as fp8 (half the bytes of a 16-bit cache) and is widened to q's dtype in
shared memory, exactly (every e4m3 value is a bf16 and an fp16 value), in a partition of its
own, so the widening of one tile overlaps the MMAs of the one before. Three partitions:
- loader (the default partition, 4 warps, one thread issues): Q once, then each 64-key tile
  as two halves of 32 keys, each half into its own fp8 slot (``f_ready[h]``) once the
  converter has released it (``f_empty[h]``); at page 1 every thread gathers its part of a
  half by cp.async (``_gather_half``);
- converter (4 warps): widens half h of tile t into rows 32h..32h+31 of the 16-bit ring
  slot t % 2 (``_widen_tile``, stale V rows zeroed), releases the fp8 half at once, and
  when both halves are in, hands the slot to the MMA warpgroup (``w_ready[t % 2]``) after
  waiting for it to be free (``w_empty[t % 2]``);
- MMA warpgroup (4 warps): ``gluon_transposed``'s tile (S^T, softmax over keys, O^T) on the
  16-bit slot, which it releases when its MMAs are done; then its epilogue and merge.
The cache's per-tensor scale multiplies S (folded into the softmax scale) and O. Every
barrier has one arrival a phase, but ``f_ready`` at page 1: one a loader thread. Same
tensors, out and LSE as ``gluon_transposed.decode_launcher``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from mlatune.kernels import gluon_hopper_plan as plan
from mlatune.kernels import gluon_transposed as base
from mlatune.kernels.gluon_common import (
    GATHERED,
    TILE_KEYS,
    aot_compile_kernel,
    compile_options,
    copy_rows,
    gather_into,
    gather_pages,
    gather_rows,
    last_keys,
    program_keys,
    tile_rows,
    tma_descriptors,
)
from mlatune.kernels.gluon_hopper_plan import kv_box_rows

HALF = 32  # keys per fp8 half tile
MAXNREG = 168  # 12 warps: the two worker partitions rise to theirs, the loader gets the rest
MMA_REGS = gl.constexpr(240)
CONVERT_REGS = gl.constexpr(232)
WIDEN_COLS = 256  # fp8 columns widened a step (whole 64-column atoms)

__all__ = ["aot_compile", "decode_launcher", "transposed_ws_kernel"]


# e4m3 -> 16-bit by bit moves (integer pipes, not the few conversion units that
# cvt uses): the byte's 7 magnitude bits placed under the 16-bit format's exponent field
# give value * 2^-120 (bf16) or value * 2^-8 (fp16) exactly, subnormals included; one
# multiply by the power of two (exact) restores it. NaN (0x7f) becomes 480: only stale
# slots hold it, and those are masked or zeroed. prmt spreads bytes b0, b1 into the
# high bytes of two 16-bit halves ([b1 00 b0 00]; b2, b3 likewise).
_WIDEN_ASM = """{{
.reg .b32 y, m, c;
mov.b32 c, {one};
prmt.b32 y, $2, 0, 0x1404;
shr.b32 m, y, {shift};
and.b32 m, m, {mask};
and.b32 y, y, 0x80008000;
or.b32 y, y, m;
mul.rn.{ty}x2 $0, y, c;
prmt.b32 y, $2, 0, 0x3424;
shr.b32 m, y, {shift};
and.b32 m, m, {mask};
and.b32 y, y, 0x80008000;
or.b32 y, y, m;
mul.rn.{ty}x2 $1, y, c;
}}"""
_WIDEN_BF16 = gl.constexpr(_WIDEN_ASM.format(ty="bf16", shift=4, mask="0x07f007f0",
                                             one="0x7b807b80"))  # 2^120 in bf16
_WIDEN_F16 = gl.constexpr(_WIDEN_ASM.format(ty="f16", shift=1, mask="0x3f803f80",
                                            one="0x5c005c00"))  # 2^8 in fp16


@gluon.jit
def _widen(x, dtype: gl.constexpr):
    """e4m3 values (any layout) as ``dtype`` (bf16 or fp16), exactly."""
    bits = x.to(gl.int8, bitcast=True)
    if dtype == gl.bfloat16:
        y = gl.inline_asm_elementwise(_WIDEN_BF16, "=r,=r,r", [bits], dtype=gl.bfloat16,
                                      is_pure=True, pack=4)
    else:
        y = gl.inline_asm_elementwise(_WIDEN_F16, "=r,=r,r", [bits], dtype=gl.float16,
                                      is_pure=True, pack=4)
    return y


@gluon.jit
def _widen_tile(kn8, kr8, kn16, kr16, valid, COLS: gl.constexpr, num_warps: gl.constexpr):
    """Copy a tile's fp8 K (nope and rope) into the 16-bit buffers, rows >= valid of the
    nope part (V) as zeros (a real cache holds NaN there), COLS columns at a time: every
    load of a chunk is issued before its stores, which the compiler cannot move past."""
    N: gl.constexpr = kn8.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
    rows = gl.arange(0, N, layout=gl.SliceLayout(1, layout))
    keep = gl.expand_dims(rows < valid, 1)
    r = _widen(kr8.load(layout), kr16.dtype)
    for c in gl.static_range(kn8.shape[1] // COLS):
        x = _widen(kn8.slice(c * COLS, COLS, dim=1).load(layout), kn16.dtype)
        kn16.slice(c * COLS, COLS, dim=1).store(gl.where(keep, x, gl.zeros_like(x)))
    kr16.store(r)
    fence_async_shared()  # generic-proxy writes read by wgmma (async proxy)
    gl.thread_barrier()


@gluon.jit
def _loader(descs, q_bufs, f_bufs, bars, src, q_row, start, n_tiles, PAGE: gl.constexpr):
    """Q once, then every tile as two 32-key halves, each into its own fp8 slot, a TMA box a
    page or a half (``tile_rows``), or at page 1 by cp.async (``_gather_half``). ``src``: the
    request's block-table row and last page; at page 1 also the split's end, the cache's
    pointer and row stride."""
    qn_desc, qr_desc, kn_desc, kr_desc = descs
    q_nope, q_rope = q_bufs
    f_nope, f_rope = f_bufs
    q_bar, f_ready, f_empty = bars
    H: gl.constexpr = f_nope.shape[1]
    R: gl.constexpr = kn_desc.block_type.shape[0]
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, q_nope)
    tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, q_rope)
    for t in range(n_tiles):
        if PAGE == GATHERED:
            for h in gl.static_range(2):
                _gather_half(f_nope.index(h), f_rope.index(h), f_ready.index(h),
                             f_empty.index(h), (t & 1) ^ 1, src, start + t * 2 * H + h * H)
        else:
            rows = tile_rows(src[0], start + t * 2 * H, src[1], True, R, 2 * H, PAGE)
            for h in gl.static_range(2):
                # A fresh barrier counts as phase 1 complete: the first wait on each half
                # passes.
                mbarrier.wait(f_empty.index(h), (t & 1) ^ 1)
                fence_async_shared()  # the converter read the half through the generic proxy
                bar = f_ready.index(h)
                mbarrier.expect(bar, (kn_desc.block_type.nbytes + kr_desc.block_type.nbytes)
                                * (H // R))
                half = rows[h * (H // R):(h + 1) * (H // R)]
                copy_rows(kn_desc, f_nope.index(h), bar, half, 0, True)
                copy_rows(kr_desc, f_rope.index(h), bar, half, 0, True)
        gl.thread_barrier()  # the partition's warps keep to one tile (no phase run ahead)


@gluon.jit
def _gather_half(kn, kr, ready, empty, phase, src, key):
    """The 32 page-1 keys from local key ``key`` into an fp8 slot (nope, rope) by every loader
    thread's cp.async, 16 bytes (16 values) a copy, in the layout a TMA box writes (the
    converter reads either alike): pages read only for keys before the split's end, zeros
    past it (``gather_into``); each thread then arrives on ``ready`` (count: the loader's
    threads) once its copies have landed. The converter reads the slot through the generic
    proxy, as the copies write it: no proxy fence either way."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    pages = gather_pages(src[0], key, src[2], kn.shape[0], layout)
    # A fresh barrier counts as phase 1 complete: the first wait on each half passes.
    mbarrier.wait(empty, phase)
    rows, ok = gather_rows(pages, src[3], src[4])
    gather_into(kn, rows, ok, 0)
    gather_into(kr, rows, ok, kn.shape[1])
    async_copy.mbarrier_arrive(ready, increment_count=False)


@gluon.jit
def _converter(f_bufs, w_bufs, bars, start, end, n_tiles, WIDEN_COLS: gl.constexpr):
    """Widen each tile's halves into the 16-bit ring; hand the slot over when whole."""
    f_nope, f_rope = f_bufs
    w_nope, w_rope = w_bufs
    f_ready, f_empty, w_ready, w_empty = bars
    H: gl.constexpr = f_nope.shape[1]
    for t in range(n_tiles):
        slot = t % 2
        mbarrier.wait(w_empty.index(slot), ((t // 2) & 1) ^ 1)
        valid = end - (start + t * 2 * H)
        for h in gl.static_range(2):
            mbarrier.wait(f_ready.index(h), t & 1)
            _widen_tile(f_nope.index(h), f_rope.index(h),
                             w_nope.index(slot).slice(h * H, H, dim=0),
                             w_rope.index(slot).slice(h * H, H, dim=0), valid - h * H,
                             WIDEN_COLS, 4)
            mbarrier.arrive(f_empty.index(h))  # _widen_tile ended on a thread barrier
        mbarrier.arrive(w_ready.index(slot))


@gluon.jit
def _mma(q_bufs, w_bufs, p_buf, bars, ptrs, counter_ptr, ints, seq_len, start, end, n_tiles, qk,
         kv_scale, CAUSAL: gl.constexpr, DIRECT: gl.constexpr, MERGE: gl.constexpr):
    """``gluon_transposed``'s walk over the widened tiles, then its epilogue and merge."""
    q_nope, q_rope = q_bufs
    w_nope, w_rope = w_bufs
    q_bar, w_ready, w_empty = bars
    rb, qlen, heads = ints[0], ints[4], ints[5]
    BR: gl.constexpr = q_nope.shape[0]
    BN: gl.constexpr = w_nope.shape[1]
    DN: gl.constexpr = w_nope.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BR, 16])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    last_pos = last_keys(rb, seq_len, qlen, heads, BR, col_s, CAUSAL)
    keys = gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BR], float("-inf"), gl.float32, layout=col_s)
    l_i = gl.full([BR], 0.0, gl.float32, layout=col_s)
    acc = gl.zeros([DN, BR], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    for t in range(n_tiles):
        slot = t % 2
        mbarrier.wait(w_ready.index(slot), (t // 2) & 1)
        acc, m_i, l_i = base._tile(q_nope, q_rope, w_nope.index(slot), w_rope.index(slot), p_buf,
                                   start + t * BN, end, last_pos, keys, qk, m_i, l_i, acc,
                                   s_layout, s_layout)
        mbarrier.arrive(w_empty.index(slot))  # _tile waited for its MMAs, then a barrier
    base._epilogue(acc, m_i, l_i, kv_scale, ptrs, ints, s_layout, DIRECT, 4)
    if MERGE:
        base._merge_if_last(ptrs, counter_ptr, ints, BR, DN, 4)


@gluon.jit(do_not_specialize=["num_splits", "qlen", "heads"])
def transposed_ws_kernel(qn_desc, qr_desc, kn_desc, kr_desc,  # kn/kr: 32-key fp8 halves
                         bt_ptr, seq_lens_ptr, kv_scale_ptr, out_ptr, lse_ptr,
                         part_out_ptr, part_lse_ptr, counter_ptr,
                         num_splits, qlen, heads, qk_scale,
                         stride_bt, stride_o_tok, stride_o_head, stride_lse_tok,
                         stride_po_slot, stride_po_row, stride_pl_slot,
                         kv_ptr, stride_kv,  # the cache's rows, where page-1 keys are gathered
                         CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr,
                         WIDEN_COLS: gl.constexpr, MERGE: gl.constexpr,
                         PDL: gl.constexpr, num_warps: gl.constexpr):
    BR: gl.constexpr = qn_desc.block_type.shape[0]
    H: gl.constexpr = TILE_KEYS // 2
    DN: gl.constexpr = kn_desc.block_type.shape[1]
    DR: gl.constexpr = kr_desc.block_type.shape[1]
    dtype: gl.constexpr = qn_desc.dtype
    rb, split, b, seq_len, start, end, n_tiles = program_keys(
        seq_lens_ptr, num_splits, qlen, heads, BR, 2 * H, CAUSAL, PDL)

    q_nope = gl.allocate_shared_memory(dtype, [BR, DN], qn_desc.layout)
    q_rope = gl.allocate_shared_memory(dtype, [BR, DR], qr_desc.layout)
    f_nope = gl.allocate_shared_memory(kn_desc.dtype, [2, H, DN], kn_desc.layout)
    f_rope = gl.allocate_shared_memory(kr_desc.dtype, [2, H, DR], kr_desc.layout)
    wide: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * H, 64], dtype)
    w_nope = gl.allocate_shared_memory(dtype, [2, 2 * H, DN], wide)
    w_rope = gl.allocate_shared_memory(dtype, [2, 2 * H, DR], wide)
    p_buf = gl.allocate_shared_memory(dtype, [BR, 2 * H],
                                      gl.NVMMASharedLayout.get_default_for([BR, 2 * H], dtype))
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    f_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    f_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    w_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        # TMA: one expecting arrival; page 1: each loader thread's (``_gather_half``)
        mbarrier.init(f_ready.index(i), count=32 * num_warps if PAGE == GATHERED else 1)
        mbarrier.init(f_empty.index(i), count=1)
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)
    fence_async_shared()

    kv_scale = gl.load(kv_scale_ptr)
    q_bufs = (q_nope, q_rope)
    f_bufs = (f_nope, f_rope)
    w_bufs = (w_nope, w_rope)
    ints = (rb, b, split, num_splits, qlen, heads, stride_o_tok, stride_o_head, stride_lse_tok,
            stride_po_slot, stride_po_row, stride_pl_slot)
    ptrs = (out_ptr, lse_ptr, part_out_ptr, part_lse_ptr)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    if PAGE == GATHERED:
        src = (bt_row, (seq_len - 1) // PAGE, end, kv_ptr, stride_kv)
    else:
        src = (bt_row, (seq_len - 1) // PAGE)
    gl.warp_specialize([
        (_loader, ((qn_desc, qr_desc, kn_desc, kr_desc), q_bufs, f_bufs,
                   (q_bar, f_ready, f_empty), src,
                   b * qlen * heads + rb * BR, start, n_tiles, PAGE)),
        (_mma, (q_bufs, w_bufs, p_buf, (q_bar, w_ready, w_empty), ptrs, counter_ptr, ints,
                seq_len, start, end, n_tiles, qk_scale * kv_scale, kv_scale, CAUSAL, DIRECT,
                MERGE)),
        (_converter, (f_bufs, w_bufs, (f_ready, f_empty, w_ready, w_empty), start, end,
                      n_tiles, WIDEN_COLS)),
    ], [4, 4], [MMA_REGS, CONVERT_REGS])


# Host side -------------------------------------------------------------------------------

def decode_launcher(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                    kv_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, num_splits: int | None = None,
                    max_seq_len: int | None = None
                    ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """``gluon_transposed.decode_launcher`` for this kernel (an fp8 e4m3 cache only)."""
    if kv_cache.dtype not in base.FP8_CACHES:
        raise ValueError(f"the warp-specialized transposed decode reads an fp8 cache only, "
                         f"got {kv_cache.dtype}")
    batch, heads = seq_lens.shape[0], q.shape[1]
    base._check_call(q, out, lse, batch * qlen, num_splits)
    why = base.check_supported(q, kv_cache, block_table, seq_lens, kv_scale)
    if why is not None:
        raise ValueError(f"gluon transposed MLA decode (warp-specialized): {why}")
    page = kv_cache.shape[1]
    meta = dict(CAUSAL=causal and qlen > 1, PAGE=page, WIDEN_COLS=WIDEN_COLS,
                **compile_options(4, MAXNREG))
    descs = tma_descriptors(q, kv_cache, plan.transposed_rows(qlen * heads),
                            kv_box_rows(page, HALF))
    return base.launch(transposed_ws_kernel, descs, q, kv_cache, block_table, seq_lens,
                       kv_scale, out, lse, qlen=qlen, sm_scale=sm_scale, num_splits=num_splits,
                       max_seq_len=max_seq_len, meta=meta)


def aot_compile(dtype: str = "bf16", *, rows: int = 16, direct: bool = True,
                causal: bool = True, merge: bool = True, page: int = 64, arch: int = 90):
    """Compile ``transposed_ws_kernel`` (an fp8 cache of ``page``-token pages under MMAs of
    ``dtype``) for ``sm_<arch>`` without a GPU (split builds as
    ``gluon_transposed.aot_compile``); returns triton's CompiledKernel."""
    constants = dict(CAUSAL=causal, DIRECT=direct, PAGE=page, WIDEN_COLS=WIDEN_COLS,
                     **base.split_constants(direct, merge), num_warps=4)
    return aot_compile_kernel(transposed_ws_kernel, constants,
                              base._blocks(dtype, "fp8", plan.transposed_rows(rows),
                                           kv_box_rows(page, HALF)),
                              base._pointers(dtype, "fp8"), arch=arch, num_warps=4, maxnreg=MAXNREG)
