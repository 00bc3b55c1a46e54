"""The architectures mlatune knows, as plain data, and a DeviceInfo for each.

`mlatune plan --arch X` describes a device that is not on this machine; this
table is where its CU count, vendor and native fp8 format come from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlatune.arch import DeviceInfo


@dataclass(frozen=True)
class ArchSpec:
    arch: str
    vendor: str  # "amd" or "nvidia"
    device_name: str  # the part the CU count below belongs to
    cu_count: int | None  # CUs (AMD) or SMs (NVIDIA); None where this project does not know it
    fp8: str  # the fp8 format the arch's kernels read, as a problem dtype name
    backends: tuple[str, ...]  # route backends that build for the arch


# fp8 formats: AITER's own table (aiter/utility/dtypes.py, `defaultDtypes`)
# gives gfx942 e4m3fnuz and gfx950/gfx1250 OCP e4m3fn; the seed reaches the
# same through `aiter.dtypes.fp8` / `current_platform.fp8_dtype()`. NVIDIA's
# Hopper and Blackwell read OCP e4m3fn.
ARCHS: dict[str, ArchSpec] = {
    spec.arch: spec
    for spec in (
        ArchSpec("gfx942", "amd", "AMD Instinct MI300X", 304, "fp8_e4m3fnuz",
                 ("aiter", "triton")),
        ArchSpec("gfx950", "amd", "AMD Instinct MI355X", 256, "fp8_e4m3fn", ("aiter", "triton")),
        ArchSpec("gfx1250", "amd", "AMD gfx1250", None, "fp8_e4m3fn", ("aiter", "triton")),
        ArchSpec("sm_90", "nvidia", "NVIDIA H200", 132, "fp8_e4m3fn", ("triton",)),
        ArchSpec("sm_100", "nvidia", "NVIDIA B200", 148, "fp8_e4m3fn", ("triton",)),
    )
}
AMD_ARCHS = tuple(a for a, s in ARCHS.items() if s.vendor == "amd")


# The machine without a GPU: the portable routes run there in Triton's interpreter (whose
# dots take both fp8 formats) and in eager torch.
CPU = ArchSpec("cpu", "cpu", "CPU (Triton interpreter)", None, "", ("triton",))


def spec_for(arch: str) -> ArchSpec | None:
    """The spec the capability rules judge ``arch`` by: a planning arch (``ARCHS``), the CPU,
    or another NVIDIA (``sm_NN``) or AMD (``gfxNNN``) GPU that a route may meet on the machine
    it runs on (an A100, an MI250), described by its vendor alone (no AITER build, no CU
    count); None for anything else."""
    if arch in ARCHS:
        return ARCHS[arch]
    if arch == CPU.arch:
        return CPU
    if re.fullmatch(r"sm_\d+", arch):
        return ArchSpec(arch, "nvidia", f"NVIDIA {arch}", None, "fp8_e4m3fn", ("triton",))
    if re.fullmatch(r"gfx[0-9a-f]+", arch):
        return ArchSpec(arch, "amd", f"AMD {arch}", None, "", ("triton",))
    return None


def sm_number(arch: str) -> int | None:
    """90 for 'sm_90'; None for an arch that is not NVIDIA's."""
    match = re.fullmatch(r"sm_(\d+)", arch)
    return int(match.group(1)) if match else None


def arch_spec(arch: str) -> ArchSpec:
    try:
        return ARCHS[arch]
    except KeyError:
        raise KeyError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}") from None


def device_for_arch(arch: str) -> DeviceInfo:
    """A description of the arch's reference part, for planning without it (cu_count 0: unknown)."""
    spec = arch_spec(arch)
    return DeviceInfo(spec.arch, spec.device_name, spec.vendor, spec.cu_count or 0)
