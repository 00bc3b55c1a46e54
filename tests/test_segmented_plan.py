"""The segmented route's per-step device plan: one Triton kernel for two torch references.

``segmented_plan_launcher`` must write exactly ``row_lengths`` (causal windows cut
to a DCP rank's share) and ``subpage_table`` (the block table in subpages, -1 for
any negative page id), also when the same launch runs again after the lengths and
block table were rewritten in place, which is what a CUDA graph replay does (the
GPU test captures one). CPU runs use the Triton interpreter.
"""

from __future__ import annotations

import random

import pytest
import torch

from mlatune.kernels.segmented import (
    PLAN_BLOCK_W,
    row_lengths,
    segment_tile,
    segmented_plan_launcher,
    subpage_table,
)

POISON = -7  # neither a length nor the -1 padding: an entry left unwritten shows


def _lens(rng: random.Random, batch: int, qlen: int, world: int) -> torch.Tensor:
    """Ragged global lengths: some shorter than the qlen window (rows clamp to 0),
    some next to multiples of the world size, some long."""
    picks = [lambda: 0, lambda: rng.randint(0, qlen), lambda: rng.randint(1, 4 * world),
             lambda: rng.randint(1, 64) * world + rng.randint(-world, world),
             lambda: rng.randint(0, 3000)]
    return torch.tensor([max(0, rng.choice(picks)()) for _ in range(batch)], dtype=torch.int32)


def _table(rng: random.Random, batch: int, pages: int) -> torch.Tensor:
    """Page ids, each row padded with -1 past a random used count (sometimes another
    negative id, which ``subpage_table`` also maps to -1)."""
    rows = []
    for _ in range(batch):
        used = rng.randint(0, pages)
        pad = [rng.choice([-1, -1, -1, -3]) for _ in range(pages - used)]
        rows.append([rng.randint(0, 5000) for _ in range(used)] + pad)
    return torch.tensor(rows, dtype=torch.int32).reshape(batch, pages)


def _plan(seq_lens: torch.Tensor, block_table: torch.Tensor, qlen: int, rank: int, world: int,
          page: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The launcher's buffers, poisoned, after one launch; and the launch."""
    tile = segment_tile(page)
    batch, pages = block_table.shape
    row_lens = torch.full((batch * qlen,), POISON, dtype=torch.int32, device=seq_lens.device)
    table = torch.full((batch, pages * page // tile), POISON, dtype=torch.int32,
                       device=seq_lens.device)
    launch = segmented_plan_launcher(seq_lens, block_table, qlen=qlen, rank=rank, world=world,
                                     page_size=page, tile=tile, row_lens=row_lens,
                                     subpage_table_out=table)
    launch()
    return row_lens, table, launch


def _assert_matches(seq_lens: torch.Tensor, block_table: torch.Tensor, qlen: int, rank: int,
                    world: int, page: int, row_lens: torch.Tensor, table: torch.Tensor) -> None:
    want_lens = row_lengths(seq_lens, qlen, rank, world)
    want_table = subpage_table(block_table, page, segment_tile(page))
    assert torch.equal(row_lens.cpu(), want_lens.cpu().to(torch.int32))
    assert torch.equal(table.cpu(), want_table.cpu())


@pytest.mark.parametrize("page", [1, 16, 64, 256])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_plan_equals_torch_references(page, world):
    rng = random.Random(page * 10 + world)
    for qlen in range(1, 9):
        batch, pages = rng.randint(1, 9), rng.randint(1, 12)
        seq_lens, block_table = _lens(rng, batch, qlen, world), _table(rng, batch, pages)
        for rank in range(world):
            row_lens, table, _ = _plan(seq_lens, block_table, qlen, rank, world, page)
            _assert_matches(seq_lens, block_table, qlen, rank, world, page, row_lens, table)


@pytest.mark.parametrize(("batch", "pages", "page"), [
    (3, 2 * PLAN_BLOCK_W + 5, 1),  # several column programs per request
    (2, PLAN_BLOCK_W // 2 + 1, 256),  # two subpages per page cross a program boundary
    (0, 4, 16),  # an empty batch: no program
    (4, 0, 64),  # an empty table: only the row lengths
])
def test_plan_edge_shapes(batch, pages, page):
    rng = random.Random(batch + pages)
    seq_lens, block_table = _lens(rng, batch, 3, 2), _table(rng, batch, pages)
    row_lens, table, _ = _plan(seq_lens, block_table, 3, 1, 2, page)
    _assert_matches(seq_lens, block_table, 3, 1, 2, page, row_lens, table)


def test_plan_reads_strided_inputs():
    # An engine's lengths and table may be views: a lengths slice, a table's first columns.
    rng = random.Random(3)
    seq_lens = _lens(rng, 12, 4, 2)[::2]
    block_table = _table(rng, 6, 10)[:, :7]
    row_lens, table, _ = _plan(seq_lens, block_table, 4, 1, 2, 64)
    _assert_matches(seq_lens, block_table, 4, 1, 2, 64, row_lens, table)


def test_relaunch_reads_rewritten_inputs():
    # A captured graph replays the same launch: it must read the inputs' new contents.
    rng = random.Random(5)
    batch, pages, qlen, rank, world, page = 7, 9, 4, 3, 4, 256
    seq_lens, block_table = _lens(rng, batch, qlen, world), _table(rng, batch, pages)
    row_lens, table, launch = _plan(seq_lens, block_table, qlen, rank, world, page)
    for _ in range(2):
        seq_lens.copy_(_lens(rng, batch, qlen, world))
        block_table.copy_(_table(rng, batch, pages))
        launch()
        _assert_matches(seq_lens, block_table, qlen, rank, world, page, row_lens, table)


def test_launcher_checks_arguments():
    seq_lens = torch.ones(3, dtype=torch.int32)
    block_table = torch.zeros(3, 4, dtype=torch.int32)
    args = dict(qlen=2, rank=0, world=2, page_size=16, tile=16,
                row_lens=torch.zeros(6, dtype=torch.int32),
                subpage_table_out=torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        segmented_plan_launcher(seq_lens.long(), block_table, **args)
    with pytest.raises(ValueError, match="rank"):
        segmented_plan_launcher(seq_lens, block_table, **args | {"rank": 2})
    with pytest.raises(ValueError, match="tile"):
        segmented_plan_launcher(seq_lens, block_table, **args | {"tile": 3})
    with pytest.raises(ValueError, match="block_table"):
        segmented_plan_launcher(seq_lens[:2], block_table, **args)
    with pytest.raises(ValueError, match="subpage_table_out"):
        segmented_plan_launcher(seq_lens, block_table, **args | {"tile": 8})


@pytest.mark.gpu
def test_plan_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need a GPU: run them on the device machine")
    rng = random.Random(1)
    batch, pages, qlen, rank, world, page = 256, 700, 4, 1, 2, 256
    seq_lens = _lens(rng, batch, qlen, world).cuda()
    block_table = _table(rng, batch, pages).cuda()
    row_lens, table, launch = _plan(seq_lens, block_table, qlen, rank, world, page)  # compiles
    _assert_matches(seq_lens, block_table, qlen, rank, world, page, row_lens, table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        seq_lens.copy_(_lens(rng, batch, qlen, world))
        block_table.copy_(_table(rng, batch, pages))
        row_lens.fill_(POISON)
        table.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(seq_lens, block_table, qlen, rank, world, page, row_lens, table)
