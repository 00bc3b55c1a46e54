"""Compile the prefill kernels for a GPU target on a machine without one.

Run as a script (``python -m tests.prefill_aot``) with TRITON_INTERPRET unset:
Triton lowers the kernels to PTX and assembles them with the ptxas its wheel
carries, so compile errors and the choice of Hopper's wgmma show up in CPU CI.
Prints one JSON line per kernel: name, whether the PTX uses wgmma, the
registers and stack (spill) bytes ptxas reports, the loop's schedule in the ttgir
(``schedule``: wgmma shapes, dot-wait pendings, dots left in flight, tile loads not
pipelined) and in the SASS (``hot_loops``: wgmma waits and spills per key step).
Arguments, if any, keep only the kernels whose names contain one of them.
"""

from __future__ import annotations

import json
import os
import re
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


def compile_main(dtype: str, config: tuple, arch: int = 90, kv_dtype: str | None = None):
    """config: (block_m, block_n, num_warps, num_stages[, v_transposed, grouped])."""
    block_m, block_n, warps, stages, *variant = config
    v_transposed = bool(variant and variant[0])  # the plan flag (grouped) changes no kernel
    kv_dtype = kv_dtype or dtype
    pointers = {"q_ptr": dtype, "k_ptr": kv_dtype, "v_ptr": kv_dtype, "out_ptr": "bf16",
                **dict.fromkeys(_FP32_POINTERS, "fp32"),
                "work_indptr_ptr": "i32", "work_info_ptr": "i32"}
    constants = dict(HAS_SCALES=kv_dtype.startswith("fp8"), CAUSAL=True, D_A=128, D_B=64,
                     D_V=128, BLOCK_M=block_m, BLOCK_N=block_n, TILE_Q=TILE_Q,
                     ROUND_P_FIRST=False, INFO_COLUMNS=WORK_INFO_COLUMNS,
                     KV_UPCAST=kv_dtype != dtype,
                     P_SHIFT=8 if dtype == kv_dtype == "fp8e4nv" else 0,
                     V_ALIGN=kernels.V_ALIGN if v_transposed else 1)
    # The stride of v's contiguous dimension is 1, which Triton's launcher specializes.
    constants["stride_v_key" if v_transposed else "stride_v_dim"] = 1
    fn = kernels._prefill_persistent_kernel
    strides = [n for n in fn.arg_names if n.startswith("stride_") and n not in constants]
    src = ASTSource(fn, _signature(fn, pointers, constants), constants,
                    _aligned(fn, [*pointers, *strides]))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages})


def compile_transpose(arch: int = 90):
    fn = kernels._transpose_v_kernel
    constants = dict(D_V=128, BLOCK_K=kernels._TRANSPOSE_BLOCK, V_ALIGN=kernels.V_ALIGN,
                     PERMUTE_32=False, WHOLE_TILES=False)
    pointers = {"v_ptr": "fp8e4nv", "vt_ptr": "fp8e4nv", "tiles_ptr": "i32"}
    strides = [n for n in fn.arg_names if n.startswith("stride_")]
    src = ASTSource(fn, _signature(fn, pointers, constants), constants,
                    _aligned(fn, [*pointers, *strides]))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def _sass(compiled) -> list[str]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(tool), "-c", cubin.name], capture_output=True, text=True,
                              check=True).stdout.splitlines()


def hot_loops(compiled) -> dict:
    """The innermost SASS loops that run MMAs (the key loops), as ptxas left them: the
    wgmma waits per step (WARPGROUP.DEPBAR: 1 when every wgmma but one stays in flight
    until the step's single wait; ptxas serializes them all when it cannot pipeline,
    its warning C7514) and local-memory spill accesses (LDL/STL) per step, the most
    of any such loop."""
    lines = _sass(compiled)
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\.(L_x_\d+):", line.strip()))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line))
             and labels.get(m.group(1), i) < i]
    inner = [(a, b) for a, b in loops
             if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    bodies = [lines[a:b] for a, b in inner if any("GMMA" in x for x in lines[a:b])]

    def most(*keys: str) -> int:
        return max((sum(any(k in x for k in keys) for x in body) for body in bodies), default=0)

    return {"key_loops": len(bodies), "loop_wgmma_waits": most("WARPGROUP.DEPBAR"),
            "loop_spill_accesses": most("LDL", "STL")}


def schedule(compiled) -> dict:
    """What the attention loop does on Hopper, from the ttgir and PTX: the wgmma
    shapes, the pendings of every warp_group_dot_wait (0: wait for every dot in
    flight; n > 0: n dots may stay in flight), the dots left in flight across a
    loop step (no wait right after them: Triton waits for them in the next step,
    at its first full wait) and the tile loads that are not async copies (a
    register load then a shared-memory store: not pipelined; q's two are outside
    the key loops)."""
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    dots = re.findall(r"(%\S+) = ttng\.warp_group_dot [^\n]*isAsync = true", ttgir)
    waited = set(re.findall(r"warp_group_dot_wait (%[^ ,]+)", ttgir))
    return {
        "wgmma_shapes": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)",
                                              ptx))),
        "dot_waits": [int(n) for n in re.findall(r"warp_group_dot_wait .*pendings = (\d+)",
                                                 ttgir)],
        # Async dots whose result no wait names: loop-carried, waited in the next step
        # (dots outside loops are synchronous).
        "dots_in_flight": sum(d not in waited for d in dots),
        "sync_tile_loads": len(re.findall(r"ttg\.local_alloc %\S+ : \(tensor<\d+x\d+x", ttgir)),
    }


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
    only = sys.argv[1:]  # substrings of job names, to compile a few
    jobs = [(f"bf16 {c}", lambda c=c: compile_main("bf16", c)) for c in _GPU_CONFIGS_16BIT]
    jobs += [(f"fp8 {c}", lambda c=c: compile_main("fp8e4nv", c)) for c in _GPU_CONFIGS_FP8]
    jobs += [(f"bf16 over fp8 {c}", lambda c=c: compile_main("bf16", c, kv_dtype="fp8e4nv"))
             for c in _GPU_CONFIGS_16BIT]
    jobs += [("merge", compile_merge), ("transpose v", compile_transpose)]
    for name, job in jobs:
        if only and not any(o in name for o in only):
            continue
        compiled = job()
        print(json.dumps({"kernel": name, "triton": triton.__version__,
                          "wgmma": "wgmma.mma_async" in compiled.asm["ptx"],
                          **resources(compiled), **schedule(compiled),
                          **hot_loops(compiled)}), flush=True)


if __name__ == "__main__":
    main()
