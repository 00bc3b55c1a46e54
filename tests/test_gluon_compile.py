"""The Hopper Gluon decode kernel (mlatune/kernels/gluon_hopper.py) on the CPU.

Compiling needs triton 3.6.x (the H200's triton, whose Gluon API the kernel is
written against); other versions skip the compile tests with the reason. Locally,
with the 3.6.0 wheel unpacked into a throwaway directory:

    pip download --no-deps triton==3.6.0 -d /tmp/triton36
    mkdir -p /tmp/t36 && unzip -q -o /tmp/triton36/*.whl -d /tmp/t36
    PYTHONPATH=/tmp/t36 pytest tests/test_gluon_compile.py

Triton lowers the kernel to PTX and assembles it with the ptxas its wheel
carries: no GPU is involved, and nothing here says the kernel computes the
right thing (benchmarks/gluon_check.py checks that on the GPU).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import triton

from mlatune.kernels import gluon_common
from mlatune.kernels import gluon_hopper as g
from tests import sass_hazards
from tests.prefill_aot import resources

pytestmark = pytest.mark.kernels

HOPPER_SMEM = 232448  # bytes of shared memory one block may use on sm_90


def _needs_gluon_triton():
    ok, why = gluon_common.gluon_available()
    if not ok:
        pytest.skip(why)
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton wheel carries no ptxas")


@pytest.mark.parametrize("dtype,direct,causal", [("bf16", True, True), ("fp16", False, False)])
def test_compiles_for_sm90_with_wgmma_and_tma(dtype, direct, causal):
    _needs_gluon_triton()
    k = g.aot_compile(dtype, direct=direct, causal=causal)
    ptx = k.asm["ptx"]
    assert ".target sm_90a" in ptx
    # S = Q K^T: 36 k-steps of 16 (576 deep); O += P V: 4 (64 keys deep), per warpgroup.
    assert ptx.count("wgmma.mma_async") == 40
    assert "cp.async.bulk.tensor.2d" in ptx  # TMA copies of Q and the KV tiles
    assert "mbarrier.try_wait" in ptx
    assert len(k.asm["cubin"]) > 0
    assert k.metadata.shared <= HOPPER_SMEM
    assert resources(k)["stack"] == 0  # no register spills


@pytest.mark.parametrize("page", [16, 32, 128])
def test_pages_under_a_tile_copy_a_box_a_page(page):
    """Under 64-token pages each 64-key tile is copied as 64 / page TMA boxes of a page's rows
    (nope and rope), each page read from the block table, the barrier still expecting the
    whole tile's bytes; from 64 on a tile lies in one page: one box. The MMAs, shared memory
    and spills as at page 64."""
    _needs_gluon_triton()
    k, base = g.aot_compile("bf16", page=page), g.aot_compile("bf16")
    ptx, boxes = k.asm["ptx"], max(1, 64 // page)
    # Q's two parts, then the tile copies at three places (the ring's two, the loop's).
    assert ptx.count("cp.async.bulk.tensor.2d") == 2 + 3 * 2 * boxes
    assert ptx.count("ld.global.b32") - base.asm["ptx"].count("ld.global.b32") == \
        3 * (boxes - 1)  # a block-table entry a box
    assert set(re.findall(r"expect_tx\.shared\.b64 _, \[%r\d+\], (\d+);", ptx)) == \
        {str(64 * 576 * 2)}  # Q's bytes, and a whole tile's
    assert ptx.count("wgmma.mma_async") == 40
    assert k.metadata.shared == base.metadata.shared
    assert resources(k)["stack"] == 0
    assert sass_hazards.hazards(sass_hazards.listing(k)) == (40, 0, [])


@pytest.mark.parametrize(("dtype", "direct", "causal"), [("bf16", True, True),
                                                        ("fp16", False, False)])
def test_page_1_gathers_each_tile_by_cp_async(dtype, direct, causal):
    """Pages of one key: every thread gathers its part of each tile by cp.async, 16 bytes a
    copy (a tile's 64 x 576 over 256 threads: 18 a thread, at the ring's two starts and the
    loop's refill), its pages read ahead; the tile waited for as the thread's copy group, a
    proxy fence and a barrier; no stale rows to zero (past the length the copies write
    zeros). Only Q is a TMA copy; the MMAs as at page 64; no local memory, no hazard."""
    _needs_gluon_triton()
    k = g.aot_compile(dtype, direct=direct, causal=causal, page=1)
    ptx = k.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor.2d") == 1 + 1  # Q's two parts (8 warps: one each)
    assert len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10,", ptx)) \
        == 3 * 18
    assert len(re.findall(r"cp\.async\.wait_group\s+1;", ptx)) == 1  # a tile at a time
    assert len(re.findall(r"cp\.async\.wait_group\s+0;", ptx)) == 1  # the drain at the end
    assert ptx.count("wgmma.mma_async") == 40
    assert resources(k)["stack"] == 0 and k.metadata.shared <= HOPPER_SMEM
    assert sass_hazards.hazards(sass_hazards.listing(k)) == (40, 0, [])


def _tensors(page=64, dtype=torch.bfloat16, d=576, heads=16):
    q = torch.zeros(2, heads, d, dtype=dtype)
    kv = torch.zeros(4, page, d, dtype=dtype)
    return q, kv, torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)


@pytest.mark.parametrize("kwargs,why", [
    (dict(page=8), "page_size 8"),
    (dict(dtype=torch.float32), "q dtype"),
    (dict(d=192), "head width"),
])
def test_refuses_what_it_does_not_do(kwargs, why):
    assert why in g.check_supported(*_tensors(**kwargs))
    with pytest.raises(ValueError, match=why):
        g.decode_launcher(*_tensors(**kwargs), qlen=1, sm_scale=0.1)


def test_other_triton_is_named():
    reason = g.check_supported(*_tensors())
    assert (reason is None) == triton.__version__.startswith(g.GLUON_TRITON)
    if reason is not None:
        assert triton.__version__ in reason


def test_launches_and_aot_builds_share_the_ptxas_options(monkeypatch):
    """Every Gluon kernel is launched with ``compile_options`` (so ptxas gets
    ``PTXAS_OPTIONS``: no debug info, whose line numbers changed the seesaw's SASS), and the
    AOT builds the compile tests check pass the same options."""
    import inspect
    import re

    from mlatune.kernels import (
        gluon_prefill_fp8,
        gluon_seesaw,
        gluon_transposed,
        gluon_transposed_fp8,
        gluon_transposed_ws,
    )

    assert gluon_common.compile_options(4, 168) == {
        "num_warps": 4, "maxnreg": 168, "ptx_options": gluon_common.PTXAS_OPTIONS}
    assert "maxnreg" not in gluon_common.compile_options(4)
    for module in (g, gluon_prefill_fp8, gluon_seesaw, gluon_transposed, gluon_transposed_fp8,
                   gluon_transposed_ws):
        launch_side = inspect.getsource(module).split("\ndef aot_compile")[0]
        assert "**compile_options(" in launch_side, module.__name__
        assert not re.search(r"\bnum_warps=\w", launch_side.split("# Host side")[-1]), \
            module.__name__  # no launch option set apart from compile_options
    seen = {}
    monkeypatch.setattr(gluon_common.triton, "compile",
                        lambda src, target=None, options=None: seen.update(options))
    g.aot_compile()
    assert seen == gluon_common.compile_options(g.NUM_WARPS)
