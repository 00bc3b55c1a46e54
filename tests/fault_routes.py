"""Test-only routes that misbehave in each way a real kernel can.

Loaded into sweep workers through MLATUNE_PLUGINS=tests.fault_routes. Each
delegates to the reference for its buffers, then breaks in its own way.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from mlatune.routes import YES, register, unregister
from mlatune.routes.torch_ref import TorchReferenceRoute


class _Fault(TorchReferenceRoute):
    def __init__(self, route_id: str, fault: str):
        self.id = route_id
        self.fault = fault

    def prepare(self, problem, inputs, *, rank=0, params=None, want_lse=True):
        if self.fault == "raise":
            raise RuntimeError("this route always raises")
        prepared = super().prepare(problem, inputs, rank=rank, params=params, want_lse=want_lse)
        good_run = prepared.run

        def run() -> None:
            if self.fault == "abort":
                os.abort()
            if self.fault == "killed" and _first_kill():
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or an operator would
            if self.fault == "hang":
                time.sleep(3600)
            good_run()
            if self.fault == "wrong":
                prepared.out.copy_(torch.randn_like(prepared.out, dtype=torch.float32))
            if self.fault == "slow":
                time.sleep(0.2)

        prepared.run = run
        return prepared

    def supports(self, problem, device):
        return YES


FAULT_ROUTES = [_Fault(f"fault-{f}/test", f)
                for f in ("abort", "hang", "wrong", "raise", "slow", "killed")]
# fault-killed/test is killed (SIGKILL) the first time it runs while this names a file that
# does not exist yet (it is made then); without it, every time.
KILL_ONCE_ENV = "MLATUNE_TEST_KILL_ONCE"


def _first_kill() -> bool:
    mark = os.environ.get(KILL_ONCE_ENV)
    if not mark:
        return True
    try:
        Path(mark).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def register_all() -> None:
    for route in FAULT_ROUTES:
        register(route)


def unregister_all() -> None:
    for route in FAULT_ROUTES:
        unregister(route.id)


register_all()  # imported through MLATUNE_PLUGINS in sweep workers
