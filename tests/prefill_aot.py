"""Compile the prefill kernels for a GPU target on a machine without one.

Run as a script (``python -m tests.prefill_aot``) with TRITON_INTERPRET unset:
Triton lowers the kernels to PTX and assembles them with the ptxas its wheel
carries, so compile errors and the choice of Hopper's wgmma show up in CPU CI.
Prints one JSON line per kernel: name, whether the PTX uses wgmma, and the
registers and stack (spill) bytes ptxas reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from mlatune.kernels import prefill as kernels
from mlatune.kernels.prefill_plan import MERGE_INFO_COLUMNS, WORK_INFO_COLUMNS
from mlatune.routes.prefill_triton import _GPU_CONFIGS_16BIT, _GPU_CONFIGS_FP8, TILE_Q

_FP32_POINTERS = ("lse_ptr", "part_out_ptr", "part_lse_ptr", "q_scale_ptr", "k_scale_ptr",
                  "v_scale_ptr")


def _signature(fn, pointers: dict[str, str], constants: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        elif name == "sm_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _aligned(fn, names) -> dict:
    """Divisibility hints Triton's launcher adds at run time for 16-aligned pointers and
    sizes (every pointer here, and the strides of packed (tokens, heads, d) tensors)."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def compile_main(dtype: str, config: tuple[int, int, int, int], arch: int = 90,
                 kv_dtype: str | None = None):
    block_m, block_n, warps, stages = config
    kv_dtype = kv_dtype or dtype
    pointers = {"q_ptr": dtype, "k_ptr": kv_dtype, "v_ptr": kv_dtype, "out_ptr": "bf16",
                **dict.fromkeys(_FP32_POINTERS, "fp32"),
                "work_indptr_ptr": "i32", "work_info_ptr": "i32"}
    constants = dict(HAS_SCALES=kv_dtype.startswith("fp8"), CAUSAL=True, D_A=128, D_B=64,
                     D_V=128, BLOCK_M=block_m, BLOCK_N=block_n, TILE_Q=TILE_Q,
                     ROUND_P_FIRST=False, INFO_COLUMNS=WORK_INFO_COLUMNS,
                     KV_UPCAST=kv_dtype != dtype)
    fn = kernels._prefill_persistent_kernel
    strides = [n for n in fn.arg_names if n.startswith("stride_")]
    src = ASTSource(fn, _signature(fn, pointers, constants), constants,
                    _aligned(fn, [*pointers, *strides]))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages})


def compile_merge(arch: int = 90):
    fn = kernels._merge_partials_kernel
    constants = dict(D_V=128, TILE_Q=TILE_Q, BLOCK_R=64, INFO_COLUMNS=MERGE_INFO_COLUMNS)
    pointers = {"part_out_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": "bf16",
                "lse_ptr": "fp32", "merge_info_ptr": "i32"}
    strides = [n for n in fn.arg_names if n.startswith("stride_")]
    src = ASTSource(fn, _signature(fn, pointers, constants), constants,
                    _aligned(fn, [*pointers, *strides]))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def resources(compiled) -> dict[str, int]:
    """Registers and stack bytes, from the cuobjdump that Triton's wheel carries."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", cubin.name],
                              capture_output=True, text=True, check=True).stdout
    fields = dict(part.split(":") for part in text.split() if part.count(":") == 1)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"])}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    jobs = [(f"bf16 {c}", lambda c=c: compile_main("bf16", c)) for c in _GPU_CONFIGS_16BIT]
    jobs += [(f"fp8 {c}", lambda c=c: compile_main("fp8e4nv", c)) for c in _GPU_CONFIGS_FP8]
    jobs += [(f"bf16 over fp8 {c}", lambda c=c: compile_main("bf16", c, kv_dtype="fp8e4nv"))
             for c in _GPU_CONFIGS_16BIT]
    jobs.append(("merge", compile_merge))
    for name, job in jobs:
        compiled = job()
        print(json.dumps({"kernel": name, "wgmma": "wgmma.mma_async" in compiled.asm["ptx"],
                          **resources(compiled)}), flush=True)


if __name__ == "__main__":
    main()
