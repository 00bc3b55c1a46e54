"""Whether a table was measured in the environment that loads it.

A table's timings hold for the GPU, driver and libraries they were measured with
(its provenance, ``mlatune.table.schema.Provenance``); under another torch, Triton or
driver the fastest route may change. ``Dispatcher.load`` compares the table's
provenance with the running environment (``differences``) and, as FlashInfer's
autotuner does, logs a warning on the ``mlatune`` logger naming what differs
(``warn_once``), once per process for each table file and set of differences: a
second ``Dispatcher.load`` of the same table, or a repeated ``from_bundled()``, does
not warn again, while ``Dispatcher.environment_differences`` is set on every
dispatcher.

Compared: the GPU (name and SM/CU count, against the device the dispatcher serves),
the driver, torch, Triton and every other library version both sides record (aiter,
...). Not compared: mlatune's own version (each release would warn about every
bundled table, though a release rarely changes a route's speed) and Python's (the
kernels do not run in it). Nothing is compared where this process has no GPU (a CPU
device, or a GPU's ``DeviceInfo`` standing in on a machine without one: tests, CI)
nor when a table is loaded with ``allow_arch`` for another arch (planning for
another machine).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlatune.arch import DeviceInfo, driver_version, library_versions

log = logging.getLogger("mlatune")

# library_versions() entries compared through their own provenance fields, or not at all.
NOT_FROM_BACKEND_VERSIONS = ("mlatune", "python", "torch", "triton")
_WARNED: set[tuple[str, tuple[str, ...]]] = set()


@dataclass(frozen=True)
class Environment:
    """What a table's timings depend on, as this process runs."""

    device_name: str
    cu_count: int
    arch: str
    driver: str
    versions: Mapping[str, str | None] = field(default_factory=dict)  # library_versions()


def here(device: DeviceInfo) -> Environment | None:
    """The running environment around ``device``; None where there is no GPU to run on."""
    import torch

    if not device.is_gpu or not torch.cuda.is_available():
        return None
    return Environment(device.name, device.cu_count, device.arch, driver_version(),
                       _versions())


@functools.lru_cache(maxsize=1)
def _versions() -> Mapping[str, str | None]:
    # Package metadata lookups scan sys.path; the installed versions do not change
    # under a running engine, so one look per process.
    return library_versions()


def differences(provenance: Sequence[Mapping[str, Any]], table_device: tuple[str, str, int],
                running: Environment) -> list[str]:
    """What differs between where a table's device rows were measured and ``running``,
    one phrase each ("torch: table 2.11.0+cu130, running 2.13.0"); [] when nothing does.
    A field the table does not record (no provenance, a library it did not list) is
    not a difference."""
    found = []
    _, name, cu_count = table_device
    if (name, cu_count) != (running.device_name, running.cu_count):
        unit = _cu_unit(running.arch)
        found.append(f"device: table {name} ({cu_count} {unit}), running "
                     f"{running.device_name} ({running.cu_count} {unit})")
    for label, theirs, ours in _compared(provenance, running):
        if theirs != {ours}:
            found.append(f"{label}: table {', '.join(sorted(theirs))}, running {ours}")
    return found


def _compared(provenance: Sequence[Mapping[str, Any]], running: Environment
              ) -> Iterator[tuple[str, set[str], str]]:
    """(label, the table's values, the running value) of each compared field."""
    if not provenance:
        return
    yield "driver", {_text(p.get("driver")) for p in provenance}, _text(running.driver)
    yield "torch", {_text(p.get("torch_version")) for p in provenance}, \
        _text(running.versions.get("torch"))
    yield "triton", {_text(p.get("triton_version")) for p in provenance}, \
        _text(running.versions.get("triton"))
    recorded = [_backend_versions(p) for p in provenance]
    names = set(running.versions).intersection(*recorded) - set(NOT_FROM_BACKEND_VERSIONS)
    for name in sorted(names):
        yield name, {_text(r[name]) for r in recorded}, _text(running.versions[name])


def _backend_versions(record: Mapping[str, Any]) -> dict[str, Any]:
    """A provenance record's ``backend_versions`` (a JSON object); {} if unreadable."""
    try:
        parsed = json.loads(record.get("backend_versions") or "{}")
    except (TypeError, ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _text(value: Any) -> str:
    """A version as compared and shown: not installed (None or "") is "none"."""
    return "none" if value in (None, "") else str(value)


def _cu_unit(arch: str) -> str:
    return "SMs" if arch.startswith("sm_") else "CUs"


def warn_once(source: str, found: Sequence[str]) -> None:
    """Log ``found`` for the table at ``source``, unless this process already did."""
    key = (source, tuple(found))
    if not found or key in _WARNED:
        return
    _WARNED.add(key)
    log.warning("mlatune: table %s was measured in another environment (%s); its choices "
                "may not be the fastest here (sweep again to refresh it)",
                source, "; ".join(found))
