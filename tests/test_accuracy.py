import math

import torch

from mlatune.check.accuracy import Rounding, compare, looser, tolerance_for
from mlatune.problem import DTYPES


def test_tolerances_are_ordered_by_precision():
    fp16, bf16 = tolerance_for("fp16", "fp16"), tolerance_for("bf16", "bf16")
    fp8 = tolerance_for("fp8_e4m3fn", "fp8_e4m3fn")
    assert fp16.rel_l2 < bf16.rel_l2 < fp8.rel_l2 < 0.2
    assert tolerance_for("bf16", "fp8_e4m3fn") == bf16


def test_p_rounded_sits_between_a_16_bit_q_and_a_quantized_one():
    """P rounded to fp8 with a 16-bit-precision q: looser than bf16, half a quantized q's
    output bound; of two classes the looser one's; an fp8 q keeps its own; an
    override of the fp8 class reaches it."""
    bf16 = tolerance_for("bf16", "fp8_e4m3fn")
    rounded = tolerance_for("bf16", "fp8_e4m3fn", rounding=Rounding.P_FP8)
    quantized = tolerance_for("bf16", "fp8_e4m3fn", rounding=Rounding.Q_FP8)
    assert bf16.rel_l2 < rounded.rel_l2 < quantized.rel_l2
    assert bf16.lse_abs < rounded.lse_abs < quantized.lse_abs
    assert tolerance_for("fp16", "fp8_e4m3fn", rounding=Rounding.P_FP8) == rounded
    assert looser(Rounding.P_FP8, Rounding.Q_FP8) == looser(Rounding.Q_FP8, Rounding.NONE) \
        == Rounding.Q_FP8
    fp8 = tolerance_for("fp8_e4m3fn", "fp8_e4m3fn")
    assert tolerance_for("fp8_e4m3fn", "fp8_e4m3fn", rounding=Rounding.P_FP8) == fp8
    assert tolerance_for("bf16", "fp8_e4m3fn", {"fp8": 0.05}, Rounding.P_FP8).rel_l2 == 0.05


def test_rounding_passes_and_bugs_fail():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 8, 32, generator=gen)
    tol = tolerance_for("bf16", "bf16")
    assert compare(ref.to(DTYPES["bf16"]), ref, tol).ok
    wrong_rows = ref[torch.randperm(64, generator=gen)]
    bad = compare(wrong_rows, ref, tol)
    assert not bad.ok and bad.rel_l2 > 0.5 and "rel_l2" in bad.reason


def test_unwritten_elements_are_caught():
    ref = torch.randn(4, 2, 8)
    out = ref.clone()
    out[1, 0, 3] = math.nan
    acc = compare(out, ref, tolerance_for("fp16", "fp16"))
    assert not acc.ok and acc.bad_elements == 1 and "unwritten" in acc.reason


def test_lse_checks():
    ref, lse = torch.randn(4, 2, 8), torch.randn(4, 2)
    lse[0, 0] = -math.inf  # a row with no keys
    tol = tolerance_for("fp16", "fp16")
    assert compare(ref, ref, tol, lse.clone(), lse).ok
    off = lse.clone()
    off[1, 1] += 0.5
    assert "lse" in compare(ref, ref, tol, off, lse).reason
    finite_for_empty = lse.clone()
    finite_for_empty[0, 0] = 0.0
    assert not compare(ref, ref, tol, finite_for_empty, lse).ok
    assert not compare(ref, ref, tol, lse[:2], lse).ok


def test_shape_mismatch():
    acc = compare(torch.randn(2, 3), torch.randn(3, 2), tolerance_for("bf16", "bf16"))
    assert not acc.ok and "shape" in acc.reason
