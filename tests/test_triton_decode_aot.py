"""The Triton decode routes' parameter sets compiled for sm_90 on the CPU.

Needs triton 3.6.x (the H200's) with TRITON_INTERPRET=0; other versions, and the
interpreter, skip with the reason. Locally, with the 3.6.0 wheel unpacked as
tests/test_gluon_compile.py says:

    TRITON_INTERPRET=0 PYTHONPATH=/tmp/t36 pytest tests/test_triton_decode_aot.py

Triton lowers each kernel to PTX and assembles it with its wheel's ptxas: what
the GPU run would reject at compile time (a dot shape triton refuses, shared
memory past sm_90's 232,448 bytes a block) shows up here. It gives the H200's
figures to the byte: the removed fp8_dot sets compiled here to the 233,472 and
235,520 bytes that the GPU run refused (2026-12-01). Nothing here checks the
numbers (tests/test_triton_decode.py and its _gpu twin do).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import triton

from mlatune.problem import MLAProblem
from mlatune.routes.triton_decode import SegmentedTritonRoute
from tests.test_gluon_compile import HOPPER_SMEM
from tests.test_triton_decode import H200

pytestmark = pytest.mark.kernels

D_V, D_QK = 512, 576
_TRITON_TYPES = {"bf16": "bf16", "fp16": "fp16", "fp8_e4m3fn": "fp8e4nv"}


def _needs_triton_36() -> None:
    if not triton.__version__.startswith("3.6"):
        pytest.skip(f"triton {triton.__version__}: the sets are checked against 3.6 (the H200's)")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("TRITON_INTERPRET=1: the interpreter compiles nothing")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton wheel carries no ptxas")


def _pointer_types(problem: MLAProblem, fn) -> dict[str, str]:
    """q and the cache in the problem's dtypes; scales, partials and outputs fp32 or the
    output dtype; tables and lengths int32."""
    fp8_kv = problem.kv_dtype.startswith("fp8")
    types = {"q_ptr": _TRITON_TYPES[problem.q_dtype], "kv_ptr": _TRITON_TYPES[problem.kv_dtype],
             "out_ptr": _TRITON_TYPES[problem.out_dtype]}
    for name in fn.arg_names:
        if name.endswith("_ptr") and name not in types:
            int_ptr = name.startswith(("bt_", "seq_lens", "row_lens", "work"))
            types[name] = "i32" if int_ptr else "fp32"
    if not fp8_kv:  # the launchers pass q for an absent scale
        types.update(q_scale_ptr=types["q_ptr"], kv_scale_ptr=types["q_ptr"])
    return {n: t for n, t in types.items() if n in fn.arg_names}


def aot_compile(fn, problem: MLAProblem, constants: dict, num_warps: int, num_stages: int):
    """``fn`` compiled for sm_90 as the launchers would call it: every pointer and the
    q/cache strides 16-aligned (packed 576-wide rows), the other ints plain i32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    pointers = _pointer_types(problem, fn)
    sig = {n: "constexpr" if n in constants else "*" + pointers[n] if n in pointers
           else "fp32" if n == "sm_scale_log2" else "i32" for n in fn.arg_names}
    aligned = [*pointers, "stride_q_tok", "stride_q_head", "stride_kv_page", "stride_kv_tok"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, sig, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_segmented(problem: MLAProblem, params: dict):
    """``segmented_kernel`` for one of the route's sets, its tile cut to the subpage as the
    route's ``_plan`` cuts it."""
    from mlatune.kernels.segmented import segment_tile, segmented_kernel

    tile = segment_tile(problem.page_size)
    block_n = min(tile, params["block_n"]) if tile >= 16 else 16
    constants = dict(D_NOPE=D_V, D_ROPE=D_QK - D_V, PAGE_SIZE=tile, BLOCK_M=params["block_m"],
                     BLOCK_N=block_n, Q_FP8=problem.q_dtype.startswith("fp8"),
                     HAS_Q_SCALE=problem.q_dtype.startswith("fp8"),
                     HAS_KV_SCALE=problem.kv_dtype.startswith("fp8"),
                     KV_TWICE=bool(params.get("kv_twice")), FOLD=bool(params.get("fold")))
    return aot_compile(segmented_kernel, problem, constants, params["num_warps"],
                       params["num_stages"])


def compile_split_kv(problem: MLAProblem, params: dict):
    """``split_kv_kernel`` (or ``persistent_kernel``) for a padded/gluon/cprr set."""
    from mlatune.kernels.split_kv import persistent_kernel, split_kv_kernel

    fp8_q, fp8_kv = problem.q_dtype.startswith("fp8"), problem.kv_dtype.startswith("fp8")
    constants = dict(D_NOPE=D_V, D_ROPE=D_QK - D_V, PAGE_SIZE=problem.page_size,
                     BLOCK_M=params["block_m"], BLOCK_N=params["block_n"],
                     CAUSAL=problem.causal, Q_FP8=fp8_q, HAS_Q_SCALE=fp8_q,
                     HAS_KV_SCALE=fp8_kv, KV_TWICE=bool(params.get("kv_twice")))
    fn = persistent_kernel
    if not params.get("persistent"):
        fn = split_kv_kernel
        direct = params["num_splits"] == 1
        constants.update(DIRECT=direct, WRITE_LSE=direct)
    return aot_compile(fn, problem, constants, params["num_warps"], params["num_stages"])


def _verify(heads: int, qlen: int, kv: str, page: int) -> MLAProblem:
    return MLAProblem(num_heads=heads, qlen=qlen, q_dtype="bf16", kv_dtype=kv, batch=64,
                      kv_len=4096, dcp_size=2, page_size=page)


# DCP-2 verify problems: qlen x heads = 16, 32 and 64 rows (every fold tile), pages that
# cut the kernel's tile to 16 (page 1 and 16) or leave it whole, bf16 and fp8 caches.
PROBLEMS = [_verify(h, q, kv, page) for kv in ("bf16", "fp8_e4m3fn")
            for h, q, page in ((8, 2, 16), (16, 2, 64), (16, 4, 1), (4, 4, 64))]


def _label(problem: MLAProblem) -> str:
    return f"h{problem.num_heads}-q{problem.qlen}-p{problem.page_size}-{problem.kv_dtype}"


@pytest.mark.parametrize("problem", PROBLEMS, ids=_label)
def test_every_fold_set_compiles_within_shared_memory(problem):
    _needs_triton_36()
    folded = [p for p in SegmentedTritonRoute().param_space(problem, H200) if p.get("fold")]
    assert folded, "the route offers no fold set here"
    for params in folded:
        kernel = compile_segmented(problem, params)
        assert kernel.metadata.shared <= HOPPER_SMEM, (params, kernel.metadata.shared)


def test_q_fp8_fold_compiles():
    """An fp8 q over an fp8 cache (both upcast to fp16) at the largest fold tile."""
    _needs_triton_36()
    problem = dataclasses.replace(PROBLEMS[-1], q_dtype="fp8_e4m3fn")
    for params in SegmentedTritonRoute().param_space(problem, H200):
        if params.get("fold"):
            assert compile_segmented(problem, params).metadata.shared <= HOPPER_SMEM, params


def _gpu_problems() -> list:
    from tests.test_triton_decode_gpu import PROBLEMS as GPU_PROBLEMS

    return GPU_PROBLEMS


@pytest.mark.parametrize("item", _gpu_problems(), ids=lambda item: f"{item[0]}-{_label(item[1])}")
def test_every_set_of_the_gpu_tests_compiles_within_shared_memory(item):
    """Every set the GPU test runs (tests/test_triton_decode_gpu.py), compiled as it would
    be there: what failed on the H200 at compile time (OutOfResources, a refused dot
    shape) fails here first."""
    _needs_triton_36()
    from mlatune import routes

    route_id, problem = item
    compile_set = compile_segmented if route_id == "segmented/triton" else compile_split_kv
    for params in routes.get(route_id).param_space(problem, H200):
        assert compile_set(problem, params).metadata.shared <= HOPPER_SMEM, params
