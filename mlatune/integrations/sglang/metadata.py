"""A step's block table and lengths from SGLang's batch, in torch alone (no SGLang).

SGLang gives each request a row of ``req_to_token`` (the pool's slot of each of its
tokens) and, per step, the requests' rows (``req_pool_indices``) and lengths. With pages
of ``page_size`` tokens a page's slots are consecutive and page-aligned, so page ``j`` of
a request is the slot of its token ``j * page_size`` divided by ``page_size``. Both
functions write fixed-shape persistent buffers on the device, with no host sync, so a
CUDA graph that records them replays them with the lengths of the step it replays.
"""

from __future__ import annotations

import torch


def pages_per_row(row_tokens: int, page_size: int) -> int:
    """Block-table columns that hold every page of a ``req_to_token`` row."""
    return -(-row_tokens // page_size)


def fill_block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     page_size: int, out: torch.Tensor) -> torch.Tensor:
    """Write the page ids of the requests ``req_pool_indices`` names into ``out``'s first
    rows (``out``: int32, ``pages_per_row(req_to_token.shape[1], page_size)`` columns)
    and return those rows. Entries past a request's length hold whatever its row holds:
    pages inside the pool, which the kernels never read."""
    rows = out[: req_pool_indices.shape[0]]
    torch.index_select(req_to_token[:, ::page_size], 0, req_pool_indices, out=rows)
    if page_size > 1:
        rows.floor_divide_(page_size)
    return rows


def fill_seq_lens(seq_lens: torch.Tensor, new_tokens: int, out: torch.Tensor
                  ) -> torch.Tensor:
    """Write mlatune's int32 lengths into ``out``'s first rows and return them: SGLang's
    ``seq_lens`` plus ``new_tokens`` (a verify step's draft tokens, which SGLang's lengths
    leave out), and 0 where SGLang's length is 0 (a padded slot: an empty request)."""
    rows = out[: seq_lens.shape[0]]
    rows.copy_(seq_lens)
    if new_tokens:
        rows.add_(rows.clamp(max=1) * new_tokens)
    return rows
