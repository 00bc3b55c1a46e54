"""What mlatune's Hopper Gluon decodes share (``gluon_hopper``, ``gluon_seesaw``,
``gluon_transposed``, ``gluon_transposed_ws``, ``gluon_transposed_fp8``), written against
triton 3.6.0's Gluon API.

Host: whether this triton can run them, the shared-memory layouts and TMA descriptors of q
and the paged cache, their out, LSE and split count, the fp32 split partials with the reduce
launch that merges them, and the ahead-of-time compile (no GPU). Device: a tile's TMA copy
from the block table (a box a page under 64-token pages), its cp.async gather where each key
is its own page (page 1), the zeroing of stale cache rows, a program's request and its split's
key range, each row's last key, a tile's online softmax, the rows' LSE store, the combine of
split partials by their LSEs, and the signal that lets a dependent launch start.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlatune import lse
from mlatune.kernels.gluon_hopper_plan import (
    BLOCK_N,
    D_NOPE,
    D_ROPE,
    GATHER_PAGE,
    pick_splits,
    triton_refusal,
)

LN2 = gl.constexpr(lse.LN2)  # a base-2 LSE times this: the natural-log LSE (a constexpr: JIT)
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}  # q's (and MMAs')
GL_CACHE_DTYPES = {**GL_DTYPES, torch.float8_e4m3fn: gl.float8e4nv}
TORCH_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
_IR_NAMES = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8e4nv"}
TILE_KEYS = gl.constexpr(BLOCK_N)  # keys a tile (the kernels' BN)
GATHERED = gl.constexpr(GATHER_PAGE)  # the page the gather loaders read (1; constexpr: JIT)


def gluon_available() -> tuple[bool, str]:
    """Whether this triton is the release the kernels are written for, and why not."""
    why = triton_refusal(triton.__version__)
    return (False, why) if why else (True, "ok")


# Host ------------------------------------------------------------------------------------

def nvmma_layout(block: list[int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The MMA-ready (swizzled) shared-memory layout of a ``block`` of ``dtype``."""
    return gl.NVMMASharedLayout.get_default_for(block, GL_CACHE_DTYPES[dtype])


def tma_descriptors(q: torch.Tensor, kv_cache: torch.Tensor, q_rows: int,
                    kv_rows: int = BLOCK_N) -> tuple[TensorDescriptor, ...]:
    """TMA descriptors of q's and the cache's nope and rope parts (in that order), in
    [q_rows, .] and [kv_rows, .] blocks, each a 2-D table of (token, head) or (page, slot)
    rows: the rows of one table each (``check_supported`` asks for that); the descriptors
    take a view at the rope column, no copy."""
    out = []
    for t, rows in ((q, q_rows), (kv_cache, kv_rows)):
        n_rows, row_stride = t.shape[0] * t.shape[1], t.stride(1)
        for col, width in ((0, D_NOPE), (D_NOPE, D_ROPE)):
            block = [rows, width]
            out.append(TensorDescriptor(t[..., col:], [n_rows, width], [row_stride, 1], block,
                                        nvmma_layout(block, t.dtype)))
    return tuple(out)


def outputs_and_splits(q: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor | None,
                       lse: torch.Tensor | None, row_blocks: int, num_splits: int | None,
                       max_seq_len: int | None, per_program: float = 0.0,
                       tile_step: int = 1, by_reduce: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The caller's out and lse, or new ones ((tokens, heads, 512) in q's dtype, (tokens,
    heads) fp32), and the split count: ``num_splits`` or ``pick_splits`` (with the kernel's
    ``per_program``, ``tile_step`` and ``by_reduce``) over the longest request
    (``max_seq_len``, read from ``seq_lens`` on the host only when not given)."""
    tokens, heads = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty(tokens, heads, D_NOPE, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    if num_splits is None:
        batch = seq_lens.shape[0]
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if batch else 0
        num_splits = pick_splits(batch, row_blocks, max_seq_len, per_program=per_program,
                                 tile_step=tile_step, by_reduce=by_reduce)
    return out, lse, num_splits


def partials_and_merge(out: torch.Tensor, lse: torch.Tensor, batch: int, num_splits: int,
                       qlen: int, pdl: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
    """fp32 partials (a slot per request and split: normalized output, base-2 LSE) and
    the launch of ``reduce_launcher`` that merges them into out and lse (``pdl``: as a
    programmatic dependent launch of the kernel that writes them)."""
    # Triton kernels: when a split merge is launched
    from mlatune.kernels.reduce import reduce_launcher

    heads = out.shape[1]
    slots = batch * num_splits
    part_out = out.new_empty((slots, qlen * heads, D_NOPE), dtype=torch.float32)
    part_lse = out.new_empty((slots, qlen * heads), dtype=torch.float32)
    indptr = torch.arange(0, slots + 1, num_splits, dtype=torch.int32, device=out.device)
    merge = reduce_launcher(part_out, part_lse, indptr, out, lse, tokens_per_group=qlen,
                            q_heads=heads, row_heads=heads, head_rep=1, max_slots=num_splits,
                            pdl=pdl, uniform=True)
    return part_out, part_lse, merge


# ptxas given no debug info (the PTX keeps its lines): with it, triton 3.6's ptxas 12.8
# compiled the same PTX differently when only source line numbers had moved.
PTXAS_OPTIONS = "-suppress-debug-info"


def compile_options(num_warps: int, maxnreg: int | None = None) -> dict:
    """The compile options of a Gluon kernel's launch and of its AOT build (the same)."""
    return {"num_warps": num_warps, "ptx_options": PTXAS_OPTIONS,
            **({"maxnreg": maxnreg} if maxnreg else {})}


def aot_compile_kernel(fn, constants: dict, blocks: dict[str, tuple[str, int, int]],
                       pointers: dict[str, str], *, arch: int, num_warps: int,
                       maxnreg: int | None = None):
    """Compile a Gluon decode kernel for ``sm_<arch>`` without a GPU (triton's bundled
    ptxas). ``blocks``: descriptor argument -> (dtype name, rows, columns); ``pointers``:
    pointer argument -> element type; other arguments are i32 but ``qk_scale`` (fp32).
    Pointers and the output strides (those the kernel has) are taken as 16-divisible.
    Returns triton's CompiledKernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def arg_type(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name in blocks:
            dt, rows, cols = blocks[name]
            layout = nvmma_layout([rows, cols], TORCH_NAMES[dt])
            return f"tensordesc<{_IR_NAMES[dt]}[{rows}, {cols}],{layout!r}>"
        if name in pointers:
            return "*" + pointers[name]
        return "fp32" if name == "qk_scale" else "i32"

    strides = ("stride_o_tok", "stride_o_head", "stride_po_slot", "stride_po_row",
               "stride_o_row", "stride_kv", "stride_kv_tok")
    aligned = (*pointers, *(n for n in strides if n in fn.arg_names))
    attrs = {(fn.arg_names.index(n), ): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn, {n: arg_type(n) for n in fn.arg_names}, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=compile_options(num_warps, maxnreg))


# Device ----------------------------------------------------------------------------------

@gluon.jit
def page_row(bt_row, key, last_page, pred, PAGE: gl.constexpr):
    """The cache row (page * PAGE + slot) of local key ``key``, its page read from the
    request's block-table row. Pages under a tile (PAGE < TILE_KEYS): a key past the request's
    ``last_page`` reads that page instead (its rows are masked; the block table past a
    request's pages may hold anything, or end)."""
    idx = key // PAGE
    if PAGE < TILE_KEYS:
        idx = gl.minimum(idx, last_page)
    page = gl.load(bt_row + idx, mask=pred, other=0)
    return page * PAGE + key % PAGE


@gluon.jit
def tile_rows(bt_row, key, last_page, pred, R: gl.constexpr, N: gl.constexpr,
              PAGE: gl.constexpr):
    """The cache rows where the N keys from local key ``key`` (N-aligned) lie, a row for
    each box of R of them (R: a page, or the whole page's share of N): the page read once
    where they lie in one page (PAGE >= N), else a page a box."""
    first = page_row(bt_row, key, last_page, pred, PAGE)
    rows = (first, )
    for p in gl.static_range(1, N // R):
        if PAGE >= N:
            rows = rows + (first + p * R, )  # noqa: RUF005 (a tuple grown in a JIT loop)
        else:
            rows = rows + (page_row(bt_row, key + p * R, last_page, pred, PAGE), )  # noqa: RUF005
    return rows


@gluon.jit
def copy_rows(desc, buf, bar, rows, col, pred):
    """TMA copies into ``buf`` of its rows (``tile_rows``) from ``desc``'s column ``col``:
    a box of the descriptor's rows at each of ``rows``."""
    R: gl.constexpr = desc.block_type.shape[0]
    if buf.shape[0] == R:
        tma.async_copy_global_to_shared(desc, [rows[0], col], bar, buf, pred=pred)
    else:
        for p in gl.static_range(buf.shape[0] // R):
            tma.async_copy_global_to_shared(desc, [rows[p], col], bar, buf.slice(p * R, R),
                                            pred=pred)


@gluon.jit
def issue_kv(kn_desc, kr_desc, kn_buf, kr_buf, bar, bt_row, key, last_page, pred,
             PAGE: gl.constexpr):
    """Start the TMA copies of the key tile that begins at local key ``key`` into a ring slot
    (``last_page``: the request's, see ``page_row``); the barrier expects the whole tile."""
    R: gl.constexpr = kn_desc.block_type.shape[0]
    N: gl.constexpr = kn_buf.shape[0]
    rows = tile_rows(bt_row, key, last_page, pred, R, N, PAGE)
    mbarrier.expect(bar, (kn_desc.block_type.nbytes + kr_desc.block_type.nbytes) * (N // R),
                    pred=pred)
    copy_rows(kn_desc, kn_buf, bar, rows, 0, pred)
    copy_rows(kr_desc, kr_buf, bar, rows, 0, pred)


@constexpr_function
def gather_layout(num_warps):
    """The layout of a page-1 gather of 16-bit [keys, columns]: 16 bytes a thread, 8 lanes
    across 64 columns (a 128-byte swizzle atom's row), the warps down the keys."""
    return gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])


@gluon.jit
def gather_pages(bt_row, key, end, N: gl.constexpr, layout: gl.constexpr,
                 PAGE: gl.constexpr = GATHER_PAGE):
    """The pages of the N keys from local key ``key`` (N-aligned; PAGE divides N), a key's
    page (block-table entry key // PAGE) in ``layout``'s rows: -1 from ``end`` on, whose
    entries are not read. Page 1: each key its own page (no division)."""
    keys = key + gl.arange(0, N, layout=gl.SliceLayout(1, layout))
    if PAGE == GATHERED:
        idx = keys
    else:
        idx = key // PAGE + gl.arange(0, N, layout=gl.SliceLayout(1, layout)) // PAGE
    return gl.load(bt_row + idx, mask=keys < end, other=-1)


@gluon.jit
def gather_rows(pages, kv_ptr, stride_page, stride_tok=0, PAGE: gl.constexpr = GATHER_PAGE):
    """The cache rows of the keys whose pages ``gather_pages`` read: each one's row pointer
    (its page's row, ``stride_page`` apart, plus its slot's, key % PAGE rows of
    ``stride_tok``; page 1: the page's) and whether it has one (page -1 not), as [keys, 1] of
    ``pages``' parent layout."""
    rows = kv_ptr + pages.to(gl.int64) * stride_page
    if PAGE != GATHERED:  # the keys start N-aligned: a key's slot is its index's
        slots = gl.arange(0, pages.shape[0], layout=pages.type.layout) % PAGE
        rows = rows + slots * stride_tok
    return gl.expand_dims(rows, 1), gl.expand_dims(pages >= 0, 1)


@gluon.jit
def gather_into(buf, rows, ok, col):
    """Start the cp.async copies of ``buf`` ([keys, columns]) from its keys' rows
    (``gather_rows``) at cache column ``col``, 16 bytes a copy; a key without a row gets
    zeros (no stale rows to zero)."""
    cols = gl.arange(0, buf.shape[1], layout=gl.SliceLayout(0, rows.type.layout))
    async_copy.async_copy_global_to_shared(buf, rows + col + gl.expand_dims(cols, 0), mask=ok)


@gluon.jit
def gather_kv(kn_buf, kr_buf, kv_ptr, stride_kv, pages):
    """Start the cp.async copies of a tile of page-1 keys (``pages``) into its nope and rope
    buffers (``gather_into``)."""
    rows, ok = gather_rows(pages, kv_ptr, stride_kv)
    gather_into(kn_buf, rows, ok, 0)
    gather_into(kr_buf, rows, ok, kn_buf.shape[1])


@gluon.jit
def start_tile(descs, kn_buf, kr_buf, bar, src, key, pred, pages, PAGE: gl.constexpr,
               num_warps: gl.constexpr):
    """Start the copies of the tile at local key ``key`` into a ring slot (``pred``: there is
    one), for a kernel whose threads all load: by TMA on ``bar`` (``issue_kv``), or at page 1
    by every thread's cp.async from ``pages`` (``gather_kv``) as one commit group. ``src``:
    the request's block-table row and last page, its split's end, the cache's pointer and
    row stride. Returns the pages of the tile after (page 1; else ``pages``)."""
    if PAGE == GATHERED:
        gather_kv(kn_buf, kr_buf, src[3], src[4], pages)
        async_copy.commit_group()
        return gather_pages(src[0], key + kn_buf.shape[0], src[2], kn_buf.shape[0],
                            gather_layout(num_warps))
    else:
        issue_kv(descs[0], descs[1], kn_buf, kr_buf, bar, src[0], key, src[1], pred, PAGE)
        return pages


@gluon.jit
def first_pages(src, key, N: gl.constexpr, PAGE: gl.constexpr, num_warps: gl.constexpr):
    """The pages of the first tile ``start_tile`` gathers (page 1; else 0, unread)."""
    if PAGE == GATHERED:
        return gather_pages(src[0], key, src[2], N, gather_layout(num_warps))
    else:
        return 0


@gluon.jit
def wait_tile(bar, phase, AHEAD: gl.constexpr, PAGE: gl.constexpr):
    """Wait until a tile ``start_tile`` started has landed: its barrier's ``phase``, or at
    page 1 this thread's copy groups but the AHEAD latest, then every thread's, made visible
    to wgmma (cp.async writes through the generic proxy: a proxy fence, then a barrier)."""
    if PAGE == GATHERED:
        async_copy.wait_group(AHEAD)
        fence_async_shared()
        gl.thread_barrier()
    else:
        mbarrier.wait(bar, phase)


@gluon.jit
def drain_tiles(PAGE: gl.constexpr):
    """At page 1, wait for the copies ``start_tile`` started past the split's last tile (all
    zeros) before the shared memory they write is reused or the program ends."""
    if PAGE == GATHERED:
        async_copy.wait_group(0)


@gluon.jit
def zero_stale_rows(kn_buf, valid, num_warps: gl.constexpr):
    """Zero the V rows (first 512 dims) of slots >= valid in a tile's buffer (16-bit or fp8)."""
    N: gl.constexpr = kn_buf.shape[0]
    D: gl.constexpr = kn_buf.shape[1]
    # 128 bytes at a time (64 16-bit columns, 128 fp8 ones): whole swizzle atoms of the
    # 128B-swizzled tile. fp8 bytes are zeroed as integers.
    BYTE: gl.constexpr = kn_buf.dtype.primitive_bitwidth == 8
    COLS: gl.constexpr = 128 if BYTE else 64
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, N, layout=gl.SliceLayout(1, layout))
    keep = gl.expand_dims(rows < valid, 1)
    for c in gl.static_range(D // COLS):
        part = kn_buf.slice(c * COLS, COLS, dim=1)
        if BYTE:
            x = part.load(layout).to(gl.int8, bitcast=True)
            part.store(gl.where(keep, x, gl.zeros_like(x)).to(kn_buf.dtype, bitcast=True))
        else:
            x = part.load(layout)
            part.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def launch_dependents():
    """Let the next kernel on the stream, if launched as a programmatic dependent, start
    once every block of this one has signalled or exited (it waits for this one's writes
    itself); a no-op otherwise."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def program_keys(seq_lens_ptr, num_splits, qlen, heads, BM: gl.constexpr, BN: gl.constexpr,
                 CAUSAL: gl.constexpr, PDL: gl.constexpr):
    """This program's (row block, split, request), its request's length and its split's keys
    [start, end) with their tile count (``key_range``); with ``PDL`` it first lets the
    dependent reduce kernel launch (it waits for the partials itself)."""
    rb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    if PDL:
        launch_dependents()
    seq_len = gl.load(seq_lens_ptr + b)
    start, end, n_tiles = key_range(seq_len, rb, split, num_splits, qlen, heads, BM, BN, CAUSAL)
    return rb, split, b, seq_len, start, end, n_tiles


@gluon.jit
def key_range(seq_len, rb, split, num_splits, qlen, heads, BM: gl.constexpr,
              BN: gl.constexpr, CAUSAL: gl.constexpr):
    """The split's keys [start, end) (BN-aligned chunks; causal: none past the BM-row
    block's last row's bound) and its tile count."""
    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BN) * BN
    start = split * chunk
    end = gl.minimum(start + chunk, seq_len)
    if CAUSAL:
        block_last = seq_len - qlen + (gl.minimum(qlen * heads, rb * BM + BM) - 1) // heads
        end = gl.minimum(end, block_last + 1)
    return start, end, gl.cdiv(gl.maximum(end - start, 0), BN)


@gluon.jit
def last_keys(rb, seq_len, qlen, heads, BM: gl.constexpr, row_layout: gl.constexpr,
              CAUSAL: gl.constexpr):
    """Each of a BM-row block's last allowed key: causal row r (token r // heads) sees keys
    up to seq_len - qlen + token; otherwise all seq_len."""
    if CAUSAL:
        return seq_len - qlen + (rb * BM + gl.arange(0, BM, layout=row_layout)) // heads
    return gl.full([BM], 0, gl.int32, layout=row_layout) + (seq_len - 1)


@gluon.jit
def online_softmax(s, n0, end, last_pos, cols, m_i, l_i, KEY_AXIS: gl.constexpr):
    """Online softmax (base 2) of one tile's scaled scores, keys along ``KEY_AXIS`` (1: S,
    rows x keys; 0: S^T): (P, new max, new sum, alpha): ``softmax_step`` and the rows' sums.
    """
    p, m_new, alpha = softmax_step(s, n0, end, last_pos, cols, m_i, KEY_AXIS)
    return p, m_new, l_i * alpha + gl.sum(p, axis=KEY_AXIS), alpha


@gluon.jit
def softmax_step(s, n0, end, last_pos, cols, m_i, KEY_AXIS: gl.constexpr):
    """One tile's P, the rows' new max and alpha (as ``online_softmax``), without summing P.

    Keys past ``end`` or past a row's causal bound get weight 0; alpha rescales what
    the rows accumulated before this tile.
    """
    s = mask_scores(s, n0, end, last_pos, cols, KEY_AXIS)
    m_new = gl.maximum(m_i, gl.max(s, axis=KEY_AXIS))
    m_shift = no_shift(m_new)
    alpha = gl.exp2(m_i - m_shift)
    p = gl.exp2(s - gl.expand_dims(m_shift, KEY_AXIS))
    return p, m_new, alpha


@constexpr_function
def warps_by_columns(cols):
    """[4 warps, cols]: every warp's value of a thread's columns in its registers, the
    columns where the wgmma accumulator has them (2 (lane % 4) + {0, 1} + 8 i), the other
    lanes and the warps holding copies."""
    col_regs = [[0, 8 << i] for i in range((cols // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], *col_regs, [1, 0], [2, 0]],
        lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, cols])


@gluon.jit
def key_max(s, warp_maxes):
    """Each column's max over S^T's rows (the tile's keys, 16 a warp): each warp's by
    shuffles, then the four through ``warp_maxes`` after one barrier, every thread reading
    its columns' four. (``gl.max`` over the rows crosses the warps in two barriers and a
    second round of shuffles.) The next write of ``warp_maxes`` comes after the barrier
    that follows P^T's store, so no warp still reads it."""
    W: gl.constexpr = warp_maxes.shape[0]
    per_warp = gl.max(gl.reshape(s, [W, s.shape[0] // W, s.shape[1]]), axis=1)
    warp_maxes.store(per_warp)
    gl.thread_barrier()
    every = warp_maxes.load(warps_by_columns(s.shape[1]))
    return gl.convert_layout(gl.max(every, axis=0), gl.SliceLayout(0, s.type.layout))


@gluon.jit
def slim_step_across_warps(s, qk, n0, end, last_pos, keys, m_i, warp_maxes, mask_from):
    """``softmax_step`` over raw scores S^T (keys on axis 0, 16 a warp) in fewer instructions
    a score: the max over keys by ``key_max`` (one barrier), the bounds applied only where the
    tile reaches ``mask_from`` (``first_masked_key``; a decode's last tile), the column scales
    ``qk`` ([cols], positive) folded into the exponent (one FMA; the max taken of the raw
    scores)."""
    if n0 + s.shape[0] > mask_from:
        s = mask_scores(s, n0, end, last_pos, keys, 0)
    m_new = gl.maximum(m_i, key_max(s, warp_maxes) * qk)
    m_shift = no_shift(m_new)
    p = gl.exp2(s * gl.expand_dims(qk, 0) - gl.expand_dims(m_shift, 0))
    return p, m_new, gl.exp2(m_i - m_shift)


@gluon.jit
def no_shift(m):
    """The max to subtract: 0 where a row has no key yet (m = -inf), so exp2 gives 0, not NaN."""
    return gl.where(m == float("-inf"), gl.zeros_like(m), m)


@gluon.jit
def mask_scores(s, n0, end, last_pos, cols, KEY_AXIS: gl.constexpr):
    """S with -inf at keys past ``end`` or past a row's causal bound (``last_keys``)."""
    ROW_AXIS: gl.constexpr = 1 - KEY_AXIS
    key = n0 + cols
    allowed = (gl.expand_dims(key, ROW_AXIS) <= gl.expand_dims(last_pos, KEY_AXIS)) \
        & gl.expand_dims(key < end, ROW_AXIS)
    return gl.where(allowed, s, gl.full_like(s, float("-inf")))


@gluon.jit
def first_masked_key(end, last_pos):
    """The first key some row may not see: tiles wholly before it need no ``mask_scores``."""
    return gl.minimum(end, gl.min(last_pos, axis=0) + 1)


@gluon.jit
def slim_softmax(s, qk_scale, n0, end, last_pos, cols, m_i, l_i, mask_from,
                 ROWS: gl.constexpr = False):
    """``online_softmax`` of raw scores S (rows x keys) in fewer instructions a score: the
    bounds applied only where the tile reaches ``mask_from`` (``first_masked_key``), the
    scale folded into the exponent (one FMA: the max is taken of the raw scores, qk_scale
    being positive). ROWS: ``qk_scale`` is a scale a row ([rows], in S's row layout)."""
    if n0 + s.shape[1] > mask_from:
        s = mask_scores(s, n0, end, last_pos, cols, 1)
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_shift = no_shift(m_new)
    alpha = gl.exp2(m_i - m_shift)
    qk = gl.expand_dims(qk_scale, 1) if ROWS else qk_scale
    p = gl.exp2(s * qk - gl.expand_dims(m_shift, 1))
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def store_row_lse(m_i, l_i, lse_ptr, where, stride_lse_tok, stride_pl_slot, BM: gl.constexpr,
                  DIRECT: gl.constexpr, num_warps: gl.constexpr):
    """BM rows' LSE from their running max and sum (base 2): natural log into the LSE
    (direct), base 2 into the split's partial slot (as ``reduce`` reads). ``where``: (row
    block, request, split, splits, qlen, heads); ``num_warps``: the calling partition's."""
    rb, b, split, num_splits, qlen, heads = where
    # A flat layout over the partition's threads (a row's value on several threads when
    # BM is under their count): triton 3.6 does not lower the store from the wgmma layout.
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    m_i = gl.convert_layout(m_i, flat)
    l_i = gl.convert_layout(l_i, flat)
    has_keys = l_i > 0.0
    lse2 = gl.where(has_keys, m_i + gl.log2(gl.where(has_keys, l_i, gl.full_like(l_i, 1.0))),
                    gl.full_like(l_i, float("-inf")))
    r = rb * BM + gl.arange(0, BM, layout=flat)
    if DIRECT:
        dst = lse_ptr + (b * qlen + r // heads).to(gl.int64) * stride_lse_tok + r % heads
        val = lse2 * LN2
    else:
        dst = lse_ptr + (b * num_splits + split).to(gl.int64) * stride_pl_slot + r
        val = lse2
    gl.store(dst, val, mask=r < qlen * heads)


@gluon.jit
def combine_partials(part_out, part_lse, part_strides, out_ptr, lse_ptr, out_strides, first,
                     num_splits, tok0, heads, r, r_ok, DN: gl.constexpr, layout: gl.constexpr):
    """Rows ``r`` (token tok0 + r // heads, head r % heads) of a request's ``num_splits`` fp32
    partials (slots ``first`` on: normalized output, base-2 LSE) combined by their LSEs into
    out and the natural-log LSE: each split weighted by exp2(its LSE - the rows' max); a row
    no split saw gets 0 and -inf. ``part_strides``: (slot, row) of the outputs, slot of the
    LSEs; ``out_strides``: (token, head) of out, token of lse. ``layout``: a 2-D layout of
    [rows, 256] (columns are combined 256 at a time). The partials were written by other
    programs: read past L1 (.cg)."""
    stride_po_slot, stride_po_row, stride_pl_slot = part_strides
    stride_o_tok, stride_o_head, stride_lse_tok = out_strides
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    BR: gl.constexpr = r.shape[0]
    m = gl.full([BR], float("-inf"), gl.float32, layout=rows)
    for s in range(num_splits):
        lse_s = gl.load(part_lse + (first + s) * stride_pl_slot + r, mask=r_ok,
                        other=float("-inf"), cache_modifier=".cg")
        m = gl.maximum(m, lse_s)
    m_shift = no_shift(m)
    row_off = (tok0 + r // heads).to(gl.int64) * stride_o_tok + (r % heads) * stride_o_head
    CW: gl.constexpr = 256  # columns combined at a time (registers: 32 rows x 256 fp32)
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
    lse = gl.where(has, (m + gl.log2(gl.where(has, w_sum, gl.full_like(w_sum, 1.0)))) * LN2,
                   gl.full_like(w_sum, float("-inf")))
    gl.store(lse_ptr + (tok0 + r // heads).to(gl.int64) * stride_lse_tok + r % heads, lse,
             mask=r_ok)
