"""Planning for the persistent split-KV kernel: a closed-form schedule, on the host or the GPU.

Like AITER's get_mla_metadata_v1 and FlashMLA's tile scheduler: the work of a
batch, measured in KV tiles plus a fixed per-item overhead (loading q, writing
a partial, one more reduce input), is cut into near-equal shares, one per
worker (a program resident on one SM). A worker's share may end inside one
request and continue into the next; each piece is an item (request, local key
range, partial slot). A request's slots are consecutive, so the reduce reads
``split_indptr[b]:split_indptr[b + 1]``; a request with no local keys gets no
slot and the reduce writes its rows as empty (output 0, LSE -inf).

The schedule is closed-form so that one Triton program can compute it from the
lengths on the device, into fixed-size buffers, with no host sync: the route
can then be captured in a CUDA graph and replayed after the lengths change.
Request b costs ``tiles + overhead`` cost units (0 without keys), laid end to
end in request order with the overhead in front of the tiles; worker w owns
units ``[w * share, (w + 1) * share)``, ``share = cdiv(total, workers)``. An
item is a (request, worker) pair whose units overlap in tiles; its slot is also
its row in the work list, which is then worker-major as the kernel needs.
``plan_persistent`` is the plain-Python reference of the same schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Cost of one item beyond its tiles, in tiles (FlashMLA uses a similar fixed charge).
ITEM_OVERHEAD_TILES = 2


@dataclass(frozen=True)
class PersistentPlan:
    work: list[tuple[int, int, int, int]]  # (request, key start, key end, slot), worker-major
    work_indptr: list[int]  # worker w owns work[work_indptr[w]:work_indptr[w + 1]]
    split_indptr: list[int]  # request b owns slots split_indptr[b]:split_indptr[b + 1]

    @property
    def num_slots(self) -> int:
        return self.split_indptr[-1]

    @property
    def max_slots(self) -> int:
        """The most slots any one request has."""
        bounds = self.split_indptr
        return max((bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)), default=0)


def work_capacity(batch: int, workers: int) -> int:
    """Rows enough for any plan's work list (and slots for its partials).

    A request with keys is one item, plus one for each of the ``workers - 1``
    share boundaries that cuts it: at most ``batch + workers - 1`` items.
    """
    return batch + workers


def max_slots_bound(workers: int, max_local_keys: int, block_n: int) -> int:
    """The most slots (items) one request can get: one per worker it touches, and
    each of those holds at least one of its tiles."""
    return min(workers, -(-max_local_keys // block_n))


def plan_persistent(local_lens: list[int], block_n: int, workers: int,
                    overhead: int = ITEM_OVERHEAD_TILES) -> PersistentPlan:
    """The schedule for requests of ``local_lens`` keys on this rank (the module docstring's)."""
    if workers < 1 or block_n < 1:
        raise ValueError(f"need workers >= 1 and block_n >= 1, got {workers}, {block_n}")
    tiles = [-(-n // block_n) for n in local_lens]
    share = max(1, -(-sum(t + overhead for t in tiles if t) // workers))
    work: list[tuple[int, int, int, int]] = []
    per_worker = [0] * workers
    split_indptr = [0]
    end = 0  # cost units of the requests so far
    for b, (n, t) in enumerate(zip(local_lens, tiles, strict=True)):
        if t:
            first, end = end + overhead, end + overhead + t  # this request's tile units
            for w in range(first // share, (end - 1) // share + 1):
                s, e = max(w * share, first) - first, min((w + 1) * share, end) - first
                work.append((b, s * block_n, min(e * block_n, n), len(work)))
                per_worker[w] += 1
        split_indptr.append(len(work))
    work_indptr = [0]
    for count in per_worker:
        work_indptr.append(work_indptr[-1] + count)
    return PersistentPlan(work, work_indptr, split_indptr)


@triton.jit
def _costs(lens, rank, world, BLOCK_N: tl.constexpr, OVERHEAD: tl.constexpr):
    """Local keys, tiles and cost units of requests of global lengths ``lens``."""
    last = lens - 1
    n = tl.where(last >= rank, (last - rank) // world + 1, 0)
    tiles = tl.cdiv(n, BLOCK_N)
    return n, tiles, tl.where(tiles > 0, tiles + OVERHEAD, 0)


@triton.jit
def _load_lens(seq_lens_ptr, offs, batch):
    return tl.load(seq_lens_ptr + offs, mask=offs < batch, other=0)


@triton.jit(do_not_specialize=["batch", "rank", "world", "workers"])
def plan_kernel(seq_lens_ptr, work_ptr, work_indptr_ptr, split_indptr_ptr,
                batch, rank, world, workers,
                BLOCK_N: tl.constexpr, OVERHEAD: tl.constexpr, BLOCK_B: tl.constexpr):
    # One program, two passes over the requests: the total cost fixes the share;
    # then, in chunks of BLOCK_B requests, prefix sums (carried between chunks)
    # give every request's units, workers and slots at once, with no serial walk.
    lanes = tl.arange(0, BLOCK_B)
    lens = _load_lens(seq_lens_ptr, lanes, batch)  # pass 2's first chunk, in flight meanwhile
    wide = tl.arange(0, 4 * BLOCK_B)  # pass 1 only sums: wider steps, fewer load round trips
    costs = tl.zeros([4 * BLOCK_B], dtype=tl.int32)
    for b0 in range(0, batch, 4 * BLOCK_B):
        costs += _costs(_load_lens(seq_lens_ptr, b0 + wide, batch), rank, world,
                        BLOCK_N, OVERHEAD)[2]
    total = tl.sum(costs, axis=0)
    share = tl.maximum(tl.cdiv(total, workers), 1)

    unit_carry = total * 0
    slot_carry = total * 0
    tl.store(split_indptr_ptr, slot_carry)
    for b0 in range(0, batch, BLOCK_B):
        next_lens = _load_lens(seq_lens_ptr, b0 + BLOCK_B + lanes, batch)  # in flight meanwhile
        n, tiles, cost = _costs(lens, rank, world, BLOCK_N, OVERHEAD)
        end = unit_carry + tl.cumsum(cost, axis=0)
        first = end - cost + OVERHEAD  # the request's first tile unit
        first_w = first // share
        items = tl.where(tiles > 0, (end - 1) // share - first_w + 1, 0)
        first_slot = slot_carry + tl.cumsum(items, axis=0) - items
        tl.store(split_indptr_ptr + b0 + lanes + 1, first_slot + items, mask=b0 + lanes < batch)
        # Item 0 of each request: from its first tile to its first worker's end.
        e = tl.minimum((first_w + 1) * share, end) - first
        _store_row(work_ptr, first_slot, b0 + lanes, 0, tl.minimum(e * BLOCK_N, n), tiles > 0)
        chunk_end = unit_carry + tl.sum(cost, axis=0)
        _store_workers(work_ptr, work_indptr_ptr, b0, n, first, end, first_w, first_slot,
                       _last_worker(unit_carry, share), _last_worker(chunk_end, share), share,
                       BLOCK_N, BLOCK_B)
        unit_carry = chunk_end
        slot_carry += tl.sum(items, axis=0)
        lens = next_lens
    # Workers past the last request's last worker start at the end of the list.
    for w0 in range(_last_worker(total, share) + 1, workers + 1, BLOCK_B):
        tl.store(work_indptr_ptr + w0 + lanes, slot_carry, mask=w0 + lanes <= workers)


@triton.jit
def _last_worker(units, share):
    """The worker of unit ``units - 1`` (-1 for none)."""
    return tl.where(units > 0, (units - 1) // share, -1)


@triton.jit
def _store_row(work_ptr, slot, b, start, end, mask):
    row = work_ptr + slot * 4
    tl.store(row, b, mask=mask)
    tl.store(row + 1, start, mask=mask)
    tl.store(row + 2, end, mask=mask)
    tl.store(row + 3, slot, mask=mask)


@triton.jit
def _first_at_least(sorted_vals, x, BLOCK: tl.constexpr):
    """For each ``x``, the first index of the nondecreasing ``sorted_vals`` (BLOCK of them)
    holding a value >= x (BLOCK - 1 when none does): a branch-free binary search whose
    probes are register gathers, not memory loads."""
    pos = tl.zeros_like(x)
    for k in tl.static_range(1, 32):
        if BLOCK >> k > 0:  # probes BLOCK / 2, BLOCK / 4, ..., 1 ahead
            below = tl.gather(sorted_vals, pos + ((BLOCK >> k) - 1), 0) < x
            pos = tl.where(below, pos + (BLOCK >> k), pos)
    return pos


@triton.jit
def _store_workers(work_ptr, work_indptr_ptr, b0, n, first, end, first_w, first_slot,
                   w_lo, w_hi, share, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """One lane per worker w in ``(w_lo, w_hi]`` (those whose last unit lies in this
    chunk), however the chunk's items fall (one long request or many short ones).

    Worker w starts at item ``max(0, w - first_w)`` of request r, the first whose last
    worker is >= w (w < first_w: a worker inside r's overhead, with no items). For
    w > first_w that item continues r from unit ``w * share``: w writes its row.
    """
    lanes = tl.arange(0, BLOCK_B)
    last_w = _last_worker(end, share)  # nondecreasing: a request without tiles repeats
    for w0 in range(w_lo + 1, w_hi + 1, BLOCK_B):
        w = w0 + lanes
        ok = w <= w_hi
        r = _first_at_least(last_w, w, BLOCK_B)
        j = w - tl.gather(first_w, r, 0)
        slot = tl.gather(first_slot, r, 0) + tl.maximum(j, 0)
        tl.store(work_indptr_ptr + w, slot, mask=ok)
        f = tl.gather(first, r, 0)
        e = tl.minimum((w + 1) * share, tl.gather(end, r, 0)) - f
        _store_row(work_ptr, slot, b0 + r, (w * share - f) * BLOCK_N,
                   tl.minimum(e * BLOCK_N, tl.gather(n, r, 0)), ok & (j > 0))


def allocate_plan_buffers(batch: int, workers: int,
                          device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(work, work_indptr, split_indptr) int32 buffers for ``persistent_plan_launcher``."""
    i32 = dict(dtype=torch.int32, device=device)
    return (torch.zeros(work_capacity(batch, workers), 4, **i32),
            torch.zeros(workers + 1, **i32), torch.zeros(batch + 1, **i32))


def persistent_plan_launcher(seq_lens: torch.Tensor, *, rank: int, world: int, block_n: int,
                             workers: int, work: torch.Tensor, work_indptr: torch.Tensor,
                             split_indptr: torch.Tensor) -> Callable[[], None]:
    """A zero-argument launch of ``plan_kernel``: the plan of ``seq_lens``' current
    (global) lengths on DCP rank ``rank`` of ``world``, into the given buffers.

    No host sync or allocation per launch, so it can be captured in a CUDA graph
    and replayed after ``seq_lens`` is rewritten in place. Work rows past the
    plan's item count are left as they were. Compiled once per ``block_n``: the
    batch, rank, world and worker count are runtime values.
    """
    batch = seq_lens.shape[0]
    _check_buffers(seq_lens, work, work_indptr, split_indptr, batch, workers)
    if block_n < 1 or not 0 <= rank < world:
        raise ValueError(f"need block_n >= 1 and 0 <= rank < world, got {block_n}, {rank}, {world}")
    block_b, num_warps = plan_blocks()
    args = (seq_lens, work, work_indptr, split_indptr, batch, rank, world, workers)
    meta = dict(BLOCK_N=block_n, OVERHEAD=ITEM_OVERHEAD_TILES, BLOCK_B=block_b,
                num_warps=num_warps)

    def launch() -> None:
        plan_kernel[(1,)](*args, **meta)

    return launch


def plan_blocks() -> tuple[int, int]:
    """``plan_kernel``'s requests per chunk and warps: one chunk covers a usual decode
    batch (each further one adds about 1.4 us on an H200), one request per thread
    (more per thread made Triton convert layouts through shared memory)."""
    return 256, 8


def _check_buffers(seq_lens: torch.Tensor, work: torch.Tensor, work_indptr: torch.Tensor,
                   split_indptr: torch.Tensor, batch: int, workers: int) -> None:
    tensors = (seq_lens, work, work_indptr, split_indptr)
    if any(t.dtype != torch.int32 or not t.is_contiguous() for t in tensors):
        raise ValueError("seq_lens and the plan buffers must be contiguous int32")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("seq_lens and the plan buffers must be on one device")
    if workers < 1 or seq_lens.dim() != 1:
        raise ValueError(f"need workers >= 1 and 1-D seq_lens, got {workers}, {seq_lens.dim()}-D")
    rows = work_capacity(batch, workers)
    if work.dim() != 2 or work.shape[1] != 4 or work.shape[0] < rows:
        raise ValueError(f"work must be (>= {rows}, 4), got {tuple(work.shape)}")
    if work_indptr.shape != (workers + 1,) or split_indptr.shape != (batch + 1,):
        raise ValueError(f"work_indptr and split_indptr must be ({workers + 1},) and "
                         f"({batch + 1},), got {tuple(work_indptr.shape)} and "
                         f"{tuple(split_indptr.shape)}")
