"""A warp-specialized "seesaw" MLA decode for Hopper (sm_90) in Triton's Gluon dialect.

A variant of ``gluon_hopper`` (same problem, same launcher interface, its S and softmax
steps; the shared helpers from ``gluon_common``), written against triton 3.6.0's Gluon API. Why
another schedule: ``gluon_hopper`` splits S = Q K^T across its two warpgroups
by key columns, so both read all of Q (72 KB) from shared memory every tile
and P goes through shared memory too; its per-tile time is the same whatever
the number of heads. Here each warpgroup computes S of a whole tile (Q read
once per tile) and the two alternate, so one's softmax runs while the other's
MMAs use the tensor cores (the schedule FlashMLA's deep dive calls "seesaw";
this is our own code).

Per program: 64 query rows (heads x qlen folded, as ``gluon_hopper``), Q in
shared memory once, a ring of two 64-key tiles (one page each; slot 0 holds the
even tiles, slot 1 the odd ones) and three partitions (``gl.warp_specialize``):
- loader (the default partition: 4 warps at 24 registers, one thread issues):
  Q, then each tile by TMA into its slot once both compute warpgroups have
  released the slot (``empty``, count 2), page id from the block table.
- WG0 (a worker partition, 4 warps) owns O[:, :256]; WG1 (4 warps) owns
  O[:, 256:]. For a pair of tiles (a = 2j in slot 0, b = 2j+1 in slot 1):
  WG0: S_a = Q K_a^T; m0 = max(m, rowmax S_a); P_a = exp2(S_a - m0), published
  (with m0) for WG1; O_L = O_L * 2^(m - m0) + P_a V_a[:, :256] (P_a from
  registers, the wgmma A operand); then, with WG1's m1: O_L *= 2^(m0 - m1);
  O_L += P_b V_b[:, :256] (P_b from shared memory).
  WG1: S_b issued first; with m0: O_R *= 2^(m - m0); O_R += P_a V_a[:, 256:]
  (shared) while S_b finishes; m1 = max(m0, rowmax S_b); P_b = exp2(S_b - m1),
  published (with m1); O_R *= 2^(m0 - m1); O_R += P_b V_b[:, 256:] (registers).
  Both end the pair at the running max m1. Each warpgroup keeps the row sum of
  its own tiles' P in the current max's base; the two sums are added at the end.
- P needs no buffer of its own: a tile's rope part (64 keys x 64 dims, the same
  size and swizzle as P) is dead once that tile's S is done (V is the first 512
  dims), so P_a is written over K_a's rope part and P_b over K_b's.
- An odd tile count: WG1's S of the missing tile reads a slot that nothing is
  loading (masked to weight 0 whatever it holds) and both skip its P V.
- Stale slots past the split's end in the last page (NaN in a real cache): each
  warpgroup zeroes the V rows of the half of V it reads before its P V; S of
  those keys is masked, never multiplied.
- Split-KV, the row mapping, causal verify rows, out and LSE as ``gluon_hopper``:
  one split writes out and the natural-log LSE directly; more write fp32
  partials (normalized output, base-2 LSE) merged by ``reduce.reduce_launcher``.
Registers: O's half (64 x 256 fp32) is 128 a thread, so the compute warpgroups get
240 (setmaxnreg) and the loader 24, over 12 warps at ``MAXNREG`` 168. The compute
warpgroups are both workers (not one the default partition) so that they compile
alike: as the default partition WG0 kept its scalars in registers and spilled.
The ``seesaw/gluon`` route runs it (first timed 2026-12-01: ``benchmarks/results/README.md``,
session 8, call 6); ``benchmarks/gluon_check.py`` times it as ``seesaw/gluon``.

The CHUNKED form (``decode_launcher(chunked=True)``; ``gluon_check``'s ``seesaw/gluon
chunked``; call 8: correct, 0-3.5% faster at every point; the route's param sets run it
since session 9, its stored rows without ``chunked`` the form above) aims at the
compute-bound gap to FlashMLA (2.28 us a 64-key tile per SM against 1.86 at (8, 128,
32768, 1)). Above, S of a tile starts only
when all of its 72 KB has landed, and WG1 asks for its next tile b only as it releases
slot 1, so its S waits out the copy's whole latency every pair. Chunked:
- each tile lands as 9 TMA boxes of [64, 64] (nope columns 64c..64c+63, then the rope
  part), each on its own barrier (``ready[9 * slot + c]``), from one descriptor over the
  cache's whole 576-wide rows (passed as ``kr_desc``); S = Q K^T is issued a chunk at a
  time (4 k-steps), each after its chunk's wait, so it starts on the first 8 KB;
- a slot is released in two groups, each by the one warpgroup that reads it last: the
  owner's V half (slot 0: columns 0-255, WG0; slot 1: 256-511, WG1) by the owner after
  its own P V, the other V half and the rope part (P) by the other warpgroup after its
  P V (``_release``; ``empty[2 * slot + group]``, count 1). The loader copies the
  owner's half first and S reads the chunks in that order (slot 1: 256-511 first), so
  WG0's next S starts on columns 0-255 that WG0 itself freed half a pair earlier.
The same ops otherwise; stale-row zeroing of tile a by WG0 moves after S (which has
waited for every chunk). Compiled (triton 3.6.0, sm_90a): 26 mbarriers, 222,688 bytes
of shared memory, 24 bytes of spills (72 above), no wgmma serialization. The SLIM form
(``decode_launcher(chunked=True, slim=True)``) runs each tile's softmax in fewer
instructions (``gluon_common.slim_softmax``: the bounds only on tiles that reach them, the
scale folded into the exponent's FMA), for the softmax on the critical path between the
two warpgroups: 0.97-1.00x the chunked form's time at 7 of issue 19's 8 points, 1.03x at
batch 1 (H200, 2026-12-01, session 14 calls 3 and 5). The LONE form (``lone_bars=True``,
of the slim one) gives each mbarrier its own allocation (``_lone_bars``): triton 3.6's
barrier analysis takes a wait as a write of its barrier and the rows of one allocation as
the same memory, so it puts a warpgroup bar.sync before every wait; with lone barriers a
warpgroup's pair passes about 8 instead of 24: 0.96-1.01x the slim form's time at issue
19's points, faster mostly unsplit (0.96x at (128, 16, 4096, 2), 0.98x at 128 heads; H200,
2026-12-01, session 16 call 2). The AFRESH form (``afresh_q=True``, of the lone one)
addresses Q each pair through the zero the compiler cannot prove, as the slots already are:
ptxas otherwise hoists Q's 9 chunk descriptors into general registers, moves them to uniform
ones before each wgmma (66 R2UR in WG0's pair loop) and spills some; with it the build has
no local memory: 0.97-1.00x the lone form's time at issue 19's seesaw points (H200,
2026-12-02, session 17 call 1); the route's param sets run it.

Tried and dropped (H200, 2026-12-01): the warpgroups handing each tile's row max over on
barriers of their own before the exponentials, P_a after WG1's max (FlashMLA's deep dive's
order), so that the two softmaxes overlap (session 13, commit 636020d): right, and
1.01-1.05x this form's time at every point (1.05x at 128 heads), 8 more bytes of spills.
16-bit split partials (session 16, branch ``next/seesaw-lone-half``): the partial outputs in
out's dtype, half the bytes written and read back; right, and 1.04-1.21x the lone form's time
wherever split (1.19x at (64, 64, 4096, 1), 1.21x at (128, 128, 4096, 1) in 2 splits), with
rel_l2 0.0023 against 0.0017. A lazy rescale (session 16, branch ``next/seesaw-lazy``): each
row's base kept until its max passes it by 2^8, O's rescale skipped while no row's base moved;
right (fp64 model to 3e-14), and 1.00-1.03x the lone form's time, rel_l2 0.0020 against
0.0017: the rescale is not what holds the pair back.
A lead form (session 14, commit 90cc006): slot 1 copied and read columns 0-255 first and
WG0's half of slot 0 released before it awaits P_b, so that each S's first chunks land
earlier: right, and 1.00-1.03x the chunked form's time (1.02x at (128, 128, 4096, 1),
1.03x at (8, 128, 32768, 1); ``benchmarks/results/README.md``, session 14, call 2). A
self-copy form (session 14, commit 0510a3b; the profile of call 4 has WG1 waiting about a
quarter of its time for slot 1's first chunk): the loader copied Q and the first two tiles
only, each compute warpgroup the next tiles' groups it read last, with no loader wake-up
between: right, and 1.03-1.11x the slim form's time (1.11x at 128 heads; 80 bytes of spills
against 32), so the wake-up is not what that wait is made of (call 5). A fine form
(session 17, branch ``next/seesaw-fine``): O's half as 4 accumulators of 64 columns, each
tile's V chunks released one piece at a time as its wgmma completes (18 release barriers),
Q afresh, no local memory in its pair loops: right, and 1.04-1.15x the afresh form's time at
every split of issue 19's seesaw points (1.12x at the best split at 128 heads and at (8, 128,
32768, 1); H200, 2026-12-02, call 3): four 64-wide wgmma groups a P V cost more than the
earlier release gains. Session 22 (H200, 2026-12-02; code in
``benchmarks/results/h200-s22-call2-20261202/named-early.patch``): the hand-over of P on
hardware barriers (``bar.arrive``/``bar.sync`` by inline PTX, no warpgroup barrier before a
one-thread arrival): 0.99-1.02x, so its latency is not the limit; FlashMLA's pair order again
on those barriers (WG1's own P_b V_b first, so slot 1's owner half is freed mid-pair; P_a
rescaled to m1 by WG0): 1.06x at (128, 128, 4096, 1), 1.00-1.08x elsewhere.

The TWO_REQUESTS form (``two_requests=True``, of the afresh one; kernel flag MULTI): a
program walks requests b and b + cdiv(batch, 2) (``_compute_units``, ``_loader_units``)
through the one ring, pairs counted across requests and slot 1 filled in a pair without a
tile b (its barriers' phases stay one a pair); the second's Q is copied once both
warpgroups are done with the first's (``q_free``), while they write its output. Where the
programs pass one wave it removes the second wave's start (every SM asking for Q and two
tiles at once): 0.988x at (128, 128, 4096, 1); where one wave holds them it halves the busy
SMs (1.45-1.89x), so the route offers it only past one wave (session 22, call 3). The ROPE
form (``rope_regs=True``, of the afresh one, with two_requests or without): Q's rope part
(64 x 64) in registers as the A operand of S's rope k-steps, loaded once a request, as
FlashMLA keeps it: S of 64 keys reads its two operands at the shared memory's whole rate, so
half that traffic on 4 of its 36 k-steps: 0.98-1.00x at the 128-head points,
0.99-1.005x elsewhere (call 5); the route's sets run it.
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlatune.kernels.gluon_common import (
    LOG2E,
    aot_compile_kernel,
    compile_options,
    first_masked_key,
    issue_kv,
    key_range,
    last_keys,
    no_shift,
    nvmma_layout,
    online_softmax,
    outputs_and_splits,
    partials_and_merge,
    program_keys,
    slim_softmax,
    store_row_lse,
    tma_descriptors,
    zero_stale_rows,
)
from mlatune.kernels.gluon_hopper import _issue_scores, check_supported
from mlatune.kernels.gluon_hopper_plan import (
    BLOCK_M,
    BLOCK_N,
    D_NOPE,
    D_ROPE,
    PAGE_SIZE,
)

NUM_WARPS = 4  # the default partition: the loader (one thread issues); WG0, WG1: workers
COMPUTE_REGS = gl.constexpr(240)  # a compute warpgroup's registers a thread (O's half alone is 128)
LOADER_REGS = gl.constexpr(24)
UNITS_A_PROGRAM = gl.constexpr(2)  # the two_requests form's requests a program (MULTI)
MAXNREG = 168  # 12 warps (3 warpgroups) x 168 = the SM's 64K registers, rounded down

__all__ = ["aot_compile", "decode_launcher", "seesaw_decode", "seesaw_kernel"]


@gluon.jit
def _loader(descs, bufs, bars, bt_row, q_row, start, n_tiles, PAGE: gl.constexpr,
            CHUNKED: gl.constexpr, LONE: gl.constexpr):
    """Q once, then tile t into slot t % 2 as soon as both warpgroups have released it."""
    qn_desc, qr_desc = descs[:2]
    q_bar = bars[0]
    mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, bufs[0])
    tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, bufs[1])
    if CHUNKED:
        _load_tiles_chunked(descs[3], bufs, bars, bt_row, start, n_tiles, PAGE, LONE)
    else:
        _load_tiles(descs, bufs, bars, bt_row, start, n_tiles, PAGE)


@gluon.jit
def _loader_units(descs, bufs, bars, bt_ptr, stride_bt, ints, walk, PAGE: gl.constexpr,
                  CAUSAL: gl.constexpr):
    """The loader of the two_requests form: for each of the program's requests
    (``_compute_units``) its Q once both warpgroups are done with the last one's
    (``q_free``), then its tiles through the one ring, pairs counted across requests, slot 1
    filled in a pair without a tile b too (so that its barriers' phases stay one a pair)."""
    qn_desc, qr_desc, kc_desc = descs[0], descs[1], descs[3]
    seq_lens_ptr, batch, q_free = walk
    rb, split, num_splits, qlen, heads = ints[4], ints[6], ints[7], ints[8], ints[9]
    q_bar = bars[0]
    BM: gl.constexpr = qn_desc.block_type.shape[0]
    BN: gl.constexpr = kc_desc.block_type.shape[0]
    j0 = 0
    for k in gl.static_range(UNITS_A_PROGRAM):
        b = gl.program_id(2) + k * gl.num_programs(2)
        if b < batch:
            seq_len = gl.load(seq_lens_ptr + b)
            start, _, n_tiles = key_range(seq_len, rb, split, num_splits, qlen, heads, BM, BN,
                                          CAUSAL)
            if k > 0:
                mbarrier.wait(q_free, (k - 1) & 1)
            q_row = b * qlen * heads + rb * BM
            mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, bufs[0])
            tma.async_copy_global_to_shared(qr_desc, [q_row, 0], q_bar, bufs[1])
            _load_tiles_chunked(kc_desc, bufs, bars, bt_ptr + b.to(gl.int64) * stride_bt,
                                start, n_tiles, PAGE, True, j0, True)
            j0 += (n_tiles + 1) // 2


@gluon.jit
def _load_tiles(descs, bufs, bars, bt_row, start, n_tiles, PAGE: gl.constexpr):
    kn_desc, kr_desc = descs[2:]
    k_nope, k_rope = bufs[2:4]
    ready, empty = bars[1:3]
    BN: gl.constexpr = kn_desc.block_type.shape[0]
    for t in range(n_tiles):
        slot = t % 2
        # A fresh barrier counts as phase 1 complete: the first wait on each slot passes.
        mbarrier.wait(empty.index(slot), ((t // 2) & 1) ^ 1)
        # The warpgroups wrote the slot (P, zeroed rows) through the generic proxy.
        fence_async_shared()
        issue_kv(kn_desc, kr_desc, k_nope.index(slot), k_rope.index(slot), ready.index(slot),
                  bt_row, start + t * BN, True, PAGE)


@gluon.jit
def _load_tiles_chunked(kc_desc, bufs, bars, bt_row, start, n_tiles, PAGE: gl.constexpr,
                        LONE: gl.constexpr, j0=0, PAD: gl.constexpr = False):
    """``_load_tiles`` with each tile copied in 9 chunks of 64 columns, each on its own
    barrier (``ready[9 * slot + c]``: nope columns [64c, 64c + 64), c = 8 the rope part),
    in two groups released apart (see ``_release``): the owner's V half first, then the rest.
    ``j0``: pairs copied before (the units form); PAD: slot 1 filled (with tile a's page) in
    a pair without a tile b."""
    k_nope, k_rope = bufs[2:4]
    ready, empty = bars[1:3]
    BN: gl.constexpr = kc_desc.block_type.shape[0]
    for j in range((n_tiles + 1) // 2):
        ph = ((j0 + j) & 1) ^ 1  # a fresh barrier counts as phase 1 complete: first waits pass
        key = start + 2 * j * BN
        _load_tile_chunked(kc_desc, k_nope.index(0), k_rope.index(0), ready, empty, 0, ph,
                           bt_row, key, PAGE, LONE)
        if 2 * j + 1 < n_tiles:
            _load_tile_chunked(kc_desc, k_nope.index(1), k_rope.index(1), ready, empty, 1, ph,
                               bt_row, key + BN, PAGE, LONE)
        elif PAD:
            _load_tile_chunked(kc_desc, k_nope.index(1), k_rope.index(1), ready, empty, 1, ph,
                               bt_row, key, PAGE, LONE)


@gluon.jit
def _load_tile_chunked(kc_desc, kn, kr, ready, empty, SLOT: gl.constexpr, ph, bt_row, key,
                       PAGE: gl.constexpr, LONE: gl.constexpr):
    """One tile into slot SLOT: its owner's V half (slot 0: columns 0-255, slot 1: 256-511)
    once the owner released it, then the other half and the rope part."""
    W: gl.constexpr = kc_desc.block_type.shape[1]
    page = gl.load(bt_row + key // PAGE)
    row = page * PAGE + key % PAGE
    for g in gl.static_range(2):
        mbarrier.wait(_bar(empty, 2 * SLOT + g, LONE), ph)
        fence_async_shared()  # the warpgroups wrote the slot (P, zeroed rows) as generic proxy
        # Chunk (4 (SLOT + g) + i) % 8: slot 0 copies columns 0-255 first, slot 1 256-511.
        for c in gl.static_range(4 * (SLOT + g), 4 * (SLOT + g) + 4):
            bar = _bar(ready, 9 * SLOT + c % 8, LONE)
            mbarrier.expect(bar, kc_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kc_desc, [row, c % 8 * W], bar,
                                            kn.slice(c % 8 * W, W, dim=1))
    bar = _bar(ready, 9 * SLOT + 8, LONE)
    mbarrier.expect(bar, kc_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kc_desc, [row, kn.shape[1]], bar, kr)


@gluon.jit
def _scores_chunked(q_nope, q_rope, kn, kr, ready, SLOT: gl.constexpr, ph, pred,
                    s_layout: gl.constexpr, LONE: gl.constexpr):
    """S = Q K^T of the tile in slot SLOT, each 64-column step issued as soon as its chunk
    has landed, in the order the loader copies them (the owner's V half first, rope last)."""
    W: gl.constexpr = kr.shape[1]
    BM: gl.constexpr = q_nope.shape[0]
    BN: gl.constexpr = kn.shape[0]
    s = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    for c in gl.static_range(4 * SLOT, 4 * SLOT + 8):  # chunk c % 8
        mbarrier.wait(_bar(ready, 9 * SLOT + c % 8, LONE), ph, pred=pred)
        s = warpgroup_mma(q_nope.slice(c % 8 * W, W, dim=1),
                          kn.slice(c % 8 * W, W, dim=1).permute((1, 0)), s,
                          use_acc=c > 4 * SLOT, is_async=True)
    mbarrier.wait(_bar(ready, 9 * SLOT + 8, LONE), ph, pred=pred)
    return warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)


@gluon.jit
def _wait_half(ready, SLOT: gl.constexpr, HALF: gl.constexpr, ph, pred, CHUNKED: gl.constexpr,
               LONE: gl.constexpr):
    """Wait until the V half HALF (0: columns 0-255) of slot SLOT has landed."""
    if CHUNKED:
        for i in gl.static_range(4):
            mbarrier.wait(_bar(ready, 9 * SLOT + 4 * HALF + i, LONE), ph, pred=pred)
    else:
        mbarrier.wait(ready.index(SLOT), ph, pred=pred)


@gluon.jit
def _release(empty, SLOT: gl.constexpr, WG: gl.constexpr, CHUNKED: gl.constexpr,
             LONE: gl.constexpr):
    """Warpgroup WG is done with slot SLOT. Chunked, the slot's two groups are each read by
    one warpgroup last: the owner's V half by the owner (WG0 owns slot 0, WG1 slot 1), the
    other V half and the rope part (P) by the other: ``empty[2 * SLOT + (WG != SLOT)]``,
    count 1; else ``empty[SLOT]``, count 2."""
    if CHUNKED:
        mbarrier.arrive(_bar(empty, 2 * SLOT + (WG != SLOT), LONE))
    else:
        mbarrier.arrive(empty.index(SLOT))


@gluon.jit
def _bar(group, i: gl.constexpr, LONE: gl.constexpr):
    """Barrier i of a group: its own allocation (LONE: the group is a tuple of them) or a row
    of the group's one allocation."""
    return group[i] if LONE else group.index(i)


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
def _softmax(s, qk_scale, n0, end, bounds, cols, m_i, l_i, SLIM: gl.constexpr):
    """One tile's online softmax of raw scores: ``slim_softmax`` (SLIM) or ``online_softmax``.
    ``bounds``: the rows' last keys (``last_keys``) and the first key some row may not see."""
    last_pos, mask_from = bounds
    if SLIM:
        p, m_new, l_new, alpha = slim_softmax(s, qk_scale, n0, end, last_pos, cols, m_i, l_i,
                                              mask_from)
    else:
        p, m_new, l_new, alpha = online_softmax(s * qk_scale, n0, end, last_pos, cols, m_i,
                                                l_i, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _zero_if_last(v, n0, end):
    """Zero the V rows past ``end`` of the tile at ``n0`` (only the last tile has any)."""
    if n0 + v.shape[0] > end:
        zero_stale_rows(v, end - n0, 4)


@gluon.jit
def _halves(kn_a, kn_b, half: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """The V columns a warpgroup owns in both tiles of a pair, and S's key columns."""
    DH: gl.constexpr = o_layout.instr_shape[1]
    cols = gl.arange(0, kn_a.shape[0], layout=gl.SliceLayout(0, s_layout))
    return kn_a.slice(half * DH, DH, dim=1), kn_b.slice(half * DH, DH, dim=1), cols


@gluon.jit
def _pair_wg0(bufs, kv, bars, ph, n0, end, has_b, bounds, qk_scale, m_run, l_run, acc,
              s_layout: gl.constexpr, o_layout: gl.constexpr, CHUNKED: gl.constexpr,
              SLIM: gl.constexpr, LONE: gl.constexpr):
    """WG0's half of a pair: its own tile a (slot 0), then WG1's tile b (slot 1)."""
    q_nope, q_rope, m_buf = bufs[0], bufs[1], bufs[4]
    kn_a, kr_a, kn_b, kr_b = kv
    ready, empty, p_bars = bars[1:4]
    v_a, v_b, cols = _halves(kn_a, kn_b, 0, s_layout, o_layout)
    BN: gl.constexpr = kn_a.shape[0]
    if CHUNKED:
        s = _scores_chunked(q_nope, q_rope, kn_a, kr_a, ready, 0, ph, True, s_layout, LONE)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        _zero_if_last(v_a, n0, end)  # after S, which has waited for every chunk
    else:
        mbarrier.wait(ready.index(0), ph)
        _zero_if_last(v_a, n0, end)
        s = _issue_scores(q_nope, q_rope, kn_a, kr_a, s_layout)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    p, m0, l_run, alpha = _softmax(s, qk_scale, n0, end, bounds, cols, m_run, l_run, SLIM)
    p = p.to(kr_a.dtype)
    _publish(p, kr_a, _row_slot(m_buf, 0), m0, _bar(p_bars, 0, LONE))
    acc = _scale_rows(acc, alpha, o_layout)
    p_op = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    acc = warpgroup_mma(p_op, v_a, acc, is_async=True)
    mbarrier.wait(_bar(p_bars, 1, LONE), ph)
    m1 = _row_slot(m_buf, 1).load(gl.SliceLayout(1, s_layout))
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    _release(empty, 0, 0, CHUNKED, LONE)
    alpha = gl.exp2(m0 - no_shift(m1))
    acc = _scale_rows(acc, alpha, o_layout)
    if has_b:
        _wait_half(ready, 1, 0, ph, True, CHUNKED, LONE)
        _zero_if_last(v_b, n0 + BN, end)
        acc = warpgroup_mma(kr_b, v_b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _release(empty, 1, 0, CHUNKED, LONE)
    return acc, m1, l_run * alpha


@gluon.jit
def _pair_wg1(bufs, kv, bars, ph, n0, end, has_b, bounds, qk_scale, m_run, l_run, acc,
              s_layout: gl.constexpr, o_layout: gl.constexpr, CHUNKED: gl.constexpr,
              SLIM: gl.constexpr, LONE: gl.constexpr, PAD: gl.constexpr = False):
    """WG1's half of a pair: S of its own tile b first, WG0's P_a V_a while S_b finishes.
    PAD: slot 1 is filled in a pair without a tile b too, and waited for."""
    kn_a, kr_a, kn_b, kr_b = kv
    q_nope, q_rope, m_buf = bufs[0], bufs[1], bufs[4]
    ready, empty, p_bars = bars[1:4]
    v_a, v_b, cols = _halves(kn_a, kn_b, 1, s_layout, o_layout)
    n1 = n0 + kn_a.shape[0]
    # Without a tile b (odd count), S_b reads whatever slot 1 holds: all masked (n1 >= end).
    if CHUNKED:
        s = _scores_chunked(q_nope, q_rope, kn_b, kr_b, ready, 1, ph, has_b | PAD, s_layout,
                            LONE)
    else:
        mbarrier.wait(ready.index(1), ph, pred=has_b)
        s = _issue_scores(q_nope, q_rope, kn_b, kr_b, s_layout)
    _wait_half(ready, 0, 1, ph, True, CHUNKED, LONE)
    mbarrier.wait(_bar(p_bars, 0, LONE), ph)
    m0 = _row_slot(m_buf, 0).load(gl.SliceLayout(1, s_layout))
    alpha = gl.exp2(m_run - no_shift(m0))
    acc = _scale_rows(acc, alpha, o_layout)
    _zero_if_last(v_a, n0, end)
    acc = warpgroup_mma(kr_a, v_a, acc, is_async=True)
    # wgmma groups retire in order: one outstanding leaves P_a V_a running.
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    p, m1, l_run, alpha = _softmax(s, qk_scale, n1, end, bounds, cols, m0, l_run * alpha, SLIM)
    p = p.to(kr_a.dtype)
    _publish(p, kr_b, _row_slot(m_buf, 1), m1, _bar(p_bars, 1, LONE))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _release(empty, 0, 1, CHUNKED, LONE)
    acc = _scale_rows(acc, alpha, o_layout)
    if has_b:
        _zero_if_last(v_b, n1, end)
        p_op = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                        k_width=2))
        acc = warpgroup_mma(p_op, v_b, acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    _release(empty, 1, 1, CHUNKED, LONE)
    return acc, m1, l_run


@gluon.jit
def _afresh(buf, zero):
    """``buf`` (2-D) through a leading index ``zero`` (0, unprovable to the compiler), so that
    the wgmma descriptors over it stay loop variant (not hoisted into spilled registers)."""
    return buf._reinterpret(buf.dtype, [1, buf.shape[0], buf.shape[1]], buf.layout).index(zero)


@gluon.jit
def _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, WG: gl.constexpr,
             CAUSAL: gl.constexpr, DIRECT: gl.constexpr, CHUNKED: gl.constexpr,
             SLIM: gl.constexpr = False, LONE: gl.constexpr = False,
             AFRESH: gl.constexpr = False, ROPE: gl.constexpr = False):
    """One compute warpgroup: its walk over the pairs of tiles, then its half of the output.
    AFRESH (of the lone form): Q too addressed through the unprovable zero each pair. ROPE
    (of the afresh form): Q's rope part in registers (``_walk_pairs``)."""
    acc, m_run, l_run = _walk_pairs(bufs, bars, ints, qk_scale, 0, 0, WG, CAUSAL, CHUNKED,
                                    SLIM, LONE, AFRESH, False, ROPE)
    _finish(acc, m_run, l_run, bufs[5], bars[4], 0, 0, out_ptr, lse_ptr, ints, WG, DIRECT)


@gluon.jit
def _compute_units(bufs, bars, out_ptr, lse_ptr, ints, walk, qk_scale, WG: gl.constexpr,
                   CAUSAL: gl.constexpr, DIRECT: gl.constexpr, ROPE: gl.constexpr):
    """The two_requests form (MULTI, of the afresh one): this program's requests b0, b0 + n
    (n the grid's third size; UNITS_A_PROGRAM of them), one after another; Q of the next is
    copied while this warpgroup finishes the last one's output (``q_free``,
    ``_loader_units``)."""
    seq_lens_ptr, batch, q_free = walk
    rb, split, num_splits, qlen, heads = ints[4], ints[6], ints[7], ints[8], ints[9]
    BM: gl.constexpr = bufs[0].shape[0]
    BN: gl.constexpr = bufs[2].shape[1]
    j0 = 0
    for k in gl.static_range(UNITS_A_PROGRAM):
        b = gl.program_id(2) + k * gl.num_programs(2)
        if b < batch:
            seq_len = gl.load(seq_lens_ptr + b)
            start, end, n_tiles = key_range(seq_len, rb, split, num_splits, qlen, heads, BM,
                                            BN, CAUSAL)
            unit = (start, end, n_tiles, seq_len, rb, b) + ints[6:]  # noqa: RUF005 (JIT)
            acc, m_run, l_run = _walk_pairs(bufs, bars, unit, qk_scale, j0, k & 1, WG, CAUSAL,
                                            True, True, True, True, True, ROPE)
            gl.thread_barrier()  # the warpgroup's last S (read Q) precedes the one arrival
            mbarrier.arrive(q_free)
            _finish(acc, m_run, l_run, bufs[5], bars[4], k & 1, (k & 1) * 2, out_ptr, lse_ptr,
                    unit, WG, DIRECT)
            j0 += (n_tiles + 1) // 2


@gluon.jit
def _walk_pairs(bufs, bars, ints, qk_scale, j0, q_phase, WG: gl.constexpr,
                CAUSAL: gl.constexpr, CHUNKED: gl.constexpr, SLIM: gl.constexpr,
                LONE: gl.constexpr, AFRESH: gl.constexpr, PAD: gl.constexpr,
                ROPE: gl.constexpr = False):
    """A warpgroup's walk over the pairs of one (request, split)'s tiles: (O's half, the rows'
    max, this warpgroup's row sums). ``j0``: pairs this program walked before (the ring's
    phases); the forms as ``_compute``'s; PAD (two_requests): slot 1 waited for in a pair
    without a tile b, which the loader then fills too. ROPE: Q's rope part (64 x 64) held in
    registers as S's last k-steps' A operand, read from shared memory once instead of each
    tile: S = Q K^T of 64 keys reads its two operands at the shared memory's whole rate
    (FlashMLA keeps the same part of Q in registers)."""
    q_nope, k_nope, k_rope = bufs[0], bufs[2], bufs[3]
    BM: gl.constexpr = q_nope.shape[0]
    BN: gl.constexpr = k_nope.shape[1]
    DH: gl.constexpr = q_nope.shape[1] // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    start, end, n_tiles, seq_len, rb = ints[:5]
    qlen, heads = ints[8:10]
    last_pos = last_keys(rb, seq_len, qlen, heads, BM, row_s, CAUSAL)
    bounds = (last_pos, first_masked_key(end, last_pos))
    m_run = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_run = gl.full([BM], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([BM, DH], gl.float32, layout=o_layout)
    mbarrier.wait(bars[0], q_phase)
    if ROPE:
        q_rope_op = bufs[1].load(gl.DotOperandLayout(operand_index=0, parent=s_layout,
                                                     k_width=2))
    for j in range((n_tiles + 1) // 2):
        # j >> 30 is 0, which the compiler cannot prove: slot addresses stay loop
        # variant, so their 36 wgmma descriptors are not hoisted into (spilled) registers.
        kv = (k_nope.index(j >> 30), k_rope.index(j >> 30), k_nope.index(1 + (j >> 30)),
              k_rope.index(1 + (j >> 30)))
        n0 = start + 2 * j * BN
        has_b = 2 * j + 1 < n_tiles
        ph = (j0 + j) & 1
        # AFRESH: Q's 9 chunk descriptors likewise (else hoisted into registers, juggled
        # to uniform ones before each wgmma and partly spilled).
        pair_bufs = (_afresh(q_nope, j >> 30), q_rope_op if ROPE else _afresh(bufs[1], j >> 30),
                     bufs[2], bufs[3], bufs[4], bufs[5]) if AFRESH else bufs
        if WG == 0:
            acc, m_run, l_run = _pair_wg0(pair_bufs, kv, bars, ph, n0, end, has_b, bounds,
                                          qk_scale, m_run, l_run, acc, s_layout, o_layout,
                                          CHUNKED, SLIM, LONE)
        else:
            acc, m_run, l_run = _pair_wg1(pair_bufs, kv, bars, ph, n0, end, has_b, bounds,
                                          qk_scale, m_run, l_run, acc, s_layout, o_layout,
                                          CHUNKED, SLIM, LONE, PAD)
    return acc, m_run, l_run


@gluon.jit
def _finish(acc, m_run, l_run, l_buf, l_bar, l_phase, SLOT0: gl.constexpr, out_ptr, lse_ptr,
            ints, WG: gl.constexpr, DIRECT: gl.constexpr):
    """The row sums added across the warpgroups (on ``l_bar``, through the two row slots of
    ``l_buf`` from SLOT0), both in the final max's base, then this warpgroup's output."""
    BM: gl.constexpr = m_run.shape[0]
    row_s: gl.constexpr = m_run.type.layout
    o_layout: gl.constexpr = acc.type.layout
    l_buf.slice((SLOT0 + WG) * BM, BM).store(l_run)
    gl.thread_barrier()
    mbarrier.arrive(l_bar)
    mbarrier.wait(l_bar, l_phase)
    l_run = l_run + l_buf.slice((SLOT0 + 1 - WG) * BM, BM).load(row_s)
    _epilogue(acc, m_run, l_run, out_ptr, lse_ptr, ints, WG, DIRECT, o_layout)


@gluon.jit
def _epilogue(acc, m_i, l_i, out_ptr, lse_ptr, ints, WG: gl.constexpr, DIRECT: gl.constexpr,
              o_layout: gl.constexpr):
    """Store this warpgroup's 256 columns of the normalized output (and, WG0, the LSE).

    Straight from the accumulator's registers: the output is 1/72 of the bytes the
    program reads, and a staging buffer would not fit next to Q and the ring.
    """
    rb, b, split, num_splits, qlen, heads = ints[4:10]
    stride_o_tok, stride_o_head = ints[10:12]
    stride_po_slot, stride_po_row = ints[13:15]
    BM: gl.constexpr = acc.shape[0]
    DH: gl.constexpr = acc.shape[1]
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_i, row_o)
    has_keys = l_o > 0.0
    inv = gl.where(has_keys, 1.0 / gl.where(has_keys, l_o, gl.full_like(l_o, 1.0)),
                   gl.zeros_like(l_o))
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


@gluon.jit
def _wg0(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
         DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 0, CAUSAL, DIRECT, False)


@gluon.jit
def _wg0_chunked(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
                 DIRECT: gl.constexpr):
    # A worker's arguments reach it as values (constexprs too): the form is in its name.
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 0, CAUSAL, DIRECT, True)


@gluon.jit
def _wg1(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
         DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 1, CAUSAL, DIRECT, False)


@gluon.jit
def _wg1_chunked(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
                 DIRECT: gl.constexpr):
    # A worker's arguments reach it as values (constexprs too): the form is in its name.
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 1, CAUSAL, DIRECT, True)


@gluon.jit
def _wg0_slim(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
              DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 0, CAUSAL, DIRECT, True, True)


@gluon.jit
def _wg1_slim(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
              DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 1, CAUSAL, DIRECT, True, True)


@gluon.jit
def _wg0_lone(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
              DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 0, CAUSAL, DIRECT, True, True, True)


@gluon.jit
def _wg1_lone(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
              DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 1, CAUSAL, DIRECT, True, True, True)


@gluon.jit
def _wg0_afresh(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
                DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 0, CAUSAL, DIRECT, True, True, True,
             True)


@gluon.jit
def _wg1_afresh(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
                DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 1, CAUSAL, DIRECT, True, True, True,
             True)


@gluon.jit
def _wg0_units(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
               DIRECT: gl.constexpr, walk):
    _compute_units(bufs, bars, out_ptr, lse_ptr, ints, walk, qk_scale, 0, CAUSAL, DIRECT, False)


@gluon.jit
def _wg1_units(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
               DIRECT: gl.constexpr, walk):
    _compute_units(bufs, bars, out_ptr, lse_ptr, ints, walk, qk_scale, 1, CAUSAL, DIRECT, False)


@gluon.jit
def _wg0_units_rope(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
                    DIRECT: gl.constexpr, walk):
    _compute_units(bufs, bars, out_ptr, lse_ptr, ints, walk, qk_scale, 0, CAUSAL, DIRECT, True)


@gluon.jit
def _wg1_units_rope(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
                    DIRECT: gl.constexpr, walk):
    _compute_units(bufs, bars, out_ptr, lse_ptr, ints, walk, qk_scale, 1, CAUSAL, DIRECT, True)


@gluon.jit
def _wg0_rope(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
              DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 0, CAUSAL, DIRECT, True, True, True,
             True, True)


@gluon.jit
def _wg1_rope(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL: gl.constexpr,
              DIRECT: gl.constexpr):
    _compute(bufs, bars, out_ptr, lse_ptr, ints, qk_scale, 1, CAUSAL, DIRECT, True, True, True,
             True, True)


@gluon.jit(do_not_specialize=["num_splits", "qlen", "heads", "batch"])
def seesaw_kernel(qn_desc, qr_desc, kn_desc, kr_desc,  # TMA: q's and the cache's two parts
                  # (CHUNKED: kr_desc is the cache's whole rows in [64, 64] blocks instead)
                  bt_ptr, seq_lens_ptr, out_ptr, lse_ptr, num_splits, qlen, heads, qk_scale,
                  stride_bt, stride_o_tok, stride_o_head, stride_lse_tok,  # direct out
                  stride_po_slot, stride_po_row, stride_pl_slot,  # fp32 partials
                  CAUSAL: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr,
                  CHUNKED: gl.constexpr, PDL: gl.constexpr, SLIM: gl.constexpr,
                  LONE: gl.constexpr, num_warps: gl.constexpr, AFRESH: gl.constexpr = False,
                  MULTI: gl.constexpr = False, ROPE: gl.constexpr = False, batch=1):
    BM: gl.constexpr = qn_desc.block_type.shape[0]
    BN: gl.constexpr = kn_desc.block_type.shape[0]
    dtype: gl.constexpr = qn_desc.dtype
    rb, split, b, seq_len, start, end, n_tiles = program_keys(
        seq_lens_ptr, num_splits, qlen, heads, BM, BN, CAUSAL, PDL)

    q_nope = gl.allocate_shared_memory(dtype, qn_desc.block_type.shape, qn_desc.layout)
    q_rope = gl.allocate_shared_memory(dtype, qr_desc.block_type.shape, qr_desc.layout)
    k_nope = gl.allocate_shared_memory(dtype, [2, BN, kn_desc.block_type.shape[1]], kn_desc.layout)
    k_rope = gl.allocate_shared_memory(dtype, [2, BN, kr_desc.block_type.shape[1]], kr_desc.layout)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    m_buf = gl.allocate_shared_memory(gl.float32, [2 * BM], rows_layout)  # m0, m1 of a pair
    # Each warpgroup's row sum (MULTI: a pair of slots a request's parity).
    l_buf = gl.allocate_shared_memory(gl.float32, [(4 if MULTI else 2) * BM], rows_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    l_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    # Chunked: a barrier a 64-column chunk (9 a slot) and two release groups a slot; P_a and
    # m0, P_b and m1. LONE: each barrier its own allocation (``_lone_bars``).
    if LONE:
        ready = _lone_bars(18, bar_layout)
        empty = _lone_bars(4, bar_layout)
        p_bars = _lone_bars(2, bar_layout)
    else:
        ready = gl.allocate_shared_memory(gl.int64, [18 if CHUNKED else 2, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [4 if CHUNKED else 2, 1], bar_layout)
        p_bars = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    mbarrier.init(l_bar, count=2)
    if MULTI:  # both warpgroups are done with a request's Q
        q_free = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        mbarrier.init(q_free, count=2)
    if CHUNKED:
        for i in gl.static_range(18):
            mbarrier.init(_bar(ready, i, LONE), count=1)
        for i in gl.static_range(4):
            mbarrier.init(_bar(empty, i, LONE), count=1)  # one warpgroup reads each group last
        for i in gl.static_range(2):
            mbarrier.init(_bar(p_bars, i, LONE), count=1)
    else:
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both warpgroups release a slot
            mbarrier.init(p_bars.index(i), count=1)
    fence_async_shared()

    bufs = (q_nope, q_rope, k_nope, k_rope, m_buf, l_buf)
    bars = (q_bar, ready, empty, p_bars, l_bar)
    ints = (start, end, n_tiles, seq_len, rb, b, split, num_splits, qlen, heads,
            stride_o_tok, stride_o_head, stride_lse_tok, stride_po_slot, stride_po_row,
            stride_pl_slot)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    q_row = b * qlen * heads + rb * BM
    compute_args = (bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL, DIRECT)
    # The loader is the default partition: as workers, both compute warpgroups get the
    # same register budget and take their scalars from shared memory alike.
    if MULTI:
        walk = (seq_lens_ptr, batch, q_free)
        units_args = (bufs, bars, out_ptr, lse_ptr, ints, qk_scale, CAUSAL, DIRECT, walk)
        gl.warp_specialize([
            (_loader_units, ((qn_desc, qr_desc, kn_desc, kr_desc), bufs, bars, bt_ptr,
                             stride_bt, ints, walk, PAGE, CAUSAL)),
            (_wg0_units_rope if ROPE else _wg0_units, units_args),
            (_wg1_units_rope if ROPE else _wg1_units, units_args),
        ], [4, 4], [COMPUTE_REGS, COMPUTE_REGS])
    else:
        gl.warp_specialize([
            (_loader, ((qn_desc, qr_desc, kn_desc, kr_desc), bufs, bars, bt_row, q_row, start,
                       n_tiles, PAGE, CHUNKED, LONE)),
            (_wg0_rope if ROPE else _wg0_afresh if AFRESH else
             _wg0_lone if LONE else _wg0_slim if SLIM else _wg0_chunked if CHUNKED else _wg0,
             compute_args),
            (_wg1_rope if ROPE else _wg1_afresh if AFRESH else
             _wg1_lone if LONE else _wg1_slim if SLIM else _wg1_chunked if CHUNKED else _wg1,
             compute_args),
        ], [4, 4], [COMPUTE_REGS, COMPUTE_REGS])


# Host side -------------------------------------------------------------------------------

def _chunk_descriptor(kv_cache: torch.Tensor) -> TensorDescriptor:
    """The cache's whole (page, slot) rows, 576 wide, in [64, 64] blocks: the chunked form's
    copies (nope chunk c at column 64c, the rope part at 512), in the rope part's layout."""
    block = [BLOCK_N, D_ROPE]
    return TensorDescriptor(kv_cache, [kv_cache.shape[0] * kv_cache.shape[1], D_NOPE + D_ROPE],
                            [kv_cache.stride(1), 1], block, nvmma_layout(block, kv_cache.dtype))


def _check_form(chunked: bool, slim: bool, lone_bars: bool = False,
                afresh_q: bool = False, two_requests: bool = False,
                rope_regs: bool = False) -> None:
    # The workers of each form are functions of their own: slim is chunked, lone_bars slim,
    # afresh_q lone, two_requests and rope_regs afresh.
    if slim and not chunked:
        raise ValueError("slim is a form of the chunked kernel: pass chunked=True too")
    if lone_bars and not slim:
        raise ValueError("lone_bars is a form of the slim kernel: pass chunked=slim=True too")
    if afresh_q and not lone_bars:
        raise ValueError("afresh_q is a form of the lone-barrier kernel: pass lone_bars=True too")
    for name, on in (("two_requests", two_requests), ("rope_regs", rope_regs)):
        if on and not afresh_q:
            raise ValueError(f"{name} is a form of the afresh kernel: pass afresh_q=True too")


def decode_launcher(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    num_splits: int | None = None, max_seq_len: int | None = None,
                    chunked: bool = False, pdl: bool = False, slim: bool = False,
                    lone_bars: bool = False, afresh_q: bool = False,
                    two_requests: bool = False, rope_regs: bool = False
                    ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A zero-argument launch of the seesaw decode, with the out and LSE it writes.

    Tensors and arguments as ``gluon_hopper.decode_launcher`` (page 64, bf16/fp16,
    ``num_splits`` None: ``pick_splits``); capturable. ``chunked``: the kernel's CHUNKED
    form (each tile copied in 64-column chunks, S started on the first; module docstring).
    ``pdl``: with more than one split, the reduce kernel is a programmatic dependent launch,
    started as this kernel's blocks begin (``gluon_common.program_keys``). ``slim`` (chunked
    only): the softmax in fewer instructions (``gluon_common.slim_softmax``). ``lone_bars``
    (slim only): each mbarrier its own allocation (``_lone_bars``), which drops most of the
    warpgroup barriers triton 3.6 puts before the waits. ``afresh_q`` (lone only):
    Q addressed each pair through a zero the compiler cannot prove, so that
    ptxas does not hoist Q's wgmma descriptors into registers (``_afresh``). ``two_requests``
    (afresh only): each program walks requests b and b + cdiv(batch, 2), the second's Q and
    first tiles copied while the first's output is written (``_compute_units``).
    ``rope_regs`` (afresh only, with two_requests or without): Q's rope part in registers
    (``_walk_pairs``).
    """
    _check_form(chunked, slim, lone_bars, afresh_q, two_requests, rope_regs)
    if slim and not sm_scale > 0:  # slim_softmax takes the max of the unscaled scores
        raise ValueError(f"the slim form needs a positive sm_scale, got {sm_scale}")
    why = check_supported(q, kv_cache, block_table, seq_lens)
    if why is not None:
        raise ValueError(f"gluon seesaw MLA decode: {why}")
    batch, heads = seq_lens.shape[0], q.shape[1]
    if q.shape[0] != batch * qlen:
        raise ValueError(f"q has {q.shape[0]} tokens, expected batch {batch} x qlen {qlen}")
    rows = qlen * heads
    row_blocks = triton.cdiv(rows, BLOCK_M)
    out, lse, num_splits = outputs_and_splits(q, seq_lens, out, lse, row_blocks, num_splits,
                                              max_seq_len)
    grid = (row_blocks, num_splits,
            triton.cdiv(batch, UNITS_A_PROGRAM.value) if two_requests else batch)
    descs = tma_descriptors(q, kv_cache, BLOCK_M)
    if chunked:
        descs = (*descs[:3], _chunk_descriptor(kv_cache))
    head = (*descs, block_table, seq_lens)
    sizes = (num_splits, qlen, heads, sm_scale * LOG2E, block_table.stride(0))
    meta = dict(CAUSAL=causal and qlen > 1, PAGE=PAGE_SIZE, CHUNKED=chunked, SLIM=slim,
                LONE=lone_bars, AFRESH=afresh_q, MULTI=two_requests, ROPE=rope_regs, batch=batch,
                **compile_options(NUM_WARPS, MAXNREG))
    if num_splits == 1:
        args = (*head, out, lse, *sizes, out.stride(0), out.stride(1), lse.stride(0), 0, 0, 0)
        return (lambda: seesaw_kernel[grid](*args, DIRECT=True, PDL=False, **meta)), out, lse

    part_out, part_lse, reduce = partials_and_merge(out, lse, batch, num_splits, qlen, pdl)
    args = (*head, part_out, part_lse, *sizes, 0, 0, 0, part_out.stride(0), part_out.stride(1),
            part_lse.stride(0))

    def launch_split() -> None:
        seesaw_kernel[grid](*args, DIRECT=False, PDL=pdl, **meta)
        reduce()

    return launch_split, out, lse


def seesaw_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, *, qlen: int, sm_scale: float, causal: bool = True,
                  num_splits: int | None = None, **forms: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager call: (out, lse). ``forms``: ``decode_launcher``'s form options (chunked,
    pdl, slim, lone_bars, afresh_q, two_requests, rope_regs)."""
    launch, out, lse = decode_launcher(q, kv_cache, block_table, seq_lens, qlen=qlen,
                                       sm_scale=sm_scale, causal=causal, num_splits=num_splits,
                                       **forms)
    launch()
    return out, lse


def aot_compile(dtype: str = "bf16", *, direct: bool = True, causal: bool = True,
                arch: int = 90, chunked: bool = False, pdl: bool = False, slim: bool = False,
                lone_bars: bool = False, afresh_q: bool = False, two_requests: bool = False,
                rope_regs: bool = False):
    """Compile ``seesaw_kernel`` for ``sm_<arch>`` without a GPU (triton's bundled ptxas);
    returns triton's CompiledKernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``)."""
    _check_form(chunked, slim, lone_bars, afresh_q, two_requests, rope_regs)
    constants = dict(CAUSAL=causal, DIRECT=direct, PAGE=PAGE_SIZE, CHUNKED=chunked,
                     PDL=pdl and not direct, SLIM=slim, LONE=lone_bars, AFRESH=afresh_q,
                     MULTI=two_requests, ROPE=rope_regs, num_warps=NUM_WARPS)
    blocks = dict(qn_desc=(dtype, BLOCK_M, D_NOPE), qr_desc=(dtype, BLOCK_M, D_ROPE),
                  kn_desc=(dtype, BLOCK_N, D_NOPE), kr_desc=(dtype, BLOCK_N, D_ROPE))
    pointers = dict(bt_ptr="i32", seq_lens_ptr="i32", out_ptr=dtype if direct else "fp32",
                    lse_ptr="fp32")
    return aot_compile_kernel(seesaw_kernel, constants, blocks, pointers, arch=arch,
                              num_warps=NUM_WARPS, maxnreg=MAXNREG)
