"""The seesaw decode's balanced form (mlatune/kernels/gluon_seesaw.py, ``form="balanced"``)
compiled on the CPU, as tests/test_gluon_seesaw_compile.py compiles the other forms.

A program a (row block, worker) walks its worker's items of the device plan's work list
(``mlatune.kernels.plan``) through the two-requests form's ring, in a loop of the plan's
length (not unrolled), and writes each item in place or into its partial slot (both
epilogues in one build). Needs triton 3.6.x; compiling says nothing about the numbers:
tests/test_gluon_gpu.py checks those.
"""

from __future__ import annotations

import re

import pytest

from mlatune.kernels.gluon_hopper_plan import seesaw_gathers
from tests import sass_hazards
from tests.prefill_aot import resources
from tests.test_gluon_compile import HOPPER_SMEM, _needs_gluon_triton

pytestmark = pytest.mark.kernels
TILE_CHUNK = 8192  # bytes of a [64, 64] 16-bit chunk


@pytest.fixture(scope="module",
                params=[("bf16", True, 64, None), ("fp16", False, 64, None),
                        ("bf16", True, 16, None), ("bf16", False, 32, None),
                        ("bf16", True, 1, None), ("bf16", True, 64, "fp8"),
                        ("bf16", False, 16, "fp8")],
                ids=["bf16-causal", "fp16", "bf16-causal-page16", "bf16-page32",
                     "bf16-causal-page1", "fp8-causal", "fp8-page16"])
def compiled(request):
    _needs_gluon_triton()
    from mlatune.kernels import gluon_seesaw as s
    dtype, causal, page, cache = request.param
    kernel = s.aot_compile(dtype, causal=causal, form="balanced", page=page, cache=cache)
    kernel.page, kernel.fp8 = page, cache == "fp8"
    kernel.gathered = seesaw_gathers(page, kernel.fp8)  # (pages 1-32 of a 16-bit cache)
    return kernel


def test_targets_sm90a_with_mbarriers(compiled):
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "mbarrier.try_wait" in ptx
    assert "griddepcontrol.launch_dependents" in ptx  # the reduce: a dependent launch
    assert len(compiled.asm["cubin"]) > 0


def test_one_walk_in_a_loop_over_the_plans_items(compiled):
    """Each compute warpgroup's pair loop is there once (the items' loop is not unrolled):
    S (36 k-steps) and P V twice (4 k-steps each) a warpgroup, the own P from registers."""
    ptx = compiled.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == 2 * (36 + 2 * 4)
    own_p = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.\w+\.\w+ "
                       r"[^;]*\{[^}]*\}, \{%r", ptx)
    assert len(own_p) == 2 * 4


def test_barriers_and_the_rings_copies(compiled):
    """The pairs form's 26 barriers and Q's release (27; an fp8 cache: and 18 staging
    barriers and Q's widening, 46); each 16-bit tile's chunks expect their 8192 bytes, slot 1
    also filled in a pair without a tile b (27 copy sites), or, gathered, arrive by each
    loader thread's cp.async (36 copies a thread at the 3 tile sites); S issued a chunk after
    each wait."""
    ptx = compiled.asm["ptx"]
    assert ptx.count("mbarrier.init") == (46 if compiled.fp8 else 27)
    between_waits = [part.count("wgmma.mma_async.sync.aligned.m64n64k16")
                     for part in ptx.split("mbarrier.try_wait")]
    assert sum(between_waits) == 2 * 36 and max(between_waits) == 4
    if compiled.gathered:
        assert ptx.count("cp.async.bulk.tensor.2d") == 3  # Q's alone
        copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10,", ptx)
        assert len(copies) == 3 * 36
        assert ptx.count("cp.async.mbarrier.arrive.noinc.shared.b64") == 3 * 9
    elif not compiled.fp8:
        expects = re.findall(rf"mbarrier\.arrive\.expect_tx\.shared\.b64 _, \[%r\d+\], "
                             rf"{TILE_CHUNK};", ptx)
        assert len(expects) == 27
        assert ptx.count("cp.async.bulk.tensor.2d") == 3 + 27  # Q's 3, the chunks


def test_writes_in_place_and_into_partials(compiled):
    """Both epilogues: a request's only item in q's dtype into out (16-bit pairs) with the
    natural-log LSE, a piece's fp32 partial with its base-2 LSE (each warpgroup 256 columns
    of 64 rows: 128 stores of a pair a thread)."""
    ptx = compiled.asm["ptx"]
    assert len(re.findall(r"st\.global\.v2\.b32", ptx)) == 128  # fp32 pairs: the partials
    assert len(re.findall(r"st\.global\.b32", ptx)) >= 128 + 2  # 16-bit pairs, 2 LSE stores


def test_register_budgets_and_no_local_memory(compiled):
    """The loader at 24 registers (a gathering (pages 1-32) or widening one at 40), the
    compute warpgroups at 240 (232); no local memory (``sass_hazards.mma_loop_spills``: none
    in the pair loops either), shared memory within the SM's, no wgmma hazard, every wgmma
    descriptor written on every path to it."""
    from mlatune.kernels import gluon_seesaw as s
    ptx = compiled.asm["ptx"]
    grows = set(map(int, re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)))
    shrinks = set(map(int, re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)))
    if compiled.fp8:
        assert s.WIDEN_COMPUTE_REGS.value in grows and s.WIDEN_LOADER_REGS.value in shrinks
    elif compiled.gathered:
        assert s.GATHER_COMPUTE_REGS.value in grows and s.GATHER_LOADER_REGS.value in shrinks
    else:
        assert s.COMPUTE_REGS.value in grows and s.LOADER_REGS.value in shrinks
    assert ".reqntid 384" in ptx
    assert compiled.metadata.shared <= HOPPER_SMEM
    assert resources(compiled)["stack"] == 0
    sass = sass_hazards.listing(compiled)
    assert sass.count("LDL") == 0 and sass.count("STL") == 0
    loops = sass_hazards.mma_loop_spills(sass)
    assert len(loops) == 2 and all(ldl == stl == 0 for _, ldl, stl in loops)
    assert sass_hazards.hazards(sass)[2] == []
    assert sass_hazards.undefined_descriptors(sass) == []


def test_each_mbarrier_is_its_own_allocation(compiled):
    """As the other forms (``test_gluon_seesaw_compile``): the 16-bit build's warpgroup
    bar.sync count at triton 3.6.0 (91: the pairs form's and the second epilogue's)."""
    if compiled.fp8 or compiled.gathered:
        pytest.skip("the count is the 16-bit TMA build's")
    bar_syncs = len(re.findall(r"bar\.sync\s+\d+, 128;", compiled.asm["ptx"]))
    assert bar_syncs <= 91


def test_q_rope_is_read_from_registers(compiled):
    """S's rope k-steps take Q's rope part from registers: 4 wgmma a warpgroup."""
    if compiled.fp8:
        pytest.skip("over an fp8 cache the MMAs are fp16's")
    sass = sass_hazards.listing(compiled)
    dtype = r"\.BF16" if ".bf16" in compiled.asm["ptx"] else ""
    assert len(re.findall(rf"HGMMA\.64x64x16\.F32{dtype} R\d+, R\d+,", sass)) == 8
