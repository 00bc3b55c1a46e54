"""mlatune's SGLang backend without SGLang: importing mlatune never loads SGLang, the
backend without it says in one line what to install, and the step's block table and
lengths (``integrations.sglang.metadata``, torch alone) are what SGLang's pools mean,
and (``-m gpu``) replay from a CUDA graph. The backend against the real SGLang:
tests/engines/test_sglang_contract.py."""

from __future__ import annotations

import sys

import pytest
import torch

from mlatune.integrations.sglang import INSTALL_HINT, register
from mlatune.integrations.sglang.metadata import (
    fill_block_table,
    fill_seq_lens,
    pages_per_row,
)
from tests.test_light_import import _modules_after


def test_importing_mlatune_and_the_plugin_never_loads_sglang():
    loaded = _modules_after("import mlatune, mlatune.attention, mlatune.integrations.sglang")
    assert not [m for m in loaded if m == "sglang" or m.startswith("sglang.")]
    assert "mlatune.integrations.sglang.backend" not in loaded


def test_without_sglang_the_backend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang.* now fails
    monkeypatch.delitem(sys.modules, "mlatune.integrations.sglang.backend", raising=False)
    with pytest.raises(ImportError) as raised:
        register()
    assert str(raised.value) == INSTALL_HINT and "\n" not in INSTALL_HINT
    assert "pip install 'mlatune[sglang]'" in INSTALL_HINT
    with pytest.raises(ImportError, match=r"pip install 'mlatune\[sglang\]'"):
        import mlatune.integrations.sglang.backend  # noqa: F401


def _req_to_token(rows: int, row_tokens: int, page_size: int, seed: int) -> torch.Tensor:
    """SGLang's request-to-slot map: each row's pages are whole pool pages, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    pages = pages_per_row(row_tokens, page_size)
    page_ids = torch.randperm(rows * pages + 1, generator=gen)[1:].view(rows, pages)  # 0: pad
    slots = page_ids.repeat_interleave(page_size, 1) * page_size \
        + torch.arange(page_size).repeat(pages)
    return slots[:, :row_tokens].to(torch.int32).contiguous()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_block_table_addresses_every_token_of_the_named_rows(page_size, index_dtype):
    row_tokens = 150  # not a whole number of pages
    req_to_token = _req_to_token(6, row_tokens, page_size, seed=page_size)
    indices = torch.tensor([4, 0, 5, 2], dtype=index_dtype)
    out = torch.full((8, pages_per_row(row_tokens, page_size)), -7, dtype=torch.int32)
    table = fill_block_table(req_to_token, indices, page_size, out)
    assert table.data_ptr() == out.data_ptr() and table.shape[0] == 4
    pos = torch.arange(row_tokens)
    for row, request in enumerate(indices.tolist()):
        slots = table[row, pos // page_size].long() * page_size + pos % page_size
        assert torch.equal(slots, req_to_token[request].long())
    assert (out[4:] == -7).all()  # rows past the batch untouched


def test_pages_per_row_rounds_up():
    assert [pages_per_row(n, 16) for n in (1, 16, 17, 150)] == [1, 1, 2, 10]


@pytest.mark.parametrize(("new_tokens", "want"), [(0, [7, 0, 1, 300]), (3, [10, 0, 4, 303])])
def test_lengths_add_draft_tokens_and_keep_padded_slots_empty(new_tokens, want):
    seq_lens = torch.tensor([7, 0, 1, 300], dtype=torch.int64)  # SGLang's graph buffers: int64
    out = torch.full((6,), -1, dtype=torch.int32)
    lens = fill_seq_lens(seq_lens, new_tokens, out)
    assert lens.dtype == torch.int32 and lens.data_ptr() == out.data_ptr()
    assert lens.tolist() == want and out[4:].tolist() == [-1, -1]


@pytest.mark.gpu
def test_block_table_and_lengths_replay_from_a_cuda_graph():
    """On a GPU the in-graph hook's work is recorded once in a CUDA graph and replayed after
    SGLang rewrites its inputs (rows, request indices, lengths) in place."""
    if not torch.cuda.is_available():  # fail, not skip: -m gpu without a GPU is no pass
        pytest.fail("GPU tests need a GPU: run them on the device machine")
    page, row_tokens, draft = 64, 1024, 2
    req_to_token = _req_to_token(8, row_tokens, page, seed=1).cuda()
    indices = torch.tensor([3, 1, 0, 0], device="cuda")  # int64, as SGLang's graph buffers
    lens = torch.tensor([700, 65, 1, 0], device="cuda")
    table = torch.empty(6, pages_per_row(row_tokens, page), dtype=torch.int32, device="cuda")
    step_lens = torch.empty(6, dtype=torch.int32, device="cuda")

    def record() -> None:
        fill_block_table(req_to_token, indices, page, table)
        fill_seq_lens(lens, draft, step_lens)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        record()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record()
    for seed, new_lens in ((2, [1022, 0, 300, 5]), (3, [64, 128, 0, 1])):
        req_to_token.copy_(_req_to_token(8, row_tokens, page, seed=seed))
        indices.copy_(torch.randperm(8, generator=torch.Generator().manual_seed(seed))[:4])
        lens.copy_(torch.tensor(new_lens))
        table.fill_(-7)
        step_lens.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert step_lens.tolist() == [n + draft if n else 0 for n in new_lens] + [-1, -1]
        pos = torch.arange(row_tokens, device="cuda")
        for row, request in enumerate(indices.tolist()):
            slots = table[row, pos // page].long() * page + pos % page
            assert torch.equal(slots, req_to_token[request].long())
        assert (table[4:] == -7).all()
