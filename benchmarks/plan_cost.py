"""What each device-planned route's per-step plan costs, alone: device time (graph replay,
cold L2) and host time per eager call.

    python benchmarks/plan_cost.py

Needs a GPU. The sweep records the same numbers per candidate (``plan_us``,
``plan_host_us``); this prints them for a few DCP verify and decode shapes at once.
"""

from __future__ import annotations

import torch

from mlatune import routes
from mlatune.arch import current_device
from mlatune.check.inputs import make_decode_inputs
from mlatune.problem import MLAProblem
from mlatune.sweep import bench

CASES = [("segmented/triton", MLAProblem(num_heads=16, qlen=3, batch=32, kv_len=8192,
                                         dcp_size=2)),
         ("segmented/triton", MLAProblem(num_heads=16, qlen=4, batch=256, kv_len=4096,
                                         dcp_size=4, page_size=16)),
         ("padded/triton", MLAProblem(num_heads=16, qlen=1, batch=256, kv_len=4096)),
         ("padded/triton", MLAProblem(num_heads=128, qlen=1, batch=128, kv_len=4096))]


def main() -> None:
    device = current_device()
    for route_id, problem in CASES:
        route = routes.get(route_id)
        params = next(p for p in route.param_space(problem, device)
                      if route.step_kind(p).plan_on == "device")
        inputs = make_decode_inputs(problem, seed=0, device="cuda")
        prepared = route.prepare(problem, inputs, params=params)
        device_us = bench.measure(prepared.plan, "cuda").median_us
        host_us = bench.host_us(prepared.plan, "cuda", reps=200)
        print(f"{route_id:17s} {problem.key}: plan {device_us:6.1f} us on the device, "
              f"{host_us:6.1f} us of host time", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
