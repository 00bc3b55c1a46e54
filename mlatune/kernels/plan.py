"""Host-side planning for the persistent split-KV kernel (plain Python, no GPU work).

Like AITER's get_mla_metadata_v1 and FlashMLA's tile scheduler: the work of a
batch, measured in KV tiles plus a fixed per-item overhead (loading q, writing
a partial, one more reduce input), is cut into near-equal shares, one per
worker (a program resident on one SM). A worker's share may end inside one
request and continue into the next; each piece is an item (request, local key
range, partial slot). A request's slots are consecutive, so the reduce reads
``split_indptr[b]:split_indptr[b + 1]``; a request with no local keys gets no
slot and the reduce writes its rows as empty (output 0, LSE -inf).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def plan_persistent(local_lens: list[int], block_n: int, workers: int,
                    overhead: int = ITEM_OVERHEAD_TILES) -> PersistentPlan:
    """Spread the requests' key tiles over ``workers`` in near-equal, contiguous shares."""
    if workers < 1 or block_n < 1:
        raise ValueError(f"need workers >= 1 and block_n >= 1, got {workers}, {block_n}")
    tiles = [-(-n // block_n) for n in local_lens]
    # Each of the workers - 1 share boundaries may cut a request: one more item's overhead.
    total = sum(t + overhead for t in tiles if t) + overhead * (workers - 1)
    budget = max(1, -(-total // workers))
    per_worker: list[list[tuple[int, int, int, int]]] = [[] for _ in range(workers)]
    split_indptr = [0]
    worker, load, slot = 0, 0, 0
    for b, (n, t) in enumerate(zip(local_lens, tiles, strict=True)):
        pos = 0
        while pos < t:
            room = budget - load - overhead
            if room <= 0 and load > 0 and worker < workers - 1:
                worker, load = worker + 1, 0
                continue
            take = t - pos if worker == workers - 1 else max(1, min(t - pos, room))
            per_worker[worker].append((b, pos * block_n, min((pos + take) * block_n, n), slot))
            slot += 1
            load += take + overhead
            pos += take
        split_indptr.append(slot)
    work = [item for items in per_worker for item in items]
    work_indptr = [0]
    for items in per_worker:
        work_indptr.append(work_indptr[-1] + len(items))
    return PersistentPlan(work, work_indptr, split_indptr)
