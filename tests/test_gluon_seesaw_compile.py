"""The warp-specialized seesaw decode (mlatune/kernels/gluon_seesaw.py) compiled on the CPU.

Needs triton 3.6.x, like tests/test_gluon_compile.py (whose module docstring says how
to unpack it locally); other versions skip. Compiling says nothing about the numbers
the kernel computes: benchmarks/gluon_check.py checks those on the GPU.
"""

from __future__ import annotations

import re

import pytest

from mlatune.kernels import gluon_hopper as g
from tests import sass_hazards
from tests.prefill_aot import resources
from tests.test_gluon_compile import HOPPER_SMEM, _needs_gluon_triton

pytestmark = pytest.mark.kernels
# TMA copies into shared memory (Q, the tiles) and out of it (the pairs form's direct output).
LOADS = "cp.async.bulk.tensor.2d.shared::cluster.global"
STORES = "cp.async.bulk.tensor.2d.global.shared"


@pytest.fixture(scope="module",
                params=[("bf16", True, True, "pairs", 64), ("fp16", False, False, "pairs", 64),
                        ("bf16", False, True, "two-requests", 64),
                        ("bf16", True, False, "two-requests", 64),
                        ("bf16", False, True, "pairs", 128)],
                ids=["pairs-bf16-direct-causal", "pairs-fp16-split", "two-bf16-split-causal",
                     "two-bf16-direct", "pairs-bf16-split-causal-page128"])
def compiled(request):
    return seesaw_build(*request.param)


def seesaw_build(dtype: str, direct: bool, causal: bool, form: str, page: int,
                 cache: str | None = None):
    """The seesaw kernel built for the CPU's checks (``gluon_seesaw.aot_compile``), with
    the requests a program walks (``units``), its q dtype's name and its page."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_seesaw as s
    kernel = s.aot_compile(dtype, direct=direct, causal=causal, form=form, page=page,
                           cache=cache)
    kernel.units = 2 if form == "two-requests" else 1  # requests a program walks
    kernel.tma_out = form == "pairs" and direct and cache != "fp8" and page >= 64
    kernel.dtype_name = dtype
    kernel.page = page
    return kernel


def test_targets_sm90a_with_tma_and_mbarriers(compiled):
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "cp.async.bulk.tensor.2d" in ptx
    assert "mbarrier.try_wait" in ptx
    assert len(compiled.asm["cubin"]) > 0


def test_wgmma_count(compiled):
    # Per compute warpgroup and request: S = Q K^T, 36 k-steps (576 deep) on its own tile;
    # P V twice (its own P from registers, the other's from shared memory), 64 keys = 4
    # k-steps each. The two-requests form walks its second request in a copy of the loop.
    ptx = compiled.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == compiled.units * 2 * (36 + 2 * 4)
    # P of its own tile as the A operand in registers: the register-A form, 4 k-steps.
    own_p = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.\w+\.\w+ "
                       r"[^;]*\{[^}]*\}, \{%r", ptx)
    assert len(own_p) == compiled.units * 2 * 4


def test_barriers_and_chunked_scores(compiled):
    """A barrier per 64-column chunk (9 a slot, 18), two release groups a slot (4), P_a and
    P_b, Q and the row sums: 26 (two-requests: and Q's release, 27); each tile copied as 9
    [64, 64] boxes each expecting its own 8192 bytes (two-requests: slot 1 also filled in a
    pair without a tile b); S issued 4 k-steps (one chunk) after each wait."""
    ptx = compiled.asm["ptx"]
    chunk_expects = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64 _, \[%r\d+\], 8192;", ptx)
    between_waits = [part.count("wgmma.mma_async.sync.aligned.m64n64k16")
                     for part in ptx.split("mbarrier.try_wait")]
    units = compiled.units
    assert sum(between_waits) == units * 2 * 36  # S = Q K^T: 36 k-steps a warpgroup
    assert ptx.count("mbarrier.init") == 18 + 4 + 2 + 2 + (units - 1)
    assert len(chunk_expects) == (2 * 9 if units == 1 else 2 * (2 * 9 + 9))
    assert max(between_waits) == 4  # no more than one chunk's k-steps before a wait
    assert between_waits.count(4) == units * 2 * 9  # 8 nope chunks + the 64-wide rope part


def test_each_chunk_is_a_box(compiled):
    """Each 64-column chunk of a tile (9 a tile) lands as one TMA box (pages of 64 keys and
    more: a tile lies in one page), its barrier expecting the chunk's 8192 bytes
    (``test_barriers_and_chunked_scores``): with Q's copies, 3 + 18 (two-requests: 2 x (3 +
    27)) boxes."""
    ptx = compiled.asm["ptx"]
    # Q's nope part as two copies (its 8 boxes over the loader's 4 warps) and its rope part.
    assert ptx.count(LOADS) == 3 * compiled.units + _copy_sites(compiled)


def test_the_pairs_forms_direct_output_is_stored_by_tma(compiled):
    """The pairs form writing out in place stages each warpgroup's 256 columns in Q's buffer
    and stores them by one TMA copy a warpgroup; split partials and the two-requests form
    (whose next request's Q fills that buffer) store from registers."""
    assert compiled.asm["ptx"].count(STORES) == (2 if compiled.tma_out else 0)


def _copy_sites(compiled) -> int:
    """The tile chunks' copy sites: 9 a slot (two-requests: and slot 1's pad, each request)."""
    return 18 if compiled.units == 1 else 2 * 27


def test_three_partitions_with_register_budgets(compiled):
    ptx = compiled.asm["ptx"]
    assert ".reqntid 384" in ptx  # 3 warpgroups: loader (default), WG0, WG1
    grows = set(map(int, re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)))
    shrinks = set(map(int, re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)))
    from mlatune.kernels import gluon_seesaw as s
    assert s.COMPUTE_REGS.value in grows
    assert s.LOADER_REGS.value in shrinks
    # Each compute warpgroup synchronizes its own 128 threads (named barriers), not the block.
    assert len(set(re.findall(r"bar\.sync\s+(\d+), 128;", ptx))) >= 2


def test_fits_shared_memory_without_local_memory(compiled):
    """Q (72 KB) + two 64-key tiles (144 KB) + rows' maxima and sums; P lives in the tiles'
    rope parts, so no P buffer. No local memory: Q and the slots addressed afresh each pair
    keep their wgmma descriptors out of (spilled) registers, in both pair loops of a request
    (``sass_hazards.mma_loop_spills``)."""
    assert compiled.metadata.shared <= HOPPER_SMEM
    assert compiled.metadata.shared < 3 * 73728 + 2048 * compiled.units  # two-requests: 4 sums
    assert resources(compiled)["stack"] == 0
    sass = sass_hazards.listing(compiled)
    assert sass.count("LDL") == 0
    loops = sass_hazards.mma_loop_spills(sass)
    assert len(loops) == 2 * compiled.units and all(ldl == stl == 0 for _, ldl, stl in loops)


def test_every_wgmma_descriptor_is_written_on_every_path_to_it(compiled):
    """No wgmma takes its shared-memory descriptors from uniform registers that only another
    branch sets (ptxas 12.8 has compiled such a path: right or wrong by what the SM's previous
    block left in them)."""
    assert sass_hazards.undefined_descriptors(sass_hazards.listing(compiled)) == []


def test_the_launcher_takes_a_live_form_and_a_positive_scale():
    from mlatune.kernels import gluon_seesaw as s
    assert s.FORMS == ("pairs", "two-requests", "balanced")
    with pytest.raises(ValueError, match="forms are"):
        s.decode_launcher(*[None] * 4, qlen=1, sm_scale=0.1, form="chunked")
    with pytest.raises(ValueError, match="forms are"):
        s.aot_compile(form="slim")
    with pytest.raises(ValueError, match="positive sm_scale"):
        s.decode_launcher(*[None] * 4, qlen=1, sm_scale=0.0)


def test_each_mbarrier_is_its_own_allocation(compiled):
    """triton 3.6's shared-memory barrier analysis takes a wait as a write of its barrier and
    the rows of one allocation as the same memory; with every mbarrier its own allocation it
    puts no warpgroup bar.sync before each wait. The guard: the builds' count at triton 3.6.0
    (80 in the pairs form, 183 in the two-requests one)."""
    bar_syncs = len(re.findall(r"bar\.sync\s+\d+, 128;", compiled.asm["ptx"]))
    assert bar_syncs <= {1: 80, 2: 183}[compiled.units]


def test_q_rope_is_read_from_registers_and_no_wgmma_hazard(compiled):
    """S's rope k-steps take Q's rope part from registers (4 wgmma a warpgroup and request
    with a register A operand), loaded once a request; no register of an in-flight wgmma is
    touched and every wgmma descriptor is written on every path to it."""
    sass = sass_hazards.listing(compiled)
    dtype = {"bf16": r"\.BF16", "fp16": ""}[compiled.dtype_name]  # (an fp16 HGMMA: no suffix)
    register_a = re.findall(rf"HGMMA\.64x64x16\.F32{dtype} R\d+, R\d+,", sass)
    assert len(register_a) == 8 * compiled.units
    assert sass_hazards.hazards(sass)[2] == []


def test_two_requests_doubles_the_walk_and_its_copies():
    """The two-requests form: each warpgroup's pair loop is there twice (unrolled), with
    twice the pairs form's MMAs, and its copies with slot 1's in a pair without a tile b (9
    chunks a request: the ring's phases stay one a pair across requests)."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_seesaw as s
    two, one = (s.aot_compile(direct=False, causal=True, form=form)
                for form in ("two-requests", "pairs"))
    ptx = {k: k.asm["ptx"] for k in (two, one)}
    assert ptx[two].count("wgmma.mma_async") == 2 * ptx[one].count("wgmma.mma_async")
    copies = LOADS
    assert ptx[two].count(copies) == 2 * (ptx[one].count(copies) + 9)


def test_refuses_what_gluon_hopper_refuses():
    from tests.test_gluon_compile import _tensors
    q, kv, bt, sl = _tensors(page=8)
    assert "page_size 8" in g.check_supported(q, kv, bt, sl)
    try:
        from mlatune.kernels import gluon_seesaw as s
    except ImportError as exc:  # another triton's Gluon lacks what the kernel imports
        pytest.skip(str(exc))
    with pytest.raises(ValueError, match="page_size 8"):
        s.decode_launcher(q, kv, bt, sl, qlen=1, sm_scale=0.1)


@pytest.fixture(scope="module",
                params=[("bf16", "pairs", True, 1), ("bf16", "two-requests", False, 1),
                        ("bf16", "pairs", True, 16), ("bf16", "two-requests", False, 16),
                        ("fp16", "pairs", False, 32), ("bf16", "two-requests", True, 32)],
                ids=["pairs-direct-page1", "two-split-page1", "pairs-direct-page16",
                     "two-split-page16", "pairs-fp16-split-page32", "two-direct-page32"])
def gathered(request):
    _needs_gluon_triton()
    from mlatune.kernels import gluon_seesaw as s
    dtype, form, direct, page = request.param
    kernel = s.aot_compile(dtype, direct=direct, form=form, page=page)
    kernel.units = 2 if form == "two-requests" else 1
    return kernel


def test_the_plan_names_the_gathered_pages():
    """Pages under a tile of a 16-bit cache are the ones the loader gathers (the builds
    below); an fp8 cache's tiles come by TMA at every page."""
    from mlatune.kernels.gluon_hopper_plan import seesaw_gathers
    assert [p for p in (1, 16, 32, 64, 128) if seesaw_gathers(p, False)] == [1, 16, 32]
    assert not any(seesaw_gathers(p, True) for p in (1, 16, 32, 64))


def test_small_page_tiles_are_gathered_by_the_loader(gathered):
    """Pages under a tile (1, 16, 32 keys): the loader gathers each tile by cp.async (16 bytes
    a copy: a tile's 64 x 576 over its 128 threads, 36 a thread, at each of the 2 slot sites,
    two-requests 3 a request), every thread arriving on the chunks' barriers (initialized to
    128 arrivals) once its copies land, 9 a tile; each compute warpgroup fences after each
    chunk wait before its wgmmas read (cp.async writes through the generic proxy). Only Q is
    a TMA copy; the MMAs as at page 64."""
    ptx = gathered.asm["ptx"]
    sites = 2 if gathered.units == 1 else 2 * 3
    assert ptx.count(LOADS) == 3 * gathered.units  # Q alone
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10,", ptx)
    assert len(copies) == sites * 36
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared.b64") == sites * 9
    assert len(re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], 128;", ptx)) == 18
    # A tile's pages: a block-table entry for each of a thread's 4 keys (of 64) at each site
    # (masked past the split's end), read once a tile whatever the page.
    assert len(re.findall(r"@%p\d+ ld\.global\.b32", ptx)) == sites * 4
    assert ptx.count("mbarrier.arrive.expect_tx") == gathered.units  # Q's alone
    assert ptx.count("wgmma.mma_async") == gathered.units * 2 * (36 + 2 * 4)
    # S waits for 9 chunks, then P V for the 4 chunks of the other tile's half: a fence each
    # wait (a half's four waits: one fence), per warpgroup and request.
    assert ptx.count("fence.proxy.async.shared::cta") >= gathered.units * 2 * (9 + 1)


def test_the_gather_budgets_registers_without_local_memory(gathered):
    """The gathering loader gets 40 registers (its pages and rows), the compute warpgroups
    232 (no stale rows to zero); no local memory, no wgmma hazard, descriptors defined."""
    from mlatune.kernels import gluon_seesaw as s
    ptx = gathered.asm["ptx"]
    grows = set(map(int, re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)))
    shrinks = set(map(int, re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)))
    assert s.GATHER_COMPUTE_REGS.value in grows and s.GATHER_LOADER_REGS.value in shrinks
    assert resources(gathered)["stack"] == 0
    sass = sass_hazards.listing(gathered)
    assert sass.count("LDL") == 0
    assert sass_hazards.hazards(sass)[2] == []
    assert sass_hazards.undefined_descriptors(sass) == []
    assert gathered.metadata.shared <= HOPPER_SMEM
