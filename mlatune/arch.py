"""Which device we are on, described once, so rules and tables never touch the GPU.

A ``DeviceInfo`` is plain data: capability rules read it, tables record it as
their fingerprint, and the dispatcher compares it with a table's. The CPU is a
device too (arch ``cpu``), so the whole pipeline runs on a machine without a GPU.
"""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import asdict, dataclass

import torch

CPU_ARCH = "cpu"


@dataclass(frozen=True)
class DeviceInfo:
    arch: str  # "sm_90", "gfx950", "cpu"
    name: str
    vendor: str  # "nvidia", "amd", "cpu"
    cu_count: int  # SMs on NVIDIA, CUs on AMD, cores on the CPU
    memory_bytes: int = 0
    index: int = -1  # torch device index; -1 for the CPU

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}" if self.is_gpu else "cpu"

    def as_dict(self) -> dict:
        return asdict(self)


def vendor_of(arch: str) -> str:
    """Who makes a device of ``arch``: "nvidia" (sm_*), "amd" (gfx*), "cpu" or "unknown"."""
    return "nvidia" if arch.startswith("sm_") else "amd" if arch.startswith("gfx") else \
        "cpu" if arch == CPU_ARCH else "unknown"


def units_text(arch: str, count: int) -> str:
    """A device's unit count in its maker's word: "132 SMs", "304 CUs", "2 cores"."""
    unit = {"nvidia": "SM", "amd": "CU", "cpu": "core"}.get(vendor_of(arch), "unit")
    return f"{count} {unit}{'' if count == 1 else 's'}"


def cpu_device() -> DeviceInfo:
    import os

    return DeviceInfo(CPU_ARCH, platform.processor() or platform.machine(), "cpu",
                      os.cpu_count() or 1)


def gpu_devices() -> list[DeviceInfo]:
    """Every visible GPU (CUDA or ROCm through torch.cuda); empty without one."""
    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        if torch.version.hip:
            arch = props.gcnArchName.split(":")[0]  # "gfx950:sramecc+:xnack-" -> "gfx950"
            vendor = "amd"
        else:
            arch = f"sm_{props.major}{props.minor}"
            vendor = "nvidia"
        found.append(DeviceInfo(arch, props.name, vendor, props.multi_processor_count,
                                props.total_memory, i))
    return found


def current_device() -> DeviceInfo:
    """The GPU torch would use now, or the CPU when there is none."""
    gpus = gpu_devices()
    return gpus[torch.cuda.current_device()] if gpus else cpu_device()


def device_info(device: torch.device) -> DeviceInfo:
    """The DeviceInfo of a torch device (a GPU named without an index: the current one)."""
    if device.type != "cuda":
        return cpu_device()
    return gpu_devices()[torch.cuda.current_device() if device.index is None else device.index]


def device_of(tensor: torch.Tensor) -> DeviceInfo:
    """The DeviceInfo of the device a tensor lives on."""
    return device_info(tensor.device)


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version() -> str:
    """GPU runtime/driver as torch sees it ('none' on the CPU)."""
    if torch.version.hip:
        return f"hip-{torch.version.hip}"
    if torch.cuda.is_available():
        try:
            v = torch._C._cuda_getDriverVersion()  # e.g. 12080 -> "12.8"
            return f"cuda-driver-{v // 1000}.{v % 1000 // 10}"
        except Exception:  # private API: fall back to the runtime version
            return f"cuda-{torch.version.cuda}"
    return "none"


def library_versions() -> dict[str, str | None]:
    """Versions that change what a route computes or how fast."""
    import mlatune  # the package, which imports this module

    return {
        "mlatune": mlatune.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton") or package_version("pytorch-triton-rocm"),
        "aiter": package_version("aiter") or package_version("amd-aiter"),
        "flash_mla": package_version("sgl-flash-mla") or package_version("flash-mla"),
        "flashinfer": package_version("flashinfer-python"),
    }
