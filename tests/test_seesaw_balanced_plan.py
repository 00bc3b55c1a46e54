"""The seesaw decode's balanced form's schedule on the CPU: the device plan
(``mlatune.kernels.plan``, in the Triton interpreter) walked as the kernel walks it.

A program a (row block, worker): ``balanced_workers`` workers a row block, each walking its
items of the plan's work list (request, key start, key end, slot), the end cut at the row
block's causal bound (``gluon_seesaw._item_keys``), written in place where the request has
one item, else into the item's slot. Checked against a brute-force model of that walk: every
key tile of every (request, row block) once, no partial slot's rows written twice, requests
of one item written in place by one program, empty requests by none (the reduce writes them
empty), and no worker more than one item's overhead above an even share of the work.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlatune.kernels.gluon_hopper_plan import (
    BLOCK_M,
    BLOCK_N,
    H200_SMS,
    balanced_workers,
    wave_idle,
)
from mlatune.kernels.plan import (
    ITEM_OVERHEAD_TILES,
    allocate_plan_buffers,
    persistent_plan_launcher,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_block_end(seq_len: int, rb: int, qlen: int, heads: int, causal: bool) -> int:
    """The keys row block rb of a request sees, at most (``key_range`` of one split)."""
    if not causal:
        return seq_len
    last = seq_len - qlen + (min(qlen * heads, rb * BLOCK_M + BLOCK_M) - 1) // heads
    return min(seq_len, last + 1)


def _device_plan(lens: list[int], workers: int):
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    buffers = allocate_plan_buffers(len(lens), workers, "cpu")
    for buf in buffers:
        buf.fill_(-7)
    launch = persistent_plan_launcher(seq_lens, rank=0, world=1, block_n=BLOCK_N,
                                      workers=workers, work=buffers[0],
                                      work_indptr=buffers[1], split_indptr=buffers[2])
    launch()
    return buffers, seq_lens, launch


def _walk(lens: list[int], heads: int, qlen: int, causal: bool, plan) -> dict:
    """The kernel's walk, brute force: each program (rb, w)'s pieces, as
    {(b, rb): [(w, first key, end key, where)]}, ``where`` "out" or ("slot", s)."""
    work, work_indptr, split_indptr = plan
    row_blocks = _cdiv(qlen * heads, BLOCK_M)
    pieces: dict = {}
    for rb in range(row_blocks):
        for w in range(len(work_indptr) - 1):
            for i in range(work_indptr[w], work_indptr[w + 1]):
                b, start, stop, slot = work[i]
                end = min(stop, _row_block_end(lens[b], rb, qlen, heads, causal))
                whole = split_indptr[b + 1] - split_indptr[b] == 1
                pieces.setdefault((b, rb), []).append((w, start, end, "out" if whole
                                                       else ("slot", slot)))
    return pieces


def _check(lens: list[int], heads: int, qlen: int, causal: bool, workers: int,
           buffers: tuple[torch.Tensor, ...] | None = None) -> None:
    """``_walk`` over the plan of ``lens`` (``buffers``: one already made) against what the
    module docstring says the walk must do."""
    if buffers is None:
        buffers = _device_plan(lens, workers)[0]
    plan = [b.tolist() for b in buffers]
    work, work_indptr, split_indptr = plan
    pieces = _walk(lens, heads, qlen, causal, plan)
    row_blocks = _cdiv(qlen * heads, BLOCK_M)
    written_slots = set()
    for b, n in enumerate(lens):
        for rb in range(row_blocks):
            mine = pieces.get((b, rb), [])
            if n == 0:
                assert not mine  # no program; the reduce writes its rows empty
                assert split_indptr[b + 1] == split_indptr[b]
                continue
            end = _row_block_end(n, rb, qlen, heads, causal)
            tiles = [t for _, s, e, _ in mine for t in range(s // BLOCK_N, _cdiv(e, BLOCK_N))]
            assert sorted(tiles) == list(range(_cdiv(max(end, 0), BLOCK_N))), (b, rb)
            assert all(s % BLOCK_N == 0 for _, s, _, _ in mine)
            wheres = [where for *_, where in mine]
            if len(mine) == 1:
                assert wheres == ["out"]  # in place, by its one program
            else:
                assert "out" not in wheres
                slots = [where[1] for where in wheres]
                assert all(split_indptr[b] <= s < split_indptr[b + 1] for s in slots)
                for s in slots:  # a slot's rows of this row block: one program writes them
                    assert (s, rb) not in written_slots
                    written_slots.add((s, rb))
    _check_loads(lens, workers, work, work_indptr)


def _check_loads(lens: list[int], workers: int, work, work_indptr) -> None:
    """Every worker's work (its items' tiles, and ``ITEM_OVERHEAD_TILES`` an item, the plan's
    cost) at most an even share of the whole plus one item's overhead."""
    total = sum(_cdiv(n, BLOCK_N) + ITEM_OVERHEAD_TILES for n in lens if n)
    share = max(1, _cdiv(total, workers))
    for w in range(workers):
        items = work[work_indptr[w]:work_indptr[w + 1]]
        load = sum(_cdiv(e - s, BLOCK_N) + ITEM_OVERHEAD_TILES for _, s, e, _ in items)
        assert load <= share + ITEM_OVERHEAD_TILES, (w, load, share)


# (heads, qlen, causal): one row block, two, a verify of two tokens a block, row blocks
# holding parts of two tokens (72 rows), a last block partly filled (96 rows), four causal
# blocks whose bounds differ.
SHAPES = [(128, 1, True), (64, 1, True), (64, 2, True), (24, 3, True), (96, 1, False),
          (128, 2, True), (32, 4, False)]


@pytest.mark.parametrize(("heads", "qlen", "causal"), SHAPES)
def test_balanced_walk_covers_each_tile_once(heads, qlen, causal):
    rng = random.Random(heads * 31 + qlen)
    workers = balanced_workers(H200_SMS, _cdiv(heads * qlen, BLOCK_M))
    for batch in (1, 3, 40, 161):
        lens = [rng.choice([0, qlen, rng.randint(1, 200), rng.randint(1, 5000), 1500])
                for _ in range(batch)]
        _check(lens, heads, qlen, causal, workers)


@pytest.mark.parametrize("lens", [[0, 0, 0], [1500] * 40, [0] * 7 + [64] + [0] * 7,
                                  [32768], [1, 1, 1]])
def test_balanced_walk_at_the_edges(lens):
    """All requests empty, the issue's shape (40 requests of 1,500 keys), one request among
    empty ones, one long request over every worker, requests of one key."""
    _check(lens, 128, 1, True, balanced_workers(H200_SMS, 2))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=30), st.sampled_from(SHAPES),
       st.integers(1, 70))
def test_balanced_walk_drawn(lens, shape, workers):
    heads, qlen, causal = shape
    _check(lens, heads, qlen, causal, workers)


def test_a_replayed_plan_follows_rewritten_lengths():
    """The plan's launch run again over lengths rewritten in place (a CUDA graph's replay)
    walks the new lengths."""
    lens = [1500] * 12
    buffers, seq_lens, launch = _device_plan(lens, 66)
    _check(lens, 128, 1, True, 66, buffers)
    for new in ([0, 7, 3000, 64, 65, 0, 1, 1500, 2, 9000, 0, 100], [3] * 12):
        seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        launch()  # the buffers refilled in place
        _check(new, 128, 1, True, 66, buffers)


def test_workers_and_wave_idle():
    assert balanced_workers(132, 2) == 66 and balanced_workers(132, 1) == 132
    assert balanced_workers(132, 200) == 1
    assert wave_idle(80, 132) == pytest.approx(52 / 132)  # (40, 128, ...): 0.6 of a wave
    assert wave_idle(264, 132) == 0.0 and wave_idle(0, 132) == 0.0
    assert wave_idle(256, 132) == pytest.approx(8 / 264)  # (128, 128, ...): 1.94 waves
