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

The route plans once in ``prepare`` and the kernels only read the plan's tables.
The tiles and tables are numpy arrays; only the walk along the line of tiles is a
Python loop, and it looks at a tile's sub-blocks only where a cut falls in it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from heapq import heapreplace
from itertools import pairwise

import numpy as np

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


WORK_INFO_COLUMNS = len(fields(WorkItem))
MERGE_INFO_COLUMNS = len(fields(MergeItem))
_Q_ROW0, _Q_POS0, _Q_ROWS, _K_ROW0, _PREFIX, _KV_LO, _KV_HI, _HEAD, _SLOT, _V_ROW0 = range(
    WORK_INFO_COLUMNS)


@dataclass(frozen=True, eq=False)
class WorkPlan:
    """A plan as the tables the kernels read (int32): program p runs rows
    ``work_indptr[p]:work_indptr[p + 1]`` of ``work_info``, in order; each row of
    ``merge_info`` is a split tile whose partial slots the merge kernel combines."""

    work_indptr: np.ndarray  # (programs + 1,)
    work_info: np.ndarray  # (items, WORK_INFO_COLUMNS), columns as WorkItem
    merge_info: np.ndarray  # (split tiles, MERGE_INFO_COLUMNS), columns as MergeItem
    num_partials: int
    loads: np.ndarray  # planned cost per program, float64 (for tests and reports)

    @property
    def programs(self) -> list[list[WorkItem]]:
        """The items of each program as objects (for tests and reports)."""
        items = [WorkItem(*row) for row in self.work_info.tolist()]
        return [items[a:b] for a, b in pairwise(self.work_indptr.tolist())]

    @property
    def merges(self) -> list[MergeItem]:
        return [MergeItem(*row) for row in self.merge_info.tolist()]


@dataclass(frozen=True)
class _Tiles:
    """The work tiles in plan order (request, then head, then query position).

    Tiles of one request and position share a shape (all but the head): ``shape``
    indexes ``sub_ends``, each shape's sub-block key bounds (0 past its rows).
    """

    info: np.ndarray  # (tiles, WORK_INFO_COLUMNS) int32: each tile whole, its keys [0, kv_end)
    costs: np.ndarray  # (tiles,) int64: the whole tile's cost
    shape: np.ndarray  # (tiles,)
    sub_ends: np.ndarray  # (shapes, tile_q // block_m)

    def ends(self, tile: int) -> list[int]:
        """Key bound (exclusive) of each sub-block of ``tile`` (each at least 1: a
        sub-block has a row, which sees a key)."""
        return [end for end in self.sub_ends[self.shape[tile]].tolist() if end]


def _cost(ends: list[int], lo: int, hi: int) -> int:
    """Keys the sub-blocks ending at ``ends`` visit in [lo, hi), plus their fixed cost."""
    keys = sum(max(0, min(hi, end) - lo) for end in ends)
    return keys + SUB_BLOCK_OVERHEAD_KEYS * len(ends)


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


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each of consecutive runs of ``counts`` begins."""
    return np.cumsum(counts) - counts


def _tiles(seq_lens_q: list[int], seq_lens_k: list[int], num_heads: int, tile_q: int,
           block_m: int, causal: bool, v_align: int) -> _Tiles:
    """The batch's tiles, from one shape per (request, query tile) that its heads share."""
    q_lens = np.asarray(seq_lens_q, dtype=np.int64).reshape(-1)
    k_lens = np.asarray(seq_lens_k, dtype=np.int64).reshape(-1)
    if q_lens.shape != k_lens.shape:
        raise ValueError(f"{len(q_lens)} query lengths but {len(k_lens)} key lengths")
    over = np.flatnonzero(q_lens > k_lens)
    if over.size:
        b = over[0]
        raise ValueError(f"a request has more query tokens ({q_lens[b]}) than keys ({k_lens[b]})")
    # One shape per (request, query tile).
    tiles_per_request = -(-q_lens // tile_q)
    req = np.repeat(np.arange(len(q_lens)), tiles_per_request)
    pos0 = (np.arange(len(req)) - np.repeat(_starts(tiles_per_request), tiles_per_request)) * tile_q
    rows = np.minimum(tile_q, q_lens[req] - pos0)
    k_len, prefix = k_lens[req, None], (k_lens - q_lens)[req, None]
    sub0 = np.arange(0, tile_q, block_m)
    # Causal: sub-block rows [s, s + block_m) see keys up to prefix + their last row.
    ends = (np.minimum(k_len, prefix + pos0[:, None] + np.minimum(sub0 + block_m, rows[:, None]))
            if causal else np.broadcast_to(k_len, (len(req), len(sub0))))
    sub_ends = np.where(sub0 < rows[:, None], ends, 0)
    costs = sub_ends.sum(1) + SUB_BLOCK_OVERHEAD_KEYS * -(-rows // block_m)
    v_rows = np.concatenate(([0], np.cumsum(-(-k_lens // v_align) * v_align)))
    info = np.zeros((len(req), WORK_INFO_COLUMNS), dtype=np.int64)
    info[:, _Q_ROW0] = _starts(q_lens)[req] + pos0
    info[:, _Q_POS0], info[:, _Q_ROWS] = pos0, rows
    info[:, _K_ROW0], info[:, _PREFIX] = _starts(k_lens)[req], prefix[:, 0]
    info[:, _KV_HI], info[:, _SLOT], info[:, _V_ROW0] = sub_ends.max(1, initial=0), -1, v_rows[req]
    # Each request's shapes once per head.
    pair_req = np.repeat(np.arange(len(q_lens)), num_heads)
    counts = tiles_per_request[pair_req]
    shape = np.repeat(_starts(tiles_per_request)[pair_req] - _starts(counts), counts)
    shape += np.arange(len(shape))
    tiles_info = info.astype(np.int32)[shape]
    tiles_info[:, _HEAD] = np.repeat(np.tile(np.arange(num_heads), len(q_lens)), counts)
    return _Tiles(tiles_info, costs[shape], shape, sub_ends)


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
    costs = tiles.costs
    if grouped and len(costs) and (int(costs.sum())
                                   >= GROUPED_MIN_TILES * int(costs.max()) * num_programs):
        return _grouped_plan(tiles, num_programs)
    return _contiguous_plan(tiles, num_programs, split_align, min_split)


def _contiguous_plan(tiles: _Tiles, num_programs: int, split_align: int,
                     min_split: int) -> WorkPlan:
    """The line of tiles cut into equal lengths: tiles that fit their program's quota
    go whole; ``_cut_tile`` places the others, splitting them where worth it."""
    costs = tiles.costs.tolist()
    loads = [0.0] * num_programs
    # Each program's quota is an equal share of the work still unassigned, so an
    # over- or undershoot (pieces are whole key blocks; a split's extra piece pays
    # the sub-block overhead again) is spread over the programs after it.
    remaining = float(sum(costs))
    p, last = 0, num_programs - 1
    quota, load = remaining / num_programs, 0.0
    run_starts, run_programs = [0], [0]  # tiles from run_starts[i] on go to run_programs[i]
    splits: dict[int, list[tuple[int, int, int]]] = {}  # tile: its pieces (program, kv_lo, kv_hi)
    for t, cost in enumerate(costs):
        if p == last or cost <= quota - load:
            load += cost
            remaining -= cost
            continue
        loads[p] = load
        pieces, p, quota, remaining = _cut_tile(tiles.ends(t), loads, p, quota, remaining,
                                                split_align, min_split)
        load = loads[p]
        if len(pieces) > 1:
            splits[t] = pieces
        run_starts.append(t)  # a tile placed whole is on p; a split one's pieces say where
        run_programs.append(p)
    loads[p] = load
    run_starts.append(len(costs))
    programs = np.repeat(np.asarray(run_programs), np.diff(run_starts))
    return _contiguous_tables(tiles, programs, splits, np.asarray(loads))


def _cut_tile(ends: list[int], loads: list[float], p: int, quota: float, remaining: float,
              split_align: int, min_split: int
              ) -> tuple[list[tuple[int, int, int]], int, float, float]:
    """Place one tile from program ``p`` on, cut where it passes a program's quota:
    its pieces (program, kv_lo, kv_hi), then the walk's next p, quota and remaining."""
    num_programs = len(loads)
    kv_end = max(ends)
    pieces: list[tuple[int, int, int]] = []
    lo, rest = 0, _cost(ends, 0, kv_end)  # rest: the cost of [lo, kv_end)
    while True:
        room = quota - loads[p]
        last_program = p == num_programs - 1
        hi = kv_end if last_program or rest <= room else _split_point(
            ends, lo, room, split_align)
        if hi - lo < min_split and hi < kv_end:  # no room for a useful piece here
            if loads[p] > 0:
                p += 1
                quota = remaining / (num_programs - p)
                continue
            # An empty program still takes one piece of the smallest useful size.
            hi = min(lo + -(-min_split // split_align) * split_align, kv_end)
        if kv_end - hi < min_split:  # the remainder would be a sliver: keep it
            hi = kv_end
        piece = rest if hi == kv_end else _cost(ends, lo, hi)
        pieces.append((p, lo, hi))
        loads[p] += piece
        remaining -= piece
        if hi == kv_end:
            return pieces, p, quota, remaining
        after = _cost(ends, hi, kv_end)
        remaining += after - (rest - piece)  # the split's extra cost
        lo, rest = hi, after
        p += 1
        quota = remaining / (num_programs - p)


def _split_point(ends: list[int], lo: int, room: float, align: int) -> int:
    """The furthest aligned key bound hi > lo, short of the tile's end, with
    cost(lo, hi) <= room (lo if none); cost grows with hi, so a bisection finds it."""
    fits, past = 0, -(-(max(ends) - lo) // align)  # in steps of align from lo
    while past - fits > 1:
        mid = (fits + past) // 2
        if _cost(ends, lo, lo + mid * align) <= room:
            fits = mid
        else:
            past = mid
    return lo + fits * align


def _contiguous_tables(tiles: _Tiles, programs: np.ndarray,
                       splits: dict[int, list[tuple[int, int, int]]], loads: np.ndarray
                       ) -> WorkPlan:
    """The tables of a contiguous plan: its items are the tiles in order, whole on
    ``programs``, except that a split tile is its pieces (``splits``, in tile order)."""
    info, item_programs = tiles.info, programs
    merges = []
    slot = 0
    if splits:
        pieces = np.ones(len(programs), dtype=np.int64)
        pieces[list(splits)] = [len(tile_pieces) for tile_pieces in splits.values()]
        item_tile = np.repeat(np.arange(len(programs)), pieces)
        info, item_programs = info[item_tile], programs[item_tile]
        first = _starts(pieces)
    for t, tile_pieces in splits.items():
        rows = slice(first[t], first[t] + len(tile_pieces))
        item_programs[rows], info[rows, _KV_LO], info[rows, _KV_HI] = zip(*tile_pieces,
                                                                          strict=True)
        info[rows, _SLOT] = np.arange(slot, slot + len(tile_pieces))
        merges.append((*info[first[t], [_Q_ROW0, _Q_ROWS, _HEAD]].tolist(), slot,
                       len(tile_pieces)))
        slot += len(tile_pieces)
    return WorkPlan(_indptr(item_programs, len(loads)), info,
                    np.array(merges, dtype=np.int32).reshape(-1, MERGE_INFO_COLUMNS), slot, loads)


def _indptr(item_programs: np.ndarray, num_programs: int) -> np.ndarray:
    """Where each program's items begin in items ordered by program, and their count last."""
    indptr = np.zeros(num_programs + 1, dtype=np.int32)
    indptr[1:] = np.cumsum(np.bincount(item_programs, minlength=num_programs))
    return indptr


def _grouped_plan(tiles: _Tiles, num_programs: int) -> WorkPlan:
    """List scheduling in head order: each tile, whole, to the least loaded program.

    The contiguous cuts of ``plan_work`` give each program about one head, so the
    programs stream as many heads' keys at once as there are programs, more than
    L2 holds at long prompts; here the tiles running at any time are neighbours
    in head order, a few heads' worth, whose keys the programs share in L2. Each
    window of ``num_programs`` tiles goes costliest first, so the last tiles placed
    are cheap ones and the loads end close together.
    """
    costs = tiles.costs
    order = np.lexsort((-costs, np.arange(len(costs)) // num_programs))  # stable
    # A program's load and index as one int, load * num_programs + p: the least is
    # the least loaded program, the lowest index among equals.
    heap = list(range(num_programs))
    keys = []
    for cost in (costs[order] * num_programs).tolist():
        keys.append(heap[0])
        heapreplace(heap, heap[0] + cost)
    programs = np.array(keys, dtype=np.int64) % num_programs
    loads = np.zeros(num_programs)
    loads[np.mod(heap, num_programs)] = np.floor_divide(heap, num_programs)
    return WorkPlan(_indptr(programs, num_programs),
                    tiles.info[order[np.argsort(programs, kind="stable")]],
                    np.zeros((0, MERGE_INFO_COLUMNS), dtype=np.int32), 0, loads)
