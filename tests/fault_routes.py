"""Test-only routes that misbehave in each way a real kernel can.

Loaded into sweep workers through MLATUNE_PLUGINS=tests.fault_routes. Each
delegates to the reference for its buffers, then breaks in its own way.
"""

from __future__ import annotations

import os
import time

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


FAULT_ROUTES = [_Fault(f"fault-{f}/test", f) for f in ("abort", "hang", "wrong", "raise", "slow")]


def register_all() -> None:
    for route in FAULT_ROUTES:
        register(route)


def unregister_all() -> None:
    for route in FAULT_ROUTES:
        unregister(route.id)


register_all()  # imported through MLATUNE_PLUGINS in sweep workers
