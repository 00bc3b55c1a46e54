"""The transposed Gluon decodes (mlatune/kernels/gluon_transposed*.py) on the CPU.

The widening of fp8 to 16 bits (``gluon_transposed_ws``) is inline PTX:
``test_widen_asm_is_exact`` runs that PTX's instructions (a few integer and one packed
multiply) on every e4m3 byte in Python and compares with torch's conversion, on any
machine. The compile tests need triton 3.6.x,
like tests/test_gluon_compile.py; other versions skip. Compiling says nothing about the
numbers the kernel computes: benchmarks/gluon_check.py and tests/test_gluon_gpu.py check
those on the GPU.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton

from mlatune.kernels import gluon_transposed as t
from mlatune.kernels import gluon_transposed_ws as ws
from tests import sass_hazards
from tests.prefill_aot import resources
from tests.test_gluon_compile import _needs_gluon_triton

pytestmark = pytest.mark.kernels


def _run_widen_asm(asm: str, word: int, ty: torch.dtype) -> list[float]:
    """The four values the asm writes to $0 and $1 (two packed 16-bit halves each)."""
    regs: dict[str, int] = {"$2": word}

    def val(x: str) -> int:
        x = x.strip()
        return int(x, 16) if x.startswith("0x") else int(x) if x.isdigit() else regs[x]

    def halves(v: int) -> list[float]:
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16) \
            .view(ty).float().tolist()

    for line in asm.strip("{}\n").splitlines():
        op, _, rest = line.strip().rstrip(";").partition(" ")
        if op.startswith(".reg"):
            continue
        dst, *src = [a.strip() for a in rest.split(",")]
        if op == "mov.b32":
            regs[dst] = val(src[0])
        elif op == "prmt.b32":
            pool = val(src[0]).to_bytes(4, "little") + val(src[1]).to_bytes(4, "little")
            sel = val(src[2])
            regs[dst] = int.from_bytes(bytes(pool[(sel >> 4 * i) & 7] for i in range(4)), "little")
        elif op == "shr.b32":
            regs[dst] = val(src[0]) >> val(src[1])
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        elif op.startswith("mul.rn."):
            a, b = halves(val(src[0])), halves(val(src[1]))
            regs[dst] = [x * y for x, y in zip(a, b, strict=True)]  # exact: times a power of 2
        else:
            raise AssertionError(f"an instruction this test does not know: {line}")
    return regs["$0"] + regs["$1"]


@pytest.mark.parametrize(("asm", "ty"), [(ws._WIDEN_BF16.value, torch.bfloat16),
                                         (ws._WIDEN_F16.value, torch.float16)], ids=["bf16", "f16"])
def test_widen_asm_is_exact(asm, ty):
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = every.view(torch.float8_e4m3fn).float()
    got = []
    for base in range(0, 256, 4):
        got += _run_widen_asm(asm, int.from_bytes(bytes(range(base, base + 4)), "little"), ty)
    got = torch.tensor(got)
    finite = ~want.isnan()
    assert finite.sum() == 254
    assert torch.equal(got[finite], want[finite])  # subnormals and both zeros included
    assert (got[finite].abs() == 0).sum() == 2
    assert got[~finite].abs().max() == 480  # NaN bytes: finite, masked or zeroed by the kernel


@pytest.fixture(scope="module",
                params=[(("bf16", 16, True, True, True), 64),
                        (("fp16", 32, False, False, True), 64),
                        (("bf16", 16, False, True, False), 64),
                        (("bf16", 16, True, True, True), 16),
                        (("fp16", 32, False, False, True), 32),
                        (("bf16", 16, True, True, True), 1),
                        (("fp16", 32, False, False, True), 1),
                        (("bf16", 16, False, True, False), 1)],
                ids=["bf16-16rows-direct", "fp16-32rows-split-merged", "bf16-16rows-split-reduced",
                     "bf16-16rows-direct-page16", "fp16-32rows-split-merged-page32",
                     "bf16-16rows-direct-page1", "fp16-32rows-split-merged-page1",
                     "bf16-16rows-split-reduced-page1"])
def compiled(request):
    _needs_gluon_triton()
    case, page = request.param
    dtype, rows, direct, causal, merge = case
    kernel = t.aot_compile(dtype, rows=rows, direct=direct, causal=causal, merge=merge,
                           page=page)
    kernel.case, kernel.page = case, page
    return kernel


def test_a_tile_is_a_box_a_page(compiled):
    """A 64-key tile's nope and rope parts are one TMA box each where the tile lies in one
    page, else one a page; the barrier expects the whole tile (Q's bytes apart). Pages of
    one key: ``test_page_1_gathers_each_tile_by_cp_async``."""
    if compiled.page == 1:
        pytest.skip("page 1 gathers by cp.async")
    ptx = compiled.asm["ptx"]
    boxes = max(1, 64 // compiled.page)
    # A nope box is two copy instructions (its 64-column messages over the 4 warps), a rope
    # box one: Q's, then the tile's at two places (the ring's first slot, the loop's refill).
    assert ptx.count("cp.async.bulk.tensor.2d") == 3 + 2 * 3 * boxes
    expects = set(re.findall(r"expect_tx\.shared\.b64 _, \[%r\d+\], (\d+);", ptx))
    assert str(64 * 576 * 2) in expects and len(expects) == 2
    assert sass_hazards.hazards(sass_hazards.listing(compiled))[2] == []


def test_every_wgmma_descriptor_is_written_on_every_path_to_it(compiled):
    """As the seesaw kernel's test: no wgmma reads a descriptor that some path leaves unset."""
    assert sass_hazards.undefined_descriptors(sass_hazards.listing(compiled)) == []


def test_keys_are_m_and_rows_are_n(compiled):
    # S^T = K Q^T: 36 k-steps over 576 dims; O^T = V^T P^T: 512 dims as 8 m64 blocks x 4
    # k-steps over 64 keys; every MMA's N is the program's 16 or 32 query rows.
    dtype, rows, _, _, _ = compiled.case
    ptx = compiled.asm["ptx"]
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    assert shapes == {f"m64n{rows}k16"}
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    assert f".f32.{ptx_type}.{ptx_type}" in ptx  # the MMAs in q's dtype
    assert ptx.count("wgmma.mma_async") == 36 + 8 * 4
    assert ".target sm_90a" in ptx and "cp.async.bulk.tensor.2d" in ptx
    assert "prmt.b32" not in ptx and "e4m3" not in ptx  # no widening: a 16-bit cache


def test_page_1_gathers_each_tile_by_cp_async(compiled):
    """Pages of one key: the warpgroup gathers each tile by cp.async, 16 bytes a copy (a
    tile's 64 x 576 over 128 threads: 36 a thread, at the ring's start and the loop's
    refill), waited for as the thread's copy group (all but the newest), a proxy fence and a
    barrier, drained after the walk; no stale rows to zero. Only Q is a TMA copy."""
    if compiled.page != 1:
        pytest.skip("TMA boxes: test_a_tile_is_a_box_a_page")
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor.2d") == 3  # Q's
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10,", ptx)
    assert len(copies) == 2 * 36
    assert len(re.findall(r"cp\.async\.wait_group\s+1;", ptx)) == 1  # in the walk
    assert len(re.findall(r"cp\.async\.wait_group\s+0;", ptx)) == 1  # the drain
    assert "mbarrier.arrive.expect_tx" in ptx  # Q's
    assert sass_hazards.hazards(sass_hazards.listing(compiled))[2] == []


def test_fits_one_block_an_sm_without_spills(compiled):
    assert compiled.metadata.shared <= 227 * 1024
    assert resources(compiled)["stack"] == 0


def test_split_builds_merge_in_the_kernel_after_one_release_or_signal_the_reduce(compiled):
    """Split-KV: the last split of a row block to arrive merges the partials, found by one
    acq_rel atomic add at GPU scope on the block's counter; a direct build has none, nor a
    split build whose partials the reduce kernel merges: that one lets the reduce kernel
    launch early (a programmatic dependent) as its blocks begin."""
    _, _, direct, _, merge = compiled.case
    merges = not direct and merge
    ptx = compiled.asm["ptx"]
    assert ptx.count("atom.global.gpu.acq_rel.add") == (1 if merges else 0)
    assert ("ld.global.cg" in ptx) == merges  # partials read past L1
    reduced = not direct and not merge
    assert ptx.count("griddepcontrol.launch_dependents") == (1 if reduced else 0)


@pytest.mark.parametrize(("dtype", "rows", "direct", "page"),
                         [("bf16", 16, True, 64), ("fp16", 32, False, 64), ("bf16", 16, True, 16)])
def test_the_warp_specialized_widening_compiles_without_spills(dtype, rows, direct, page):
    """``gluon_transposed_ws`` (the mma16 form over an fp8 cache): the same 68 MMAs in q's
    dtype, three partitions (setmaxnreg), the fp8 tile widened by integer moves and a
    multiply by a power of two in q's dtype (no cvt from e4m3: the few conversion units are
    slow), within shared memory and without local memory. Each 32-key half lands as a TMA
    box a page (one at 64)."""
    _needs_gluon_triton()
    compiled = ws.aot_compile(dtype, rows=rows, direct=direct, page=page)
    ptx = compiled.asm["ptx"]
    # Q (3 copy instructions), then each half's nope and rope parts (one each, fp8).
    assert ptx.count("cp.async.bulk.tensor.2d") == 3 + 2 * 2 * max(1, 32 // page)
    assert ptx.count("wgmma.mma_async") == 36 + 8 * 4
    assert "setmaxnreg" in ptx and "prmt.b32" in ptx
    assert f"mul.rn.{'bf16' if dtype == 'bf16' else 'f16'}x2" in ptx
    assert "e4m3" not in ptx
    assert "cp.async.cg" not in ptx and "cp.async.mbarrier" not in ptx  # no gather
    assert compiled.metadata.shared <= 227 * 1024
    assert resources(compiled)["stack"] == 0


@pytest.mark.parametrize(("dtype", "rows", "direct"),
                         [("bf16", 16, True), ("fp16", 32, False), ("bf16", 16, False)])
def test_the_warp_specialized_widening_gathers_page_1_by_cp_async(dtype, rows, direct):
    """``gluon_transposed_ws`` over pages of one key: the loader partition gathers each
    32-key fp8 half by cp.async, 16 bytes a copy (32 x 576 bytes over its 128 threads: 9 a
    thread a half, two halves a tile), then every thread arrives on the half's barrier once
    its copies have landed (no increment: the barrier counts the loader's 128 threads); only
    Q is a TMA copy. The converter and the MMAs are the TMA build's: 68 MMAs, the widening;
    no local memory (the loader holds one row pointer), no wgmma hazard."""
    _needs_gluon_triton()
    compiled = ws.aot_compile(dtype, rows=rows, direct=direct, page=1)
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor.2d") == 3  # Q's
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10,", ptx)
    assert len(copies) == 2 * 9
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared.b64") == 2
    inits = re.findall(r"mbarrier\.init\.shared::cta\.b64 \[[^]]*\], (\d+);", ptx)
    assert sorted(inits) == ["1"] * 7 + ["128"] * 2  # the halves' ready barriers: 128
    assert "cp.async.wait_group" not in ptx  # the converter waits on the barriers
    assert ptx.count("wgmma.mma_async") == 36 + 8 * 4
    assert "setmaxnreg" in ptx and "prmt.b32" in ptx
    assert compiled.metadata.shared <= 227 * 1024
    assert resources(compiled)["stack"] == 0
    sass = sass_hazards.listing(compiled)
    assert re.search(r"\b(LDL|STL)[.\s]", sass) is None
    assert len(re.findall(r"LDGSTS\.E\.BYPASS\.128", sass)) == 2 * 9
    assert sass_hazards.undefined_descriptors(sass) == []
    assert sass_hazards.hazards(sass)[2] == []


def test_the_reduce_kernel_waits_on_its_grid_dependency():
    """The reduce kernel that merges a transposed or seesaw build's partials, launched as a
    programmatic dependent, waits on the grid dependency before it reads them."""
    _needs_gluon_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from mlatune.kernels.reduce import reduce_kernel

    sig = {n: "i32" for n in reduce_kernel.arg_names}
    sig.update(dict.fromkeys(("part_out_ptr", "part_lse_ptr", "out_ptr", "lse_ptr"), "*fp32"),
               split_indptr_ptr="*i32")
    # Slot counts read from the indptr (a group of one left in place too: the seesaw's
    # balanced form); 8 a group, in one pass.
    for slots, one_in_place in ((0, False), (8, False), (0, True)):
        consts = dict(BLOCK_R=2, BLOCK_D=64, SLOT_BLOCK=16, WRITE_LSE=True,
                      WAIT_PRIMARY=True, SLOTS=slots, ONE_IN_PLACE=one_in_place)
        sig.update(dict.fromkeys(consts, "constexpr"))
        reduce = triton.compile(ASTSource(reduce_kernel, sig, consts),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "launch_pdl": True})
        assert "griddepcontrol.wait" in reduce.asm["ptx"] and reduce.metadata.launch_pdl


def _sass_ops(listing: str, op: str) -> int:
    """Instructions of exactly opcode ``op`` (``LDS`` is not ``LDS.128``)."""
    return len(re.findall(rf"\b{re.escape(op)}\s", listing))


@pytest.mark.parametrize(("direct", "causal", "page"), [(True, False, 64), (False, True, 64),
                                                        (False, True, 16)])
def test_the_fp8_mma_form_runs_both_products_in_fp8(direct, causal, page):
    """``gluon_transposed_fp8`` (transposed-mma8/gluon, 16 query rows): q's two e4m3 terms
    stacked in one operand, so S^T is one wgmma of N 32 a k-step, 18 k32 steps a tile issued at two
    places (the first tile, then each next one in the loop), and O^T 16 of N 16 (8 blocks of
    64 dims x 2 key steps); q quantized in the kernel (a cvt to an e4m3 pair per two values),
    V^T by byte permutes in a partition of its own (setmaxnreg), loaded 4 bytes a thread
    (the conflict-free wide transpose: 64 a tile, full and masked tiles). One MMA loop, one
    wgmma wait a tile, no local memory, no hazard."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_transposed_fp8 as f

    compiled = f.aot_compile("bf16", rows=16, direct=direct, causal=causal, page=page)
    ptx = compiled.asm["ptx"]
    # Q (3 copy instructions), then a tile's nope and rope parts (one each, fp8) a box.
    assert ptx.count("cp.async.bulk.tensor.2d") == 3 + 2 * max(1, 64 // page)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3") == 2 * 18
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3") == 16
    assert "m64n16k16" not in ptx  # nothing widened to 16 bits
    assert "setmaxnreg" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx and "prmt.b32" in ptx
    assert compiled.metadata.shared <= 227 * 1024
    assert resources(compiled)["stack"] == 0
    sass = sass_hazards.listing(compiled)
    assert _sass_ops(sass, "LDS") >= 64 * 2
    (loop, ) = sass_hazards.mma_loops(sass)
    assert sum(c.op == "WARPGROUP.DEPBAR.LE" for c in loop) == 1
    assert sass_hazards.mma_loop_spills(sass)[0][1:] == (0, 0)
    assert sass_hazards.undefined_descriptors(sass) == []
    assert sass_hazards.hazards(sass)[2] == []
