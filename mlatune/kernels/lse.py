"""The LSE combine in the Triton dialect: partial attention results merged by their
log-sum-exps, in base 2 on chip (``exp2``/``log2``), natural log at the boundary."""

import triton
import triton.language as tl

from mlatune import lse
from mlatune.kernels.attend import LN2

LOG2E = tl.constexpr(lse.LOG2E)  # a constexpr, so jit functions may read it as a global


@triton.jit
def combine_step(m2, den, acc, lse2, o):
    """One partial into the running state: its base-2 LSE ``lse2`` (-inf: it saw no key, and
    ``o`` is not read) and normalized output ``o``; the state is the base-2 max ``m2``, the
    denominator ``den`` and the weighted sum ``acc``."""
    m_new = tl.maximum(m2, lse2)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m2 - shift)
    w = tl.exp2(lse2 - shift)
    den = den * alpha + w
    acc = acc * alpha[:, None] + tl.where((lse2 == float("-inf"))[:, None], 0.0, w[:, None] * o)
    return m_new, den, acc


@triton.jit
def combine_finish(m2, den, acc):
    """The combined output and its natural-log LSE; 0 and -inf where no partial had keys."""
    has_keys = den > 0.0
    safe = tl.where(has_keys, den, 1.0)
    out = tl.where(has_keys[:, None], acc / safe[:, None], 0.0)
    return out, tl.where(has_keys, (m2 + tl.log2(safe)) * LN2, float("-inf"))
