"""What a sweep worker process does with one candidate: check it, then time it.

Workers receive plain data (a problem as a dict, a route id, parameters, a
seed), never tensors, and make their own inputs, as PyTorch Inductor's
autotune workers do. The last problem's inputs and reference stay cached, so a
problem's candidates share them. A CUDA error can poison the whole context:
after one the worker asks to be replaced.
"""

from __future__ import annotations

import json
import math
import traceback
from typing import Any

import torch

from mlatune import bench, reference, routes
from mlatune.accuracy import check
from mlatune.inputs import make_inputs, poison_
from mlatune.merge import merge_ranks_into
from mlatune.problem import MLAProblem


class _ProblemCache:
    def __init__(self):
        self.key: tuple | None = None
        self.inputs = None
        self.ref: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, problem: MLAProblem, seed: int, device: torch.device):
        if self.key != (problem.key, seed):
            self.inputs = self.ref = None  # free the previous problem's memory first
            self.inputs = make_inputs(problem, seed, device)
            self.ref = reference.run(self.inputs)
            self.key = (problem.key, seed)
        return self.inputs, self.ref


def evaluate(task: dict[str, Any], device: torch.device, cache: _ProblemCache) -> dict[str, Any]:
    """Run one candidate; return its result fields (status, reason, timing, errors)."""
    problem = MLAProblem(**task["problem"])
    route = routes.get(task["route"])
    params = task["params"]
    try:
        inputs, (ref_out, ref_lse) = cache.get(problem, task["seed"], device)
        ranks = range(problem.dcp_size) if problem.phase == "decode" else range(1)
        want_lse = problem.dcp_size > 1
        prepared = [route.prepare(problem, inputs, rank=r, params=params, want_lse=want_lse)
                    for r in ranks]
        for p in prepared:
            poison_(p.out, p.lse)
        for p in prepared:
            p.run()
        _sync(device)
        if want_lse:
            # Ranks' partials stacked as a DCP all-to-all would deliver them.
            outs = torch.stack([p.out for p in prepared])
            lses = torch.stack([p.lse for p in prepared])
            out = torch.empty_like(prepared[0].out)
            lse = torch.empty_like(prepared[0].lse)
            merge_ranks_into(outs, lses, out, lse)
        else:
            out, lse = prepared[0].out, prepared[0].lse
        acc = check(problem, out, ref_out, lse, ref_lse if lse is not None else None,
                    task.get("tolerances"))
        errors = {"rel_err": acc.rel_l2, "max_abs_err": acc.max_abs}
        if not acc.ok:
            return {"status": "rejected_accuracy", "reason": acc.reason, **errors}

        first = prepared[0]
        if want_lse:
            # One rank's attention over the busiest shard (rank 0), its partial written
            # into the stack (the all-to-all's place), and the merge of all ranks.
            def step() -> None:
                first.run()
                outs[0].copy_(first.out)
                lses[0].copy_(first.lse)
                merge_ranks_into(outs, lses, out, lse)
        else:
            step = first.run
        timing = bench.measure(step, device, bench.Budget(**task["budget"]),
                               graph_safe=all(p.graph_safe for p in prepared))
        # What the route reports it ran with (a backend it picked, a plan) joins the params.
        ran_with = json.dumps({**params, **prepared[0].params}, sort_keys=True, default=str)
        return {"status": "ok", "reason": "", "route_params": ran_with, **errors,
                **_timing_fields(problem, timing)}
    except Exception as exc:
        restart = not _context_healthy(device)
        where = traceback.extract_tb(exc.__traceback__)[-1]
        reason = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}" \
                 f" (at {where.name}:{where.lineno})"
        return {"status": "crashed", "reason": reason[:500], "restart": restart}


def _timing_fields(problem: MLAProblem, t: bench.Timing) -> dict[str, Any]:
    seconds = t.median_us * 1e-6
    return {
        "time_us": t.median_us,
        "time_us_p20": t.p20_us,
        "time_us_p80": t.p80_us,
        "timer": t.timer,
        "reps": t.reps,
        "tb_per_s": problem.min_bytes() / seconds / 1e12 if seconds > 0 else math.nan,
        "tflops": problem.flops() / seconds / 1e12 if seconds > 0 else math.nan,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _context_healthy(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return True
    except Exception:
        return False


def serve(conn, device_str: str) -> None:
    """Worker main loop: answer tasks until told to stop or the context is lost."""
    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cache = _ProblemCache()
    conn.send({"ready": True})
    while True:
        task = conn.recv()
        if task is None:
            return
        result = evaluate(task, device, cache)
        conn.send(result)
        if result.get("restart"):
            return
