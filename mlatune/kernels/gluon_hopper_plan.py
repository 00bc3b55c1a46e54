"""What the Hopper Gluon decodes (``gluon_hopper``, ``gluon_seesaw``, ``gluon_transposed``)
are built for (the dtypes and pages each reads), their kernel forms and their split rule, on
the host.

Plain Python, no Triton: the capability rules, the Gluon routes'
``supports`` and ``param_space`` (which the dispatcher may ask) read these
without importing the kernel, whose module imports Triton's Gluon dialect.
"""

from __future__ import annotations

import functools
import math

GLUON_TRITON = "3.6."  # the triton release whose Gluon API the kernel is written for
D_NOPE = 512  # kv_lora_rank: the latent part of q and K, and all of V
D_ROPE = 64
BLOCK_M = 64  # query rows (heads x qlen folded) per program
BLOCK_N = 64  # keys per tile
TMA_MIN_PAGE = 16  # the smallest page the TMA loaders read: a box of the page's rows a page
GATHER_PAGE = 1  # each key its own page: gathered by cp.async (where a kernel's form gathers)
# The seesaw kernel over a 16-bit cache gathers every page under this (a 64-key tile) by
# cp.async too: a box a page would be 64 / page TMA copies a chunk (``seesaw_gathers``).
SEESAW_GATHER_BELOW = BLOCK_N
DTYPES = ("bf16", "fp16")  # q's, and a cache of q's dtype
FP8_CACHE = "fp8_e4m3fn"  # the fp8 cache some kernels also read under a 16-bit q
# The kernels that read an FP8_CACHE under a 16-bit q, each tile widened to 16 bits on chip
# (exactly): the seesaw kernel (fp16 MMAs, its tiles widened by its loader) and the transposed
# kernels (``gluon_transposed_ws``; ``gluon_transposed_fp8``'s fp8 MMAs). The others read a
# cache of q's dtype only.
FP8_CACHE_KERNELS = ("gluon_seesaw", "gluon_transposed")
# The kernels whose split partials the reduce kernel merges (``split_cost``'s by_reduce); the
# transposed kernels merge their own up to two splits.
REDUCE_MERGED_KERNELS = ("gluon_hopper", "gluon_seesaw")
H200_SMS = 132
MAX_SPLITS = 64

# Kernel forms, named in a param set's ``form``. The seesaw kernel: "pairs" (a program walks
# one request), "two-requests" (a program walks requests b and b + cdiv(batch, 2)),
# "balanced" (a program a row block and worker walks its worker's share of a device plan's
# tiles, ``balanced_workers``: pieces of requests, merged where a request is cut).
SEESAW_FORMS = ("pairs", "two-requests", "balanced")
# The balanced form is offered from this many query rows a request (a row block)...
BALANCED_MIN_ROWS = 64
# ...where the split pick's waves of programs leave more than this share of their SM slots
# idle (a ragged last wave: ``wave_idle``).
BALANCED_MIN_IDLE = 0.02
# Pages from which the two-requests form reads an fp8 cache: under them its build spills
# registers (a widening loader leaves the compute warpgroups 232 registers, 8 fewer).
SEESAW_FP8_TWO_REQUESTS_MIN_PAGE = 64
# The transposed kernels: "mma16" (MMAs in q's 16-bit dtype; an fp8 cache widened to it in a
# partition of its own, ``gluon_transposed_ws``: transposed/gluon's), "mma8" (an fp8 cache
# under fp8 MMAs, q as two e4m3 terms, ``gluon_transposed_fp8``: transposed-mma8/gluon's).
TRANSPOSED_FORMS = ("mma16", "mma8")


def triton_refusal(version: str | None) -> str | None:
    """Why a triton of ``version`` (None: not installed) cannot run the kernel, or None."""
    if version is None:
        return f"triton is not installed; the Gluon kernel needs triton {GLUON_TRITON}x"
    if not version.startswith(GLUON_TRITON):
        return (f"the Gluon kernel is written for triton {GLUON_TRITON}x's Gluon API; "
                f"this is triton {version}")
    return None


def page_refusal(page: int, gathers: bool = True) -> str | None:
    """Why the Gluon decodes cannot read a cache of ``page``-token pages, or None: a 64-key
    tile lies in one page of 64 or more, or spans 64 / page pages of 16 or 32 (a TMA box a
    page, or gathered where ``seesaw_gathers``); pages of one key are gathered by cp.async
    where the kernel's form gathers (``gathers`` False: the fp8-MMA form, and the seesaw
    kernel over an fp8 cache, which load by TMA alone)."""
    if page >= TMA_MIN_PAGE and page & (page - 1) == 0:
        return None
    if page == GATHER_PAGE and gathers:
        return None
    return (f"page_size {page}: the Gluon decodes read pages of a power of two from "
            f"{TMA_MIN_PAGE} tokens, and of {GATHER_PAGE} where the kernel gathers them "
            f"(not the fp8-MMA form, nor the seesaw kernel over an fp8 cache)")


def seesaw_gathers(page: int, fp8_cache: bool) -> bool:
    """Whether the seesaw kernel's loader gathers the tiles of ``page``-token pages by cp.async
    (a key's row: its page's row plus its slot's) rather than copying them by TMA: every page
    under ``SEESAW_GATHER_BELOW`` of a 16-bit cache (an fp8 cache's tiles come by TMA)."""
    return not fp8_cache and page < SEESAW_GATHER_BELOW


def dtype_refusal(kernel: str, q_dtype: str, kv_dtype: str) -> str | None:
    """Why ``kernel`` (a module of mlatune.kernels) cannot read a ``kv_dtype`` cache under a
    ``q_dtype`` q, or None: a bf16 or fp16 q over a cache of its dtype, or (the
    ``FP8_CACHE_KERNELS``) over an ``FP8_CACHE`` one."""
    fp8 = kernel in FP8_CACHE_KERNELS
    if q_dtype in DTYPES and (kv_dtype == q_dtype or (fp8 and kv_dtype == FP8_CACHE)):
        return None
    also = (f" or {FP8_CACHE}" if fp8 else
            f" ({' and '.join(FP8_CACHE_KERNELS)} also read {FP8_CACHE})")
    return (f"{q_dtype} q over a {kv_dtype} cache: the Gluon kernel {kernel} reads a bf16 or "
            f"fp16 q over a cache of q's dtype{also}")


def seesaw_form_refusal(form: str, fp8_cache: bool, page: int) -> str | None:
    """Why the seesaw kernel's ``form`` cannot read a cache of ``page``-token pages
    (``fp8_cache``: an fp8 one), or None (``SEESAW_FP8_TWO_REQUESTS_MIN_PAGE``)."""
    if form == "two-requests" and fp8_cache and page < SEESAW_FP8_TWO_REQUESTS_MIN_PAGE:
        return (f"the seesaw kernel's two-requests form reads an fp8 cache at pages of "
                f"{SEESAW_FP8_TWO_REQUESTS_MIN_PAGE} tokens and more, not {page}")
    return None


def balanced_workers(sms: int, row_blocks: int) -> int:
    """The balanced form's workers (programs a row block): a program an SM, the row blocks of
    a request walking the same plan side by side (their programs read the same keys at about
    the same time)."""
    return max(1, sms // max(1, row_blocks))


def wave_idle(programs: int, sms: int) -> float:
    """The share of SM slots that ``programs`` programs (one an SM at a time) leave idle over
    the waves they take: 0 where they fill their last wave."""
    if programs <= 0:
        return 0.0
    waves = -(-programs // sms)
    return 1.0 - programs / (waves * sms)


def kv_box_rows(page: int, keys: int = BLOCK_N) -> int:
    """Rows of the cache's TMA boxes where a loader copies ``keys`` keys at once: a page, at
    most ``keys``; under ``TMA_MIN_PAGE`` (gathered, no boxes) ``keys``, so that the boxes'
    shared layout stays the tile's."""
    return min(page, keys) if page >= TMA_MIN_PAGE else keys


def transposed_rows(rows: int) -> int:
    """The transposed kernel's query rows per program (its MMAs' N): 16 up to 16 rows, else
    32 (O^T, 512 x 32 fp32, is 128 registers a thread)."""
    return 16 if rows <= 16 else 32


def transposed_row_blocks(heads: int, qlen: int) -> int:
    """The transposed kernel's programs per request (and split)."""
    rows = heads * qlen
    return -(-rows // transposed_rows(rows))


# ``pick_splits``'s costs, in tiles of one program's time: a program's fixed cost (Q's load,
# the ring's fill and drain, the epilogue) and the merge's: a base, then where the kernel
# merges its partials itself (the last split to arrive reads them all) a part a split, or
# where the reduce kernel merges them a part a program, spread over the SMs (a 64-row
# program's partial, 64 x 512 fp32, is written and read back: about 3.6 times the bytes of
# a 16-bit cache's 64-key tile). Fitted to the sweep journals' times of the Gluon decodes'
# listed split sets (tables/journals: 1,540 H200 and 992 H100 problems with two sets or
# more timed; the reduce's part ranks them alike from 4.5 to 7; docs/kernels/gluon_hopper.md,
# "The split pick").
PROGRAM_TILES = 8.0
MERGE_TILES = 1.0
MERGE_TILES_A_SPLIT = 0.1
REDUCE_TILES_A_PROGRAM = 6.0


def split_cost(batch: int, row_blocks: int, max_seq_len: int, splits: int,
               sms: int = H200_SMS, per_program: float = 0.0, tile_step: int = 1,
               by_reduce: bool = False) -> float:
    """A launch's estimated time, in tiles of one program's time, at ``splits`` per request.

    A program's time ~ its tiles (rounded up to a multiple of ``tile_step``: the tiles a
    program's walk takes at once) plus ``PROGRAM_TILES``; more than one split adds the
    merge: ``MERGE_TILES`` and ``MERGE_TILES_A_SPLIT`` a split, or with ``by_reduce`` (the
    reduce kernel merges the partials) ``REDUCE_TILES_A_PROGRAM`` a program over the SMs.
    One program fits an SM (its shared memory), so programs run in waves of ``sms``.
    ``per_program``: tiles of time each program adds to the whole launch, spread over the
    SMs (a kernel whose tiles are cheap beside what a program costs to start and to merge:
    ``FP8_MMA_PROGRAM_COST``).
    """
    tiles = max(1, math.ceil(max_seq_len / BLOCK_N))
    walked = -(-math.ceil(tiles / splits) // tile_step) * tile_step
    programs = batch * row_blocks * splits
    merge = 0.0
    if splits > 1:
        merge = MERGE_TILES + (REDUCE_TILES_A_PROGRAM * programs / sms if by_reduce
                               else MERGE_TILES_A_SPLIT * splits)
    return math.ceil(programs / sms) * (walked + PROGRAM_TILES) + merge \
        + per_program * programs / sms


@functools.lru_cache(maxsize=8192)  # a table's load asks it the same questions often
def pick_splits(batch: int, row_blocks: int, max_seq_len: int, sms: int = H200_SMS,
                per_program: float = 0.0, tile_step: int = 1, by_reduce: bool = False
                ) -> int:
    """Splits per request: the least ``split_cost`` (the fewest among equals)."""
    best, best_cost = 1, math.inf
    for s in range(1, min(max(1, math.ceil(max_seq_len / BLOCK_N)), MAX_SPLITS) + 1):
        cost = split_cost(batch, row_blocks, max_seq_len, s, sms, per_program, tile_step,
                          by_reduce)
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


# ``pick_splits``'s per_program for the fp8-MMA transposed kernel (``gluon_transposed_fp8``):
# its tiles take about 0.6x the bf16 kernel's, so what a program costs besides them (q
# quantized, the ring filled, the partials written and merged) weighs more. Fitted to its
# times at forced split counts (docs/kernels/gluon_transposed.md) on the costs above.
FP8_MMA_PROGRAM_COST = 4.0


def seesaw_tile_step(fp8_cache: bool) -> int:
    """``split_cost``'s tile_step for the seesaw kernel: over a 16-bit cache its warpgroups
    take the tiles in pairs (each the scores of one), so a split's lone last tile costs
    about a pair (H100 journals, batch 1, 128 heads, 4,096 keys at pages 1 and 16: 1, 2, 3
    and 6 tiles a split 34.6, 23.9, 36.5 and 25.2 us); over an fp8 cache each tile's
    widening by the loader dominates, and a lone tile is cheaper (64 heads, qlen 2, 1,024
    keys: 1 tile 18.8 us, 2 tiles 27.5)."""
    return 1 if fp8_cache else 2
