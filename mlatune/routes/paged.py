"""A rank's paged KV shard as CSR page lists, the form AITER's and FlashInfer's kernels take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlatune.check.inputs import KVShard


@dataclass(frozen=True)
class PagedView:
    """One rank's shard in pages of ``page`` tokens, with its CSR page indices."""

    kv: torch.Tensor  # (pages, page, 1, d_qk)
    indptr: torch.Tensor  # (batch + 1,) int32, in pages
    indices: torch.Tensor  # (used pages,) int32
    last_page_lens: torch.Tensor  # (batch,) int32
    page: int


def paged_view(shard: KVShard, page: int) -> PagedView:
    """Re-express the shard in pages of ``page`` tokens (``page`` divides the cache's page).

    page 1 is the per-token view the ASM decode and Gluon read in the seed
    (cache.view(-1, 1, 1, D) plus flat token indices). Reads the lengths on the host.
    """
    cache = shard.kv_cache
    per = cache.shape[1] // page  # sub-pages in one cache page
    lens = shard.seq_lens.long()
    pages = (lens + page - 1) // page
    width = int(pages.max()) if pages.numel() else 0
    j = torch.arange(width, device=cache.device)
    table = shard.block_table.long().clamp(min=0)  # -1 pads are never read (masked below)
    ids = table[:, j // per] * per + j % per
    indices = ids[j[None, :] < pages[:, None]].to(torch.int32)
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=cache.device)
    indptr[1:] = pages.cumsum(0)
    last = (lens - (pages - 1) * page).to(torch.int32)  # a page-1 view gives all ones
    return PagedView(cache.view(-1, page, 1, cache.shape[-1]), indptr, indices, last, page)


def uniform_indptr(n: int, step: int, device) -> torch.Tensor:
    return torch.arange(0, (n + 1) * step, step, dtype=torch.int32, device=device)
