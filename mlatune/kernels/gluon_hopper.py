"""A Hopper (sm_90) MLA decode kernel in Triton's Gluon dialect (triton 3.6.0's API), run by
the ``wgmma/gluon`` route; its history: docs/kernels/gluon_hopper.md.

Problem (absorbed MLA): q (tokens, heads, 576) = 512 latent ("nope") + 64 rope dims; a paged
cache (pages, page, 576) holding one latent head shared by every query head: K is the 576-wide
row, V its first 512 dims; out (tokens, heads, 512) and the natural-log LSE. Token t of a
request's qlen query tokens sees keys ``< seq_len - qlen + t + 1`` when causal.

Per program: 64 query rows of one request (rows ``r = t * heads + h``: heads and the verify
tokens folded into the MMA's M; rows past the request's are never stored) and one split of
its keys, walked in 64-key tiles copied once into a ring of two buffers that serve both
S = Q K^T and O += P V: by TMA (a tile lies in one page of 64 or more keys, else spans
64 / page pages, a box each), or at page 1 gathered by every thread's cp.async
(``gluon_common.start_tile``). Eight warps form two warpgroups: for S each computes
32 key columns over the 576-deep product; for O each owns 256 of the 512 columns. The
softmax is base 2, online; P goes through shared memory as P V's A operand. Stale slots of a
request's last page have their V rows zeroed. One split writes out and LSE; more write fp32
partials (normalized output, base-2 LSE) that ``reduce.reduce_launcher`` merges. Sizes and
the split rule: ``gluon_hopper_plan``; helpers shared with the other Gluon decodes:
``gluon_common``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mlatune.kernels.gluon_common import (
    GATHERED,
    GL_DTYPES,
    LN2,
    TILE_KEYS,
    aot_compile_kernel,
    compile_options,
    drain_tiles,
    first_pages,
    gluon_available,
    online_softmax,
    outputs_and_splits,
    start_tile,
    tma_descriptors,
    wait_tile,
    zero_stale_rows,
)
from mlatune.kernels.gluon_hopper_plan import (  # noqa: F401  (GLUON_TRITON, H200_SMS: the API)
    BLOCK_M,
    BLOCK_N,
    D_NOPE,
    D_ROPE,
    GLUON_TRITON,
    H200_SMS,
    REDUCE_MERGED_KERNELS,
    kv_box_rows,
    page_refusal,
    pick_splits,
    triton_refusal,
)
from mlatune.lse import LOG2E

NUM_WARPS = 8
NUM_STAGES = 2  # the ring of 64-key tiles: with Q (72 KB), what one block's shared memory holds

@gluon.jit
def _issue_scores(q_nope, q_rope, kn, kr, s_layout: gl.constexpr):
    """Start S = Q K^T of one tile (the 512-wide and the 64-wide parts): an async token."""
    BM: gl.constexpr = q_nope.shape[0]
    BN: gl.constexpr = kn.shape[0]
    s = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    s = warpgroup_mma(q_nope, kn.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)


@gluon.jit
def _walk_keys(q_nope, q_rope, k_nope, k_rope, kv_bar, p_buf, kv_descs, src, pages,
               start, end, n_tiles, last_pos, qk_scale, m_i, l_i, acc,
               s_layout: gl.constexpr, o_layout: gl.constexpr, PAGE: gl.constexpr,
               NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The key walk, one tile at a time: S, softmax, then P V, each waited for at once
    (``src``, ``pages``: ``start_tile``'s)."""
    BN: gl.constexpr = k_nope.shape[1]
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    for i in range(n_tiles):
        stage = i % NUM_STAGES
        kn = k_nope.index(stage)
        kr = k_rope.index(stage)
        wait_tile(kv_bar.index(stage), (i // NUM_STAGES) & 1, NUM_STAGES - 1, PAGE)
        n0 = start + i * BN
        if PAGE != GATHERED and n0 + BN > end:  # (gathered rows past the end are zeros)
            zero_stale_rows(kn, end - n0, num_warps)
        s = _issue_scores(q_nope, q_rope, kn, kr, s_layout)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, m_i, l_i, alpha = online_softmax(s * qk_scale, n0, end, last_pos, cols, m_i, l_i, 1)
        p_buf.store(p.to(p_buf.dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        acc = warpgroup_mma(p_buf, kn, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # Both warpgroups are done with this slot (and with P): refill it.
        gl.thread_barrier()
        pages = start_tile(kv_descs, kn, kr, kv_bar.index(stage), src, n0 + NUM_STAGES * BN,
                           i + NUM_STAGES < n_tiles, pages, PAGE, num_warps)
    return acc, m_i, l_i


@gluon.jit(do_not_specialize=["num_splits", "qlen", "heads"])
def mla_decode_kernel(qn_desc, qr_desc, kn_desc, kr_desc, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,
                      num_splits, qlen, heads, qk_scale,
                      stride_bt, stride_o_tok, stride_o_head, stride_lse_tok,
                      stride_po_slot, stride_po_row, stride_pl_slot,
                      kv_ptr, stride_kv,  # the cache's rows, where page-1 keys are gathered
                      CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
                      PAGE: gl.constexpr, NUM_STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    BM: gl.constexpr = qn_desc.block_type.shape[0]
    DN: gl.constexpr = qn_desc.block_type.shape[1]
    BN: gl.constexpr = TILE_KEYS
    dtype: gl.constexpr = qn_desc.dtype
    WG_N: gl.constexpr = num_warps // 4  # warpgroups side by side along N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG_N], instr_shape=[16, BN // WG_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG_N], instr_shape=[16, DN // WG_N, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    rb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    rows = qlen * heads
    seq_len = gl.load(seq_lens_ptr + b)
    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BN) * BN
    start = split * chunk
    end = gl.minimum(start + chunk, seq_len)
    if CAUSAL:
        # The block's last row is token (min(rows, rb*BM + BM) - 1) // heads.
        block_last = seq_len - qlen + (gl.minimum(rows, rb * BM + BM) - 1) // heads
        end = gl.minimum(end, block_last + 1)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)

    q_nope = gl.allocate_shared_memory(dtype, [BM, DN], qn_desc.layout)
    q_rope = gl.allocate_shared_memory(dtype, [BM, qr_desc.block_type.shape[1]], qr_desc.layout)
    k_nope = gl.allocate_shared_memory(dtype, [NUM_STAGES, BN, DN], kn_desc.layout)
    k_rope = gl.allocate_shared_memory(dtype, [NUM_STAGES, BN, kr_desc.block_type.shape[1]],
                                       kr_desc.layout)
    p_buf = gl.allocate_shared_memory(dtype, [BM, BN],
                                      gl.NVMMASharedLayout.get_default_for([BM, BN], dtype))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_bar.index(i), count=1)
    fence_async_shared()

    q_row = b * rows + rb * BM
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, q_nope)
    tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, q_rope)
    src = (bt_ptr + b.to(gl.int64) * stride_bt, (seq_len - 1) // PAGE, end, kv_ptr, stride_kv)
    pages = first_pages(src, start, BN, PAGE, num_warps)
    for i in gl.static_range(NUM_STAGES):
        pages = start_tile((kn_desc, kr_desc), k_nope.index(i), k_rope.index(i),
                           kv_bar.index(i), src, start + i * BN, i < n_tiles, pages, PAGE,
                           num_warps)

    offs_m = rb * BM + gl.arange(0, BM, layout=row_s)
    if CAUSAL:
        last_pos = seq_len - qlen + offs_m // heads
    else:
        last_pos = gl.full([BM], 0, gl.int32, layout=row_s) + (seq_len - 1)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([BM], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([BM, DN], gl.float32, layout=o_layout)
    mbarrier.wait(q_bar, 0)
    acc, m_i, l_i = _walk_keys(q_nope, q_rope, k_nope, k_rope, kv_bar, p_buf,
                               (kn_desc, kr_desc), src, pages, start, end, n_tiles, last_pos,
                               qk_scale, m_i, l_i, acc, s_layout, o_layout, PAGE, NUM_STAGES,
                               num_warps)

    drain_tiles(PAGE)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(kv_bar.index(i))

    has_keys = l_i > 0.0
    safe_l = gl.where(has_keys, l_i, gl.full_like(l_i, 1.0))
    inv = gl.where(has_keys, 1.0 / safe_l, gl.zeros_like(l_i))
    lse2 = gl.where(has_keys, m_i + gl.log2(safe_l), gl.full_like(l_i, float("-inf")))
    o = acc * gl.expand_dims(gl.convert_layout(inv, row_o), 1)

    # Rows of the block that belong to the request, stored through shared memory in
    # 128-column chunks with a coalescing layout.
    out_ty: gl.constexpr = out_ptr.dtype.element_ty
    o_buf = gl.allocate_shared_memory(out_ty, [BM, DN],
                                      gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    o_buf.store(o.to(out_ty))
    gl.thread_barrier()
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    r = rb * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, st_layout))
    r_ok = gl.expand_dims(r < rows, 1)
    if DIRECT:
        row_off = (b * qlen + r // heads).to(gl.int64) * stride_o_tok + (r % heads) * stride_o_head
    else:
        slot = b * num_splits + split
        row_off = slot.to(gl.int64) * stride_po_slot + r * stride_po_row
    for c in gl.static_range(DN // 128):
        d = c * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, st_layout))
        part = o_buf.slice(c * 128, 128, dim=1).load(st_layout)
        gl.store(out_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(d, 0), part, mask=r_ok)
    r_ok_s = offs_m < rows
    if DIRECT:
        dst = (b * qlen + offs_m // heads).to(gl.int64) * stride_lse_tok + offs_m % heads
        gl.store(lse_ptr + dst, lse2 * LN2, mask=r_ok_s)
    else:
        slot_s = b * num_splits + split
        gl.store(lse_ptr + slot_s.to(gl.int64) * stride_pl_slot + offs_m, lse2, mask=r_ok_s)


# Host side -------------------------------------------------------------------------------

def check_supported(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor) -> str | None:
    """Why the kernel cannot take these tensors (or this triton), or None when it can."""
    if q.dtype not in GL_DTYPES:
        return f"q dtype {q.dtype} (bf16 and fp16 only)"
    if kv_cache.dtype != q.dtype:
        return f"cache dtype {kv_cache.dtype} differs from q's {q.dtype}"
    if q.shape[-1] != D_NOPE + D_ROPE or kv_cache.shape[-1] != D_NOPE + D_ROPE:
        return f"head width must be {D_NOPE + D_ROPE}"
    why = page_refusal(kv_cache.shape[1])
    if why:
        return why
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        return "the cache's pages must be contiguous rows"
    if q.stride(-1) != 1 or q.stride(0) != q.shape[1] * q.stride(1):
        return "q's (token, head) rows must be contiguous"
    if (kv_cache.stride(1) * 2) % 16 or (q.stride(1) * 2) % 16 \
            or kv_cache.data_ptr() % 16 or q.data_ptr() % 16:
        return "addresses and row strides must be 16-byte aligned for TMA"
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        return "block_table and seq_lens must be int32"
    ok, why = gluon_available()
    return None if ok else why


def decode_launcher(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    num_splits: int | None = None, max_seq_len: int | None = None
                    ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A zero-argument launch of the Gluon decode, with the out and LSE it writes.

    q (batch * qlen, heads, 576), kv_cache (pages, page, 576), block_table (batch,
    max_pages) int32, seq_lens (batch,) int32, as the Triton routes take them;
    out (batch * qlen, heads, 512) in q's dtype and lse (batch * qlen, heads)
    fp32 (natural log) are allocated when not given. ``num_splits`` None: picked
    from the batch and ``max_seq_len`` (read from seq_lens, a host sync, when not
    given). The launch reads seq_lens and block_table when it runs (capturable).
    """
    why = check_supported(q, kv_cache, block_table, seq_lens)
    if why is not None:
        raise ValueError(f"gluon MLA decode: {why}")
    batch = seq_lens.shape[0]
    heads = q.shape[1]
    if q.shape[0] != batch * qlen:
        raise ValueError(f"q has {q.shape[0]} tokens, expected batch {batch} x qlen {qlen}")
    rows = qlen * heads
    row_blocks = triton.cdiv(rows, BLOCK_M)
    by_reduce = "gluon_hopper" in REDUCE_MERGED_KERNELS  # its partials: the reduce kernel's
    out, lse, num_splits = outputs_and_splits(q, seq_lens, out, lse, row_blocks, num_splits,
                                              max_seq_len, by_reduce=by_reduce)
    page = kv_cache.shape[1]
    descs = tma_descriptors(q, kv_cache, BLOCK_M, kv_box_rows(page))
    grid = (row_blocks, num_splits, batch)
    scale = sm_scale * LOG2E
    meta = dict(CAUSAL=causal and qlen > 1, PAGE=page, NUM_STAGES=NUM_STAGES,
                **compile_options(NUM_WARPS))
    common = (*descs, block_table, seq_lens)
    sizes = (num_splits, qlen, heads, scale, block_table.stride(0))
    cache = (kv_cache, kv_cache.stride(1))
    if num_splits == 1:
        args = (*common, out, lse, *sizes, out.stride(0), out.stride(1), lse.stride(0), 0, 0, 0,
                *cache)

        def launch() -> None:
            mla_decode_kernel[grid](*args, DIRECT=True, **meta)

        return launch, out, lse

    # Triton kernels: when a split merge is launched
    from mlatune.kernels.reduce import reduce_launcher

    part_out = torch.empty(batch * num_splits, rows, D_NOPE, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(batch * num_splits, rows, dtype=torch.float32, device=q.device)
    split_indptr = (torch.arange(batch + 1, dtype=torch.int32, device=q.device) * num_splits)
    args = (*common, part_out, part_lse, *sizes, 0, 0, 0, part_out.stride(0), part_out.stride(1),
            part_lse.stride(0), *cache)
    reduce = reduce_launcher(part_out, part_lse, split_indptr, out, lse,
                             tokens_per_group=qlen, q_heads=heads, row_heads=heads, head_rep=1,
                             max_slots=num_splits, uniform=True)

    def launch_split() -> None:
        mla_decode_kernel[grid](*args, DIRECT=False, **meta)
        reduce()

    return launch_split, out, lse


def gluon_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                 num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager call: (out, lse). See ``decode_launcher``."""
    launch, out, lse = decode_launcher(q, kv_cache, block_table, seq_lens, qlen=qlen,
                                       sm_scale=sm_scale, causal=causal, num_splits=num_splits)
    launch()
    return out, lse


# Ahead-of-time compile (no GPU needed: triton's bundled ptxas) ---------------------------

def aot_compile(dtype: str = "bf16", *, direct: bool = True, causal: bool = True,
                page: int = 64, arch: int = 90):
    """Compile ``mla_decode_kernel`` for ``sm_<arch>`` and a cache of ``page``-token pages
    without a GPU; returns triton's CompiledKernel (``.asm["ptx"]``, ``.asm["cubin"]``,
    ``.metadata.shared``)."""
    box = kv_box_rows(page)
    blocks = dict(qn_desc=(dtype, BLOCK_M, D_NOPE), qr_desc=(dtype, BLOCK_M, D_ROPE),
                  kn_desc=(dtype, box, D_NOPE), kr_desc=(dtype, box, D_ROPE))
    pointers = {"kv_ptr": dtype, "bt_ptr": "i32", "seq_lens_ptr": "i32",
                "out_ptr": dtype if direct else "fp32", "lse_ptr": "fp32"}
    constants = dict(CAUSAL=causal, DIRECT=direct, PAGE=page,
                     NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS)
    return aot_compile_kernel(mla_decode_kernel, constants, blocks, pointers, arch=arch,
                              num_warps=NUM_WARPS)
