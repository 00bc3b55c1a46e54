"""The persistent split-KV schedule: its plain-Python reference and the device planner.

The reference (``plan_persistent``) must cover every local key once, in slots
that are consecutive per request, within the capacity and slot bounds the
routes size their buffers with, and with balanced workers. The one-program
Triton planner must write exactly the reference's plan (CPU: the interpreter),
also when the same launch runs again after the lengths were rewritten in place,
which is what a CUDA graph replay does (the GPU test captures one).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlatune.check.inputs import shard_lengths
from mlatune.kernels import plan as plan_module
from mlatune.kernels.plan import (
    ITEM_OVERHEAD_TILES,
    PersistentPlan,
    allocate_plan_buffers,
    max_slots_bound,
    persistent_plan_launcher,
    plan_blocks,
    plan_persistent,
    work_capacity,
)

OV = ITEM_OVERHEAD_TILES


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_schedule(lens: list[int], block_n: int, workers: int, plan: PersistentPlan) -> None:
    work, work_indptr, split_indptr = plan.work, plan.work_indptr, plan.split_indptr
    assert len(work_indptr) == workers + 1 and work_indptr[0] == 0
    assert work_indptr[-1] == len(work) and work_indptr == sorted(work_indptr)
    assert len(split_indptr) == len(lens) + 1 and split_indptr[0] == 0
    assert len(work) <= sum(1 for n in lens if n) + workers - 1 <= work_capacity(len(lens), workers)
    for i, (b, start, end, slot) in enumerate(work):
        assert slot == i  # the slot is the row
        assert split_indptr[b] <= slot < split_indptr[b + 1]
        assert start % block_n == 0 and start < end <= lens[b]
    for b, n in enumerate(lens):
        mine = work[split_indptr[b]:split_indptr[b + 1]]
        assert all(row[0] == b for row in mine)
        # Slots in key order, back to back: every key once.
        bounds = [0] + [k for _, s, e, _ in mine for k in (s, e)] + [n]
        assert bounds[::2] == bounds[1::2]
        assert len(mine) <= max_slots_bound(workers, max(lens, default=0), block_n)
    _check_balance(lens, block_n, workers, plan)


def _check_balance(lens: list[int], block_n: int, workers: int, plan: PersistentPlan) -> None:
    """Every worker's load (tiles + OV per item) is within its share plus one OV.

    Worker w owns ``share`` cost units. Only its first item can be charged units
    outside them: the continuation of a request begun on an earlier worker
    (whose OV lies there) or one whose OV straddles the boundary. Any later
    item's request begins inside w's units, OV first, and its tiles end there.
    """
    share = max(1, _cdiv(sum(_cdiv(n, block_n) + OV for n in lens if n), workers))
    for w in range(workers):
        items = plan.work[plan.work_indptr[w]:plan.work_indptr[w + 1]]
        assert sum(_cdiv(e - s, block_n) + OV for _, s, e, _ in items) <= share + OV
        # Items in worker order are in request order, requests after each other.
        assert [row[0] for row in items] == sorted({row[0] for row in items})


@pytest.mark.parametrize(("lens", "block_n", "workers"),
                         [([4096], 64, 132), ([1, 0, 300, 7, 64], 16, 4), ([5000] * 6, 64, 7),
                          ([0, 0], 16, 3), ([100, 2000, 30, 800], 32, 1), ([], 16, 5),
                          ([1] * 10, 16, 3), ([16, 32, 48], 16, 100)])
def test_persistent_plan_covers_each_key_once_evenly(lens, block_n, workers):
    _check_schedule(lens, block_n, workers, plan_persistent(lens, block_n, workers))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=40), st.sampled_from([1, 16, 32, 64]),
       st.integers(1, 300))
def test_persistent_plan_properties(lens, block_n, workers):
    _check_schedule(lens, block_n, workers, plan_persistent(lens, block_n, workers))


def test_persistent_plan_balance_bound_is_reached():
    # Requests of 6 and 4 tiles cost 8 + 6 units: share 7 over 2 workers. Worker 1
    # continues request 0 (1 tile, its OV charged again) and runs request 1: 3 + 6 = share + OV.
    plan = plan_persistent([6 * 16, 4 * 16], 16, 2)
    assert plan.work == [(0, 0, 80, 0), (0, 80, 96, 1), (1, 0, 64, 2)]
    assert plan.work_indptr == [0, 1, 3] and plan.split_indptr == [0, 2, 3]


def test_bound_helpers():
    assert work_capacity(256, 132) == 388
    assert max_slots_bound(132, 4096, 64) == 64
    assert max_slots_bound(8, 4096, 64) == 8
    assert max_slots_bound(8, 0, 64) == 0
    with pytest.raises(ValueError, match="workers"):
        plan_persistent([1], 16, 0)


# -- the device planner -------------------------------------------------------------
def _global_lens(rng: random.Random, batch: int, block_n: int, world: int) -> list[int]:
    """Ragged global lengths: zeros, ones, and local lengths next to multiples of block_n."""
    step = block_n * world
    picks = [lambda: 0, lambda: 1, lambda: rng.randint(1, 3 * step),
             lambda: max(0, rng.randint(1, 12) * step + rng.randint(-world, world)),
             lambda: rng.randint(0, 40 * step)]
    return [rng.choice(picks)() for _ in range(batch)]


def _device_plan(seq_lens: torch.Tensor, rank: int, world: int, block_n: int, workers: int,
                 chunk: int | None = None) -> tuple:
    """The device plan's buffers (poisoned first) and its launch, with ``chunk``
    requests per chunk (None: the kernel's own) to cross chunks in small batches."""
    work, work_indptr, split_indptr = allocate_plan_buffers(seq_lens.shape[0], workers,
                                                            seq_lens.device)
    for buf in (work, work_indptr, split_indptr):
        buf.fill_(-7)  # every entry the plan defines must be written
    with pytest.MonkeyPatch.context() as mp:
        if chunk is not None:
            mp.setattr(plan_module, "plan_blocks", lambda: (chunk, 4))
        launch = persistent_plan_launcher(seq_lens, rank=rank, world=world, block_n=block_n,
                                          workers=workers, work=work, work_indptr=work_indptr,
                                          split_indptr=split_indptr)
    launch()
    return work, work_indptr, split_indptr, launch


def _assert_matches(seq_lens: torch.Tensor, rank: int, world: int, block_n: int, workers: int,
                    work: torch.Tensor, work_indptr: torch.Tensor,
                    split_indptr: torch.Tensor) -> PersistentPlan:
    want = plan_persistent(shard_lengths(seq_lens.cpu(), rank, world).tolist(), block_n, workers)
    items = len(want.work)
    assert work_indptr.tolist() == want.work_indptr
    assert split_indptr.tolist() == want.split_indptr
    assert work[:items].tolist() == [list(row) for row in want.work]
    return want


# (batch, workers, block_n, world): W below and above the batch, an empty batch, a batch
# past the kernel's own chunk of requests; each also in chunks of 16.
DEVICE_CASES = [(5, 1, 16, 1), (8, 132, 64, 1), (300, 3, 16, 1), (40, 600, 16, 2),
                (33, 7, 32, 4), (0, 4, 16, 1), (17, 20, 16, 2), (64, 64, 16, 4), (260, 9, 16, 2)]


def test_device_cases_cross_chunks():
    assert any(batch > plan_blocks()[0] for batch, *_ in DEVICE_CASES)


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize(("batch", "workers", "block_n", "world"), DEVICE_CASES)
def test_device_plan_equals_reference(batch, workers, block_n, world, chunk):
    rng = random.Random(batch * 7919 + workers * 31 + world)
    seq_lens = torch.tensor(_global_lens(rng, batch, block_n, world), dtype=torch.int32)
    for rank in range(world):
        work, work_indptr, split_indptr, _ = _device_plan(seq_lens, rank, world, block_n, workers,
                                                          chunk)
        want = _assert_matches(seq_lens, rank, world, block_n, workers, work, work_indptr,
                               split_indptr)
        assert torch.all(work[len(want.work):] == -7)  # rows past the plan are left alone


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize(("lens", "workers"), [
    ([100_000], 132),  # one request over every worker
    ([0, 1, 70_000, 16, 17, 0, 33], 132),  # a long request among short ones
    ([16, 32, 0, 48], 100),  # share 1: workers inside a request's overhead own no items
])
def test_device_plan_equals_reference_long_requests(lens, workers, chunk):
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    buffers = _device_plan(seq_lens, 0, 1, 16, workers, chunk)[:3]
    _assert_matches(seq_lens, 0, 1, 16, workers, *buffers)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 700), max_size=24), st.integers(1, 40), st.sampled_from([16, 32]),
       st.sampled_from([(1, 0), (2, 0), (2, 1), (4, 0), (4, 3)]), st.sampled_from([None, 4]))
def test_device_plan_equals_reference_drawn(lens, workers, block_n, dcp, chunk):
    world, rank = dcp
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    work, work_indptr, split_indptr, _ = _device_plan(seq_lens, rank, world, block_n, workers,
                                                      chunk)
    _assert_matches(seq_lens, rank, world, block_n, workers, work, work_indptr, split_indptr)


@pytest.mark.parametrize(("batch", "workers", "world", "rank"), [(12, 5, 1, 0), (70, 300, 2, 1)])
def test_device_plan_relaunch_reads_rewritten_lengths(batch, workers, world, rank):
    # A captured graph replays the same launch: it must plan from the lengths' new contents.
    rng = random.Random(batch + workers)
    seq_lens = torch.tensor(_global_lens(rng, batch, 16, world), dtype=torch.int32)
    *buffers, launch = _device_plan(seq_lens, rank, world, 16, workers, chunk=16)
    _assert_matches(seq_lens, rank, world, 16, workers, *buffers)
    for _ in range(2):
        seq_lens.copy_(torch.tensor(_global_lens(rng, batch, 16, world), dtype=torch.int32))
        launch()
        _assert_matches(seq_lens, rank, world, 16, workers, *buffers)


def test_launcher_checks_buffers():
    seq_lens = torch.ones(4, dtype=torch.int32)
    work, work_indptr, split_indptr = allocate_plan_buffers(4, 3, "cpu")
    args = dict(rank=0, world=1, block_n=16, workers=3, work_indptr=work_indptr,
                split_indptr=split_indptr)
    with pytest.raises(ValueError, match="work must be"):
        persistent_plan_launcher(seq_lens, work=work[:-1], **args)
    with pytest.raises(ValueError, match="int32"):
        persistent_plan_launcher(seq_lens.long(), work=work, **args)
    with pytest.raises(ValueError, match="split_indptr must be"):
        persistent_plan_launcher(seq_lens, work=work, **args | {"split_indptr": work_indptr})


@pytest.mark.gpu
def test_device_plan_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need a GPU: run them on the device machine")
    rng = random.Random(1)
    batch, workers, world, rank = 256, 132, 2, 1
    seq_lens = torch.tensor(_global_lens(rng, batch, 64, world), dtype=torch.int32, device="cuda")
    *buffers, launch = _device_plan(seq_lens, rank, world, 64, workers)  # compiles, warms up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        seq_lens.copy_(torch.tensor(_global_lens(rng, batch, 64, world), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(seq_lens, rank, world, 64, workers, *buffers)
