"""The transposed Gluon decode (mlatune/kernels/gluon_transposed.py) on the CPU.

The widening of fp8 to 16 bits is inline PTX: ``test_widen_asm_is_exact`` runs that PTX's
instructions (a few integer and one packed multiply) on every e4m3 byte in Python and
compares with torch's conversion, on any machine. The compile tests need triton 3.6.x,
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


@pytest.mark.parametrize(("asm", "ty"), [(t._WIDEN_BF16.value, torch.bfloat16),
                                         (t._WIDEN_F16.value, torch.float16)], ids=["bf16", "f16"])
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
                params=[("bf16", None, 16, True, True, "auto"),
                        ("fp16", None, 32, False, False, "auto"),
                        ("bf16", "fp8", 16, True, True, "auto"),
                        ("bf16", "fp8", 32, False, True, "auto"),
                        ("fp16", "fp8", 16, False, True, "reduce")],
                ids=["bf16-16rows-direct", "fp16-32rows-split", "fp8-16rows-direct",
                     "fp8-32rows-split", "fp16-over-fp8-split-reduce"])
def compiled(request):
    _needs_gluon_triton()
    dtype, kv, rows, direct, causal, merge = request.param
    kernel = t.aot_compile(dtype, kv, rows=rows, direct=direct, causal=causal, merge=merge)
    kernel.case = request.param
    return kernel


def test_every_wgmma_descriptor_is_written_on_every_path_to_it(compiled):
    """As the seesaw kernel's test: no wgmma reads a descriptor that some path leaves unset."""
    from tests import sass_hazards

    assert sass_hazards.undefined_descriptors(sass_hazards.listing(compiled)) == []


def test_keys_are_m_and_rows_are_n(compiled):
    # S^T = K Q^T: 36 k-steps over 576 dims; O^T = V^T P^T: 512 dims as 8 m64 blocks x 4
    # k-steps over 64 keys; every MMA's N is the program's 16 or 32 query rows.
    dtype, _, rows, _, _, _ = compiled.case
    ptx = compiled.asm["ptx"]
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    assert shapes == {f"m64n{rows}k16"}
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    assert f".f32.{ptx_type}.{ptx_type}" in ptx  # the MMAs in q's dtype, whatever the cache's
    assert ptx.count("wgmma.mma_async") == 36 + 8 * 4
    assert ".target sm_90a" in ptx and "cp.async.bulk.tensor.2d" in ptx


def test_fp8_widens_with_integer_moves_not_conversions(compiled):
    dtype, kv, _, _, _, _ = compiled.case
    ptx = compiled.asm["ptx"]
    assert ("prmt.b32" in ptx) == (kv == "fp8")
    # The widening multiplies by the power of two in q's dtype (2^120 bf16, 2^8 fp16).
    assert (f"mul.rn.{'bf16' if dtype == 'bf16' else 'f16'}x2" in ptx) == (kv == "fp8")
    assert "e4m3" not in ptx  # no cvt from fp8 (the few conversion units are slow)


def test_fits_one_block_an_sm_with_few_spills(compiled):
    # 255 registers over an fp8 tile at 32 rows (O^T 128 a thread, the widened chunk 64):
    # 8 bytes of stack there (triton 3.6.0, 2026-12-01), none elsewhere.
    _, kv, rows, _, _, _ = compiled.case
    assert compiled.metadata.shared <= 227 * 1024
    assert resources(compiled)["stack"] <= (16 if (kv, rows) == ("fp8", 32) else 0)


def test_split_builds_merge_in_the_kernel_after_one_release_unless_reduced(compiled):
    # Split-KV: the last split of a row block to arrive merges the partials, found by one
    # acq_rel atomic add at GPU scope on the block's counter; a direct build has none, nor
    # a split build whose partials the reduce kernel merges.
    _, _, _, direct, _, merge = compiled.case
    merges = not direct and merge != "reduce"
    ptx = compiled.asm["ptx"]
    assert ptx.count("atom.global.gpu.acq_rel.add") == (1 if merges else 0)
    assert ("ld.global.cg" in ptx) == merges  # partials read past L1


@pytest.mark.parametrize(("dtype", "rows", "direct"), [("bf16", 16, True), ("fp16", 32, False)])
def test_the_warp_specialized_fp8_form_compiles_without_spills(dtype, rows, direct):
    """``gluon_transposed_ws`` (what transposed/gluon's fp8 param sets run): the same 68
    MMAs in q's dtype, three partitions (setmaxnreg), within shared memory and without
    local memory."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_transposed_ws as ws

    compiled = ws.aot_compile(dtype, rows=rows, direct=direct)
    ptx = compiled.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == 36 + 8 * 4
    assert "setmaxnreg" in ptx and "prmt.b32" in ptx
    assert compiled.metadata.shared <= 227 * 1024
    assert resources(compiled)["stack"] == 0


def test_pdl_builds_let_the_reduce_kernel_launch_early():
    """``pdl=True`` (transposed/gluon's param sets ask for it): the split kernel signals its
    dependents at once and the reduce kernel waits on the grid dependency; a default build
    has neither."""
    _needs_gluon_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from mlatune.kernels.reduce import reduce_kernel

    split = t.aot_compile("bf16", rows=16, direct=False, merge="reduce", pdl=True)
    assert split.asm["ptx"].count("griddepcontrol.launch_dependents") == 1
    plain = t.aot_compile("bf16", rows=16, direct=False, merge="reduce")
    assert "griddepcontrol" not in plain.asm["ptx"]
    sig = {n: "i32" for n in reduce_kernel.arg_names}
    sig.update(dict.fromkeys(("part_out_ptr", "part_a_ptr", "part_b_ptr", "out_ptr", "lse_ptr"),
                             "*fp32"), split_indptr_ptr="*i32")
    for slots in (0, 8):  # slot counts read from the indptr; 8 a group, in one pass
        consts = dict(BLOCK_R=2, BLOCK_D=64, SLOT_BLOCK=16, MAX_EXPSUM=False, WRITE_LSE=True,
                      WAIT_PRIMARY=True, SLOTS=slots)
        sig.update(dict.fromkeys(consts, "constexpr"))
        reduce = triton.compile(ASTSource(reduce_kernel, sig, consts),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "launch_pdl": True})
        assert "griddepcontrol.wait" in reduce.asm["ptx"] and reduce.metadata.launch_pdl


@pytest.mark.parametrize(("rows", "direct", "q_terms"), [(16, True, 2), (32, False, 2),
                                                        (16, False, 1), (32, True, 1)])
def test_the_fp8_mma_form_runs_both_products_in_fp8(rows, direct, q_terms):
    """``gluon_transposed_fp8``: per tile 18 k32 e4m3 MMAs for S^T (512 + 64 dims) per e4m3
    term of q, issued twice in the code (the first tile, then each next one inside the
    loop), and 16 for O^T (8 blocks of 64 dims x 2 key steps); q quantized in the kernel
    (one cvt to an e4m3 pair per two values), V^T by byte permutes in a partition of its
    own (setmaxnreg); within shared memory."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_transposed_fp8 as f

    compiled = f.aot_compile("bf16", rows=rows, direct=direct, q_terms=q_terms)
    ptx = compiled.asm["ptx"]
    assert "setmaxnreg" in ptx
    mmas = ptx.count(f"wgmma.mma_async.sync.aligned.m64n{rows}k32.f32.e4m3.e4m3")
    assert mmas == 2 * 18 * q_terms + 16
    assert "wgmma.mma_async.sync.aligned.m64n16k16" not in ptx  # nothing widened to 16 bits
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "prmt.b32" in ptx
    assert compiled.metadata.shared <= 227 * 1024
    if rows == 16:
        assert resources(compiled)["stack"] == 0


def test_deferred_sums_leave_the_mmas_and_local_memory_as_they_were():
    """``defer_sums`` (the route's fp8_mma form): P's row sums kept per element and summed
    once after the keys; the same wgmmas as without, and at 16 rows no local memory."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_transposed_fp8 as f

    plain, deferred = (f.aot_compile("bf16", rows=16, direct=False, defer_sums=defer)
                       for defer in (False, True))
    assert plain.asm["ptx"] != deferred.asm["ptx"]
    assert deferred.asm["ptx"].count("wgmma.mma_async") == plain.asm["ptx"].count("wgmma.mma_async")
    assert resources(deferred)["stack"] == 0


def test_stacked_terms_halve_the_score_wgmmas_and_add_their_halves_in_registers():
    """``stacked`` (two terms): q's terms one above the other in one operand,
    S^T a wgmma of N 32 a k-step (the K tile read once) where the route's form issues two of
    N 16; the folding of the two column halves adds no shuffle and no shared-memory store;
    the same shared memory, no local memory, no hazard. Refused with one term."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_transposed_fp8 as f
    from tests import sass_hazards

    plain, stacked = (f.aot_compile("bf16", rows=16, direct=False, defer_sums=True,
                                    stacked=flag) for flag in (False, True))
    steps = 2 * (512 + 64) // 32  # S^T's k-steps a tile, issued at two places
    ptx = {k: k.asm["ptx"] for k in (plain, stacked)}
    assert ptx[plain].count("m64n16k32") == 2 * steps + 16  # two terms, and O^T's 16
    assert ptx[stacked].count("m64n32k32") == steps and ptx[stacked].count("m64n16k32") == 16
    assert stacked.metadata.shared == plain.metadata.shared
    assert resources(stacked)["stack"] == 0
    sass = {k: sass_hazards.listing(k) for k in (plain, stacked)}
    for op in ("SHFL", "STS"):
        assert sass[stacked].count(op) == sass[plain].count(op), op
    assert sass_hazards.undefined_descriptors(sass[stacked]) == []
    assert sass_hazards.hazards(sass[stacked])[2] == []


def _sass_ops(listing: str, op: str) -> int:
    """Instructions of exactly opcode ``op`` (``LDS`` is not ``LDS.128``)."""
    return len(re.findall(rf"\b{re.escape(op)}\s", listing))


def test_the_wide_transpose_loads_4_bytes_stores_16_and_keeps_one_o_product():
    """``wide_vt``: V^T one buffer of two tiles' key slots, the transposer's sixteen 16-byte
    loads a tile become 4-byte ones (64), its stores stay 16-byte; O^T is still one product
    of 16 wgmmas a tile (the tile's half of the buffer chosen by address, not a product for
    each half); the same shared memory, no local memory, no hazard."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_transposed_fp8 as f
    from tests import sass_hazards

    plain, wide = (f.aot_compile("bf16", rows=16, direct=False, defer_sums=True, stacked=True,
                                 wide_vt=flag) for flag in (False, True))
    assert wide.asm["ptx"].count("m64n16k32") == plain.asm["ptx"].count("m64n16k32") == 16
    assert wide.metadata.shared == plain.metadata.shared
    assert resources(wide)["stack"] == 0
    sass = {k: sass_hazards.listing(k) for k in (plain, wide)}
    paths = 2  # the transposer's full and masked tiles
    assert _sass_ops(sass[wide], "LDS") - _sass_ops(sass[plain], "LDS") == 64 * paths
    assert _sass_ops(sass[plain], "LDS.128") - _sass_ops(sass[wide], "LDS.128") > 15 * paths
    assert _sass_ops(sass[wide], "STS.128") == _sass_ops(sass[plain], "STS.128")
    assert sass_hazards.undefined_descriptors(sass[wide]) == []
    assert sass_hazards.hazards(sass[wide])[2] == []


def test_warp_max_takes_the_tiles_max_over_keys_in_one_barrier_not_two():
    """``warp_max``: each warp's max over its 16 keys by shuffles, the four warps' through
    shared memory after one barrier; ``gl.max`` over S^T's rows took a second barrier and a
    second round of two shuffles. No local memory, no hazard."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_transposed_fp8 as f
    from tests import sass_hazards

    plain, warp = (f.aot_compile("bf16", rows=16, direct=False, defer_sums=True, stacked=True,
                                 wide_vt=True, warp_max=flag) for flag in (False, True))
    sass = {k: sass_hazards.listing(k) for k in (plain, warp)}
    assert _sass_ops(sass[plain], "BAR.SYNC.DEFER_BLOCKING") \
        - _sass_ops(sass[warp], "BAR.SYNC.DEFER_BLOCKING") == 1
    assert _sass_ops(sass[plain], "SHFL.BFLY") - _sass_ops(sass[warp], "SHFL.BFLY") == 2
    assert resources(warp)["stack"] == 0
    assert sass_hazards.hazards(sass[warp])[2] == []


def test_slim_scales_in_the_exponent_and_masks_behind_a_branch_with_the_mmas_as_they_were():
    """``slim`` (non-causal decode): the column scales folded into the exponent's FMA (fewer
    FMULs, more FFMAs in the MMA loop), the bounds behind a branch taken only on a tile
    that reaches them; still one wgmma wait a tile (the S^T product in flight across the
    branch is not serialized), no spills in the loop, no hazard."""
    _needs_gluon_triton()
    from mlatune.kernels import gluon_transposed_fp8 as f
    from tests import sass_hazards

    plain, slim = (f.aot_compile("bf16", rows=16, direct=True, causal=False, defer_sums=True,
                                 stacked=True, wide_vt=True, warp_max=True, slim=flag)
                   for flag in (False, True))
    sass = {k: sass_hazards.listing(k) for k in (plain, slim)}
    (loop, ), (plain_loop, ) = (sass_hazards.mma_loops(sass[k]) for k in (slim, plain))

    def count(body, op):
        return sum(c.op == op for c in body)

    assert count(loop, "FMUL") < count(plain_loop, "FMUL")
    assert count(loop, "FFMA") > count(plain_loop, "FFMA")
    assert count(loop, "BRA") == count(plain_loop, "BRA") + 1
    assert count(loop, "WARPGROUP.DEPBAR.LE") == 1
    assert sum(op.startswith("QGMMA") for op in (c.op for c in loop)) == \
        sum(op.startswith("QGMMA") for op in (c.op for c in plain_loop))
    assert sass_hazards.mma_loop_spills(sass[slim])[0][1:] == (0, 0)
    assert sass_hazards.undefined_descriptors(sass[slim]) == []
    assert sass_hazards.hazards(sass[slim])[2] == []
