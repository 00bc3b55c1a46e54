"""A transposed MLA decode for Hopper (sm_90) in Triton's Gluon dialect (triton 3.6.0's API):
keys are the MMA's M, query rows its N; the "mma16" form of the ``transposed/gluon`` route
over a cache of q's 16-bit dtype. Its history: docs/kernels/gluon_transposed.md.

``gluon_hopper`` and ``gluon_seesaw`` put the query rows on the warpgroup MMA's M, 64 rows
wide whatever the problem has; at 16 heads x 1 token three quarters of every product is
padding. Here S^T = K Q^T has the tile's 64 keys as M and 16 or 32 query rows (heads x qlen
folded) as N, and O^T = V^T P^T the 512 latent dims as M: no padding. Per program: BR query
rows of one request and one split of its keys; one warpgroup, no warp specialization: a ring
of two 64-key tiles (TMA-copied; at page 1 gathered by the threads' cp.async) keeps the next
tile in flight while this one is computed.
P^T goes through shared memory; stale slots past the split's end have their V rows zeroed.
One split writes out and the natural-log LSE; more write fp32 partials, merged by the last
split of a row block to arrive (up to ``MERGE_IN_KERNEL_MAX_SPLITS``) or by
``reduce.reduce_launcher`` launched as a programmatic dependent. ``launch`` and the tile,
epilogue and merge steps serve the fp8 forms too (``gluon_transposed_ws``,
``gluon_transposed_fp8``).
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
    GATHERED,
    GL_DTYPES,
    TILE_KEYS,
    aot_compile_kernel,
    combine_partials,
    compile_options,
    drain_tiles,
    first_pages,
    gluon_available,
    last_keys,
    online_softmax,
    outputs_and_splits,
    partials_and_merge,
    program_keys,
    start_tile,
    store_row_lse,
    tma_descriptors,
    wait_tile,
    zero_stale_rows,
)
from mlatune.kernels.gluon_hopper_plan import D_NOPE, D_ROPE, kv_box_rows, page_refusal
from mlatune.lse import LOG2E

NUM_WARPS = 4  # one warpgroup
STAGES = 2  # the ring of 64-key tiles: with Q and P^T, what one block's shared memory holds
FP8_CACHES = (torch.float8_e4m3fn, )  # read by the fp8 forms (``check_supported``)
# Split partials: merged by the last split to finish (no second launch) up to this many
# splits, else by the reduce kernel (the last split merges alone, one split after another).
MERGE_IN_KERNEL_MAX_SPLITS = 2

__all__ = ["aot_compile", "check_supported", "decode_launcher", "launch", "transposed_kernel"]


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
    """The last split to finish these rows combines every split's partials into out and lse
    (``combine_partials``: the split-KV reduce without a second launch), then rezeroes the
    rows' counter for the next launch (a CUDA graph replays it as it left it)."""
    out_ptr, lse_ptr, part_out, part_lse = ptrs
    rb, b, _, num_splits, qlen, heads = ints[:6]
    stride_o_tok, stride_o_head, stride_lse_tok, stride_po_slot, stride_po_row, \
        stride_pl_slot = ints[6:]
    counter = counter_ptr + b * gl.num_programs(0) + rb
    gl.thread_barrier()  # every thread's partial stores precede the release below
    ticket = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
        r = rb * BR + gl.arange(0, BR, layout=gl.SliceLayout(1, layout))
        combine_partials(part_out, part_lse, (stride_po_slot, stride_po_row, stride_pl_slot),
                         out_ptr, lse_ptr, (stride_o_tok, stride_o_head, stride_lse_tok),
                         (b * num_splits).to(gl.int64), num_splits, b * qlen, heads, r,
                         r < qlen * heads, DN, layout)
        gl.store(counter, 0)


@gluon.jit
def _start_copies(descs, q_bufs, ring, q_bar, ready, src, q_row, start, n_tiles,
                  PAGE: gl.constexpr, num_warps: gl.constexpr):
    """Q's TMA copy and the first tiles' (all the ring's slots but one; ``src``: as
    ``start_tile``'s); returns the pages of the next tile to copy (page 1)."""
    qn_desc, qr_desc = descs[:2]
    k_nope, k_rope = ring
    STAGES: gl.constexpr = k_nope.shape[0]
    BN: gl.constexpr = k_nope.shape[1]
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, q_bufs[0])
    tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, q_bufs[1])
    pages = first_pages(src, start, BN, PAGE, num_warps)
    for i in gl.static_range(STAGES - 1):
        pages = start_tile(descs[2:], k_nope.index(i), k_rope.index(i), ready.index(i), src,
                           start + i * BN, i < n_tiles, pages, PAGE, num_warps)
    return pages


@gluon.jit(do_not_specialize=["num_splits", "qlen", "heads"])
def transposed_kernel(qn_desc, qr_desc, kn_desc, kr_desc,  # TMA: q's and the cache's parts
                      bt_ptr, seq_lens_ptr, kv_scale_ptr, out_ptr, lse_ptr,
                      part_out_ptr, part_lse_ptr, counter_ptr,  # split-KV: partials, merge
                      num_splits, qlen, heads, qk_scale,
                      stride_bt, stride_o_tok, stride_o_head, stride_lse_tok,  # direct out
                      stride_po_slot, stride_po_row, stride_pl_slot,  # fp32 partials
                      kv_ptr, stride_kv,  # the cache's rows, where page-1 keys are gathered
                      CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr,
                      STAGES: gl.constexpr, MERGE: gl.constexpr, PDL: gl.constexpr,
                      num_warps: gl.constexpr):
    BR: gl.constexpr = qn_desc.block_type.shape[0]
    BN: gl.constexpr = TILE_KEYS
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
    fence_async_shared()

    src = (bt_ptr + b.to(gl.int64) * stride_bt, (seq_len - 1) // PAGE, end, kv_ptr, stride_kv)
    pages = _start_copies((qn_desc, qr_desc, kn_desc, kr_desc), (q_nope, q_rope),
                          (k_nope, k_rope), q_bar, ready, src, b * qlen * heads + rb * BR,
                          start, n_tiles, PAGE, num_warps)

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
        # The slot was touched through the generic proxy (rows zeroed) before this TMA write
        # (async proxy).
        fence_async_shared()
        pages = start_tile((kn_desc, kr_desc), k_nope.index(nxt % STAGES),
                           k_rope.index(nxt % STAGES), ready.index(nxt % STAGES), src,
                           start + nxt * BN, nxt < n_tiles, pages, PAGE, num_warps)
        slot = i % STAGES
        wait_tile(ready.index(slot), (i // STAGES) & 1, STAGES - 1, PAGE)
        n0 = start + i * BN
        kn = k_nope.index(slot)
        kr = k_rope.index(slot)
        if PAGE != GATHERED and n0 + BN > end:  # (gathered rows past the end are zeros)
            zero_stale_rows(kn, end - n0, num_warps)
        acc, m_i, l_i = _tile(q_nope, q_rope, kn, kr, p_buf, n0, end, last_pos, keys, qk,
                              m_i, l_i, acc, s_layout, o_layout)
    drain_tiles(PAGE)

    ints = (rb, b, split, num_splits, qlen, heads, stride_o_tok, stride_o_head, stride_lse_tok,
            stride_po_slot, stride_po_row, stride_pl_slot)
    ptrs = (out_ptr, lse_ptr, part_out_ptr, part_lse_ptr)
    _epilogue(acc, m_i, l_i, kv_scale, ptrs, ints, o_layout, DIRECT, num_warps)
    if MERGE:
        _merge_if_last(ptrs, counter_ptr, ints, BR, DN, num_warps)


# Host side -------------------------------------------------------------------------------

def check_supported(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, kv_scale: torch.Tensor | None,
                    fp8_mma: bool = False) -> str | None:
    """Why the kernel (``fp8_mma``: the fp8-MMA form's) cannot take these tensors (or this
    triton), or None when it can."""
    if q.dim() != 3 or kv_cache.dim() != 3 or block_table.dim() != 2 or seq_lens.dim() != 1:
        return ("q (tokens, heads, 576), kv_cache (pages, page, 576), block_table (batch, pages) "
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
    why = page_refusal(kv_cache.shape[1], gathers=not fp8_mma)
    if why:
        return why
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
                tokens: int, num_splits: int | None) -> None:
    """Refuse, with a ValueError, a split count and caller buffers the kernel cannot take."""
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
                    max_seq_len: int | None = None
                    ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A zero-argument launch of the transposed decode over a cache of q's dtype, with the out
    and LSE it writes.

    Tensors as ``gluon_hopper.decode_launcher`` (bf16/fp16); ``kv_scale``, where
    given, multiplies the cache (read by the kernel, so capturable). ``num_splits`` None:
    ``pick_splits``. An fp8 cache runs ``gluon_transposed_ws`` or ``gluon_transposed_fp8``.
    """
    if kv_cache.dtype in FP8_CACHES:
        raise ValueError("the transposed decode reads a cache of q's dtype; an fp8 cache runs "
                         "gluon_transposed_ws or gluon_transposed_fp8")
    batch, heads = seq_lens.shape[0], q.shape[1]
    _check_call(q, out, lse, batch * qlen, num_splits)
    why = check_supported(q, kv_cache, block_table, seq_lens, kv_scale)
    if why is not None:
        raise ValueError(f"gluon transposed MLA decode: {why}")
    page = kv_cache.shape[1]
    meta = dict(CAUSAL=causal and qlen > 1, PAGE=page, STAGES=STAGES,
                **compile_options(NUM_WARPS))
    descs = tma_descriptors(q, kv_cache, plan.transposed_rows(qlen * heads), kv_box_rows(page))
    return launch(transposed_kernel, descs, q, kv_cache, block_table, seq_lens, kv_scale, out,
                  lse,
                  qlen=qlen, sm_scale=sm_scale, num_splits=num_splits,
                  max_seq_len=max_seq_len, meta=meta)


def launch(kernel, descs: tuple, q: torch.Tensor, kv_cache: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor, kv_scale: torch.Tensor | None,
           out: torch.Tensor | None, lse: torch.Tensor | None, *, qlen: int, sm_scale: float,
           num_splits: int | None, max_seq_len: int | None, meta: dict,
           per_program: float = 0.0
           ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A transposed kernel's launch (this module's, ``gluon_transposed_ws``'s or
    ``gluon_transposed_fp8``'s: they take the same arguments; the cache itself is read where
    a kernel gathers page-1 keys), with out and LSE; without
    ``num_splits``, ``pick_splits`` with the kernel's ``per_program``. Split partials are
    merged in the kernel up to ``MERGE_IN_KERNEL_MAX_SPLITS`` splits (its arrival counter is
    this launch's own, so two of its launches must not run at once), else by the reduce
    kernel, launched as a programmatic dependent."""
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
    cache = (kv_cache, kv_cache.stride(1))
    if num_splits == 1:
        args = (*head, out, lse, kv_scale, *sizes, 0, 0, 0, *cache)  # no partials, no counter
        return (lambda: kernel[grid](*args, DIRECT=True, MERGE=False, PDL=False, **meta)), \
            out, lse

    in_kernel = num_splits <= MERGE_IN_KERNEL_MAX_SPLITS
    # The reduce kernel, where there is one, is the dependent launched early.
    part_out, part_lse, reduce = partials_and_merge(out, lse, batch, num_splits, qlen,
                                                    not in_kernel)
    # One arrival counter per (request, row block), zero between launches.
    counter = torch.zeros(batch * row_blocks if in_kernel else 1, dtype=torch.int32,
                          device=q.device)
    args = (*head, part_out, part_lse, counter, *sizes, part_out.stride(0), part_out.stride(1),
            part_lse.stride(0), *cache)
    if in_kernel:
        return (lambda: kernel[grid](*args, DIRECT=False, MERGE=True, PDL=False, **meta)), \
            out, lse

    def launch_split() -> None:
        kernel[grid](*args, DIRECT=False, MERGE=False, PDL=True, **meta)
        reduce()

    return launch_split, out, lse


def aot_compile(dtype: str = "bf16", *, rows: int = 16, direct: bool = True,
                causal: bool = True, merge: bool = True, page: int = 64, arch: int = 90):
    """Compile ``transposed_kernel`` for ``sm_<arch>`` without a GPU (triton's bundled
    ptxas): q and cache of ``dtype``, ``rows`` query rows, ``page``-token pages; a split
    build (not ``direct``) merges its partials in the kernel (``merge``) or leaves them to
    the reduce kernel, launched as its dependent. Returns triton's CompiledKernel
    (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``)."""
    constants = dict(CAUSAL=causal, DIRECT=direct, PAGE=page, STAGES=STAGES,
                     **split_constants(direct, merge), num_warps=NUM_WARPS)
    return aot_compile_kernel(transposed_kernel, constants,
                              _blocks(dtype, dtype, plan.transposed_rows(rows),
                                      kv_box_rows(page)),
                              _pointers(dtype, dtype), arch=arch, num_warps=NUM_WARPS)


def split_constants(direct: bool, merge: bool) -> dict:
    """MERGE and PDL of a build as ``launch`` runs it (for ``aot_compile``)."""
    return dict(MERGE=not direct and merge, PDL=not direct and not merge)


def _blocks(dtype: str, kv: str, q_rows: int, kv_rows: int) -> dict:
    """The descriptor arguments' (dtype, rows, columns), for ``aot_compile_kernel``."""
    return dict(qn_desc=(dtype, q_rows, D_NOPE), qr_desc=(dtype, q_rows, D_ROPE),
                kn_desc=(kv, kv_rows, D_NOPE), kr_desc=(kv, kv_rows, D_ROPE))


def _pointers(dtype: str, kv: str) -> dict:
    """The pointer arguments' element types (q's ``dtype``, the cache's ``kv``), for
    ``aot_compile_kernel``."""
    return dict(kv_ptr={"fp8": "fp8e4nv"}.get(kv, kv), bt_ptr="i32", seq_lens_ptr="i32",
                kv_scale_ptr="fp32", out_ptr=dtype, lse_ptr="fp32", part_out_ptr="fp32",
                part_lse_ptr="fp32", counter_ptr="i32")
