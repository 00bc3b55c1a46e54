"""The seesaw decode over an fp8 e4m3 cache (mlatune/kernels/gluon_seesaw.py's widening form)
compiled on the CPU, and the arithmetic of its in-place widening.

Needs triton 3.6.x for the builds, like tests/test_gluon_seesaw_compile.py; other versions
skip. Compiling says nothing about the numbers the kernel computes: tests/test_gluon_gpu.py
checks those on the GPU.
"""

from __future__ import annotations

import itertools
import re

import pytest

from tests import sass_hazards
from tests.prefill_aot import resources
from tests.test_gluon_compile import HOPPER_SMEM, _needs_gluon_triton
from tests.test_gluon_seesaw_compile import seesaw_build

pytestmark = pytest.mark.kernels

SLOT_NOPE = 64 * 512 * 2  # a ring slot's fp16 nope part (bytes); its rope part 64 x 64 x 2
CHUNK16, CHUNK8 = 64 * 64 * 2, 64 * 64  # a 64-column chunk of a tile, widened and staged
Q_AND_RING = 64 * 576 * 2 * 3  # Q and two slots, 16-bit


@pytest.fixture(scope="module",
                params=[("bf16", True, True, "pairs", 64), ("fp16", False, False, "pairs", 64),
                        ("bf16", False, True, "two-requests", 64),
                        ("bf16", True, False, "pairs", 16),
                        ("bf16", False, True, "pairs", 32),
                        ("bf16", True, True, "two-requests", 128)],
                ids=["pairs-bf16-direct-causal", "pairs-fp16-split", "two-bf16-split-causal",
                     "pairs-bf16-direct-page16", "pairs-bf16-split-causal-page32",
                     "two-bf16-direct-causal-page128"])
def compiled(request):
    return seesaw_build(*request.param, cache="fp8")


def _tile_sites(compiled) -> int:
    """Where the loader's code copies a tile: slot 0 and slot 1 (two-requests: and slot 1's
    pad, each request)."""
    return 2 if compiled.units == 1 else 2 * 3


def _widen_sites(compiled) -> int:
    """Where its code widens one: slot 0 and slot 1, each request (the pad's widening is
    tile b's, merged by the compiler)."""
    return 2 * compiled.units


def test_fits_shared_memory_without_local_memory_or_hazards(compiled):
    """Q and the two 16-bit slots (221,184 bytes) and, besides the 16-bit build's rows and
    barriers, 19 barriers and the rows' scales: no fp8 staging of its own (each tile is staged
    in its slot). No local memory, no register an in-flight wgmma uses touched, every wgmma
    descriptor written on every path to it."""
    assert compiled.metadata.shared <= HOPPER_SMEM
    assert Q_AND_RING < compiled.metadata.shared < Q_AND_RING + 2048 + 1024 * compiled.units
    assert resources(compiled)["stack"] == 0
    sass = sass_hazards.listing(compiled)
    assert sass.count("LDL") == 0 and sass.count("STL") == 0
    loops = sass_hazards.mma_loop_spills(sass)
    assert len(loops) == 2 * compiled.units and all(ldl == stl == 0 for _, ldl, stl in loops)
    assert sass_hazards.hazards(sass)[2] == []
    assert sass_hazards.undefined_descriptors(sass) == []


def test_register_budgets_give_the_widening_loader_40(compiled):
    from mlatune.kernels import gluon_seesaw as s
    ptx = compiled.asm["ptx"]
    grows = set(map(int, re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)))
    shrinks = set(map(int, re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)))
    assert s.WIDEN_COMPUTE_REGS.value in grows and s.WIDEN_LOADER_REGS.value in shrinks
    assert (s.WIDEN_COMPUTE_REGS.value, s.WIDEN_LOADER_REGS.value) == (232, 40)


def test_fp16_mmas_over_tiles_widened_by_the_loader(compiled):
    """The MMAs as the 16-bit build's (S: 36 k-steps a warpgroup and request, P V: 2 x 4), in
    fp16; each tile's 9 fp8 chunks widened by one cvt a pair of values (a thread's 32 values a
    chunk: 16), in a build for the split's last tile (stale rows zeroed) and one for the rest,
    at each of the loader's widening sites."""
    ptx = compiled.asm["ptx"]
    units = compiled.units
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(\w+)\.(\w+)", ptx)
    assert len(mmas) == units * 2 * (36 + 2 * 4)
    assert {(a, b) for _, a, b in mmas} == {("f16", "f16")}
    cvts = ptx.count("cvt.rn.f16x2.e4m3x2")
    assert cvts == _widen_sites(compiled) * 2 * 9 * 16
    assert sass_hazards.listing(compiled).count("F2FP.F16.E4M3.UNPACK_B") == cvts


def test_each_fp8_chunk_lands_on_its_own_barrier(compiled):
    """Each staged chunk (4096 bytes) is a TMA box, or a box a page, on its own barrier: 18
    staged barriers besides the 16-bit build's 26 (and Q's release, two-requests), and one
    that both warpgroups have widened Q; only Q is copied at 16 bits."""
    ptx = compiled.asm["ptx"]
    sites = _tile_sites(compiled)
    boxes = max(1, 64 // compiled.page)
    expects = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64 _, \[%r\d+\], (\d+);", ptx)
    assert expects.count(str(CHUNK8)) == sites * 9
    assert set(expects) == {str(CHUNK8), str(64 * 576 * 2)}  # the chunks', and Q's
    assert ptx.count("cp.async.bulk.tensor.2d") == 3 * compiled.units + sites * 9 * boxes
    assert ptx.count("mbarrier.init") == 18 + 4 + 2 + 2 + 18 + 1 + (compiled.units - 1)


def test_the_widening_takes_about_two_instructions_a_pair_of_values(compiled):
    """A chunk of a tile before the split's last (no stale rows to zero, no SEL): a thread's
    two 16-byte loads, 16 e4m3 -> fp16 cvt (32 values), four 16-byte stores, the proxy fence,
    the barriers, a wait and an arrival; ptxas moves some cvts across the arrivals, so the
    stretches between two arrivals are counted together: at most 2.25 instructions a cvt
    (31 a chunk, 1.94 a cvt, at triton 3.6.0; the last tile's build, zeroing, about 100)."""
    code = sass_hazards.parse(sass_hazards.listing(compiled))
    arrivals = [i for i, ins in enumerate(code) if ins.op.startswith("SYNCS.ARRIVE")]
    spans, cvts = 0, 0
    for a, b in itertools.pairwise(arrivals):
        n = sum(ins.op.startswith("F2FP.F16.E4M3") for ins in code[a:b])
        if n >= 12 and not any(ins.op == "SEL" for ins in code[a:b]):
            spans, cvts = spans + b - a, cvts + n
    assert cvts >= _widen_sites(compiled) * 7 * 16
    assert spans <= 2.25 * cvts


def test_staging_positions_are_read_before_they_are_overwritten():
    """The in-place widening's arithmetic (``chunk_at``, ``staged_at``): each slot stages its
    8 nope chunks in its non-owner V half (the second release group, with the rope part's
    upper half), in the order they are widened, and the fp16 write of position k reaches no
    staged position past k; the first four writes (the owner's half) reach none."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_seesaw as s

    def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
        return a[0] < b[1] and b[0] < a[1]

    for slot in (0, 1):
        order = [s.chunk_at(slot, k) for k in range(9)]
        assert order[:4] == list(range(4 * slot, 4 * slot + 4)) and sorted(order) == \
            list(range(9))
        base = slot * SLOT_NOPE
        other_half = (base + (1 - slot) * SLOT_NOPE // 2, base + (2 - slot) * SLOT_NOPE // 2)
        staged = [(CHUNK8 * s.staged_at(slot, k), CHUNK8 * s.staged_at(slot, k) + CHUNK8)
                  for k in range(8)]
        assert all(other_half[0] <= a and b <= other_half[1] for a, b in staged)
        for k, chunk in enumerate(order[:8]):
            written = (base + CHUNK16 * chunk, base + CHUNK16 * (chunk + 1))
            reached = [j for j, place in enumerate(staged) if overlap(written, place)]
            assert all(j <= k for j in reached), (slot, k, reached)
            assert (k < 4) is (not reached)


def test_refuses_page_1_and_the_two_requests_form_under_page_64():
    """The fp8 form's loader copies by TMA: page 1 is refused; the two-requests form reads an
    fp8 cache from page 64 (under it its build spills registers); the launcher asks for the
    cache's scale over fp8 and takes none over a 16-bit cache."""
    _needs_gluon_triton()
    import torch

    from mlatune.kernels import gluon_seesaw as s
    from tests.test_gluon_compile import _tensors
    with pytest.raises(ValueError, match="page_size 1"):
        s.aot_compile("bf16", page=1, cache="fp8")
    with pytest.raises(ValueError, match="two-requests form reads an fp8 cache"):
        s.aot_compile("bf16", page=16, cache="fp8", form="two-requests")
    q, kv, bt, sl = _tensors(page=16)
    fp8 = kv.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs its per-tensor scale"):
        s.decode_launcher(q, fp8, bt, sl, qlen=1, sm_scale=0.1)
    with pytest.raises(ValueError, match="two-requests form reads an fp8 cache"):
        s.decode_launcher(q, fp8, bt, sl, qlen=1, sm_scale=0.1, kv_scale=torch.ones(1),
                          form="two-requests")
    with pytest.raises(ValueError, match="takes no kv_scale"):
        s.decode_launcher(q, kv, bt, sl, qlen=1, sm_scale=0.1, kv_scale=torch.ones(1))
    q1, kv1, bt1, sl1 = _tensors(page=1)
    with pytest.raises(ValueError, match="page_size 1"):
        s.decode_launcher(q1, kv1.to(torch.float8_e4m3fn), bt1, sl1, qlen=1, sm_scale=0.1,
                          kv_scale=torch.ones(1))
