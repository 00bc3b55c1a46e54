"""Test helpers: rebuild inputs in other layouts from the same logical KV."""

from __future__ import annotations

import torch

from mlatune.check import reference
from mlatune.check.inputs import DecodeInputs, KVShard, shard_lengths
from mlatune.check.reference import _gather_pages


def expected_now(inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 reference for the lengths ``inputs.seq_lens`` holds now (each rank's
    shard lengths derived again), with the inputs' softmax scale: what a step that read
    lengths rewritten in place must match."""
    p = inputs.problem
    shards = tuple(KVShard(s.rank, s.kv_cache, s.block_table,
                           shard_lengths(inputs.seq_lens, s.rank, p.dcp_size))
                   for s in inputs.shards)
    return reference.run(DecodeInputs(p, inputs.q, inputs.q_scale, inputs.kv_scale,
                                      inputs.seq_lens, shards, inputs.sm_scale), torch.float64)


def dense_kv(inputs: DecodeInputs) -> list[torch.Tensor]:
    """Each request's global KV (L, d_qk), reassembled from the round-robin shards."""
    world = inputs.dcp_size
    result = []
    for b, length in enumerate(inputs.seq_lens.tolist()):
        kv = torch.empty(length, inputs.q.shape[-1], dtype=inputs.shards[0].kv_cache.dtype)
        for shard in inputs.shards:
            local = _gather_pages(shard.kv_cache, shard.block_table[b:b + 1],
                                  int(shard.seq_lens[b]))[0]
            kv[shard.rank::world] = local
        result.append(kv)
    return result


def paged(kvs: list[torch.Tensor], page_size: int, seed: int) -> KVShard:
    """One shard (rank 0, dcp 1) holding ``kvs`` in shuffled pages of ``page_size``."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = [-(-kv.shape[0] // page_size) for kv in kvs]
    perm = torch.randperm(sum(n_pages), generator=gen)
    cache = torch.randn(sum(n_pages), page_size, kvs[0].shape[-1], generator=gen).to(kvs[0].dtype)
    table = torch.full((len(kvs), max(n_pages)), -1, dtype=torch.int32)
    start = 0
    for b, (kv, n) in enumerate(zip(kvs, n_pages, strict=True)):
        ids = perm[start:start + n]
        start += n
        table[b, :n] = ids.to(torch.int32)
        for j, page in enumerate(ids.tolist()):
            chunk = kv[j * page_size:(j + 1) * page_size]
            cache[page, :chunk.shape[0]] = chunk
    lens = torch.tensor([kv.shape[0] for kv in kvs], dtype=torch.int32)
    return KVShard(0, cache, table, lens)


def unsharded(inputs: DecodeInputs, page_size: int = 16, seed: int = 99) -> DecodeInputs:
    """The same problem computed by one rank holding every token (kernel heads kept)."""
    p = inputs.problem
    flat = p.with_(num_heads=p.kernel_heads, dcp_size=1, page_size=page_size)
    shard = paged(dense_kv(inputs), page_size, seed)
    return DecodeInputs(flat, inputs.q, inputs.q_scale, inputs.kv_scale, inputs.seq_lens, (shard,))


def poison_stale_slots(inputs: DecodeInputs) -> int:
    """Set rank 0's cache slots past each request's length in its last page to NaN (a
    kernel must not let them through); returns how many."""
    shard = inputs.shards[0]
    page = shard.kv_cache.shape[1]
    count = 0
    for b, n in enumerate(shard.seq_lens.tolist()):
        if n % page:
            pid = int(shard.block_table[b, (n - 1) // page])
            shard.kv_cache[pid, n % page:] = float("nan")
            count += page - n % page
    return count


def lock_is_free(journal) -> bool:
    """Whether another sweep could take the journal's lock now (its file may stay)."""
    from filelock import FileLock, Timeout

    from mlatune.sweep.journal import lock_path

    lock = FileLock(lock_path(journal), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    lock.release()
    return True
