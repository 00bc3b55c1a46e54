"""No register of an in-flight wgmma touched (tests/sass_hazards.py) in the Gluon decodes'
builds for sm_90 (triton 3.6.0; the prefill's builds: tests/test_gluon_prefill.py)."""

from __future__ import annotations

import pytest

from tests import sass_hazards
from tests.test_gluon_compile import _needs_gluon_triton

pytestmark = pytest.mark.kernels

BUILDS = {  # name: (module under mlatune.kernels, aot_compile keywords, wgmmas, A from registers)
    "hopper": ("gluon_hopper", {}, 40, 0),
    "seesaw": ("gluon_seesaw", {}, 88, 16),
    "seesaw-split": ("gluon_seesaw", {"direct": False}, 88, 16),
    "seesaw-two-requests": ("gluon_seesaw", {"form": "two-requests", "direct": False}, 176, 32),
    "transposed": ("gluon_transposed", {"dtype": "bf16"}, 68, 0),
    "transposed-fp8mma": ("gluon_transposed_fp8", {"dtype": "bf16", "rows": 16,
                                                   "direct": False}, 52, 0),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_no_register_of_an_inflight_wgmma_is_touched(name):
    _needs_gluon_triton()
    import importlib

    module, options, mmas, with_a = BUILDS[name]
    kernel = importlib.import_module(f"mlatune.kernels.{module}").aot_compile(**options)
    assert sass_hazards.hazards(sass_hazards.listing(kernel)) == (mmas, with_a, [])


def _sass(*lines: str) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/  {text} ;" for i, text in enumerate(lines))


def test_the_check_follows_commit_groups_branches_and_loops():
    """A synthetic listing (runs without triton 3.6): P.V with A in R200 and its accumulator
    in R0-R63 (64 x 128 fp32), S into R64-R127 in the group before it."""
    s_then_pv = ("QGMMA.64x128x32.F32.E4M3.E4M3 R64, gdesc[UR4], RZ, !UPT, gsb0",
                 "QGMMA.64x128x32.F32.E4M3.E4M3 R0, R200, gdesc[UR8], R0, gsb0")
    # Waiting for S only (one group left in flight) frees S's registers, not P's or O's.
    ok = _sass(*s_then_pv, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "FADD R130, R64, R65",
               "WARPGROUP.DEPBAR.LE gsb0, 0x0", "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R200, "
               "R1, R0, RZ", "EXIT")
    assert sass_hazards.hazards(ok) == (2, 1, [])
    early_p = _sass(*s_then_pv, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "IMAD.MOV.U32 R201, RZ, RZ, R150",
                    "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT")
    assert len(sass_hazards.hazards(early_p)[2]) == 1
    early_s = _sass(*s_then_pv, "FMUL R130, R70, R71", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT")
    assert len(sass_hazards.hazards(early_s)[2]) == 1
    # A write after a predicate destination (a shuffle), and a compare that only reads.
    shuffled = _sass(*s_then_pv, "SHFL.BFLY PT, R201, R150, 0x1, 0x1f",
                     "ISETP.GE.AND P0, PT, R200, R150, PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT")
    assert [h.split(": ")[1] for h in sass_hazards.hazards(shuffled)[2]] == \
        ["SHFL.BFLY PT, R201, R150, 0x1, 0x1f"]
    # A loop whose back edge reaches a read of O with P.V still in flight (only on that path).
    looped = _sass("FADD R130, R2, R3",  # 0x0000: O read; fine the first time
                   "QGMMA.64x128x32.F32.E4M3.E4M3 R0, R200, gdesc[UR8], R0, gsb0",
                   "@P0 BRA 0x0", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT")
    assert [h.split(":")[0] for h in sass_hazards.hazards(looped)[2]] == ["0x0"]


def test_descriptors_unwritten_on_some_path_are_found():
    """A synthetic listing: a branch writes UR48:49 (A's descriptor) and UR50:51 (B's) on one
    path only; the P.V wgmma after the join reads them (found), unless the other path writes
    them too (a predicated write does not count)."""
    mma = "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR48].tnspB, R24"
    writes = ("R2UR UR48, R17", "R2UR UR49, R11", "UIADD3.64 UR50, UR12, 0x2, URZ")

    def listing(other_path: tuple[str, ...]) -> str:
        # a branch to the other path, this path (its writes, a jump to the join), the other
        # path, the join (the wgmma)
        lines = ["@P0 BRA 0x" + f"{16 * (1 + len(writes) + 1):x}", *writes,
                 "BRA 0x" + f"{16 * (2 + len(writes) + len(other_path)):x}", *other_path,
                 mma, "EXIT"]
        return _sass(*lines)

    assert sass_hazards.undefined_descriptors(listing(())) == [f"{16 * 5:#x}: {mma}"]
    assert sass_hazards.undefined_descriptors(listing(writes)) == []
    predicated = ("@P1 R2UR UR48, R17", *writes[1:])
    assert len(sass_hazards.undefined_descriptors(listing(predicated))) == 1
    # B alone from a descriptor (A in registers): URn, URn+1 suffice.
    b_only = _sass("R2UR UR8, R1", "R2UR UR9, R2",
                   "HGMMA.64x256x16.F32.BF16 R24, R200, gdesc[UR8], R24", "EXIT")
    assert sass_hazards.undefined_descriptors(b_only) == []


def test_spills_in_mma_loops_are_counted_per_innermost_loop():
    """A synthetic listing: an outer loop around an inner one that issues wgmmas with a local
    load and store in it (counted), a local load outside every loop (not), and a wait's retry
    stub after the EXIT that jumps back into the inner loop (not a loop of its own)."""
    listing = _sass(
        "LDL R9, [R1]",  # 0x00: outside the loops
        "MOV R2, RZ",  # 0x10: the outer loop's head
        "LDL R3, [R1+0x8]",  # 0x20: the inner loop's head
        "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24",
        "STL [R1+0x8], R3",
        "@P0 BRA 0x20",  # 0x50: the inner back edge
        "@P1 BRA 0x10",  # 0x60: the outer back edge
        "EXIT",  # 0x70
        "BRA 0x30")  # 0x80: a retry stub, back into the inner loop
    assert sass_hazards.mma_loop_spills(listing) == [(0x20, 1, 1)]
    assert sass_hazards.mma_loop_spills(_sass("LDL R3, [R1]", "EXIT")) == []
