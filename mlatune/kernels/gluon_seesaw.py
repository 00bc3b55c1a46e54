"""A warp-specialized "seesaw" MLA decode for Hopper (sm_90) in Triton's Gluon dialect (triton
3.6.0's API), run by the ``seesaw/gluon`` route; its history: docs/kernels/gluon_seesaw.md.

Same problem, tensors and launcher interface as ``gluon_hopper``. A program holds 64 query
rows (heads x qlen folded) of one request and one split of its keys, and three partitions:
- the loader (default partition, 4 warps at 24 registers): Q once, then 64-key tiles into a
  ring of two slots (slot 0 the even tiles, slot 1 the odd), each tile as 9 chunks of 64
  columns on their own mbarriers (a TMA box a chunk; under 64-token pages its threads'
  cp.async, each arriving once its copies land), the owner's V half first;
- WG0 and WG1 (4 warps each at 240 registers), owning O[:, :256] and O[:, 256:]. For a pair
  of tiles each computes S of its own tile, a chunk at a time as the chunks land, and the
  two alternate: WG0's softmax of tile a runs while WG1's MMAs of tile b use the tensor cores.
  P is handed over through the tile's rope part (dead once S is done) with the running max;
  a warpgroup's own P is the wgmma A operand from registers, the other's is read from shared
  memory. A slot is released in two groups, each by the warpgroup that reads it last.
Every mbarrier is its own allocation (triton 3.6 then puts no warpgroup barrier before each
wait), Q's descriptors are re-derived each pair through a zero the compiler cannot prove (so
ptxas keeps them out of spilled registers), and Q's rope part stays in registers. Forms
(``FORMS``): "pairs" walks one request a program; "two-requests" walks requests b and b +
cdiv(batch, 2) through the one ring, the second's Q copied while the first's output is
written; "balanced" walks, the same way, its worker's items of a device plan
(``balanced_plan``: an even share of the requests' key tiles, a program a row block and
worker), a request of one item written in place, the others' pieces into partial slots.
One split writes out and the natural-log LSE; more write fp32 partials merged by
``reduce.reduce_launcher``, launched as a programmatic dependent.

Over an fp8 e4m3 cache (a bf16 or fp16 q) the MMAs run in fp16: the loader (40 registers,
the warpgroups 232) copies each fp8 tile by TMA into its slot's second release group and
widens it to fp16 in place, a chunk at a time (``_widen_tile``; e4m3 -> fp16 is exact, one
``cvt`` a pair), zeros past the split's end; each warpgroup first writes its half of Q's
rows as fp16 in place, a bf16 row scaled by a power of two (exact, ``_widen_q``), and the
rows' scales (softmax, row and cache scales) into shared memory. The cache's scale also
multiplies the output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlatune.kernels import gluon_transposed
from mlatune.kernels import plan as device_plan
from mlatune.kernels.gluon_common import (
    TILE_KEYS,
    aot_compile_kernel,
    compile_options,
    copy_rows,
    gather_into,
    gather_layout,
    gather_pages,
    gather_rows,
    key_range,
    last_keys,
    no_shift,
    nvmma_layout,
    outputs_and_splits,
    page_row,
    partials_and_merge,
    program_keys,
    slim_softmax,
    store_row_lse,
    tile_rows,
    tma_descriptors,
    zero_stale_rows,
)
from mlatune.kernels.gluon_hopper import check_supported
from mlatune.kernels.gluon_hopper_plan import (
    BLOCK_M,
    BLOCK_N,
    D_NOPE,
    D_ROPE,
    REDUCE_MERGED_KERNELS,
    SEESAW_FORMS,
    balanced_workers,
    kv_box_rows,
    page_refusal,
    seesaw_form_refusal,
    seesaw_gathers,
    seesaw_tile_step,
)
from mlatune.kernels.reduce import reduce_launcher
from mlatune.lse import LOG2E

FORMS = SEESAW_FORMS  # "pairs", "two-requests", "balanced"
NUM_WARPS = 4  # the default partition: the loader (one thread issues); WG0, WG1: workers
COMPUTE_REGS = gl.constexpr(240)  # a compute warpgroup's registers a thread (O's half alone is 128)
LOADER_REGS = gl.constexpr(24)
# Pages under a tile: the loader's cp.async gather holds a tile's pages and rows (it spills at
# 24), and the compute warpgroups, with no stale rows to zero, fit in 232: the loader gets 40.
GATHER_COMPUTE_REGS = gl.constexpr(232)
GATHER_LOADER_REGS = gl.constexpr(40)
# Over an fp8 cache the loader also widens each tile (a chunk's fp8 and fp16 values and their
# addresses), and the compute warpgroups zero no stale rows (the widening writes zeros there).
WIDEN_COMPUTE_REGS = gl.constexpr(232)
WIDEN_LOADER_REGS = gl.constexpr(40)
# How a tile reaches its slot (the compute warpgroups' FILL): TMA copies of a 16-bit cache, the
# loader's cp.async gather (pages under a tile: ``gathers``), or an fp8 tile widened to fp16 in
# place by the loader.
FILL_TMA = gl.constexpr(0)
FILL_GATHER = gl.constexpr(1)
FILL_WIDEN = gl.constexpr(2)
# A bf16 q row is scaled by the power of two that puts its largest |value| in
# [2^Q_TOP, 2^(Q_TOP + 1)): under fp16's largest value (65504), and every value down to
# 2^-28 of it a normal fp16, where a bf16 value's 8 significant bits are exact.
Q_TOP = gl.constexpr(14)
Q_SHIFT_LIMIT = gl.constexpr(100)  # |shift| at most this: 2^shift stays a normal fp32
UNITS_A_PROGRAM = gl.constexpr(2)  # the two-requests form's requests a program
ROW_BLOCK = gl.constexpr(BLOCK_M)  # query rows a program (the kernels' BM)
# How a program walks its units (a row block's keys of one request, or of a piece of it): one
# (pairs), requests b and b + cdiv(batch, 2) (two-requests), a device plan's list (balanced).
WALK_PAIRS = gl.constexpr(0)
WALK_TWO = gl.constexpr(1)
WALK_PLAN = gl.constexpr(2)
WALKS = {"pairs": WALK_PAIRS, "two-requests": WALK_TWO, "balanced": WALK_PLAN}
MAXNREG = 168  # 12 warps (3 warpgroups) x 168 = the SM's 64K registers, rounded down
# Whether the loader gathers a cache's tiles (its PAGE, fp8 or not): the plan's rule, in the JIT.
gathers = constexpr_function(seesaw_gathers)

__all__ = ["FORMS", "aot_compile", "balanced_plan", "decode_launcher", "seesaw_decode",
           "seesaw_kernel"]


@gluon.jit
def _loader(descs, bufs, bars, src, q_row, start, n_tiles, PAGE: gl.constexpr):
    """Q once, then tile t into slot t % 2 as each of its groups is released (``src``: the
    request's block-table row and last page, the split's end, the cache's pointer, page
    stride and token-row stride)."""
    qn_desc, qr_desc = descs[:2]
    q_bar = bars[0]
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, bufs[0])
    tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, bufs[1])
    _load_tiles(descs[3], bufs, bars, src, start, n_tiles, PAGE)


@gluon.jit
def _loader_units(descs, bufs, bars, tables, ints, walk, PAGE: gl.constexpr,
                  CAUSAL: gl.constexpr, WALK: gl.constexpr):
    """The loader of the forms that walk several units a program (``_compute_units``; the
    units' keys as ``_request_keys`` and ``_item_keys`` give them): each unit's Q once both
    warpgroups are done with the last one's (``q_free``), then its tiles through the one
    ring (``_load_unit``). ``tables``: the block table and its row stride, the cache's
    pointer, page stride and token-row stride; ``walk``: as ``_compute_units``'."""
    j0 = 0
    if WALK == WALK_TWO:
        for k in gl.static_range(UNITS_A_PROGRAM):
            b = gl.program_id(2) + k * gl.num_programs(2)
            if b < walk[1]:
                keys = _request_keys(walk[0], b, ints, CAUSAL)
                j0 = _load_unit(descs, bufs, bars, tables, ints, walk[2], b, keys, k, j0, PAGE)
    else:
        first, last = _items_of(walk)
        for i in range(first, last):
            b, keys = _item_keys(walk, i, ints, CAUSAL)
            j0 = _load_unit(descs, bufs, bars, tables, ints, walk[2], b, keys, i - first, j0,
                            PAGE)


@gluon.jit
def _load_unit(descs, bufs, bars, tables, ints, q_free, b, keys, k, j0, PAGE: gl.constexpr):
    """The program's k-th unit (request b's row block ``ints[4]``, its ``keys``: start, end,
    tiles, the request's length): its Q once the last unit's is free, then its tiles, pairs
    counted across units (``j0``: before this one; returned: after it), slot 1 filled in a
    pair without a tile b too (so that its barriers' phases stay one a pair)."""
    qn_desc, qr_desc = descs[0], descs[1]
    start, end, n_tiles, seq_len = keys
    q_bar = bars[0]
    if k > 0:
        mbarrier.wait(q_free, (k - 1) & 1)
    q_row = b * ints[8] * ints[9] + ints[4] * qn_desc.block_type.shape[0]
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, bufs[0])
    tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, bufs[1])
    src = (tables[0] + b.to(gl.int64) * tables[1], (seq_len - 1) // PAGE, end, tables[2],
           tables[3], tables[4])
    _load_tiles(descs[3], bufs, bars, src, start, n_tiles, PAGE, j0, True)
    return j0 + (n_tiles + 1) // 2


@gluon.jit
def _request_keys(seq_lens_ptr, b, ints, CAUSAL: gl.constexpr):
    """The keys of request b's split ``ints[6]`` of ``ints[7]`` at row block ``ints[4]``
    (``key_range``): (start, end, tiles, the request's length)."""
    seq_len = gl.load(seq_lens_ptr + b)
    start, end, n_tiles = key_range(seq_len, ints[4], ints[6], ints[7], ints[8], ints[9],
                                    ROW_BLOCK, TILE_KEYS, CAUSAL)
    return start, end, n_tiles, seq_len


@gluon.jit
def _items_of(walk):
    """This program's items of the balanced form's work list: [first, last) of its worker
    (the grid's second index; ``mlatune.kernels.plan``'s ``work_indptr``)."""
    w = gl.program_id(1)
    return gl.load(walk[4] + w), gl.load(walk[4] + w + 1)


@gluon.jit
def _item_keys(walk, i, ints, CAUSAL: gl.constexpr):
    """Item i of the work list (request, key start, key end, slot; ``walk[3]``): its request
    and keys (start, end, tiles, the request's length) at row block ``ints[4]``, the end cut
    at the row block's causal bound (``key_range`` over the whole request)."""
    row = walk[3] + 4 * i
    b = gl.load(row)
    start = gl.load(row + 1)
    stop = gl.load(row + 2)
    seq_len = gl.load(walk[0] + b)
    end = key_range(seq_len, ints[4], 0, 1, ints[8], ints[9], ROW_BLOCK, TILE_KEYS, CAUSAL)[1]
    end = gl.minimum(end, stop)
    return b, (start, end, gl.cdiv(gl.maximum(end - start, 0), TILE_KEYS), seq_len)


@gluon.jit
def _load_tiles(kc_desc, bufs, bars, src, start, n_tiles, PAGE: gl.constexpr, j0=0,
                PAD: gl.constexpr = False):
    """The split's tiles, each in 9 chunks of 64 columns on barriers of their own
    (``ready[9 * slot + c]``: nope columns [64c, 64c + 64), c = 8 the rope part), in two
    groups released apart (``_release``). ``j0``: pairs copied before (two-requests); PAD:
    slot 1 filled (with tile a's page) in a pair without a tile b."""
    BN: gl.constexpr = TILE_KEYS
    for j in range((n_tiles + 1) // 2):
        ph = ((j0 + j) & 1) ^ 1  # a fresh barrier counts as phase 1 complete: first waits pass
        key = start + 2 * j * BN
        _load_tile(kc_desc, bufs, bars, 0, ph, src, key, PAGE)
        if 2 * j + 1 < n_tiles:
            _load_tile(kc_desc, bufs, bars, 1, ph, src, key + BN, PAGE)
        elif PAD:
            _load_tile(kc_desc, bufs, bars, 1, ph, src, key, PAGE)


@gluon.jit
def _load_tile(kc_desc, bufs, bars, SLOT: gl.constexpr, ph, src, key, PAGE: gl.constexpr):
    """One tile into slot SLOT: its owner's V half (slot 0: columns 0-255, slot 1: 256-511)
    once the owner released it, then the other half and the rope part: a TMA box a chunk
    (``_copy_tile``), gathered under 64-token pages (``_gather_tile``), or an fp8 cache's
    tile widened (``_widen_tile``)."""
    k_nope, k_rope = bufs[2:4]
    ready, empty = bars[1:3]
    if kc_desc.dtype.primitive_bitwidth == 8:
        _widen_tile(kc_desc, k_nope, k_rope, bars, SLOT, ph, src, key, PAGE)
    elif gathers(PAGE, False):
        _gather_tile(k_nope.index(SLOT), k_rope.index(SLOT), ready, empty, SLOT, ph, src, key,
                     PAGE)
    else:
        _copy_tile(kc_desc, k_nope.index(SLOT), k_rope.index(SLOT), ready, empty, SLOT, ph, src,
                   key, PAGE)


@gluon.jit
def _gather_tile(kn, kr, ready, empty, SLOT: gl.constexpr, ph, src, key, PAGE: gl.constexpr):
    """``_load_tile`` of a tile of pages under its 64 keys: each group by the loader's
    cp.async (``gather_into``), every thread arriving on each of the group's chunk barriers
    (count: the loader's threads) once its copies have landed; the warpgroups fence before
    their wgmmas read."""
    pages = gather_pages(src[0], key, src[2], kn.shape[0], gather_layout(4), PAGE)
    for g in gl.static_range(2):
        mbarrier.wait(_bar(empty, 2 * SLOT + g), ph)
        fence_async_shared()  # the warpgroups' wgmmas (async proxy) read the slot last
        # (the rows' pointers made after the wait: at 24 registers the loader holds only
        # the pages across it)
        rows, ok = gather_rows(pages, src[3], src[4], src[5], PAGE)
        _gather_group(kn, kr, ready, SLOT, g, rows, ok)


@gluon.jit
def _gather_group(kn, kr, ready, SLOT: gl.constexpr, G: gl.constexpr, rows, ok):
    """Group G of a gathered tile in slot SLOT: V columns [256 H, + 256), H = (SLOT + G) % 2
    (and, the second, the rope part), then each thread's arrival on their chunks' barriers,
    due once its copies have landed."""
    W: gl.constexpr = kr.shape[1]
    H: gl.constexpr = (SLOT + G) % 2
    gather_into(kn.slice(H * 4 * W, 4 * W, dim=1), rows, ok, H * 4 * W)
    if G == 1:
        gather_into(kr, rows, ok, kn.shape[1])
    for i in gl.static_range(4):
        async_copy.mbarrier_arrive(_bar(ready, 9 * SLOT + 4 * H + i), increment_count=False)
    if G == 1:
        async_copy.mbarrier_arrive(_bar(ready, 9 * SLOT + 8), increment_count=False)


@gluon.jit
def _copy_tile(kc_desc, kn, kr, ready, empty, SLOT: gl.constexpr, ph, src, key,
               PAGE: gl.constexpr):
    """``_load_tile`` by TMA where a tile lies in one page: a box a chunk from the tile's
    first row (its page read once)."""
    W: gl.constexpr = kc_desc.block_type.shape[1]
    CHUNK: gl.constexpr = kc_desc.block_type.nbytes
    row = page_row(src[0], key, src[1], True, PAGE)
    for g in gl.static_range(2):
        mbarrier.wait(_bar(empty, 2 * SLOT + g), ph)
        fence_async_shared()  # the warpgroups wrote the slot (P, zeroed rows) as generic proxy
        # Chunk (4 (SLOT + g) + i) % 8: slot 0 copies columns 0-255 first, slot 1 256-511.
        for c in gl.static_range(4 * (SLOT + g), 4 * (SLOT + g) + 4):
            bar = _bar(ready, 9 * SLOT + c % 8)
            mbarrier.expect(bar, CHUNK)
            tma.async_copy_global_to_shared(kc_desc, [row, c % 8 * W], bar,
                                            kn.slice(c % 8 * W, W, dim=1))
    bar = _bar(ready, 9 * SLOT + 8)
    mbarrier.expect(bar, CHUNK)
    tma.async_copy_global_to_shared(kc_desc, [row, kn.shape[1]], bar, kr)


# An fp8 cache: each tile copied by TMA into its slot's staging area, then widened in place.
#
# A slot holds 64 keys x 576 fp16 (73,728 bytes: nope chunk c (64 columns, 8 KB) at 8192 c of
# its nope part, the rope part apart); the fp8 tile is half that. Its 9 chunks (4 KB each) are
# staged in the order the compute warpgroups read them (``chunk_at``): the nope chunks in the
# slot's non-owner V half (slot 0: bytes 32768-65535 of its nope part, slot 1: 0-32767),
# position k at 4096 k, the rope part in the upper half of the slot's rope part. Widened in that
# order, the fp16 write of position k (8 KB at its chunk's place) reaches only positions <= k:
# the owner's half holds no staging, and in the non-owner's half position k's write covers
# positions 2 (k - 4) and 2 (k - 4) + 1 (the rope part: its own). So once every thread has
# read positions <= k, position k may be written. The staging lies in the slot's second
# release group (the non-owner's half and the rope part): its copy starts once that group is
# released; the widening's first writes (the owner's half) wait for the first group.

@constexpr_function
def chunk_at(slot, k):
    """The chunk a slot's tile copies (and its warpgroup reads) k-th: the owner's V half first
    (slot 0: nope chunks 0-3, slot 1: 4-7), then the other half, then the rope part (8)."""
    return 8 if k == 8 else (4 * slot + k) % 8


@constexpr_function
def staged_at(slot, k):
    """Where staging position k (< 8) of slot ``slot`` lies: its index among the ring's nope
    parts as 4 KB chunks (16 a slot), in the slot's non-owner V half."""
    return 16 * slot + 8 * (1 - slot) + k


@gluon.jit
def _staged(f_nope, f_rope, SLOT: gl.constexpr, k: gl.constexpr):
    """Staging position k of slot SLOT, [64, 64] fp8 (``f_nope``: the nope parts as 4 KB
    chunks, 16 a slot; ``f_rope``: the rope parts, 2 a slot: the upper one)."""
    if k < 8:
        return f_nope.index(staged_at(SLOT, k))
    else:
        return f_rope.index(2 * SLOT + 1)


@gluon.jit
def _widen_tile(kc_desc, k_nope, k_rope, bars, SLOT: gl.constexpr, ph, src, key,
                PAGE: gl.constexpr):
    """``_load_tile`` of an fp8 cache: the tile's 9 fp8 chunks copied by TMA into slot SLOT's
    staging area once its second group is released (``_stage_tile``), then, once the first is
    too, widened to fp16 in place chunk by chunk as they land (``_widen_chunks``), V rows
    past the split's end as zeros (a real cache may hold NaN there)."""
    ready, empty, staged = bars[1], bars[2], bars[5]
    W: gl.constexpr = kc_desc.block_type.shape[1]
    N: gl.constexpr = k_nope.shape[1]
    fp8: gl.constexpr = kc_desc.dtype
    f_nope = k_nope._reinterpret(fp8, [k_nope.shape[0] * k_nope.shape[2] * 2 // W, N, W],
                                 kc_desc.layout)
    f_rope = k_rope._reinterpret(fp8, [k_rope.shape[0] * 2, N, W], kc_desc.layout)
    _stage_tile(kc_desc, f_nope, f_rope, staged, empty, SLOT, ph, src, key, PAGE)
    mbarrier.wait(_bar(empty, 2 * SLOT), ph)
    fence_async_shared()  # the owner's wgmmas (async proxy) read the half written first
    valid = src[2] - key
    # ``ph`` is the parity the release barriers are waited with (their first waits pass); a
    # staged chunk's barrier completes its phase (j0 + j) & 1 in pair j, the other parity.
    if valid < N:
        _widen_chunks(f_nope, f_rope, k_nope.index(SLOT), k_rope.index(SLOT), staged, ready,
                      SLOT, ph ^ 1, valid, True)
    else:
        _widen_chunks(f_nope, f_rope, k_nope.index(SLOT), k_rope.index(SLOT), staged, ready,
                      SLOT, ph ^ 1, valid, False)


@gluon.jit
def _stage_tile(kc_desc, f_nope, f_rope, staged, empty, SLOT: gl.constexpr, ph, src, key,
                PAGE: gl.constexpr):
    """The fp8 tile's chunks by TMA into slot SLOT's staging positions (``_staged``), each on
    its own barrier (``staged[9 * SLOT + k]``), a box a chunk or a box a page."""
    tables = (src[0], src[1])
    R: gl.constexpr = kc_desc.block_type.shape[0]
    W: gl.constexpr = kc_desc.block_type.shape[1]
    N: gl.constexpr = f_nope.shape[1]
    CHUNK: gl.constexpr = kc_desc.block_type.nbytes * (N // R)
    if PAGE >= N:
        rows = tile_rows(tables[0], key, tables[1], True, R, N, PAGE)
    mbarrier.wait(_bar(empty, 2 * SLOT + 1), ph)
    fence_async_shared()  # the warpgroups wrote the group (P) through the generic proxy
    for k in gl.static_range(9):
        if PAGE < N:
            rows = tile_rows(tables[0], key, tables[1], True, R, N, PAGE)
        bar = _bar(staged, 9 * SLOT + k)
        mbarrier.expect(bar, CHUNK)
        copy_rows(kc_desc, _staged(f_nope, f_rope, SLOT, k), bar, rows, chunk_at(SLOT, k) * W,
                  True)


@gluon.jit
def _widen_chunks(f_nope, f_rope, kn, kr, staged, ready, SLOT: gl.constexpr, ph, valid,
                  MASK: gl.constexpr):
    """Widen slot SLOT's staged chunks into its fp16 chunks (``kn``, ``kr``) once each has
    landed (``staged``, phase ``ph``), in the staged order: each thread reads position k + 1
    before it writes position k (so the barrier after each chunk's writes also says that every
    thread has read the next), then a proxy fence (the wgmmas read the chunk through the async
    proxy), the loader's barrier and the chunk's one arrival on ``ready``. MASK: V rows from
    ``valid`` on written as zeros. (Triton adds a barrier before each write, the read before
    it being of the same allocation, and one after each arrival, which it takes as an access
    of any shared memory: 27 a tile.)"""
    # 16 fp8 columns of a row a thread (one 16-byte load), two rows: 32 values, 16 cvt.
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    W: gl.constexpr = kr.shape[1]
    keep = gl.expand_dims(gl.arange(0, kn.shape[0], layout=gl.SliceLayout(1, layout)) < valid, 1)
    mbarrier.wait(_bar(staged, 9 * SLOT), ph)
    x = _staged(f_nope, f_rope, SLOT, 0).load(layout)
    for k in gl.static_range(9):
        if k < 8:
            mbarrier.wait(_bar(staged, 9 * SLOT + k + 1), ph)
            x_next = _staged(f_nope, f_rope, SLOT, k + 1).load(layout)
        y = x.to(gl.float16)
        if k < 8:
            if MASK:
                y = gl.where(keep, y, gl.zeros_like(y))
            kn.slice(chunk_at(SLOT, k) * W, W, dim=1).store(y)
        else:
            kr.store(y)
        fence_async_shared()
        gl.thread_barrier()  # every thread's writes precede the one arrival
        mbarrier.arrive(_bar(ready, 9 * SLOT + chunk_at(SLOT, k)))
        if k < 8:
            x = x_next


@gluon.jit
def _scores(q_nope, q_rope, kn, kr, ready, SLOT: gl.constexpr, ph, pred,
            s_layout: gl.constexpr, FILL: gl.constexpr):
    """S = Q K^T of the tile in slot SLOT, each 64-column step issued as soon as its chunk
    has landed, in the order the loader copies them (the owner's V half first, rope last).
    FILL: how the chunks reached the slot (``_landed``)."""
    W: gl.constexpr = kr.shape[1]
    BM: gl.constexpr = q_nope.shape[0]
    BN: gl.constexpr = kn.shape[0]
    s = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    for c in gl.static_range(4 * SLOT, 4 * SLOT + 8):  # chunk c % 8
        mbarrier.wait(_bar(ready, 9 * SLOT + c % 8), ph, pred=pred)
        _landed(FILL)
        s = warpgroup_mma(q_nope.slice(c % 8 * W, W, dim=1),
                          kn.slice(c % 8 * W, W, dim=1).permute((1, 0)), s,
                          use_acc=c > 4 * SLOT, is_async=True)
    mbarrier.wait(_bar(ready, 9 * SLOT + 8), ph, pred=pred)
    _landed(FILL)
    return warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)


@gluon.jit
def _wait_half(ready, SLOT: gl.constexpr, HALF: gl.constexpr, ph, pred, FILL: gl.constexpr):
    """Wait until the V half HALF (0: columns 0-255) of slot SLOT has landed."""
    for i in gl.static_range(4):
        mbarrier.wait(_bar(ready, 9 * SLOT + 4 * HALF + i), ph, pred=pred)
    _landed(FILL)


@gluon.jit
def _landed(FILL: gl.constexpr):
    """After a wait on a chunk the loader gathered by cp.async (pages under a tile), which
    writes through the generic proxy: a proxy fence, so that this thread's wgmmas (async
    proxy) read it. (A widened chunk was fenced by the threads that wrote it, before their
    arrival.)"""
    if FILL == FILL_GATHER:
        fence_async_shared()


@gluon.jit
def _release(empty, SLOT: gl.constexpr, WG: gl.constexpr):
    """Warpgroup WG is done with slot SLOT. The slot's two groups are each read by one
    warpgroup last: the owner's V half by the owner (WG0 owns slot 0, WG1 slot 1), the other
    V half and the rope part (P) by the other: ``empty[2 * SLOT + (WG != SLOT)]``, count 1."""
    mbarrier.arrive(_bar(empty, 2 * SLOT + (WG != SLOT)))


@gluon.jit
def _bar(group, i: gl.constexpr):
    """Barrier i of a group (``_lone_bars``)."""
    return group[i]


@gluon.jit
def _lone_bars(N: gl.constexpr, layout: gl.constexpr):
    """N mbarriers, each its own shared allocation: Triton's shared-memory barrier analysis
    then tells a wait on one from a wait on another (a wait reads and writes its barrier;
    rows of one allocation it takes as the same memory, and puts a warpgroup barrier
    between any two waits)."""
    bars = ()
    for _ in gl.static_range(N):
        bars = bars + (gl.allocate_shared_memory(gl.int64, [1], layout), )  # noqa: RUF005 (JIT)
    return bars


@gluon.jit
def _scale_rows(acc, factor, o_layout: gl.constexpr):
    return acc * gl.expand_dims(gl.convert_layout(factor, gl.SliceLayout(1, o_layout)), 1)


@gluon.jit
def _row_slot(buf, i: gl.constexpr):
    """Rows' values number ``i`` (a max or a sum) of a [2 * 64] fp32 buffer."""
    return buf.slice(i * (buf.shape[0] // 2), buf.shape[0] // 2)


@gluon.jit
def _publish(p, kr_buf, m_slot, m, bar):
    """Hand a tile's P (over its dead rope part) and its running max to the other warpgroup."""
    kr_buf.store(p)
    m_slot.store(m)
    fence_async_shared()  # P is read by the other warpgroup's wgmma (async proxy)
    gl.thread_barrier()  # every thread's stores precede the one arrival
    mbarrier.arrive(bar)


@gluon.jit
def _softmax(s, qk, n0, end, bounds, cols, m_i, l_i, FILL: gl.constexpr):
    """One tile's online softmax of raw scores (``slim_softmax``; ``qk``: the scores' scale,
    over a widened cache the buffer of a scale a row). ``bounds``: the rows' last keys
    (``last_keys``) and the first key some row may not see."""
    last_pos, mask_from = bounds
    if FILL == FILL_WIDEN:
        qk = qk.load(gl.SliceLayout(1, s.type.layout))
    return slim_softmax(s, qk, n0, end, last_pos, cols, m_i, l_i, mask_from,
                        FILL == FILL_WIDEN)


@gluon.jit
def _zero_if_last(v, n0, end, FILL: gl.constexpr):
    """Zero the V rows past ``end`` of the tile at ``n0`` (only the last tile has any; a
    gathered or widened tile has zeros there already)."""
    if FILL == FILL_TMA and n0 + v.shape[0] > end:
        zero_stale_rows(v, end - n0, 4)


@gluon.jit
def _halves(kn_a, kn_b, half: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """The V columns a warpgroup owns in both tiles of a pair, and S's key columns."""
    DH: gl.constexpr = o_layout.instr_shape[1]
    cols = gl.arange(0, kn_a.shape[0], layout=gl.SliceLayout(0, s_layout))
    return kn_a.slice(half * DH, DH, dim=1), kn_b.slice(half * DH, DH, dim=1), cols


@gluon.jit
def _pair_wg0(bufs, kv, bars, ph, n0, end, has_b, bounds, qk, m_run, l_run, acc,
              s_layout: gl.constexpr, o_layout: gl.constexpr, FILL: gl.constexpr):
    """WG0's half of a pair: its own tile a (slot 0), then WG1's tile b (slot 1). FILL:
    how the tiles reached their slots (``FILL_TMA``, ``FILL_GATHER``, ``FILL_WIDEN``)."""
    q_nope, q_rope, m_buf = bufs[0], bufs[1], bufs[4]
    kn_a, kr_a, kn_b, kr_b = kv
    ready, empty, p_bars = bars[1:4]
    v_a, v_b, cols = _halves(kn_a, kn_b, 0, s_layout, o_layout)
    BN: gl.constexpr = kn_a.shape[0]
    s = _scores(q_nope, q_rope, kn_a, kr_a, ready, 0, ph, True, s_layout, FILL)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    _zero_if_last(v_a, n0, end, FILL)  # after S, which has waited for every chunk
    p, m0, l_run, alpha = _softmax(s, qk, n0, end, bounds, cols, m_run, l_run, FILL)
    p = p.to(kr_a.dtype)
    _publish(p, kr_a, _row_slot(m_buf, 0), m0, _bar(p_bars, 0))
    acc = _scale_rows(acc, alpha, o_layout)
    p_op = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    acc = warpgroup_mma(p_op, v_a, acc, is_async=True)
    mbarrier.wait(_bar(p_bars, 1), ph)
    m1 = _row_slot(m_buf, 1).load(gl.SliceLayout(1, s_layout))
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    _release(empty, 0, 0)
    alpha = gl.exp2(m0 - no_shift(m1))
    acc = _scale_rows(acc, alpha, o_layout)
    if has_b:
        _wait_half(ready, 1, 0, ph, True, FILL)
        _zero_if_last(v_b, n0 + BN, end, FILL)
        acc = warpgroup_mma(kr_b, v_b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _release(empty, 1, 0)
    return acc, m1, l_run * alpha


@gluon.jit
def _pair_wg1(bufs, kv, bars, ph, n0, end, has_b, bounds, qk, m_run, l_run, acc,
              s_layout: gl.constexpr, o_layout: gl.constexpr, PAD: gl.constexpr,
              FILL: gl.constexpr):
    """WG1's half of a pair: S of its own tile b first, WG0's P_a V_a while S_b finishes.
    PAD: slot 1 is filled in a pair without a tile b too, and waited for; FILL: as
    ``_pair_wg0``'s."""
    kn_a, kr_a, kn_b, kr_b = kv
    q_nope, q_rope, m_buf = bufs[0], bufs[1], bufs[4]
    ready, empty, p_bars = bars[1:4]
    v_a, v_b, cols = _halves(kn_a, kn_b, 1, s_layout, o_layout)
    n1 = n0 + kn_a.shape[0]
    # Without a tile b (odd count), S_b reads whatever slot 1 holds: all masked (n1 >= end).
    s = _scores(q_nope, q_rope, kn_b, kr_b, ready, 1, ph, has_b | PAD, s_layout, FILL)
    _wait_half(ready, 0, 1, ph, True, FILL)
    mbarrier.wait(_bar(p_bars, 0), ph)
    m0 = _row_slot(m_buf, 0).load(gl.SliceLayout(1, s_layout))
    alpha = gl.exp2(m_run - no_shift(m0))
    acc = _scale_rows(acc, alpha, o_layout)
    _zero_if_last(v_a, n0, end, FILL)
    acc = warpgroup_mma(kr_a, v_a, acc, is_async=True)
    # wgmma groups retire in order: one outstanding leaves P_a V_a running.
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    p, m1, l_run, alpha = _softmax(s, qk, n1, end, bounds, cols, m0, l_run * alpha, FILL)
    p = p.to(kr_a.dtype)
    _publish(p, kr_b, _row_slot(m_buf, 1), m1, _bar(p_bars, 1))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _release(empty, 0, 1)
    acc = _scale_rows(acc, alpha, o_layout)
    if has_b:
        _zero_if_last(v_b, n1, end, FILL)
        p_op = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                        k_width=2))
        acc = warpgroup_mma(p_op, v_b, acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    _release(empty, 1, 1)
    return acc, m1, l_run


@gluon.jit
def _afresh(buf, zero):
    """``buf`` (2-D) through a leading index ``zero`` (0, unprovable to the compiler), so that
    the wgmma descriptors over it stay loop variant (not hoisted into spilled registers)."""
    return buf._reinterpret(buf.dtype, [1, buf.shape[0], buf.shape[1]], buf.layout).index(zero)


@gluon.jit
def _compute(bufs, bars, out_ptr, lse_ptr, ints, scales, WG: gl.constexpr,
             CAUSAL: gl.constexpr, DIRECT: gl.constexpr, FILL: gl.constexpr, o_desc,
             TMA_OUT: gl.constexpr):
    """One compute warpgroup of the pairs form: its walk over the pairs of tiles, then its
    half of the output (``TMA_OUT``: staged in Q's buffer, free once both warpgroups summed
    their rows, and stored by TMA through ``o_desc``)."""
    acc, m_run, l_run = _walk_pairs(bufs, bars, ints, scales, 0, 0, WG, CAUSAL, False, FILL)
    l_run = _sum_rows(l_run, bufs[5], bars[4], 0, 0, WG)
    o_layout: gl.constexpr = acc.type.layout
    if TMA_OUT:
        _tma_epilogue(acc, m_run, l_run, bufs[0], o_desc, lse_ptr, ints, WG, o_layout)
    else:
        _epilogue(acc, m_run, l_run, out_ptr, lse_ptr, ints, WG, DIRECT, o_layout, scales,
                  FILL)


@gluon.jit
def _tma_epilogue(acc, m_i, l_i, q_nope, o_desc, lse_ptr, ints, WG: gl.constexpr,
                  o_layout: gl.constexpr):
    """This warpgroup's 256 columns of the normalized output written into its half of Q's
    buffer and stored by one TMA copy (the request's rows as rows of ``o_desc``'s table);
    WG0 the LSE too."""
    rb, b, qlen, heads = ints[4], ints[5], ints[8], ints[9]
    BM: gl.constexpr = acc.shape[0]
    DH: gl.constexpr = acc.shape[1]
    inv = _inverse_sums(l_i, gl.SliceLayout(1, o_layout))
    half = q_nope.slice(WG * DH, DH, dim=1)
    half.store((acc * gl.expand_dims(inv, 1)).to(q_nope.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(o_desc, [b * qlen * heads + rb * BM, WG * DH], half)
    if WG == 0:
        _store_lse(m_i, l_i, lse_ptr, ints, BM, True)
    tma.store_wait(0)


@gluon.jit
def _compute_units(bufs, bars, outs, ints, walk, scales, WG: gl.constexpr,
                   CAUSAL: gl.constexpr, DIRECT: gl.constexpr, FILL: gl.constexpr,
                   WALK: gl.constexpr):
    """One compute warpgroup of the forms that walk several units a program, one after
    another (``_compute_unit``), the loader (``_loader_units``) copying the next one's Q
    while this warpgroup writes the last one's output. Two-requests: requests b0 and b0 + n
    (n the grid's third size; UNITS_A_PROGRAM of them), written as ``DIRECT`` says;
    balanced: the items of this program's worker in the device plan's work list, each a
    piece of a request's keys: written in place (``outs[:2]``) where it is its request's
    only item, else into its slot of the partials (``outs[2:]``) that the reduce merges.
    ``walk``: the lengths, the batch, ``q_free``, and the plan's work list, worker and
    request offsets (``mlatune.kernels.plan``)."""
    j0 = 0
    if WALK == WALK_TWO:
        for k in gl.static_range(UNITS_A_PROGRAM):
            b = gl.program_id(2) + k * gl.num_programs(2)
            if b < walk[1]:
                keys = _request_keys(walk[0], b, ints, CAUSAL)
                unit = keys + (ints[4], b) + ints[6:]  # noqa: RUF005 (JIT)
                j0 = _compute_unit(bufs, bars, outs, unit, walk, scales, k, k, j0, WG, CAUSAL,
                                   DIRECT, FILL, WALK)
    else:
        first, last = _items_of(walk)
        for k in range(last - first):
            # The first item read again (not held in a register across the walk).
            i = _items_of(walk)[0] + k
            b, keys = _item_keys(walk, i, ints, CAUSAL)
            unit = keys + (ints[4], b) + ints[6:]  # noqa: RUF005 (JIT)
            j0 = _compute_unit(bufs, bars, outs, unit, walk, scales, i, k, j0, WG, CAUSAL,
                               DIRECT, FILL, WALK)


@gluon.jit
def _compute_unit(bufs, bars, outs, unit, walk, scales, item, k, j0, WG: gl.constexpr,
                  CAUSAL: gl.constexpr, DIRECT: gl.constexpr, FILL: gl.constexpr,
                  WALK: gl.constexpr):
    """The program's k-th unit (``unit``: its keys, row block, request and the kernel's
    ``ints`` past them), ``j0`` pairs walked before it: the walk, Q released (``walk[2]``),
    the row sums added across the warpgroups (through the row slots of the unit's parity),
    then this warpgroup's output: balanced, that of work-list item ``item``
    (``_item_output``); otherwise as ``DIRECT`` says. Returns the pairs walked after it."""
    acc, m_run, l_run = _walk_pairs(bufs, bars, unit, scales, j0, k & 1, WG, CAUSAL, True,
                                    FILL)
    gl.thread_barrier()  # the warpgroup's last S (read Q) precedes the one arrival
    mbarrier.arrive(walk[2])
    l_run = _sum_rows(l_run, bufs[5], bars[4], k & 1, (k & 1) * 2, WG)
    o_layout: gl.constexpr = acc.type.layout
    if WALK == WALK_PLAN:
        _item_output(acc, m_run, l_run, outs, unit, walk, scales, item, WG, o_layout, FILL)
    else:
        _epilogue(acc, m_run, l_run, outs[0], outs[1], unit, WG, DIRECT, o_layout, scales,
                  FILL)
    return j0 + (unit[2] + 1) // 2


@gluon.jit
def _item_output(acc, m_run, l_run, outs, unit, walk, scales, item, WG: gl.constexpr,
                 o_layout: gl.constexpr, FILL: gl.constexpr):
    """This warpgroup's output of work-list item ``item`` (read after the walk, so that no
    register holds them across it): in place (``outs[:2]``) where it is its request's only
    item, else into its slot of the partials (``outs[2:]``), the reduce's to merge."""
    b = unit[5]
    if gl.load(walk[5] + b + 1) - gl.load(walk[5] + b) == 1:
        _epilogue(acc, m_run, l_run, outs[0], outs[1], unit, WG, True, o_layout, scales, FILL)
    else:
        # The slot as a request of one split (``_epilogue``'s partial rows).
        slot = gl.load(walk[3] + 4 * item + 3)
        in_slot = unit[:5] + (slot, 0, 1) + unit[8:]  # noqa: RUF005 (JIT)
        _epilogue(acc, m_run, l_run, outs[2], outs[3], in_slot, WG, False, o_layout, scales,
                  FILL)


@gluon.jit
def _walk_pairs(bufs, bars, ints, scales, j0, q_phase, WG: gl.constexpr,
                CAUSAL: gl.constexpr, PAD: gl.constexpr, FILL: gl.constexpr):
    """A warpgroup's walk over the pairs of one (request, split)'s tiles: (O's half, the rows'
    max, this warpgroup's row sums). ``j0``: pairs this program walked before (the ring's
    phases); PAD (two-requests): slot 1 waited for in a pair without a tile b, which the
    loader then fills too; FILL: how the loader fills the slots (``FILL_TMA``, ...); Q and
    the scores' scale as ``_q_operands`` gives them. Q's rope part (64 x 64) is held in
    registers as S's last k-steps' A operand, read from shared memory once a request."""
    k_nope, k_rope = bufs[2], bufs[3]
    BM: gl.constexpr = bufs[0].shape[0]
    BN: gl.constexpr = k_nope.shape[1]
    DH: gl.constexpr = bufs[0].shape[1] // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    start, end, n_tiles, seq_len, rb = ints[:5]
    qlen, heads = ints[8:10]
    last_pos = last_keys(rb, seq_len, qlen, heads, BM, row_s, CAUSAL)
    # The first key some row may not see (``first_masked_key``): the block's first row's
    # bound is the least (a scalar: no reduction across the warps).
    first_last = seq_len - 1
    if CAUSAL:
        first_last = seq_len - qlen + rb * BM // heads
    bounds = (last_pos, gl.minimum(end, first_last + 1))
    m_run = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_run = gl.full([BM], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([BM, DH], gl.float32, layout=o_layout)
    mbarrier.wait(bars[0], q_phase)
    q_nope, q_rope, qk = _q_operands(bufs, bars, scales, q_phase, WG, row_s, FILL)
    q_rope_op = q_rope.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    for j in range((n_tiles + 1) // 2):
        # j >> 30 is 0, which the compiler cannot prove: slot and Q addresses stay loop
        # variant, so their wgmma descriptors are not hoisted into (spilled) registers.
        kv = (k_nope.index(j >> 30), k_rope.index(j >> 30), k_nope.index(1 + (j >> 30)),
              k_rope.index(1 + (j >> 30)))
        n0 = start + 2 * j * BN
        has_b = 2 * j + 1 < n_tiles
        ph = (j0 + j) & 1
        pair_bufs = (_afresh(q_nope, j >> 30), q_rope_op, bufs[2], bufs[3], bufs[4], bufs[5])
        if WG == 0:
            acc, m_run, l_run = _pair_wg0(pair_bufs, kv, bars, ph, n0, end, has_b, bounds, qk,
                                          m_run, l_run, acc, s_layout, o_layout, FILL)
        else:
            acc, m_run, l_run = _pair_wg1(pair_bufs, kv, bars, ph, n0, end, has_b, bounds, qk,
                                          m_run, l_run, acc, s_layout, o_layout, PAD, FILL)
    return acc, m_run, l_run


@gluon.jit
def _q_operands(bufs, bars, scales, q_phase, WG: gl.constexpr, row_layout: gl.constexpr,
                FILL: gl.constexpr):
    """Q's nope and rope parts as the MMAs read them, and the scores' scale (``scales``: the
    softmax scale in base 2, and over an fp8 cache the cache's scale's pointer): as copied,
    and the one scale; over a widened cache, fp16 views of them and the rows' scales in shared
    memory (``_widen_q``: each warpgroup its half of the rows; read each tile, so that the
    walk holds no registers for them)."""
    q_nope, q_rope, qk = bufs[0], bufs[1], scales[0]
    if FILL == FILL_WIDEN:
        q16_nope = _as_fp16(q_nope)
        q16_rope = _as_fp16(q_rope)
        _widen_q(q_nope, q_rope, q16_nope, q16_rope, bufs[6], qk * scales[1], WG)
        fence_async_shared()  # the wgmmas (async proxy) read the rows written here
        gl.thread_barrier()  # every thread's writes precede the one arrival
        mbarrier.arrive(bars[6])
        mbarrier.wait(bars[6], q_phase)
        q_nope, q_rope, qk = q16_nope, q16_rope, bufs[6]
    return q_nope, q_rope, qk


@gluon.jit
def _as_fp16(buf):
    """A 16-bit shared buffer read as fp16 (the same bytes and layout)."""
    return buf._reinterpret(gl.float16, buf.shape, buf.layout)


@gluon.jit
def _widen_q(q_nope, q_rope, q16_nope, q16_rope, q_rows, qk, WG: gl.constexpr):
    """Warpgroup WG's half of Q's rows as fp16 in place (``q16_*``: the same bytes), and
    their scores' scales into ``q_rows``: a bf16 row times 2^-e, e its largest |value|'s
    exponent less ``Q_TOP`` (bounded by ``Q_SHIFT_LIMIT``; exact where its values lie
    within 2^28 of its largest), its scale ``qk`` 2^e; an fp16 row as it is, its scale
    ``qk``. Each thread writes the values it read."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    R: gl.constexpr = q_nope.shape[0] // 2
    W: gl.constexpr = q_rope.shape[1]
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    if q_nope.dtype == gl.bfloat16:
        top = gl.zeros([R, W], gl.float32, layout=layout)
        for c in gl.static_range(9):
            x = _q_chunk(q_nope, q_rope, c).slice(WG * R, R).load(layout).to(gl.float32)
            top = gl.maximum(top, gl.abs(x))
        e = ((gl.max(top, axis=1).to(gl.int32, bitcast=True) >> 23) & 0xFF) - (127 + Q_TOP)
        e = gl.minimum(gl.maximum(e, -Q_SHIFT_LIMIT), Q_SHIFT_LIMIT)
        down = gl.expand_dims(((127 - e) << 23).to(gl.float32, bitcast=True), 1)
        for c in gl.static_range(9):
            x = _q_chunk(q_nope, q_rope, c).slice(WG * R, R).load(layout).to(gl.float32)
            _q_chunk(q16_nope, q16_rope, c).slice(WG * R, R).store((x * down).to(gl.float16))
        scale = qk * ((127 + e) << 23).to(gl.float32, bitcast=True)
    else:
        scale = gl.full([R], 0.0, gl.float32, layout=rows) + qk
    q_rows.slice(WG * R, R).store(scale)


@gluon.jit
def _q_chunk(q_nope, q_rope, c: gl.constexpr):
    """Q's 64 columns from 64 c (c = 8: the rope part)."""
    W: gl.constexpr = q_rope.shape[1]
    if c < 8:
        return q_nope.slice(c * W, W, dim=1)
    else:
        return q_rope


@gluon.jit
def _sum_rows(l_run, l_buf, l_bar, l_phase, slot0, WG: gl.constexpr):
    """The rows' sums added across the warpgroups (both in the final max's base), through
    rows ``slot0`` and ``slot0 + 1`` of ``l_buf`` on ``l_bar`` (phase ``l_phase``)."""
    l_buf.index(slot0 + WG).store(l_run)
    gl.thread_barrier()
    mbarrier.arrive(l_bar)
    mbarrier.wait(l_bar, l_phase)
    return l_run + l_buf.index(slot0 + 1 - WG).load(l_run.type.layout)


@gluon.jit
def _inverse_sums(l_i, row_layout: gl.constexpr):
    """1 / each row's sum in ``row_layout`` (0 for a row that saw no key)."""
    l_o = gl.convert_layout(l_i, row_layout)
    has_keys = l_o > 0.0
    return gl.where(has_keys, 1.0 / gl.where(has_keys, l_o, gl.full_like(l_o, 1.0)),
                    gl.zeros_like(l_o))


@gluon.jit
def _epilogue(acc, m_i, l_i, out_ptr, lse_ptr, ints, WG: gl.constexpr, DIRECT: gl.constexpr,
              o_layout: gl.constexpr, scales, FILL: gl.constexpr):
    """Store this warpgroup's 256 columns of the normalized output (and, WG0, the LSE)
    straight from the accumulator's registers, where ``_tma_epilogue`` cannot (split
    partials; the two-requests and balanced forms, whose next unit's Q fills Q's buffer;
    rows a TMA box cannot take). A widened cache's scale (``scales[1]``) multiplies the
    output."""
    rb, b, split, num_splits, qlen, heads = ints[4:10]
    stride_o_tok, stride_o_head = ints[10:12]
    stride_po_slot, stride_po_row = ints[13:15]
    BM: gl.constexpr = acc.shape[0]
    DH: gl.constexpr = acc.shape[1]
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    inv = _inverse_sums(l_i, row_o)
    if FILL == FILL_WIDEN:
        inv = inv * scales[1]
    o = acc * gl.expand_dims(inv, 1)
    rows = qlen * heads
    r = rb * BM + gl.arange(0, BM, layout=row_o)
    r_ok = r < rows
    if DIRECT:
        row_off = (b * qlen + r // heads).to(gl.int64) * stride_o_tok + (r % heads) * stride_o_head
    else:
        slot = b * num_splits + split
        row_off = slot.to(gl.int64) * stride_po_slot + r * stride_po_row
    d = WG * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(d, 0),
             o.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(r_ok, 1))
    if WG == 0:
        _store_lse(m_i, l_i, lse_ptr, ints, BM, DIRECT)


@gluon.jit
def _store_lse(m_i, l_i, lse_ptr, ints, BM: gl.constexpr, DIRECT: gl.constexpr):
    """The rows' LSE (see ``store_row_lse``), the strides from this kernel's ``ints``."""
    rb, b, split, num_splits, qlen, heads = ints[4:10]
    store_row_lse(m_i, l_i, lse_ptr, (rb, b, split, num_splits, qlen, heads), ints[12],
                  ints[15], BM, DIRECT, 4)


# The partitions' entry points: a worker's arguments reach it as values, so which warpgroup
# it is (a constexpr) is in its name.

@gluon.jit
def _wg0(bufs, bars, out_ptr, lse_ptr, ints, scales, CAUSAL: gl.constexpr,
         DIRECT: gl.constexpr, FILL: gl.constexpr, o_desc, TMA_OUT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, scales, 0, CAUSAL, DIRECT, FILL, o_desc,
             TMA_OUT)


@gluon.jit
def _wg1(bufs, bars, out_ptr, lse_ptr, ints, scales, CAUSAL: gl.constexpr,
         DIRECT: gl.constexpr, FILL: gl.constexpr, o_desc, TMA_OUT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, scales, 1, CAUSAL, DIRECT, FILL, o_desc,
             TMA_OUT)


@gluon.jit
def _wg0_units(bufs, bars, outs, ints, scales, CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
               FILL: gl.constexpr, walk, WALK: gl.constexpr):
    _compute_units(bufs, bars, outs, ints, walk, scales, 0, CAUSAL, DIRECT, FILL, WALK)


@gluon.jit
def _wg1_units(bufs, bars, outs, ints, scales, CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
               FILL: gl.constexpr, walk, WALK: gl.constexpr):
    _compute_units(bufs, bars, outs, ints, walk, scales, 1, CAUSAL, DIRECT, FILL, WALK)


@gluon.jit(do_not_specialize=["num_splits", "qlen", "heads", "batch"])
def seesaw_kernel(qn_desc, qr_desc, kn_desc, kr_desc,  # TMA: q's parts; the cache's nope part
                  # and its whole rows in [64, 64] blocks (``_chunk_descriptor``)
                  bt_ptr, seq_lens_ptr, out_ptr, lse_ptr, num_splits, qlen, heads, qk_scale,
                  stride_bt, stride_o_tok, stride_o_head, stride_lse_tok,  # direct out
                  stride_po_slot, stride_po_row, stride_pl_slot,  # fp32 partials
                  kv_ptr, stride_kv,  # the cache, where pages under a tile are gathered,
                  # and a page's stride (its token rows': ``stride_kv_tok``)
                  kv_scale_ptr,  # an fp8 cache's scale (fp32; unread over a 16-bit cache)
                  # balanced: fp32 partials (out and lse are the final ones) and the device
                  # plan (``mlatune.kernels.plan``); unread by the other forms
                  part_out_ptr, part_lse_ptr, work_ptr, work_indptr_ptr, split_indptr_ptr,
                  stride_kv_tok,  # here: the arguments before it keep their offsets
                  o_desc,  # TMA_OUT: out as a table of rows, in [64, 256] blocks
                  TMA_OUT: gl.constexpr, CAUSAL: gl.constexpr, DIRECT: gl.constexpr,
                  PAGE: gl.constexpr, PDL: gl.constexpr, WALK: gl.constexpr,
                  num_warps: gl.constexpr, batch=1):
    BM: gl.constexpr = qn_desc.block_type.shape[0]
    BN: gl.constexpr = TILE_KEYS
    dtype: gl.constexpr = qn_desc.dtype
    # An fp8 cache is widened to fp16 in the ring, and the MMAs run in fp16.
    FP8: gl.constexpr = kr_desc.dtype.primitive_bitwidth == 8
    MMA: gl.constexpr = gl.float16 if FP8 else dtype
    rb, split, b, seq_len, start, end, n_tiles = program_keys(
        seq_lens_ptr, num_splits, qlen, heads, BM, BN, CAUSAL, PDL)

    q_nope = gl.allocate_shared_memory(dtype, qn_desc.block_type.shape, qn_desc.layout)
    q_rope = gl.allocate_shared_memory(dtype, qr_desc.block_type.shape, qr_desc.layout)
    # The ring in the MMAs' dtype, laid out as Q's parts (128-byte swizzled 16-bit rows).
    k_nope = gl.allocate_shared_memory(MMA, [2, BN, qn_desc.block_type.shape[1]], qn_desc.layout)
    k_rope = gl.allocate_shared_memory(MMA, [2, BN, qr_desc.block_type.shape[1]], qr_desc.layout)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    m_buf = gl.allocate_shared_memory(gl.float32, [2 * BM], rows_layout)  # m0, m1 of a pair
    # Each warpgroup's row sums (MULTI: a pair of rows a unit's parity).
    MULTI: gl.constexpr = WALK != WALK_PAIRS
    l_buf = gl.allocate_shared_memory(gl.float32, [4 if MULTI else 2, BM], rows_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    l_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    # A barrier a 64-column chunk (9 a slot), two release groups a slot; P_a and m0, P_b and m1.
    ready = _lone_bars(18, bar_layout)
    empty = _lone_bars(4, bar_layout)
    p_bars = _lone_bars(2, bar_layout)
    mbarrier.init(q_bar, count=1)
    mbarrier.init(l_bar, count=2)
    if MULTI:  # both warpgroups are done with a request's Q
        q_free = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        mbarrier.init(q_free, count=2)
    GATHER: gl.constexpr = gathers(PAGE, FP8)
    for i in gl.static_range(18):  # TMA: one expecting arrival; gathered: each loader thread's
        mbarrier.init(_bar(ready, i), count=32 * num_warps if GATHER else 1)
    for i in gl.static_range(4):
        mbarrier.init(_bar(empty, i), count=1)  # one warpgroup reads each group last
    for i in gl.static_range(2):
        mbarrier.init(_bar(p_bars, i), count=1)
    bufs = (q_nope, q_rope, k_nope, k_rope, m_buf, l_buf)
    bars = (q_bar, ready, empty, p_bars, l_bar)
    if FP8:
        bufs, bars = _widening_state(bufs, bars, BM, bar_layout, rows_layout)
    fence_async_shared()

    ints = (start, end, n_tiles, seq_len, rb, b, split, num_splits, qlen, heads,
            stride_o_tok, stride_o_head, stride_lse_tok, stride_po_slot, stride_po_row,
            stride_pl_slot)
    q_row = b * qlen * heads + rb * BM
    FILL: gl.constexpr = FILL_WIDEN if FP8 else (FILL_GATHER if GATHER else FILL_TMA)
    scales = (qk_scale, gl.load(kv_scale_ptr)) if FP8 else (qk_scale, )
    REGS: gl.constexpr = WIDEN_COMPUTE_REGS if FP8 else (
        GATHER_COMPUTE_REGS if GATHER else COMPUTE_REGS)
    # The loader is the default partition: as workers, both compute warpgroups get the
    # same register budget and take their scalars from shared memory alike. (Their
    # arguments are written in the call: a tuple assigned first holds its constexprs as
    # values.)
    if MULTI:
        walk = (seq_lens_ptr, batch, q_free, work_ptr, work_indptr_ptr, split_indptr_ptr)
        outs = (out_ptr, lse_ptr, part_out_ptr, part_lse_ptr)
        gl.warp_specialize([
            (_loader_units, ((qn_desc, qr_desc, kn_desc, kr_desc), bufs, bars,
                             (bt_ptr, stride_bt, kv_ptr, stride_kv, stride_kv_tok), ints,
                             walk, PAGE, CAUSAL,
                             WALK)),
            (_wg0_units, (bufs, bars, outs, ints, scales, CAUSAL, DIRECT, FILL, walk, WALK)),
            (_wg1_units, (bufs, bars, outs, ints, scales, CAUSAL, DIRECT, FILL, walk, WALK)),
        ], [4, 4], [REGS, REGS])
    else:
        gl.warp_specialize([
            (_loader, ((qn_desc, qr_desc, kn_desc, kr_desc), bufs, bars,
                       (bt_ptr + b.to(gl.int64) * stride_bt, (seq_len - 1) // PAGE, end,
                        kv_ptr, stride_kv, stride_kv_tok), q_row, start, n_tiles, PAGE)),
            (_wg0, (bufs, bars, out_ptr, lse_ptr, ints, scales, CAUSAL, DIRECT, FILL, o_desc,
                    TMA_OUT)),
            (_wg1, (bufs, bars, out_ptr, lse_ptr, ints, scales, CAUSAL, DIRECT, FILL, o_desc,
                    TMA_OUT)),
        ], [4, 4], [REGS, REGS])


@gluon.jit
def _widening_state(bufs, bars, BM: gl.constexpr, bar_layout: gl.constexpr,
                    rows_layout: gl.constexpr):
    """``bufs`` and ``bars`` with what widening an fp8 cache adds: the rows' scores' scales
    (``_widen_q``); a barrier a staged chunk (9 a slot, each expecting its TMA copy) and one
    that both warpgroups have widened their halves of Q."""
    q_rows = gl.allocate_shared_memory(gl.float32, [BM], rows_layout)
    staged = _lone_bars(18, bar_layout)
    q16_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    for i in gl.static_range(18):
        mbarrier.init(_bar(staged, i), count=1)
    mbarrier.init(q16_bar, count=2)
    return bufs + (q_rows, ), bars + (staged, q16_bar)  # noqa: RUF005 (JIT)


# Host side -------------------------------------------------------------------------------

def _chunk_descriptor(kv_cache: torch.Tensor) -> TensorDescriptor:
    """The cache's whole (page, slot) rows, 576 wide, in [rows, 64] blocks (a page's rows, at
    most 64: ``kv_box_rows``): the tiles' chunk copies (nope chunk c at column 64c, the rope
    part at 512), in the rope part's layout."""
    block = [kv_box_rows(kv_cache.shape[1]), D_ROPE]
    return TensorDescriptor(kv_cache, [kv_cache.shape[0] * kv_cache.shape[1], D_NOPE + D_ROPE],
                            [kv_cache.stride(1), 1], block, nvmma_layout(block, kv_cache.dtype))


def _check_form(form: str, fp8_cache: bool = False, page: int = 64) -> None:
    if form not in FORMS:
        raise ValueError(f"the seesaw decode's forms are {FORMS}, got {form!r}")
    why = seesaw_form_refusal(form, fp8_cache, page)
    if why:
        raise ValueError(why)


def decode_launcher(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    num_splits: int | None = None, max_seq_len: int | None = None,
                    kv_scale: torch.Tensor | None = None,
                    plan: tuple[torch.Tensor, ...] | None = None, form: str = FORMS[0]
                    ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A zero-argument launch of the seesaw decode in ``form`` (``FORMS``), with the out and
    LSE it writes. Tensors and arguments as ``gluon_hopper.decode_launcher`` (the pages
    ``page_refusal`` allows, a bf16/fp16 q over a cache of its dtype or over an fp8 e4m3 cache
    with its scale ``kv_scale`` (one fp32 value, read when the launch runs; pages of 16 keys
    and over), ``num_splits`` None: ``pick_splits``; ``sm_scale`` positive); capturable.
    "balanced" takes no split: it reads ``plan``, the buffers (work, work_indptr,
    split_indptr) that ``balanced_plan``'s launch fills from the current lengths, which the
    caller runs first (None: the launch plans itself, first)."""
    fp8 = _checked(q, kv_cache, block_table, seq_lens, qlen, sm_scale, kv_scale, form)
    batch, heads = seq_lens.shape[0], q.shape[1]
    rows = qlen * heads
    row_blocks = triton.cdiv(rows, BLOCK_M)
    if form == "balanced":
        num_splits = 1  # what the outputs' helper would otherwise pick from the lengths
    out, lse, num_splits = outputs_and_splits(q, seq_lens, out, lse, row_blocks, num_splits,
                                              max_seq_len, tile_step=seesaw_tile_step(fp8),
                                              by_reduce="gluon_seesaw" in REDUCE_MERGED_KERNELS)
    page = kv_cache.shape[1]
    descs = (*tma_descriptors(q, kv_cache, BLOCK_M, kv_box_rows(page))[:3],
             _chunk_descriptor(kv_cache))
    head = (*descs, block_table, seq_lens)
    sizes = (num_splits, qlen, heads, sm_scale * LOG2E, block_table.stride(0))
    # The cache, its page stride, its scale (read over an fp8 cache only; lse: any fp32
    # pointer otherwise) and its token-row stride (the kernel's last argument: ``tail``).
    cache = (kv_cache, kv_cache.stride(0), kv_scale if fp8 else lse, kv_cache.stride(1))
    meta = dict(CAUSAL=causal and qlen > 1, PAGE=page, WALK=WALKS[form], batch=batch,
                **compile_options(NUM_WARPS, MAXNREG))
    no_plan = (out, lse, seq_lens, seq_lens, seq_lens)  # the balanced form's, unread
    o_desc = _out_descriptor(out, qlen, heads, fp8 or seesaw_gathers(page, fp8)) \
        if form == "pairs" and num_splits == 1 else None
    meta["TMA_OUT"] = o_desc is not None
    tail = (*no_plan, cache[3], o_desc if o_desc is not None else descs[0])
    if form == "balanced":
        return _balanced_launch(out, lse, head, sizes, cache, meta, plan, row_blocks)
    grid = (row_blocks, num_splits,
            triton.cdiv(batch, UNITS_A_PROGRAM.value) if form == "two-requests" else batch)
    if num_splits == 1:
        args = (*head, out, lse, *sizes, out.stride(0), out.stride(1), lse.stride(0), 0, 0, 0,
                *cache[:3], *tail)
        return (lambda: seesaw_kernel[grid](*args, DIRECT=True, PDL=False, **meta)), out, lse

    part_out, part_lse, reduce = partials_and_merge(out, lse, batch, num_splits, qlen, pdl=True)
    args = (*head, part_out, part_lse, *sizes, 0, 0, 0, part_out.stride(0), part_out.stride(1),
            part_lse.stride(0), *cache[:3], *tail)

    def launch_split() -> None:
        seesaw_kernel[grid](*args, DIRECT=False, PDL=True, **meta)
        reduce()

    return launch_split, out, lse


def _out_descriptor(out: torch.Tensor, qlen: int, heads: int, refused: bool
                    ) -> TensorDescriptor | None:
    """A TMA descriptor of ``out``'s rows in [BLOCK_M, 256] blocks where a row block's rows
    are whole blocks of them (``qlen * heads`` a multiple of BLOCK_M, heads rows one token's,
    16-byte aligned); None otherwise (the epilogue stores from registers) and where
    ``refused`` (an fp8 cache, gathered pages: builds with the TMA store not run on a GPU
    yet)."""
    if refused or (qlen * heads) % BLOCK_M or out.stride(2) != 1 \
            or out.stride(0) != heads * out.stride(1) or out.data_ptr() % 16 \
            or (out.stride(1) * out.element_size()) % 16:
        return None
    block = [BLOCK_M, D_NOPE // 2]
    return TensorDescriptor(out, [out.shape[0] * heads, D_NOPE], [out.stride(1), 1], block,
                            nvmma_layout(block, out.dtype))


def _checked(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
             seq_lens: torch.Tensor, qlen: int, sm_scale: float,
             kv_scale: torch.Tensor | None, form: str) -> bool:
    """Whether the cache is fp8, once the arguments are ones the kernel in ``form`` takes
    (else ValueError)."""
    _check_form(form)
    if not sm_scale > 0:  # slim_softmax takes the max of the unscaled scores
        raise ValueError(f"the seesaw decode needs a positive sm_scale, got {sm_scale}")
    fp8 = kv_cache is not None and kv_cache.dtype in gluon_transposed.FP8_CACHES
    if fp8:
        why = (page_refusal(kv_cache.shape[1], gathers=False)  # its fp8 tiles come by TMA
               or gluon_transposed.check_supported(q, kv_cache, block_table, seq_lens, kv_scale))
    elif kv_scale is not None:
        why = "a 16-bit cache takes no kv_scale"
    else:
        why = check_supported(q, kv_cache, block_table, seq_lens)
    if why is not None:
        raise ValueError(f"gluon seesaw MLA decode: {why}")
    _check_form(form, fp8, kv_cache.shape[1])
    if q.shape[0] != seq_lens.shape[0] * qlen:
        raise ValueError(f"q has {q.shape[0]} tokens, expected batch {seq_lens.shape[0]} x "
                         f"qlen {qlen}")
    return fp8


def balanced_plan(seq_lens: torch.Tensor, *, heads: int, qlen: int, sms: int | None = None
                  ) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
    """The balanced form's device plan: a launch that fills (work, work_indptr,
    split_indptr) from the current ``seq_lens`` (``plan.persistent_plan_launcher``: no host
    sync, capturable), for ``balanced_workers`` workers a row block on ``sms`` SMs (None:
    the lengths' device's), and those buffers."""
    if sms is None:
        sms = torch.cuda.get_device_properties(seq_lens.device).multi_processor_count
    workers = balanced_workers(sms, triton.cdiv(qlen * heads, BLOCK_M))
    buffers = device_plan.allocate_plan_buffers(seq_lens.shape[0], workers, seq_lens.device)
    launch = device_plan.persistent_plan_launcher(
        seq_lens, rank=0, world=1, block_n=BLOCK_N, workers=workers, work=buffers[0],
        work_indptr=buffers[1], split_indptr=buffers[2])
    return launch, buffers


def _balanced_launch(out: torch.Tensor, lse: torch.Tensor, head: tuple, sizes: tuple,
                     cache: tuple, meta: dict, plan: tuple[torch.Tensor, ...] | None,
                     row_blocks: int) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """``decode_launcher``'s balanced form: a program a (row block, worker), each walking its
    worker's items of ``plan`` (None: planned here, in the launch); a request cut into
    several items merged by the reduce (a dependent launch), one of one item written in
    place (``one_in_place``)."""
    seq_lens = head[5]
    batch, qlen, heads = seq_lens.shape[0], sizes[1], sizes[2]
    planner = None
    if plan is None:
        planner, plan = balanced_plan(seq_lens, heads=heads, qlen=qlen)
    work, work_indptr, split_indptr = plan
    workers = work_indptr.shape[0] - 1
    slots = work.shape[0]  # a slot an item
    part_out = out.new_empty((slots, qlen * heads, D_NOPE), dtype=torch.float32)
    part_lse = out.new_empty((slots, qlen * heads), dtype=torch.float32)
    # The reduce merges any count; the hint sizes its slot block for the usual one.
    reduce = reduce_launcher(part_out, part_lse, split_indptr, out, lse,
                             tokens_per_group=qlen, q_heads=heads, row_heads=heads, head_rep=1,
                             max_slots=min(workers, triton.cdiv(workers, max(batch, 1)) + 1),
                             pdl=True, one_in_place=True)
    args = (*head, out, lse, *sizes, out.stride(0), out.stride(1), lse.stride(0),
            part_out.stride(0), part_out.stride(1), part_lse.stride(0), *cache[:3],
            part_out, part_lse, work, work_indptr, split_indptr, cache[3], head[0])
    grid = (row_blocks, workers, 1)

    def launch() -> None:
        if planner is not None:
            planner()
        if batch:  # (the kernel reads the first request's length)
            seesaw_kernel[grid](*args, DIRECT=False, PDL=True, **meta)
            reduce()

    return launch, out, lse


def seesaw_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                  num_splits: int | None = None, kv_scale: torch.Tensor | None = None,
                  form: str = FORMS[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager call: (out, lse). See ``decode_launcher``."""
    launch, out, lse = decode_launcher(q, kv_cache, block_table, seq_lens, qlen=qlen,
                                       sm_scale=sm_scale, causal=causal, num_splits=num_splits,
                                       kv_scale=kv_scale, form=form)
    launch()
    return out, lse


def aot_compile(dtype: str = "bf16", *, direct: bool = True, causal: bool = True,
                page: int = 64, arch: int = 90, form: str = FORMS[0], cache: str | None = None):
    """Compile ``seesaw_kernel`` in ``form`` for ``sm_<arch>`` and ``page``-token pages
    without a GPU (triton's bundled ptxas; a split build as the launcher runs it, with PDL;
    balanced: ``direct`` unread, its one build writes in place and into partials);
    ``cache``: the cache's dtype name ("fp8": widened; None: q's ``dtype``). Returns triton's
    CompiledKernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``)."""
    cache = cache or dtype
    why = page_refusal(page, gathers=cache != "fp8")
    if why:
        raise ValueError(why)
    _check_form(form, cache == "fp8", page)
    planned = form == "balanced"  # its outputs as a split build's, with both pointers
    constants = dict(CAUSAL=causal, DIRECT=direct and not planned, PAGE=page,
                     TMA_OUT=direct and form == "pairs" and cache != "fp8"
                     and not seesaw_gathers(page, False),
                     PDL=not direct or planned, WALK=WALKS[form], num_warps=NUM_WARPS)
    blocks = dict(qn_desc=(dtype, BLOCK_M, D_NOPE), qr_desc=(dtype, BLOCK_M, D_ROPE),
                  kn_desc=(cache, kv_box_rows(page), D_NOPE),
                  kr_desc=(cache, kv_box_rows(page), D_ROPE),
                  o_desc=(dtype, BLOCK_M, D_NOPE // 2))
    pointers = dict(bt_ptr="i32", seq_lens_ptr="i32",
                    out_ptr=dtype if direct or planned else "fp32", lse_ptr="fp32",
                    kv_ptr={"fp8": "fp8e4nv"}.get(cache, cache), kv_scale_ptr="fp32",
                    part_out_ptr="fp32", part_lse_ptr="fp32", work_ptr="i32",
                    work_indptr_ptr="i32", split_indptr_ptr="i32")
    return aot_compile_kernel(seesaw_kernel, constants, blocks, pointers, arch=arch,
                              num_warps=NUM_WARPS, maxnreg=MAXNREG)
