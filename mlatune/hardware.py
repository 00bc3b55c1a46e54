"""What decides kernel speed on a GPU, in device terms: SMs, DRAM bandwidth, tensor
throughput and clocks (``Hardware``).

A table records the ``Hardware`` it was measured on; the dispatcher's cost laws rescale a
table measured on one GPU model to another from these figures (``mlatune.dispatch.laws``).
Each figure comes from the best source there is, in this order: what this process can read
(torch's device properties, ``nvidia-smi``'s clocks), a short measurement
(``measure_bandwidth``: the DRAM bandwidth a large copy reaches), then the vendor's datasheet
for the model (``DATASHEETS``, matched by name). ``source`` says which each came from.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mlatune.arch import DeviceInfo, vendor_of


@dataclass(frozen=True)
class Hardware:
    """One GPU model's speed-deciding figures; None where nothing says."""

    name: str
    arch: str
    sm_count: int
    memory_bytes: int = 0
    bandwidth_gbs: float | None = None  # peak DRAM bandwidth, GB/s
    tensor_tflops: float | None = None  # dense 16-bit tensor throughput, TFLOP/s
    sm_clock_mhz: float | None = None  # the SMs' highest clock
    memory_clock_mhz: float | None = None
    l2_bytes: int | None = None
    measured_bandwidth_gbs: float | None = None  # a device-to-device copy, read + write
    source: Mapping[str, str] = field(default_factory=dict)  # figure -> where it came from

    def as_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v not in (None, {})},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any] | None) -> Hardware | None:
        """A recorded ``as_json``; None for nothing recorded or an unreadable record."""
        if not text:
            return None
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
            known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            return cls(**known)
        except (TypeError, ValueError, RecursionError):
            return None


@dataclass(frozen=True)
class Datasheet:
    """A model's published figures (dense 16-bit tensor TFLOP/s, peak GB/s, SMs, boost MHz)."""

    pattern: str  # a regular expression over the device name, lower case
    sm_count: int
    bandwidth_gbs: float
    tensor_tflops: float
    sm_clock_mhz: float


# NVIDIA's datasheets; the first match wins, so narrower names come first.
DATASHEETS: tuple[Datasheet, ...] = (
    Datasheet(r"h100.*pcie", 114, 2000.0, 756.0, 1755.0),
    Datasheet(r"h100.*nvl", 132, 3900.0, 835.0, 1785.0),
    Datasheet(r"gh200.*(144|hbm3e)", 132, 4900.0, 989.0, 1980.0),
    Datasheet(r"gh200", 132, 4000.0, 989.0, 1980.0),
    Datasheet(r"h200", 132, 4800.0, 989.0, 1980.0),
    Datasheet(r"h800", 132, 3350.0, 989.0, 1980.0),
    Datasheet(r"h20\b", 78, 4000.0, 148.0, 1980.0),
    Datasheet(r"h100", 132, 3350.0, 989.0, 1980.0),  # SXM5 80GB HBM3
)


def datasheet(name: str) -> Datasheet | None:
    """The datasheet whose pattern the device name matches; None for a model not listed."""
    lowered = name.lower()
    return next((d for d in DATASHEETS if re.search(d.pattern, lowered)), None)


def of_device(device: DeviceInfo, measured_bandwidth_gbs: float | None = None) -> Hardware:
    """``device``'s figures: read where this process can (a GPU it holds), else from its
    datasheet."""
    read = _read_properties(device) if device.is_gpu and device.index >= 0 else {}
    sheet = datasheet(device.name)
    source = {k: "read" for k in read}
    figures: dict[str, Any] = dict(read)
    if sheet is not None:
        for key in ("bandwidth_gbs", "tensor_tflops", "sm_clock_mhz"):
            if figures.get(key) is None:
                figures[key] = getattr(sheet, key)
                source[key] = "datasheet"
    if measured_bandwidth_gbs:
        figures["measured_bandwidth_gbs"] = round(measured_bandwidth_gbs, 1)
        source["measured_bandwidth_gbs"] = "measured"
    return Hardware(device.name, device.arch, device.cu_count, device.memory_bytes,
                    source=source, **figures)


def described(name: str, arch: str, sm_count: int) -> Hardware:
    """A GPU this process does not hold, by its name and SM count (its datasheet's figures)."""
    return of_device(DeviceInfo(arch, name, vendor_of(arch), int(sm_count or 0), 0, -1))


def recorded(provenance: list[Mapping[str, Any]], name: str, arch: str, sm_count: int
             ) -> Hardware:
    """The figures a table's provenance records for its device, else its datasheet's."""
    for record in provenance:
        found = Hardware.from_json(record.get("hardware"))
        if found is not None:
            return found
    return described(name, arch, sm_count)


def _read_properties(device: DeviceInfo) -> dict[str, Any]:
    """What torch's device properties and nvidia-smi say; {} where neither answers."""
    found: dict[str, Any] = {}
    try:
        import torch

        props = torch.cuda.get_device_properties(max(device.index, 0))
        l2 = getattr(props, "L2_cache_size", None)
        if l2:
            found["l2_bytes"] = int(l2)
        clock_khz = getattr(props, "memory_clock_rate", None)
        bus_bits = getattr(props, "memory_bus_width", None)
        if clock_khz and bus_bits:  # double data rate: two transfers a clock
            found["memory_clock_mhz"] = clock_khz / 1000
            found["bandwidth_gbs"] = round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, 1)
        sm_khz = getattr(props, "clock_rate", None)
        if sm_khz:
            found["sm_clock_mhz"] = sm_khz / 1000
        uuid = str(getattr(props, "uuid", "") or "")
    except Exception:  # properties differ across torch versions and builds: figures stay unknown
        uuid = ""
    if "sm_clock_mhz" not in found or "memory_clock_mhz" not in found:
        found.update({k: v for k, v in _smi_clocks(uuid).items() if k not in found})
    return found


def _smi_clocks(uuid: str) -> dict[str, float]:
    """The highest SM and memory clocks nvidia-smi reports for the GPU of ``uuid`` (torch's
    index is relative to CUDA_VISIBLE_DEVICES, nvidia-smi's not); {} without either."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not uuid:
        return {}
    gpu = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    try:
        text = subprocess.run(
            [smi, f"--id={gpu}", "--query-gpu=clocks.max.sm,clocks.max.memory",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True).stdout
        sm, mem = (float(v) for v in text.strip().split(","))
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
    return {"sm_clock_mhz": sm, "memory_clock_mhz": mem}


def measure_bandwidth(device: DeviceInfo, megabytes: int = 1024, reps: int = 10) -> float | None:
    """GB/s a device-to-device copy of ``megabytes`` reaches (bytes read plus written over
    the median time); None on the CPU or where the copy does not fit."""
    if not device.is_gpu:
        return None
    import torch

    try:
        n = megabytes * 2**20
        src = torch.empty(n, dtype=torch.uint8, device=device.torch_device)
        dst = torch.empty_like(src)
        times = []
        for _ in range(reps + 2):
            start, stop = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        median = sorted(times[2:])[len(times[2:]) // 2]
        del src, dst
        torch.cuda.empty_cache()
        return 2 * n / median / 1e9
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return None
