"""Merging DCP ranks' partial attention by their LSEs, as the sweep times it.

On a GPU this is the Triton merge kernel (one launch, no allocation, graph
safe); elsewhere the reference's merge.
"""

from __future__ import annotations

import torch

from mlatune.check import reference


def merge_ranks_into(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor | None = None) -> None:
    """out = sum_r exp(lse_r - lse) * outs[r], lse = logsumexp_r lses[r]; -inf ranks add 0.

    ``outs`` (R, T, H, D) and ``lses`` (R, T, H) stack the ranks' partials.
    """
    if outs.is_cuda:
        from mlatune.kernels.merge import merge_partials_into

        merge_partials_into(outs, lses, out, lse)
        return
    merged, total = reference.merge_partials(list(outs.float()), list(lses.float()))
    out.copy_(merged)
    if lse is not None:
        lse.copy_(total)
