"""What a sweep worker process does with one candidate: check it, then time it.

Workers receive plain data (a problem as a dict, a route id, parameters, a
seed), never tensors, and make their own inputs, as PyTorch Inductor's
autotune workers do. The last problem's inputs and references stay cached, so
a problem's candidates share them. A candidate is checked on both input
families (``mlatune.check.inputs``): model-like inputs (outlier channels, heavy
tails, a few keys holding the attention) on ragged lengths, where indexing bugs
show, then standard normal inputs on the uniform lengths it is then timed on; its
record keeps the worse error of the two. A CUDA error can poison the whole
context: after one the worker asks to be replaced.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from mlatune import routes
from mlatune.check import reference
from mlatune.check.accuracy import Accuracy, check
from mlatune.check.inputs import (
    DecodeInputs,
    PrefillInputs,
    make_inputs,
    make_model_like_inputs,
    poison_,
)
from mlatune.dcp import merge_ranks_into
from mlatune.measure import timers
from mlatune.measure.records import Result, Status, Task, step_cost_of
from mlatune.problem import MLAProblem
from mlatune.routes import Prepared, Route

_MODEL_LIKE_SEED_OFFSET = 7919
# A problem's cases in the order checked, each (its name, which a rejection's reason starts
# with; its seed's offset; its inputs (problem, seed, device)): the first alone when
# compiling ahead, the last timed.
_CASES: tuple[tuple[str, int, Callable[..., DecodeInputs | PrefillInputs]], ...] = (
    ("model-like inputs, ragged lengths", _MODEL_LIKE_SEED_OFFSET, make_model_like_inputs),
    ("normal inputs, uniform lengths", 0, make_inputs),
)
ERRORS = ("rel_err", "max_abs_err", "lse_err")  # a check's errors, as a record names them


@dataclass
class _Case:
    name: str  # its input family and lengths (_CASES), as a rejection's reason names it
    inputs: DecodeInputs | PrefillInputs
    ref: tuple[torch.Tensor, torch.Tensor]


class _ProblemCache:
    """The current problem's cases (inputs and references), shared by its candidates. Where
    all of them would not fit beside a route's own buffers (a share of the GPU's memory), it
    holds one case at a time and makes the others again when asked."""

    def __init__(self):
        self.key: tuple | None = None
        self.cases: dict[int, _Case] = {}
        self.lean = False  # one case at a time
        self.best_us = math.inf  # the problem's fastest candidate so far (for racing)

    def holds(self, problem: MLAProblem, seed: int, ragged_only: bool = False) -> bool:
        return self.key == (problem.key, seed, ragged_only) and 0 in self.cases

    def count(self, ragged_only: bool = False) -> int:
        return 1 if ragged_only else len(_CASES)

    def get(self, problem: MLAProblem, seed: int, device: torch.device) -> list[_Case]:
        """Every case at once (a DCP group's ranks hold them together)."""
        return [self.case(problem, seed, device, i) for i in range(self.count())]

    def case(self, problem: MLAProblem, seed: int, device: torch.device, index: int,
             ragged_only: bool = False) -> _Case:
        """``_CASES[index]``'s inputs with their reference (the last is timed; the first
        alone when compiling ahead)."""
        key = (problem.key, seed, ragged_only)
        if self.key != key:
            self.cases, self.key, self.lean = {}, key, False  # the last problem's memory first
            self.best_us = math.inf
        if index not in self.cases:
            if self.lean:
                self.cases.clear()
            if device.type == "cuda":
                # Graphs of the last candidates are gone; give their memory back.
                torch.cuda.empty_cache()
            name, offset, make = _CASES[index]
            inputs = make(problem, seed + offset, device)
            self.cases[index] = _Case(name, inputs, reference.run(inputs))
            self.lean = self.lean or _too_big(inputs, self.count(ragged_only), device)
        return self.cases[index]


# The share of a GPU's memory that a problem's cases may hold together: the rest is the
# route's (a plan, a gathered copy of a shard, CUDA graphs).
CASES_SHARE = 0.3


def _too_big(inputs: DecodeInputs | PrefillInputs, cases: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    total = torch.cuda.get_device_properties(device).total_memory
    return cases * _nbytes(inputs) > CASES_SHARE * total


def _nbytes(value: Any) -> int:
    """The bytes of every tensor in a case's inputs (dataclasses and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return sum(_nbytes(getattr(value, f)) for f in value.__dataclass_fields__)
    return 0


@dataclass
class _Checked:
    """One checked run: every rank's prepared call and, with DCP, the merge buffers."""

    prepared: list[Prepared]
    outs: torch.Tensor | None  # (ranks, T, H, D) partials, DCP only
    lses: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor | None


def _run_checked(problem: MLAProblem, route: Route, params: dict, case: _Case,
                 device: torch.device, want_lse: bool = False) -> _Checked:
    """The route's output (and LSE, with ``want_lse`` or DCP, whose merge needs it) on a case,
    into poisoned buffers; DCP ranks' partials merged."""
    ranks = range(problem.dcp_size) if problem.phase == "decode" else range(1)
    want_lse = want_lse or problem.dcp_size > 1
    prepared = [route.prepare(problem, case.inputs, rank=r, params=params, want_lse=want_lse)
                for r in ranks]
    for p in prepared:
        poison_(p.out, p.lse)
    for p in prepared:
        p.step()  # as an engine's step: the per-step plan, then the launch
    _sync(device)
    if problem.dcp_size == 1:  # nothing to merge (a route may return no LSE: sdpa)
        return _Checked(prepared, None, None, prepared[0].out, prepared[0].lse)
    # Ranks' partials stacked as a DCP all-to-all would deliver them, merged into
    # poisoned buffers so that an element the merge misses is caught too.
    outs = torch.stack([p.out for p in prepared])
    lses = torch.stack([p.lse for p in prepared])
    out = torch.empty_like(prepared[0].out)
    lse = torch.empty_like(prepared[0].lse)
    poison_(out, lse)
    merge_ranks_into(outs, lses, out, lse)
    _sync(device)
    return _Checked(prepared, outs, lses, out, lse)


def evaluate(data: dict[str, Any], device: torch.device, cache: _ProblemCache,
             inputs_ready: Callable[[], None] = lambda: None) -> Result:
    """Run one candidate (a ``Task`` as JSON); return what it measured (status, reason,
    timing, errors, where the time went).

    ``inputs_ready`` is called once inputs and references exist, so that the
    caller's timeout covers the route and not the setup.
    """
    task = Task.from_json(data)
    problem, route, params = task.problem, routes.get(task.route), task.params
    # Where the worker's time goes (journaled): inputs and references, the first check (and
    # the kernels it compiles), the second check, timing.
    spent = {"setup_s": 0.0, "first_check_s": 0.0, "check_s": 0.0, "bench_s": 0.0}
    clock = time.perf_counter()

    def lap(part: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        spent[part] += now - clock
        clock = now

    try:
        check_only = task.check_only
        made_here = not cache.holds(problem, task.seed, check_only)
        cases = cache.count(check_only)
        cache.case(problem, task.seed, device, 0, ragged_only=check_only)
        lap("setup_s" if made_here else "first_check_s")
        inputs_ready()
        errors = []
        for index in range(cases):
            checked = case = None  # the last case's tensors go before a lean cache makes this one
            case = cache.case(problem, task.seed, device, index, ragged_only=check_only)
            # LSE too on every case but the timed one (the last): the table holds its error
            checked = _run_checked(problem, route, params, case, device, index < cases - 1)
            ref_out, ref_lse = case.ref
            acc = check(problem, checked.out, ref_out, checked.lse,
                        ref_lse if checked.lse is not None else None, task.tolerances,
                        rounding=routes.rounding(route, problem, params))
            errors.append(errors_of(acc))
            lap("first_check_s" if index == 0 else "check_s")
            if not acc.ok:
                return Result(status=Status.REJECTED_ACCURACY,
                              reason=f"{case.name}: {acc.reason}", **worst(*errors),
                              **spent)
            if check_only:  # compiling ahead: the kernels exist now
                return Result(status=Status.CHECKED, **worst(*errors), **spent)
        fields = _bench(problem, route, params, case, checked, device,
                        timers.Budget(**task.budget), cache)
        lap("bench_s")
        return Result(status=Status.OK, **worst(*errors), **fields, **spent)
    except Exception as exc:
        restart = not _context_healthy(device)
        return Result(status=Status.CRASHED, reason=raised(exc), restart=restart, **spent)


def _bench(problem: MLAProblem, route: Route, params: dict, case: _Case, checked: _Checked,
           device: torch.device, budget: timers.Budget, cache: _ProblemCache
           ) -> dict[str, Any]:
    """The checked run timed: a record's timing fields, step costs and the parameters the
    route ran with."""
    timing = timers.measure(_timed_step(checked), device, budget,
                           graph_safe=all(p.graph_safe for p in checked.prepared),
                           best_us=cache.best_us)
    step_costs = _step_costs(problem, route, params, case, checked.prepared[0], timing,
                             device, budget)
    costs = Result(status=Status.OK, time_us=timing.median_us, **step_costs)
    cache.best_us = min(cache.best_us, step_cost_of(costs, route.id))
    # What the route reports it ran with (a backend it picked, a plan) joins the params.
    ran_with = json.dumps({**params, **checked.prepared[0].params}, sort_keys=True, default=str)
    return {"route_params": ran_with, **_timing_fields(problem, timing), **step_costs}


def errors_of(acc: Accuracy) -> dict[str, float]:
    """One check's errors, named as a record's fields (``lse_err`` NaN: no LSE returned)."""
    return {"rel_err": acc.rel_l2, "max_abs_err": acc.max_abs, "lse_err": acc.lse_max_abs}


def worst(*checks: Mapping[str, float | None]) -> dict[str, float | None]:
    """Each error's largest over the checks, as a record's fields: NaN or None (not
    measured) counts as none, and an error no check measured is None."""
    out: dict[str, float | None] = {}
    for name in ERRORS:
        measured = [e[name] for e in checks if e.get(name) is not None
                    and not math.isnan(e[name])]
        out[name] = max(measured) if measured else None
    return out


def raised(exc: BaseException) -> str:
    """A crashed candidate's reason: the exception's first line and where it was raised."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    reason = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}" \
             f" (at {where.name}:{where.lineno})"
    return reason[:500]


def _timed_step(checked: _Checked) -> Callable[[], None]:
    """What a DCP rank does per call: attention over the busiest shard (rank 0), its
    partial written into the stack (the all-to-all's place), and the merge of all
    ranks. Without DCP, the route's call alone."""
    first = checked.prepared[0]
    if checked.outs is None:
        return first.run
    outs, lses, out, lse = checked.outs, checked.lses, checked.out, checked.lse

    def step() -> None:
        first.run()
        outs[0].copy_(first.out)
        lses[0].copy_(first.lse)
        merge_ranks_into(outs, lses, out, lse)

    return step


def _step_costs(problem: MLAProblem, route: Route, params: dict, case: _Case,
                first: Prepared, timing: timers.Timing, device: torch.device,
                budget: timers.Budget) -> dict[str, Any]:
    """What an engine's step costs beyond the launch's device time (schema v2's columns).

    A device plan is timed like the launch (graph replay when capturable); its host
    cost and the launch's are eager calls' wall time. A host plan is a whole prepare
    again, device sync included: its time is ``plan_host_us`` and ``plan_us`` is 0.
    """
    kind = first.step_kind
    plan_us = plan_host_us = 0.0
    if kind.plan_on == "device":
        plan_us = timers.measure(first.plan, device, replace(budget, race_ratio=0.0),
                                graph_safe=kind.capturable).median_us
        plan_host_us = timers.host_us(first.plan, device, device_us=plan_us, warm=True)
    elif kind.plan_on == "host":
        want_lse = first.lse is not None

        def prepare_again() -> None:
            route.prepare(problem, case.inputs, rank=0, params=params, want_lse=want_lse)
            _sync(device)

        plan_host_us = timers.host_us(prepare_again, device, reps=3)
    # A launch that failed to capture is timed eagerly: not capturable after all.
    capturable = kind.capturable and timing.timer != "cuda_event"
    # Without a GPU the launch's wall time is its host time: no need to run it again.
    launch_host_us = (timing.median_us if timing.timer == "wall" else
                      timers.host_us(first.run, device, device_us=timing.median_us, warm=True))
    return {"plan_on": kind.plan_on, "capturable": capturable, "plan_us": plan_us,
            "plan_host_us": plan_host_us, "launch_host_us": launch_host_us}


def _timing_fields(problem: MLAProblem, t: timers.Timing) -> dict[str, Any]:
    seconds = t.median_us * 1e-6
    return {
        "time_us": t.median_us,
        "time_us_p20": t.p20_us,
        "time_us_p80": t.p80_us,
        "timer": t.timer,
        "reps": t.reps,
        "raced": t.raced,
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
    """Worker main loop: answer tasks until told to stop or the context is lost.

    Per task it sends {"inputs_ready": True} once its inputs exist, then the result.
    """
    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cache = _ProblemCache()
    try:
        conn.send({"ready": True})
        while True:
            task = conn.recv()
            if task is None:
                return
            result = evaluate(task, device, cache, lambda: conn.send({"inputs_ready": True}))
            conn.send(result.to_json())
            if result.restart:
                return
    except (EOFError, ConnectionError):  # the sweep is gone (killed): no one to answer
        return
