"""Merging DCP ranks' partial attention by their LSEs, on the device."""

from __future__ import annotations

import torch


def merge_ranks_into(outs: list[torch.Tensor], lses: list[torch.Tensor], out: torch.Tensor,
                     lse: torch.Tensor | None = None) -> None:
    """out = sum_r exp(lse_r - lse) * out_r with lse = logsumexp_r(lse_r); -inf ranks add 0."""
    stacked = torch.stack(lses).float()
    total = torch.logsumexp(stacked, dim=0)
    weights = torch.exp(stacked - total).nan_to_num_(0.0)
    merged = (weights[..., None] * torch.stack(outs).float()).sum(dim=0)
    out.copy_(merged)
    if lse is not None:
        lse.copy_(total)
