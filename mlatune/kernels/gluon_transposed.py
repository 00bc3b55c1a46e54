"""A transposed MLA decode for Hopper (sm_90) in Triton's Gluon dialect: keys are the
MMA's M, query rows its N. Built for few query rows (heads x qlen up to 32 per program);
more rows run as more programs, each reading the keys again.

Why: ``gluon_hopper`` and ``gluon_seesaw`` put the query rows on the warpgroup MMA's M,
which is 64 rows wide whatever the problem has: at 16 heads x 1 token three quarters of
every product is padding, and at (128, 16, 8192, 1) those padded products alone take about
as long as reading the cache (146 GFLOP at the H200's ~790 TFLOP/s: 185 us against 276 us
of bytes). Computed transposed, S^T = K Q^T has the tile's 64 keys as M and the query rows
as N (wgmma takes N in steps of 8), and O^T = V^T P^T has the 512 latent dims as M and the
rows as N: no padding, and the kernel is left to the bytes it reads.

Per program: BR query rows (16 or 32; heads x qlen folded as ``gluon_hopper``) of one
request and one split of its keys; one warpgroup (4 warps), no warp specialization: the
TMA copies are asynchronous, so a ring of STAGES 64-key tiles (one page each) keeps the
next tile in flight while this one is computed.
- S^T = K Q^T: A = the tile's K (smem, K-major), B = Q^T (Q's [BR, 576] rows in smem:
  K-major), 36 k-steps of m64nBRk16.
- Softmax over the keys (axis 0 of S^T), base 2, online max and sum per query row.
- O^T += V^T P^T: A = V^T, the tile's first 512 dims read MN-major (allowed for 16-bit
  operands), B = P^T, written to shared memory as [BR, 64] (K-major).
- fp8 caches (FP8): the tile lands as fp8 (half the bytes) and is widened to bf16/fp16
  in shared memory (exact: e4m3 values are bf16 and fp16 values) before the 16-bit MMAs,
  stale rows zeroed in the same pass; the cache's per-tensor scale multiplies S (folded
  into the softmax scale) and O (in the epilogue). q stays 16-bit: nothing is quantized
  beyond the cache the engine holds. The route's widening fp8 param sets run
  ``gluon_transposed_ws`` instead (the widening in a partition of its own), its fp8_mma
  sets ``gluon_transposed_fp8`` (``routes.gluon_hopper.TRANSPOSED_KERNELS``).
- Stale slots past the split's end in the last page (NaN in a real cache): their V rows
  are zeroed before P V; their S is masked, never multiplied.
- Split-KV, out and LSE as ``gluon_hopper``: one split writes out and the natural-log LSE
  directly; more write fp32 partials, merged (``MERGE``) by the last split of a row block
  to arrive (an acq_rel counter; up to ``MERGE_IN_KERNEL_MAX_SPLITS``) or by
  ``reduce.reduce_launcher``.
Registers: O^T is 512 x BR fp32 over 128 threads (64 or 128 a thread), S^T 64 x BR.
Shared memory: Q (BR x 576 16-bit), the ring (STAGES x 64 x 576 of the cache's dtype),
the widened tile (fp8 only) and P^T: 2 stages hold 164-185 KiB (16-bit cache), 3 stages
of fp8 with the widened tile 200-221 KiB (triton 3.6.0's counts: 168,208-225,816 bytes).
Measured on the H200 (``benchmarks/results/README.md``, session 9, call 7): 0.60x FlashMLA's
time at (1, 16, 4096, 1) and 0.91-0.93x at batch 64-128 with 16 heads (4.33 TB/s at (128,
16, 8192, 1)); 1.17-1.74x the seesaw kernel's (chunked form) at 64-128 heads; over an fp8
cache 1.52x its own bf16 time (the widening is not overlapped).
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
from mlatune.kernels.gluon_common import (
    GL_DTYPES,
    LN2,
    LOG2E,
    aot_compile_kernel,
    compile_options,
    gluon_available,
    issue_kv,
    last_keys,
    no_shift,
    online_softmax,
    outputs_and_splits,
    partials_and_merge,
    program_keys,
    store_row_lse,
    tma_descriptors,
    zero_stale_rows,
)
from mlatune.kernels.gluon_hopper_plan import BLOCK_N, D_NOPE, D_ROPE, PAGE_SIZE

NUM_WARPS = 4  # one warpgroup
FP8_CACHES = (torch.float8_e4m3fn, )
# Split partials: merged by the last split to finish (no second launch) up to this many
# splits, else by the reduce kernel. The last split merges alone, one split after another:
# at 64 splits (1, 16, 4096, 1) took 64.9 us that way against 15.9 with the reduce kernel;
# at 2, (64, 16, 4096, 1) 87.4 against 92.5 (H200, 2026-12-01, session 9 call 5).
MERGE_IN_KERNEL_MAX_SPLITS = 2
MERGE = "auto"
WIDEN_STEPS = (64, 128, 256, 512)  # fp8 columns widened per step: whole 64-column atoms
# 256 columns a step: 0.94x the time of 64 (H200 2026-12-01, gluon_splits.py --widen, call 3)
WIDEN_COLS = 256

__all__ = ["aot_compile", "check_supported", "decode_launcher", "stages_for", "transposed_kernel"]


def stages_for(fp8: bool) -> int:
    """Ring depth that fits shared memory with Q (and, fp8, the widened tile)."""
    return 3 if fp8 else 2


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
def _tile(q_nope, q_rope, kn, kr, p_buf, n0, end, last_pos, keys, qk_scale, m_i, l_i, acc,
          s_layout: gl.constexpr, o_layout: gl.constexpr):
    """One tile: S^T = K Q^T, softmax over its keys, O^T = O^T * alpha + V^T P^T."""
    BN: gl.constexpr = kn.shape[0]
    BR: gl.constexpr = q_nope.shape[0]
    s = gl.zeros([BN, BR], gl.float32, layout=s_layout)
    s = warpgroup_mma(kn, q_nope.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(kr, q_rope.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    p, m_i, l_i, alpha = online_softmax(s * qk_scale, n0, end, last_pos, keys, m_i, l_i, 0)
    p_buf.store(gl.permute(p.to(p_buf.dtype), (1, 0)))
    fence_async_shared()  # P^T is read by wgmma (async proxy)
    gl.thread_barrier()
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, o_layout)), 0)
    acc = warpgroup_mma(kn.permute((1, 0)), p_buf.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    gl.thread_barrier()  # every warp's MMAs are done with the slot and P^T: refill them
    return acc, m_i, l_i


@gluon.jit
def _epilogue(acc, m_i, l_i, v_scale, ptrs, ints, o_layout: gl.constexpr,
              DIRECT: gl.constexpr, num_warps: gl.constexpr):
    """O^T's rows of the request (normalized, times the cache's V scale) and their LSE:
    into out and lse (natural log) when direct, else into the split's fp32 partials (base
    2, as ``reduce`` and ``_merge_if_last`` read)."""
    if DIRECT:
        out_ptr, lse_ptr = ptrs[:2]
    else:
        out_ptr, lse_ptr = ptrs[2:4]
    rb, b, split, num_splits, qlen, heads = ints[:6]
    stride_o_tok, stride_o_head, stride_lse_tok, stride_po_slot, stride_po_row, \
        stride_pl_slot = ints[6:]
    DN: gl.constexpr = acc.shape[0]
    BR: gl.constexpr = acc.shape[1]
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    l_o = gl.convert_layout(l_i, col_o)
    has_keys = l_o > 0.0
    inv = gl.where(has_keys, v_scale / gl.where(has_keys, l_o, gl.full_like(l_o, 1.0)),
                   gl.zeros_like(l_o))
    o = acc * gl.expand_dims(inv, 0)
    r = rb * BR + gl.arange(0, BR, layout=col_o)
    r_ok = r < qlen * heads
    if DIRECT:
        row_off = (b * qlen + r // heads).to(gl.int64) * stride_o_tok + (r % heads) * stride_o_head
    else:
        row_off = (b * num_splits + split).to(gl.int64) * stride_po_slot + r * stride_po_row
    d = gl.arange(0, DN, layout=gl.SliceLayout(1, o_layout))
    gl.store(out_ptr + gl.expand_dims(row_off, 0) + gl.expand_dims(d, 1),
             o.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(r_ok, 0))
    store_row_lse(m_i, l_i, lse_ptr, ints[:6], stride_lse_tok, stride_pl_slot, BR, DIRECT,
                  num_warps)


@gluon.jit
def _merge_if_last(ptrs, counter_ptr, ints, BR: gl.constexpr, DN: gl.constexpr,
                   num_warps: gl.constexpr):
    """The last split to finish these rows merges every split's partials into out and lse
    (the split-KV reduce without a second launch), then rezeroes the rows' counter for the
    next launch (a CUDA graph replays it as it left it)."""
    out_ptr, lse_ptr, part_out, part_lse = ptrs
    rb, b, _, num_splits, qlen, heads = ints[:6]
    stride_o_tok, stride_o_head, stride_lse_tok, stride_po_slot, stride_po_row, \
        stride_pl_slot = ints[6:]
    counter = counter_ptr + b * gl.num_programs(0) + rb
    gl.thread_barrier()  # every thread's partial stores precede the release below
    ticket = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
        rows: gl.constexpr = gl.SliceLayout(1, layout)
        r = rb * BR + gl.arange(0, BR, layout=rows)
        r_ok = r < qlen * heads
        first = (b * num_splits).to(gl.int64)
        m = gl.full([BR], float("-inf"), gl.float32, layout=rows)
        for s in range(num_splits):  # partials written on other SMs: read past L1 (.cg)
            lse_s = gl.load(part_lse + (first + s) * stride_pl_slot + r, mask=r_ok,
                            other=float("-inf"), cache_modifier=".cg")
            m = gl.maximum(m, lse_s)
        m_shift = no_shift(m)
        row_off = (b * qlen + r // heads).to(gl.int64) * stride_o_tok + (r % heads) * stride_o_head
        CW: gl.constexpr = 256  # columns merged at a time (registers: 32 rows x 256 fp32)
        for c in gl.static_range(DN // CW):
            d = c * CW + gl.arange(0, CW, layout=gl.SliceLayout(0, layout))
            acc = gl.zeros([BR, CW], gl.float32, layout=layout)
            w_sum = gl.zeros([BR], gl.float32, layout=rows)
            for s in range(num_splits):
                lse_s = gl.load(part_lse + (first + s) * stride_pl_slot + r, mask=r_ok,
                                other=float("-inf"), cache_modifier=".cg")
                w = gl.exp2(lse_s - m_shift)
                o = gl.load(part_out + (first + s) * stride_po_slot
                            + gl.expand_dims(r * stride_po_row, 1) + gl.expand_dims(d, 0),
                            mask=gl.expand_dims(r_ok, 1), other=0.0, cache_modifier=".cg")
                acc += o * gl.expand_dims(w, 1)
                w_sum += w
            has = w_sum > 0.0
            inv = gl.where(has, 1.0 / gl.where(has, w_sum, gl.full_like(w_sum, 1.0)),
                           gl.zeros_like(w_sum))
            gl.store(out_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(d, 0),
                     (acc * gl.expand_dims(inv, 1)).to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(r_ok, 1))
        lse = gl.where(has, (m + gl.log2(gl.where(has, w_sum, gl.full_like(w_sum, 1.0))))
                       * LN2, gl.full_like(w_sum, float("-inf")))
        gl.store(lse_ptr + (b * qlen + r // heads).to(gl.int64) * stride_lse_tok + r % heads,
                 lse, mask=r_ok)
        gl.store(counter, 0)


@gluon.jit
def _start_copies(descs, q_bufs, ring, q_bar, ready, bt_row, q_row, start, n_tiles,
                  PAGE: gl.constexpr):
    """Q's TMA copy and the first tiles' (all the ring's slots but one); returns the
    request's block-table row."""
    qn_desc, qr_desc, kn_desc, kr_desc = descs
    k_nope, k_rope = ring
    STAGES: gl.constexpr = k_nope.shape[0]
    BN: gl.constexpr = k_nope.shape[1]
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, q_bufs[0])
    tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, q_bufs[1])
    for i in gl.static_range(STAGES - 1):
        issue_kv(kn_desc, kr_desc, k_nope.index(i), k_rope.index(i), ready.index(i), bt_row,
                  start + i * BN, i < n_tiles, PAGE)
    return bt_row


@gluon.jit(do_not_specialize=["num_splits", "qlen", "heads"])
def transposed_kernel(qn_desc, qr_desc, kn_desc, kr_desc,  # TMA: q's and the cache's parts
                      bt_ptr, seq_lens_ptr, kv_scale_ptr, out_ptr, lse_ptr,
                      part_out_ptr, part_lse_ptr, counter_ptr,  # split-KV: partials, merge
                      num_splits, qlen, heads, qk_scale,
                      stride_bt, stride_o_tok, stride_o_head, stride_lse_tok,  # direct out
                      stride_po_slot, stride_po_row, stride_pl_slot,  # fp32 partials
                      CAUSAL: gl.constexpr, DIRECT: gl.constexpr, FP8: gl.constexpr,
                      PAGE: gl.constexpr, STAGES: gl.constexpr, WIDEN_COLS: gl.constexpr,
                      MERGE: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
    BR: gl.constexpr = qn_desc.block_type.shape[0]
    BN: gl.constexpr = kn_desc.block_type.shape[0]
    DN: gl.constexpr = kn_desc.block_type.shape[1]
    DR: gl.constexpr = kr_desc.block_type.shape[1]
    dtype: gl.constexpr = qn_desc.dtype
    rb, split, b, seq_len, start, end, n_tiles = program_keys(
        seq_lens_ptr, num_splits, qlen, heads, BR, BN, CAUSAL, PDL)

    q_nope = gl.allocate_shared_memory(dtype, [BR, DN], qn_desc.layout)
    q_rope = gl.allocate_shared_memory(dtype, [BR, DR], qr_desc.layout)
    k_nope = gl.allocate_shared_memory(kn_desc.dtype, [STAGES, BN, DN], kn_desc.layout)
    k_rope = gl.allocate_shared_memory(kr_desc.dtype, [STAGES, BN, DR], kr_desc.layout)
    p_buf = gl.allocate_shared_memory(dtype, [BR, BN],
                                      gl.NVMMASharedLayout.get_default_for([BR, BN], dtype))
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    if FP8:
        wide: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], dtype)
        kn16 = gl.allocate_shared_memory(dtype, [BN, DN], wide)
        kr16 = gl.allocate_shared_memory(dtype, [BN, DR], wide)
    fence_async_shared()

    bt_row = _start_copies((qn_desc, qr_desc, kn_desc, kr_desc), (q_nope, q_rope),
                           (k_nope, k_rope), q_bar, ready, bt_ptr + b.to(gl.int64) * stride_bt,
                           b * qlen * heads + rb * BR, start, n_tiles, PAGE)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BR, 16])
    o_layout: gl.constexpr = s_layout  # O^T: the same BR columns, 512 rows in 8 repeats
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    last_pos = last_keys(rb, seq_len, qlen, heads, BR, col_s, CAUSAL)
    keys = gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
    kv_scale = gl.load(kv_scale_ptr)
    qk = qk_scale * kv_scale
    m_i = gl.full([BR], float("-inf"), gl.float32, layout=col_s)
    l_i = gl.full([BR], 0.0, gl.float32, layout=col_s)
    acc = gl.zeros([DN, BR], gl.float32, layout=o_layout)
    mbarrier.wait(q_bar, 0)
    for i in range(n_tiles):
        # Refill the slot tile i - 1 used (its MMAs are done: ``_tile`` waited for them).
        nxt = i + STAGES - 1
        # The slot was touched through the generic proxy (16-bit: rows zeroed; fp8: read by
        # the widening) before this TMA write (async proxy).
        fence_async_shared()
        issue_kv(kn_desc, kr_desc, k_nope.index(nxt % STAGES), k_rope.index(nxt % STAGES),
                  ready.index(nxt % STAGES), bt_row, start + nxt * BN, nxt < n_tiles, PAGE)
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        n0 = start + i * BN
        if FP8:
            _widen_tile(k_nope.index(slot), k_rope.index(slot), kn16, kr16, end - n0, WIDEN_COLS,
                        num_warps)
            kn = kn16
            kr = kr16
        else:
            kn = k_nope.index(slot)
            kr = k_rope.index(slot)
            if n0 + BN > end:
                zero_stale_rows(kn, end - n0, num_warps)
        acc, m_i, l_i = _tile(q_nope, q_rope, kn, kr, p_buf, n0, end, last_pos, keys, qk,
                              m_i, l_i, acc, s_layout, o_layout)

    ints = (rb, b, split, num_splits, qlen, heads, stride_o_tok, stride_o_head, stride_lse_tok,
            stride_po_slot, stride_po_row, stride_pl_slot)
    ptrs = (out_ptr, lse_ptr, part_out_ptr, part_lse_ptr)
    _epilogue(acc, m_i, l_i, kv_scale, ptrs, ints, o_layout, DIRECT, num_warps)
    if MERGE:
        _merge_if_last(ptrs, counter_ptr, ints, BR, DN, num_warps)


# Host side -------------------------------------------------------------------------------

def check_supported(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, kv_scale: torch.Tensor | None) -> str | None:
    """Why the kernel cannot take these tensors (or this triton), or None when it can."""
    if q.dim() != 3 or kv_cache.dim() != 3 or block_table.dim() != 2 or seq_lens.dim() != 1:
        return ("q (tokens, heads, 576), kv_cache (pages, 64, 576), block_table (batch, pages) "
                "and seq_lens (batch,) expected")
    if q.dtype not in GL_DTYPES:
        return f"q dtype {q.dtype} (bf16 and fp16 only)"
    if kv_cache.dtype != q.dtype and kv_cache.dtype not in FP8_CACHES:
        return f"cache dtype {kv_cache.dtype}: q's {q.dtype} or float8_e4m3fn"
    if kv_cache.dtype in FP8_CACHES and kv_scale is None:
        return "an fp8 cache needs its per-tensor scale (kv_scale)"
    if kv_scale is not None and (kv_scale.numel() != 1 or kv_scale.dtype != torch.float32):
        return f"kv_scale must be one fp32 value, got {kv_scale.dtype} x {kv_scale.numel()}"
    tensors = (q, kv_cache, block_table, seq_lens) + ((kv_scale, ) if kv_scale is not None else ())
    if len({t.device for t in tensors}) > 1:
        return "q, the cache, block_table, seq_lens and kv_scale must be on one device"
    if q.shape[-1] != D_NOPE + D_ROPE or kv_cache.shape[-1] != D_NOPE + D_ROPE:
        return f"head width must be {D_NOPE + D_ROPE}"
    if kv_cache.shape[1] != PAGE_SIZE:
        return f"page_size {kv_cache.shape[1]} (only {PAGE_SIZE})"
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        return "the cache's pages must be contiguous rows"
    if q.stride(-1) != 1 or q.stride(0) != q.shape[1] * q.stride(1):
        return "q's (token, head) rows must be contiguous"
    if (kv_cache.stride(1) * kv_cache.element_size()) % 16 or (q.stride(1) * 2) % 16 \
            or kv_cache.data_ptr() % 16 or q.data_ptr() % 16:
        return "addresses and row strides must be 16-byte aligned for TMA"
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        return "block_table and seq_lens must be int32"
    if block_table.shape[0] < seq_lens.shape[0] or block_table.stride(1) != 1:
        return "block_table needs a row of contiguous page ids per request"
    ok, why = gluon_available()
    return None if ok else why


def _check_call(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None,
                tokens: int, num_splits: int | None, widen_cols: int, merge: str) -> None:
    """Refuse, with a ValueError, options and caller buffers the kernel cannot take."""
    if merge not in ("auto", "kernel", "reduce"):
        raise ValueError(f"merge must be 'auto', 'kernel' or 'reduce', got {merge!r}")
    if widen_cols not in WIDEN_STEPS:
        raise ValueError(f"widen_cols must be one of {WIDEN_STEPS}, got {widen_cols}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if q.shape[0] != tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, expected {tokens} (batch x qlen)")
    heads = q.shape[1]
    for name, buf, shape, dtype in (("out", out, (tokens, heads, D_NOPE), q.dtype),
                                    ("lse", lse, (tokens, heads), torch.float32)):
        if buf is not None and (tuple(buf.shape) != shape or buf.dtype != dtype
                                or buf.stride(-1) != 1 or buf.device != q.device):
            raise ValueError(f"{name} must be {dtype} of shape {shape} on q's device with "
                             f"unit stride last; got {buf.dtype} {tuple(buf.shape)} "
                             f"stride {buf.stride()} on {buf.device}")


def decode_launcher(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                    kv_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, num_splits: int | None = None,
                    max_seq_len: int | None = None, widen_cols: int = WIDEN_COLS,
                    merge: str = MERGE, pdl: bool = False
                    ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A zero-argument launch of the transposed decode, with the out and LSE it writes.

    Tensors as ``gluon_hopper.decode_launcher`` (page 64, bf16/fp16 q) plus an fp8
    (e4m3) cache with its per-tensor ``kv_scale`` (the cache holds value / scale; read by
    the kernel, so capturable; given with a 16-bit cache, it is applied the same way).
    ``num_splits`` None: ``pick_splits``. ``widen_cols``: the fp8 tile is widened that many
    columns at a time (``WIDEN_STEPS``). ``merge``: how split partials become out and lse:
    "kernel" (the last split of a row block merges them, one launch; its arrival counter
    is this launcher's own, so two of its launches must not run at once), "reduce" (a
    second kernel, ``reduce.reduce_launcher``) or "auto" (the first up to
    ``MERGE_IN_KERNEL_MAX_SPLITS`` splits, else the second). ``pdl``: the reduce kernel is a
    programmatic dependent launch, started as this kernel's blocks begin (0.5 us less at
    batch 1-8 on the H200, 2026-12-01). The same arguments (their own options beside) run
    an fp8 cache through the warp-specialized widening (``gluon_transposed_ws``) or fp8 MMAs
    (``gluon_transposed_fp8``); which one a param set runs is the route's choice.
    """
    batch, heads = seq_lens.shape[0], q.shape[1]
    _check_call(q, out, lse, batch * qlen, num_splits, widen_cols, merge)
    why = check_supported(q, kv_cache, block_table, seq_lens, kv_scale)
    if why is not None:
        raise ValueError(f"gluon transposed MLA decode: {why}")
    fp8 = kv_cache.dtype in FP8_CACHES
    meta = dict(CAUSAL=causal and qlen > 1, FP8=fp8, PAGE=PAGE_SIZE, STAGES=stages_for(fp8),
                WIDEN_COLS=widen_cols, **compile_options(NUM_WARPS))
    descs = tma_descriptors(q, kv_cache, plan.transposed_rows(qlen * heads))
    return launch(transposed_kernel, descs, q, block_table, seq_lens, kv_scale, out, lse,
                  qlen=qlen, sm_scale=sm_scale, num_splits=num_splits,
                  max_seq_len=max_seq_len, merge=merge, meta=meta, pdl=pdl)


def launch(kernel, descs: tuple, q: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, kv_scale: torch.Tensor | None, out: torch.Tensor | None,
           lse: torch.Tensor | None, *, qlen: int, sm_scale: float, num_splits: int | None,
           max_seq_len: int | None, merge: str, meta: dict, pdl: bool = False,
           per_program: float = 0.0
           ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A transposed kernel's launch (this module's or ``gluon_transposed_ws``'s: they take
    the same arguments), its split partials merged as ``merge`` says, with out and LSE;
    without ``num_splits``, ``pick_splits`` with the kernel's ``per_program``."""
    batch, heads = seq_lens.shape[0], q.shape[1]
    row_blocks = plan.transposed_row_blocks(heads, qlen)
    out, lse, num_splits = outputs_and_splits(q, seq_lens, out, lse, row_blocks, num_splits,
                                              max_seq_len, per_program)
    if kv_scale is None:
        kv_scale = torch.ones(1, dtype=torch.float32, device=q.device)
    grid = (row_blocks, num_splits, batch)
    head = (*descs, block_table, seq_lens, kv_scale, out, lse)
    sizes = (num_splits, qlen, heads, sm_scale * LOG2E, block_table.stride(0), out.stride(0),
             out.stride(1), lse.stride(0))
    if num_splits == 1:
        args = (*head, out, lse, kv_scale, *sizes, 0, 0, 0)  # no partials, no counter
        return (lambda: kernel[grid](*args, DIRECT=True, MERGE=False, PDL=False, **meta)), \
            out, lse

    in_kernel = merge == "kernel" or (merge == "auto"
                                      and num_splits <= MERGE_IN_KERNEL_MAX_SPLITS)
    pdl = pdl and not in_kernel  # a dependent to launch early: the reduce kernel
    part_out, part_lse, reduce = partials_and_merge(out, lse, batch, num_splits, qlen, pdl)
    # One arrival counter per (request, row block), zero between launches.
    counter = torch.zeros(batch * row_blocks if in_kernel else 1, dtype=torch.int32,
                          device=q.device)
    args = (*head, part_out, part_lse, counter, *sizes, part_out.stride(0), part_out.stride(1),
            part_lse.stride(0))
    if in_kernel:
        return (lambda: kernel[grid](*args, DIRECT=False, MERGE=True, PDL=False, **meta)), \
            out, lse

    def launch_split() -> None:
        kernel[grid](*args, DIRECT=False, MERGE=False, PDL=pdl, **meta)
        reduce()

    return launch_split, out, lse


def aot_compile(dtype: str = "bf16", kv: str | None = None, *, rows: int = 16,
                direct: bool = True, causal: bool = True, arch: int = 90,
                widen_cols: int = WIDEN_COLS, merge: str = MERGE, pdl: bool = False):
    """Compile ``transposed_kernel`` for ``sm_<arch>`` without a GPU (triton's bundled
    ptxas): q of ``dtype``, a cache of ``kv`` (None: q's; "fp8": e4m3), ``rows`` query
    rows; returns triton's CompiledKernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``)."""
    if merge not in ("auto", "kernel", "reduce") or widen_cols not in WIDEN_STEPS:
        raise ValueError(f"merge {merge!r} or widen_cols {widen_cols} is not an option")
    kv = kv or dtype
    fp8 = kv == "fp8"
    br = plan.transposed_rows(rows)
    constants = dict(CAUSAL=causal, DIRECT=direct, FP8=fp8, PAGE=PAGE_SIZE,
                     STAGES=stages_for(fp8), WIDEN_COLS=widen_cols,
                     MERGE=not direct and merge != "reduce", PDL=pdl, num_warps=NUM_WARPS)
    return aot_compile_kernel(transposed_kernel, constants, _blocks(dtype, kv, br, BLOCK_N),
                              _pointers(dtype), arch=arch, num_warps=NUM_WARPS)


def _blocks(dtype: str, kv: str, q_rows: int, kv_rows: int) -> dict:
    """The descriptor arguments' (dtype, rows, columns), for ``aot_compile_kernel``."""
    return dict(qn_desc=(dtype, q_rows, D_NOPE), qr_desc=(dtype, q_rows, D_ROPE),
                kn_desc=(kv, kv_rows, D_NOPE), kr_desc=(kv, kv_rows, D_ROPE))


def _pointers(dtype: str) -> dict:
    """The pointer arguments' element types, for ``aot_compile_kernel``."""
    return dict(bt_ptr="i32", seq_lens_ptr="i32", kv_scale_ptr="fp32", out_ptr=dtype,
                lse_ptr="fp32", part_out_ptr="fp32", part_lse_ptr="fp32", counter_ptr="i32")
