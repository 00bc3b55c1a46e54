"""Log-sum-exp: the constants and the torch combine of partial attention results.

Everything mlatune stores, returns or merges is the natural-log LSE. Kernels work in base 2
(``exp2``/``log2`` are the fast instructions): a natural-log LSE times ``LOG2E`` is base 2,
a base-2 one times ``LN2`` is natural. The Triton and Gluon combines are in
``mlatune.kernels.lse`` and ``mlatune.kernels.gluon_common``.
"""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634  # log2(e)
LN2 = 0.6931471805599453  # ln(2)


def combine(outs: list[torch.Tensor], lses: list[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over disjoint key sets, combined by their natural-log LSEs.

    ``outs[i]`` (..., D) is normalized over set i, ``lses[i]`` (...) its LSE. A part with no
    keys (LSE -inf) weighs 0 and its output is not read (a kernel may leave anything there);
    a row no part saw gets output 0 and LSE -inf; a NaN LSE reaches the output.
    """
    lse_stack = torch.stack(lses)
    lse = torch.logsumexp(lse_stack, dim=0)
    empty = torch.isneginf(lse_stack)
    weights = torch.exp(lse_stack - lse[None]).masked_fill_(empty, 0.0)
    parts = (weights[..., None] * torch.stack(outs)).masked_fill_(empty[..., None], 0.0)
    return parts.sum(dim=0), lse
