"""Error metrics and the per-dtype tolerance a route's output must meet.

Tolerances are on the relative L2 error of the output, ||out - ref|| / ||ref||,
and the absolute error of the LSE, against the fp32 reference computed on the
same (dequantized) inputs. A route that reads or indexes wrongly lands near
1.0 (or NaN); rounding lands orders of magnitude lower, so the bounds sit well
above rounding and far below a bug. Inputs are normal with amplitude 0.5..2
and scale 192^-0.5, so scores have a std of about 1.7 and up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch

from mlatune.problem import FP8_DTYPES, MLAProblem


@dataclass(frozen=True)
class Tolerance:
    rel_l2: float
    lse_abs: float


# Why these numbers:
# - fp16 (11-bit significand, unit roundoff 2^-11 = 4.9e-4): the output is
#   stored in fp16 and P is rounded to fp16 for the PV product; each adds about
#   3e-4 relative, so 2e-3 leaves ~5x margin.
# - bf16 (8-bit significand, roundoff 2^-8 = 3.9e-3): the same two roundings add
#   about 2.5e-3 relative; 1e-2 leaves margin and stays 100x below a bug.
# - 16-bit q with an fp8 cache: fp8 -> 16-bit is exact (e4m3 fits in both), so
#   the error is the 16-bit one. A route that rounds past the problem's dtypes declares
#   its ``Rounding`` and is held to that class's bound below.
# - fp8 q and fp8 cache: kernels in this regime (AITER's, FlashMLA's) also round
#   P to e4m3 (roundoff 2^-4) for the PV product, which alone gives about 4e-2
#   relative; 8e-2 admits that and still refuses any indexing bug.
# LSE is kept in fp32 by every route; its error comes from the scores' dot in
# the operand precision: ~1e-3 (fp16), ~1e-2 (bf16), ~5e-2 (fp8 q).
_TOLERANCES = {
    "fp16": Tolerance(rel_l2=2e-3, lse_abs=1e-2),
    "bf16": Tolerance(rel_l2=1e-2, lse_abs=4e-2),
    "fp8": Tolerance(rel_l2=8e-2, lse_abs=2e-1),
}


class Rounding(StrEnum):
    """What a route rounds beyond the problem's own dtypes: its numeric class, declared per
    parameter set (``Route.rounding``). Over an fp8 q every class is the fp8 one."""

    NONE = "none"  # only the problem's dtypes (an fp8 cache widens to 16 bits exactly)
    P_FP8 = "p-fp8"  # P rounded to e4m3 for P.V; q kept near 16 bits (two e4m3 terms)
    Q_FP8 = "q-fp8"  # a 16-bit q quantized to fp8 per tensor (and P rounded to fp8)


# Q_FP8 (FlashMLA's fp8 path takes an fp8 q with one descale): the fp8 output bound, and an
# LSE bound for what the quantized scores cost. Measured on the H200 (2026-11-30,
# benchmarks/vendor_smoke.toml and decode.py): LSE errors of 0.21-0.49 at 16-128 heads and
# 4k-32k keys, output rel_l2 within 8e-2. An indexing bug moves the output's rel_l2 toward
# 1, which the output bound still refuses.
QUANTIZED_Q = Tolerance(rel_l2=8e-2, lse_abs=0.6)

# P_FP8 (transposed/gluon's fp8-MMA sets). Measured on the H200 (2026-12-01): rel_l2
# 0.004-0.025 over 1,200 sweep runs (median 0.012), 0.009-0.018 in the GPU tests; LSE within
# 0.05 on the GPU tests' cases. Half QUANTIZED_Q's output bound: one term (a quantized q)
# measured 0.028-0.082, mostly above.
P_ROUNDED = Tolerance(rel_l2=4e-2, lse_abs=1e-1)

_ROUNDED = {Rounding.P_FP8: P_ROUNDED, Rounding.Q_FP8: QUANTIZED_Q}


def looser(a: Rounding, b: Rounding) -> Rounding:
    """The class with the looser bound (classes are declared from tightest to loosest)."""
    order = list(Rounding)
    return max(Rounding(a), Rounding(b), key=order.index)


def tolerance_for(q_dtype: str, kv_dtype: str,
                  rel_l2_overrides: dict[str, float] | None = None,
                  rounding: Rounding = Rounding.NONE) -> Tolerance:
    """Tolerance for a (q dtype, kv dtype) pair and what the route rounds beyond them; a spec
    may override rel_l2 per class ("fp16", "bf16", "fp8": an override of "fp8" also
    replaces the rel_l2 of a 16-bit q's rounded classes)."""
    # fp8 -> 16-bit is exact, so a 16-bit q keeps its own tolerance over an fp8 cache.
    sixteen = q_dtype not in FP8_DTYPES
    rounded = sixteen and rounding != Rounding.NONE
    cls = q_dtype if sixteen and not rounded else "fp8"
    tol = _ROUNDED[rounding] if rounded else _TOLERANCES[cls]
    if rel_l2_overrides and cls in rel_l2_overrides:
        tol = Tolerance(rel_l2_overrides[cls], tol.lse_abs)
    return tol


@dataclass(frozen=True)
class Accuracy:
    rel_l2: float
    max_abs: float
    lse_max_abs: float  # NaN when the route returned no LSE
    bad_elements: int  # NaN/inf in the output or LSE: unwritten (poisoned) or overflowed
    ok: bool
    reason: str

    @property
    def summary(self) -> str:
        return (f"rel_l2={self.rel_l2:.3g} max_abs={self.max_abs:.3g} "
                f"lse_max_abs={self.lse_max_abs:.3g}")


def compare(
    out: torch.Tensor,
    ref_out: torch.Tensor,
    tol: Tolerance,
    lse: torch.Tensor | None = None,
    ref_lse: torch.Tensor | None = None,
) -> Accuracy:
    """Compare a route's output (and LSE) with the reference."""
    if out.shape != ref_out.shape:
        return Accuracy(math.inf, math.inf, math.nan, out.numel(), False,
                        f"output shape {tuple(out.shape)} != reference {tuple(ref_out.shape)}")
    got = out.double()
    want = ref_out.double().to(got.device)
    bad = int((~torch.isfinite(got)).sum())
    finite = torch.isfinite(got)
    diff = torch.where(finite, got - want, torch.zeros_like(got))
    norm = float(torch.linalg.vector_norm(want))
    rel = float(torch.linalg.vector_norm(diff)) / norm if norm > 0 else float(
        torch.linalg.vector_norm(diff))
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    lse_err = math.nan
    if lse is not None and ref_lse is not None:
        if lse.shape != ref_lse.shape:
            return Accuracy(rel, max_abs, math.inf, bad, False,
                            f"lse shape {tuple(lse.shape)} != reference {tuple(ref_lse.shape)}")
        got_lse, want_lse = lse.double(), ref_lse.double().to(lse.device)
        # -inf (a row with no keys) must be matched exactly; everything else numerically.
        empty = torch.isneginf(want_lse)
        bad += int((~torch.isfinite(got_lse) & ~empty).sum())
        bad += int((empty & ~torch.isneginf(got_lse)).sum())
        both = torch.isfinite(got_lse) & ~empty
        lse_err = float((got_lse - want_lse)[both].abs().max()) if both.any() else 0.0
    if bad:
        return Accuracy(rel, max_abs, lse_err, bad, False,
                        f"{bad} output/LSE elements NaN, inf or unwritten")
    if rel > tol.rel_l2:
        return Accuracy(rel, max_abs, lse_err, 0, False,
                        f"rel_l2 {rel:.3g} > tolerance {tol.rel_l2:g}")
    if not math.isnan(lse_err) and lse_err > tol.lse_abs:
        return Accuracy(rel, max_abs, lse_err, 0, False,
                        f"lse error {lse_err:.3g} > tolerance {tol.lse_abs:g}")
    return Accuracy(rel, max_abs, lse_err, 0, True, "ok")


def check(problem: MLAProblem, out, ref_out, lse=None, ref_lse=None,
          rel_l2_overrides: dict[str, float] | None = None,
          rounding: Rounding = Rounding.NONE) -> Accuracy:
    """Compare with the tolerance of the problem's dtypes and the route's ``rounding``
    (``routes.rounding`` says what a route rounds)."""
    tol = tolerance_for(problem.q_dtype, problem.kv_dtype, rel_l2_overrides, rounding)
    return compare(out, ref_out, tol, lse, ref_lse)
