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


@pytest.fixture(scope="module",
                params=[("bf16", True, True, ""), ("fp16", False, False, ""),
                        ("bf16", True, True, "chunked"), ("fp16", False, False, "chunked"),
                        ("bf16", False, True, "slim"), ("bf16", False, True, "lone")],
                ids=["bf16-direct-causal", "fp16-split", "chunked-bf16-direct-causal",
                     "chunked-fp16-split", "slim-bf16-split-causal", "lone-bf16-split-causal"])
def compiled(request):
    _needs_gluon_triton()
    from mlatune.kernels import gluon_seesaw as s
    dtype, direct, causal, form = request.param
    kernel = s.aot_compile(dtype, direct=direct, causal=causal, chunked=bool(form),
                           slim=form in ("slim", "lone"), lone_bars=form == "lone")
    kernel.chunked = bool(form)  # for the tests that tell the forms apart (slim is chunked)
    return kernel


def test_targets_sm90a_with_tma_and_mbarriers(compiled):
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "cp.async.bulk.tensor.2d" in ptx
    assert "mbarrier.try_wait" in ptx
    assert len(compiled.asm["cubin"]) > 0


def test_wgmma_count(compiled):
    # Per compute warpgroup: S = Q K^T, 36 k-steps (576 deep) on its own tile; P V twice
    # (its own P from registers, the other's from shared memory), 64 keys = 4 k-steps each.
    ptx = compiled.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == 2 * (36 + 2 * 4)
    # P of its own tile as the A operand in registers: the register-A form, 4 k-steps.
    own_p = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.\w+\.\w+ "
                       r"[^;]*\{[^}]*\}, \{%r", ptx)
    assert len(own_p) == 2 * 4


def test_barriers_and_chunked_scores(compiled):
    """Chunked: a barrier per 64-column chunk (9 a slot, 18), two release groups a slot
    (4), P_a and P_b, Q and the row sums: 26; each tile copied as 9 [64, 64] boxes each
    expecting its own 8192 bytes; S issued 4 k-steps (one chunk) after each wait."""
    ptx = compiled.asm["ptx"]
    chunk_expects = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64 _, \[%r\d+\], 8192;", ptx)
    between_waits = [part.count("wgmma.mma_async.sync.aligned.m64n64k16")
                     for part in ptx.split("mbarrier.try_wait")]
    assert sum(between_waits) == 2 * 36  # S = Q K^T: 36 k-steps a warpgroup
    if compiled.chunked:
        assert ptx.count("mbarrier.init") == 18 + 4 + 2 + 2
        assert len(chunk_expects) == 2 * 9  # one slot a tile, as the loader unrolls a pair
        assert max(between_waits) == 4  # no more than one chunk's k-steps before a wait
        assert between_waits.count(4) == 2 * 9  # 8 nope chunks + the 64-wide rope part
    else:
        assert ptx.count("mbarrier.init") == 2 + 2 + 2 + 2
        assert not chunk_expects
        assert max(between_waits) == 36  # S waits for the whole tile, then runs


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


def test_fits_shared_memory_without_spills(compiled):
    # Q (72 KB) + two 64-key tiles (144 KB) + rows' maxima and sums; P lives in the
    # tiles' rope parts, so no P buffer.
    assert compiled.metadata.shared <= HOPPER_SMEM
    assert compiled.metadata.shared < 3 * 73728 + 2048
    # A few scalars spill in one warpgroup (ptxas, 240 registers); the accumulators do not.
    # The chunked form spills less (24 bytes against 72 at triton 3.6.0).
    assert resources(compiled)["stack"] <= (48 if compiled.chunked else 128)


def test_every_wgmma_descriptor_is_written_on_every_path_to_it(compiled):
    """No wgmma takes its shared-memory descriptors from uniform registers that only another
    branch sets (ptxas 12.8 compiled one so in a WG1 path of session 15's persistent branch:
    right or wrong by what the SM's previous block left in them)."""
    assert sass_hazards.undefined_descriptors(sass_hazards.listing(compiled)) == []


def test_slim_is_a_form_of_the_chunked_kernel():
    from mlatune.kernels import gluon_seesaw as s
    with pytest.raises(ValueError, match="chunked"):
        s.decode_launcher(*[None] * 4, qlen=1, sm_scale=0.1, slim=True)
    with pytest.raises(ValueError, match="chunked"):
        s.aot_compile(slim=True)
    with pytest.raises(ValueError, match="positive sm_scale"):
        s.decode_launcher(*[None] * 4, qlen=1, sm_scale=0.0, chunked=True, slim=True)


def test_slim_folds_the_scale_into_the_exponent():
    """The slim form waits for the same barriers and takes as many exponentials; each
    exponent is one FMA (the scale folded in): a multiply a score fewer, less the rows'
    scaled maxima (2 rows a thread)."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_seesaw as s
    slim, chunked = (s.aot_compile(direct=False, chunked=True, causal=True, slim=flag).asm["ptx"]
                     for flag in (True, False))

    def count(ptx: str, op: str) -> int:
        return len(re.findall(rf"^\s*{re.escape(op)}[.\s]", ptx, re.MULTILINE))

    assert slim.count("mbarrier.try_wait") == chunked.count("mbarrier.try_wait")
    assert count(slim, "ex2.approx") == count(chunked, "ex2.approx")
    assert count(slim, "fma.rn") >= count(chunked, "fma.rn") + 2 * 32  # 32 scores a thread
    assert count(slim, "mul.f32") <= count(chunked, "mul.f32") - 2 * 32 + 2 * 2


def test_lone_bars_drop_the_warpgroup_barriers_before_the_waits():
    """Each mbarrier its own allocation: triton 3.6's shared-memory barrier analysis no longer
    puts a warpgroup bar.sync before every wait (a wait writes its barrier, and rows of one
    allocation count as the same memory); the same waits, copies and MMAs, no more spills,
    and it stays a form of the slim kernel."""
    from mlatune.kernels import gluon_seesaw as s
    with pytest.raises(ValueError, match="slim"):
        s.decode_launcher(*[None] * 4, qlen=1, sm_scale=0.1, chunked=True, lone_bars=True)
    _needs_gluon_triton()
    lone, slim = (s.aot_compile(direct=False, chunked=True, slim=True, lone_bars=flag)
                  for flag in (True, False))
    for op in ("mbarrier.try_wait", "cp.async.bulk.tensor.2d", "wgmma.mma_async"):
        assert lone.asm["ptx"].count(op) == slim.asm["ptx"].count(op), op

    def bar_syncs(kernel) -> int:
        return len(re.findall(r"bar\.sync\s+\d+, 128;", kernel.asm["ptx"]))

    assert bar_syncs(lone) <= 0.7 * bar_syncs(slim)
    assert resources(lone)["stack"] <= resources(slim)["stack"]
    assert lone.metadata.shared <= HOPPER_SMEM


@pytest.mark.parametrize("direct", [True, False])
def test_afresh_q_keeps_every_descriptor_out_of_registers(direct):
    """``afresh_q`` (of the lone form; the route's sets run it): Q addressed each pair
    through the zero the compiler cannot prove, as the slots are, so ptxas neither hoists Q's
    chunk descriptors into general registers (moved back to uniform ones before each wgmma) nor
    spills them: the same waits, copies and MMAs as the lone form, no local memory at all
    (the lone form: 32 bytes), far fewer register-to-uniform moves, no hazard."""
    from mlatune.kernels import gluon_seesaw as s
    from tests import sass_hazards
    with pytest.raises(ValueError, match="lone"):
        s.decode_launcher(*[None] * 4, qlen=1, sm_scale=0.1, chunked=True, slim=True,
                          afresh_q=True)
    _needs_gluon_triton()
    fresh, lone = (s.aot_compile(direct=direct, chunked=True, slim=True, lone_bars=True,
                                 afresh_q=flag) for flag in (True, False))
    for op in ("mbarrier.try_wait", "cp.async.bulk.tensor.2d", "wgmma.mma_async"):
        assert fresh.asm["ptx"].count(op) == lone.asm["ptx"].count(op), op
    assert resources(fresh)["stack"] == 0 < resources(lone)["stack"]
    sass = {k: sass_hazards.listing(k) for k in (fresh, lone)}
    assert sass[fresh].count("LDL") == 0
    assert sass[fresh].count("R2UR") <= sass[lone].count("R2UR") // 2  # 133 against 308
    assert sass_hazards.undefined_descriptors(sass[fresh]) == []
    assert sass_hazards.hazards(sass[fresh])[2] == []
    loops = sass_hazards.mma_loop_spills(sass[fresh])
    assert len(loops) == 2 and all(ldl == stl == 0 for _, ldl, stl in loops)  # both pair loops


@pytest.mark.parametrize("two", [False, True])
def test_rope_regs_reads_q_rope_from_registers(two):
    """``rope_regs`` (of the afresh form, with two_requests or without): S's rope k-steps
    take Q's rope part from registers (4 wgmma a warpgroup with a register A operand, none
    in the afresh form), loaded once a request; the same copies and MMAs otherwise, no local
    memory, no hazard."""
    from mlatune.kernels import gluon_seesaw as s
    from tests import sass_hazards
    with pytest.raises(ValueError, match="afresh"):
        s.decode_launcher(*[None] * 4, qlen=1, sm_scale=0.1, chunked=True, slim=True,
                          lone_bars=True, rope_regs=True)
    _needs_gluon_triton()
    rope, fresh = (s.aot_compile(direct=True, causal=True, chunked=True, slim=True,
                                 lone_bars=True, afresh_q=True, two_requests=two,
                                 rope_regs=flag) for flag in (True, False))
    for op in ("cp.async.bulk.tensor.2d", "wgmma.mma_async", "mbarrier.try_wait"):
        assert rope.asm["ptx"].count(op) == fresh.asm["ptx"].count(op), op
    sass = {k: sass_hazards.listing(k) for k in (rope, fresh)}

    def register_a(listing: str) -> int:  # HGMMA of S (N 64) with A in registers
        return len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16 R\d+, R\d+,", listing))

    assert register_a(sass[rope]) == 8 * (2 if two else 1) and register_a(sass[fresh]) == 0
    assert resources(rope)["stack"] == 0
    assert sass_hazards.undefined_descriptors(sass[rope]) == []
    assert sass_hazards.hazards(sass[rope])[2] == []


@pytest.mark.parametrize("direct", [True, False])
def test_two_requests_walks_both_without_local_memory(direct):
    """``two_requests`` (of the afresh form): a program walks two requests, so each
    warpgroup's pair loop is there twice (unrolled), with twice the afresh form's MMAs and
    its copies with slot 1's in a pair without a tile b (9 chunks a request: the ring's
    phases stay one a pair across requests); no local memory, no hazard."""
    from mlatune.kernels import gluon_seesaw as s
    from tests import sass_hazards
    with pytest.raises(ValueError, match="afresh"):
        s.decode_launcher(*[None] * 4, qlen=1, sm_scale=0.1, chunked=True, slim=True,
                          lone_bars=True, two_requests=True)
    _needs_gluon_triton()
    two, one = (s.aot_compile(direct=direct, causal=True, chunked=True, slim=True,
                              lone_bars=True, afresh_q=True, two_requests=flag)
                for flag in (True, False))
    ptx = {k: k.asm["ptx"] for k in (two, one)}
    assert ptx[two].count("wgmma.mma_async") == 2 * ptx[one].count("wgmma.mma_async")
    copies = "cp.async.bulk.tensor.2d"
    assert ptx[two].count(copies) == 2 * (ptx[one].count(copies) + 9)
    assert resources(two)["stack"] == 0
    sass = sass_hazards.listing(two)
    assert sass_hazards.undefined_descriptors(sass) == []
    assert sass_hazards.hazards(sass)[2] == []
    loops = sass_hazards.mma_loop_spills(sass)
    assert len(loops) == 4 and all(ldl == stl == 0 for _, ldl, stl in loops)


@pytest.mark.parametrize("causal", [True, False])
def test_the_lone_form_spills_in_its_pair_loops_without_afresh_q(causal):
    """Why ``afresh_q``: the lone form's pair loops reload spilled values every pair (the
    non-causal build, what single-token decode runs: 19 and 6 LDL); the afresh form's none."""
    from mlatune.kernels import gluon_seesaw as s
    from tests import sass_hazards
    _needs_gluon_triton()
    spills = {flag: sass_hazards.mma_loop_spills(sass_hazards.listing(
        s.aot_compile(direct=True, causal=causal, chunked=True, slim=True, lone_bars=True,
                      afresh_q=flag))) for flag in (False, True)}
    assert len(spills[False]) == len(spills[True]) == 2
    assert sum(ldl for _, ldl, _ in spills[False]) > 0
    assert sum(ldl + stl for _, ldl, stl in spills[True]) == 0


def test_refuses_what_gluon_hopper_refuses():
    from tests.test_gluon_compile import _tensors
    q, kv, bt, sl = _tensors(page=32)
    assert "page_size 32" in g.check_supported(q, kv, bt, sl)
    try:
        from mlatune.kernels import gluon_seesaw as s
    except ImportError as exc:  # another triton's Gluon lacks what the kernel imports
        pytest.skip(str(exc))
    with pytest.raises(ValueError, match="page_size 32"):
        s.decode_launcher(q, kv, bt, sl, qlen=1, sm_scale=0.1)
