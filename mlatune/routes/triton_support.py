"""What every Triton route needs from the device, whatever its family."""

from __future__ import annotations

import importlib.util
import os
import re

from mlatune.arch import DeviceInfo
from mlatune.problem import FP8_DTYPES, MLAProblem
from mlatune.routes.base import YES, Verdict, no

# Which fp8 format each AMD arch's matrix units take.
_AMD_FP8 = {"gfx940": "fp8_e4m3fnuz", "gfx941": "fp8_e4m3fnuz", "gfx942": "fp8_e4m3fnuz",
            "gfx950": "fp8_e4m3fn"}


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def arch_number(arch: str) -> int | None:
    """90 for 'sm_90'; None for non-NVIDIA archs."""
    match = re.fullmatch(r"sm_(\d+)", arch)
    return int(match.group(1)) if match else None


def fp8_verdict(dtype: str, device: DeviceInfo) -> Verdict:
    """Whether the device's matrix units take this fp8 format (the interpreter takes both)."""
    if device.vendor == "cpu":
        return YES
    if device.vendor == "nvidia":
        if dtype != "fp8_e4m3fn":
            return no(f"{dtype} is AMD's fp8 format (MI300); NVIDIA GPUs use fp8_e4m3fn")
        sm = arch_number(device.arch)
        if sm is None or sm < 89:
            return no(f"fp8 tensor-core dots need sm_89 or newer; this device is {device.arch}")
        return YES
    if device.vendor == "amd":
        wanted = _AMD_FP8.get(device.arch)
        if wanted is None:
            return no(f"no fp8 matrix support known for {device.arch} (gfx942: e4m3fnuz, "
                      f"gfx950: e4m3fn)")
        if dtype != wanted:
            return no(f"{device.arch} computes fp8 as {wanted}, not {dtype}")
        return YES
    return no(f"unknown vendor {device.vendor!r}")


def triton_verdict(problem: MLAProblem, device: DeviceInfo) -> Verdict:
    """Triton present; on the CPU, the interpreter and no bf16; the device's dot formats."""
    if importlib.util.find_spec("triton") is None:
        return no("triton is not installed")
    if device.vendor == "cpu":
        if not interpreter_enabled():
            return no("Triton kernels need a GPU; on the CPU set TRITON_INTERPRET=1 before "
                      "importing mlatune to run them in the interpreter")
        if "bf16" in (problem.q_dtype, problem.kv_dtype):
            # Seen with triton 3.6 and 3.9: bf16 tl.dot errors reach 1e10 in the interpreter.
            return no("the Triton interpreter computes bf16 dots wrongly; bf16 runs on GPUs")
        return YES
    if device.vendor == "nvidia" and (arch_number(device.arch) or 0) < 80:
        return no(f"the kernels' 16-bit dots need sm_80 or newer; this device is {device.arch}")
    for dtype in sorted({problem.q_dtype, problem.kv_dtype} & FP8_DTYPES):
        verdict = fp8_verdict(dtype, device)
        if not verdict:
            return verdict
    return YES
