"""What every portable route asks: the capability rules, then the probe of this machine.

The rules (phase, shapes, families, what each arch's dots take, the CPU
interpreter's bf16) live in ``mlatune.capability``, which `mlatune plan` asks
too; the probe is what only the machine the route runs on can answer: whether
Triton is installed, and on the CPU whether its interpreter is switched on.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

from mlatune import capability
from mlatune.arch import DeviceInfo
from mlatune.problem import MLAProblem
from mlatune.routes.base import Verdict, no


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@cache
def triton_present() -> bool:
    """Whether triton can be imported here (asked once: an install does not change under a
    running process)."""
    return importlib.util.find_spec("triton") is not None


def ruled(route_id: str, problem: MLAProblem, device: DeviceInfo) -> Verdict:
    """The capability rules' answer for the device's arch, worded as the other routes word it."""
    ruling = capability.check(route_id, problem, device.arch)
    if not ruling:
        return no(f"rule {ruling.rule}: {ruling.reason}")
    return Verdict(True, ruling.reason)


def probe_refusal(device: DeviceInfo) -> str | None:
    """Why Triton kernels cannot run on this machine's ``device``, or None."""
    if not triton_present():
        return "triton is not installed"
    if device.vendor == "cpu" and not interpreter_enabled():
        return ("Triton kernels need a GPU; on the CPU set TRITON_INTERPRET=1 before "
                "importing mlatune to run them in the interpreter")
    return None


def triton_verdict(route_id: str, problem: MLAProblem, device: DeviceInfo) -> Verdict:
    """A Triton route's ``supports``: the probe of this machine, then the capability rules."""
    refusal = probe_refusal(device)
    return no(refusal) if refusal else ruled(route_id, problem, device)
