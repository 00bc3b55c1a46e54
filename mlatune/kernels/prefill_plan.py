"""Host-side planning for the varlen prefill kernel: its persistent schedule.

The query of every (request, head) is cut into ``tile_q``-row work tiles. A
tile's cost is the keys its ``block_m``-row sub-blocks visit (a causal tile near
the end of a long prompt costs far more than one near its start) plus a fixed
overhead per sub-block. Tiles are laid end to end and the line is cut into
``num_programs`` equal lengths: program p runs the work between cuts p and p+1.
A tile that straddles a cut has its key range split there (at ``split_align``
keys), so every program gets the same work; each piece of a split tile writes a
partial output and LSE to its own slot, and a second kernel merges the slots.
Tiles that are not split are written straight to the output.

Everything here is plain Python on host lists: the route runs it once in
``prepare`` and the kernel only reads the resulting tables.
"""

from __future__ import annotations

import heapq
from dataclasses import astuple, dataclass

# Fixed cost of a sub-block (loading its q, the epilogue), in keys visited.
SUB_BLOCK_OVERHEAD_KEYS = 64
# Head-grouped scheduling needs this many of the costliest tile per program's mean
# load: list scheduling then ends within one tile of the mean (the last tiles it
# places are a head's cheapest).
GROUPED_MIN_TILES = 6


def split_head_dim(d_qk: int) -> tuple[int, int] | None:
    """d_qk as two power-of-two parts (192 -> 128 + 64), or None if it is not such a sum.

    Triton blocks are powers of two: the kernel does the q.k dot as two dots
    over these parts rather than padding 192 to 256 (a third more QK work).
    """
    if d_qk < 32:
        return None
    high = 1 << (d_qk.bit_length() - 1)
    if high == d_qk:
        return d_qk // 2, d_qk // 2
    low = d_qk - high
    return (high, low) if low >= 16 and low & (low - 1) == 0 else None


@dataclass(frozen=True)
class WorkItem:
    """One program's unit of work: some key range of one query tile of one head.

    Field order is the column order of the kernel's ``work_info`` table.
    """

    q_row0: int  # first query row of the tile in the packed (total_q, heads, d) q
    q_pos0: int  # its position among its request's query tokens
    q_rows: int  # rows in the tile (<= tile_q; the last tile of a request may be short)
    k_row0: int  # the request's first key row in the packed k/v
    prefix: int  # keys before the request's first query token (causal offset)
    kv_lo: int  # key range [kv_lo, kv_hi) of this item, in request-local positions
    kv_hi: int
    head: int
    slot: int  # partial-result slot, or -1 to write the output directly
    v_row0: int  # the request's first key in v's layout (k_row0, or aligned in a transposed v)


@dataclass(frozen=True)
class MergeItem:
    """A split tile: its partial slots [slot0, slot0 + n_slots) are merged into the output.

    Field order is the column order of the merge kernel's ``merge_info`` table.
    """

    q_row0: int
    q_rows: int
    head: int
    slot0: int
    n_slots: int


WORK_INFO_COLUMNS = len(WorkItem.__dataclass_fields__)
MERGE_INFO_COLUMNS = len(MergeItem.__dataclass_fields__)


@dataclass(frozen=True)
class WorkPlan:
    programs: list[list[WorkItem]]  # the items of each program, in run order
    merges: list[MergeItem]
    num_partials: int
    loads: list[float]  # planned cost per program (for tests and reports)

    @property
    def work_indptr(self) -> list[int]:
        indptr = [0]
        for items in self.programs:
            indptr.append(indptr[-1] + len(items))
        return indptr

    @property
    def work_info(self) -> list[tuple[int, ...]]:
        return [astuple(item) for items in self.programs for item in items]

    @property
    def merge_info(self) -> list[tuple[int, ...]]:
        return [astuple(m) for m in self.merges]


@dataclass(frozen=True)
class _Tile:
    q_row0: int
    q_pos0: int
    q_rows: int
    k_row0: int
    prefix: int
    head: int
    sub_ends: tuple[int, ...]  # key bound (exclusive) of each sub-block
    v_row0: int

    def cost(self, lo: int, hi: int) -> int:
        """Keys the tile's sub-blocks visit in [lo, hi), plus their fixed cost."""
        keys = sum(max(0, min(hi, end) - lo) for end in self.sub_ends)
        return keys + SUB_BLOCK_OVERHEAD_KEYS * len(self.sub_ends)

    @property
    def kv_end(self) -> int:
        return max(self.sub_ends)


def v_key_offsets(seq_lens_k: list[int], align: int = 1) -> list[int]:
    """Each request's first key in a v whose requests start at multiples of ``align``
    keys (a transposed v: its keys are the contiguous dimension, and the kernel's
    vector loads need aligned starts), and the total length last."""
    offsets = [0]
    for k_len in seq_lens_k:
        offsets.append(offsets[-1] + -(-k_len // align) * align)
    return offsets


def v_transpose_tiles(seq_lens_k: list[int], align: int, block: int
                      ) -> list[tuple[int, int, int]]:
    """(first key row in v, first column in the transposed v, keys) per ``block`` keys
    of each request: the tiles of the kernel that writes the transposed v."""
    tiles = []
    k_row0 = 0
    for k_len, v_col0 in zip(seq_lens_k, v_key_offsets(seq_lens_k, align), strict=False):
        tiles += [(k_row0 + t, v_col0 + t, min(block, k_len - t)) for t in range(0, k_len, block)]
        k_row0 += k_len
    return tiles


def _tiles(seq_lens_q: list[int], seq_lens_k: list[int], num_heads: int, tile_q: int,
           block_m: int, causal: bool, v_align: int) -> list[_Tile]:
    tiles = []
    q_row0 = k_row0 = 0
    v_rows = v_key_offsets(seq_lens_k, v_align)
    for b, (q_len, k_len) in enumerate(zip(seq_lens_q, seq_lens_k, strict=True)):
        if q_len > k_len:
            raise ValueError(f"a request has more query tokens ({q_len}) than keys ({k_len})")
        prefix = k_len - q_len
        for head in range(num_heads):
            for pos0 in range(0, q_len, tile_q):
                rows = min(tile_q, q_len - pos0)
                # Causal: sub-block rows [s, s + block_m) see keys up to prefix + their last row.
                ends = tuple(min(k_len, prefix + pos0 + min(s + block_m, rows)) if causal
                             else k_len for s in range(0, rows, block_m))
                tiles.append(_Tile(q_row0 + pos0, pos0, rows, k_row0, prefix, head, ends,
                                   v_rows[b]))
        q_row0 += q_len
        k_row0 += k_len
    return tiles


def plan_work(seq_lens_q: list[int], seq_lens_k: list[int], num_heads: int, num_programs: int,
              *, tile_q: int = 256, block_m: int = 128, causal: bool = True,
              split_align: int = 128, min_split: int = 256, v_align: int = 1,
              grouped: bool = False) -> WorkPlan:
    """Spread the tiles of a varlen batch evenly over ``num_programs`` programs.

    A tile is split only where it straddles a cut between programs, never into
    pieces shorter than ``min_split`` keys, and at multiples of ``split_align``
    keys (a multiple of the kernel's key block, so pieces stay block-aligned).
    Requests start at multiples of ``v_align`` keys in v (``v_key_offsets``).
    ``grouped``: where tiles are many enough, ``_grouped_plan`` instead.
    """
    if tile_q % block_m:
        raise ValueError(f"tile_q ({tile_q}) must be a multiple of block_m ({block_m})")
    if num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    tiles = _tiles(seq_lens_q, seq_lens_k, num_heads, tile_q, block_m, causal, v_align)
    costs = [t.cost(0, t.kv_end) for t in tiles]
    if grouped and tiles and sum(costs) >= GROUPED_MIN_TILES * max(costs) * num_programs:
        return _grouped_plan(tiles, num_programs)
    programs: list[list[WorkItem]] = [[] for _ in range(num_programs)]
    loads = [0.0] * num_programs
    merges: list[MergeItem] = []
    num_partials = 0
    # Each program's quota is an equal share of the work still unassigned, so an
    # over- or undershoot (pieces are whole key blocks; a split's extra piece pays
    # the sub-block overhead again) is spread over the programs after it.
    remaining = float(sum(costs))
    p = 0
    quota = remaining / num_programs
    for tile in tiles:
        pieces: list[tuple[int, int, int]] = []  # (program, kv_lo, kv_hi)
        lo = 0
        while True:
            rest = tile.cost(lo, tile.kv_end)
            room = quota - loads[p]
            last_program = p == num_programs - 1
            hi = tile.kv_end if last_program or rest <= room else _split_point(
                tile, lo, room, split_align)
            if hi - lo < min_split and hi < tile.kv_end:  # no room for a useful piece here
                if loads[p] > 0:
                    p += 1
                    quota = remaining / (num_programs - p)
                    continue
                # An empty program still takes one piece of the smallest useful size.
                hi = min(lo + -(-min_split // split_align) * split_align, tile.kv_end)
            if tile.kv_end - hi < min_split:  # the remainder would be a sliver: keep it
                hi = tile.kv_end
            piece = tile.cost(lo, hi)
            pieces.append((p, lo, hi))
            loads[p] += piece
            remaining -= piece
            if hi == tile.kv_end:
                break
            remaining += tile.cost(hi, tile.kv_end) - (rest - piece)  # the split's extra cost
            lo = hi
            p += 1
            quota = remaining / (num_programs - p)
        split = len(pieces) > 1
        if split:
            merges.append(MergeItem(tile.q_row0, tile.q_rows, tile.head, num_partials,
                                    len(pieces)))
        for i, (prog, kv_lo, kv_hi) in enumerate(pieces):
            slot = num_partials + i if split else -1
            programs[prog].append(WorkItem(tile.q_row0, tile.q_pos0, tile.q_rows, tile.k_row0,
                                           tile.prefix, kv_lo, kv_hi, tile.head, slot,
                                           tile.v_row0))
        if split:
            num_partials += len(pieces)
    return WorkPlan(programs, merges, num_partials, loads)


def _grouped_plan(tiles: list[_Tile], num_programs: int) -> WorkPlan:
    """List scheduling in head order: each tile, whole, to the least loaded program.

    The contiguous cuts of ``plan_work`` give each program about one head, so the
    programs stream as many heads' keys at once as there are programs, more than
    L2 holds at long prompts; here the tiles running at any time are neighbours
    in head order, a few heads' worth, whose keys the programs share in L2. Each
    window of ``num_programs`` tiles goes costliest first, so the last tiles placed
    are cheap ones and the loads end close together.
    """
    heap = [(0, p) for p in range(num_programs)]
    programs: list[list[WorkItem]] = [[] for _ in range(num_programs)]
    loads = [0.0] * num_programs
    for w in range(0, len(tiles), num_programs):
        for tile in sorted(tiles[w:w + num_programs], key=lambda t: -t.cost(0, t.kv_end)):
            load, p = heapq.heappop(heap)
            programs[p].append(WorkItem(tile.q_row0, tile.q_pos0, tile.q_rows, tile.k_row0,
                                        tile.prefix, 0, tile.kv_end, tile.head, -1,
                                        tile.v_row0))
            loads[p] = load + tile.cost(0, tile.kv_end)
            heapq.heappush(heap, (loads[p], p))
    return WorkPlan(programs, [], 0, loads)


def _split_point(tile: _Tile, lo: int, room: float, align: int) -> int:
    """The furthest aligned key bound hi > lo with cost(lo, hi) <= room (lo if none)."""
    hi = lo
    while hi + align < tile.kv_end and tile.cost(lo, hi + align) <= room:
        hi += align
    return hi
