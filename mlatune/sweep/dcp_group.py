"""One rank of the DCP stage's group: real DCP steps measured across processes.

Started by ``mlatune sweep --gpus N`` (``mlatune.sweep.dcp_stage``) or by hand under
torchrun over a finished sweep's journal::

    torchrun --nproc_per_node 2 -m mlatune.sweep.dcp_group --journal runs/h200-sm_90.journal.jsonl

Every rank makes the same seeded inputs as the sweep's workers (``worker._ProblemCache``:
both input families, the last case the one timed), keeps its own heads' queries and
its round-robin KV shard, and runs the step of ``mlatune.dcp``. Per task: poisoned
outputs, the step, each rank's heads checked against the unsharded reference (every
rank must pass); then the whole step (q all-gather, attention, exchange and correction;
the per-step plan left out, as ``time_us`` is a launch's) and the attention alone, each
the slowest rank's median: eagerly, or with ``--graph`` (``Settings.graph``; NCCL only)
each captured in a CUDA graph whose replay is checked again and timed
(``mlatune.sweep.dcp_graph``; the record's ``timer`` says which). Rank 0 reports: events
and results to ``--results`` for the sweep, or records straight into ``--journal`` by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mlatune import routes
from mlatune.check.accuracy import check
from mlatune.check.inputs import poison_
from mlatune.dcp import DcpStep, local_heads, prepare_dcp_step, time_slowest
from mlatune.measure import timers
from mlatune.measure.records import Record
from mlatune.sweep import dcp_graph, dcp_stage, worker
from mlatune.sweep import journal as journals
from mlatune.sweep.candidates import problem_seed
from mlatune.sweep.dcp_stage import DcpTask, Settings
from mlatune.sweep.journal import Journal
from mlatune.sweep.spec import DEFAULT_DCP_TOP_K

Emit = Callable[[dict[str, Any]], None]


def measure(task: DcpTask, settings: Settings, device: torch.device,
            cache: worker._ProblemCache, inputs_ready: Callable[[], None]) -> dict[str, Any]:
    """This rank's part of one task; every rank returns the same result fields."""
    problem = task.problem
    cases = cache.get(problem, problem_seed(settings.seed, problem), device)
    inputs_ready()
    errors: dict[str, float | None] = {}
    for case in cases:
        step, error = _prepared(task, case)
        failed = _first_failure(error)
        if failed:
            return {"status": "crashed", "reason": failed, **worker.worst(errors)}
        assert step is not None
        checked, failed = _checked(step, step, task, case, settings)
        errors = worker.worst(errors, checked)
        if failed:
            return {"status": "rejected_accuracy", "reason": f"{case.name}, {failed}",
                    **errors}
    timed = _timed(step, task, case, settings, device)
    return {"status": "ok", "reason": "", **errors, **timed}


def _checked(run: Callable[[], object], step: DcpStep, task: DcpTask, case: worker._Case,
             settings: Settings) -> tuple[dict[str, float | None], str]:
    """Poisoned outputs, then ``run`` (the step, or its graph's replay), every rank's heads
    checked against the unsharded reference: the worst errors over the ranks, and the
    first failing rank's reason ("" when every rank passes)."""
    problem = task.problem
    poison_(step.out, step.lse, step.prepared.out, step.prepared.lse)
    run()
    mine = local_heads(dist.get_rank(), problem.num_heads)
    acc = check(problem, step.out, case.ref[0][:, mine], step.lse, case.ref[1][:, mine],
                settings.tolerances,
                rounding=routes.rounding(routes.get(task.candidate.route_id), problem,
                                         task.candidate.params))
    verdicts = _gathered((acc.ok, acc.reason, worker.errors_of(acc)))
    errors = worker.worst(*(v[2] for v in verdicts))
    bad = [(rank, v[1]) for rank, v in enumerate(verdicts) if not v[0]]
    return errors, f"rank {bad[0][0]}: {bad[0][1]}" if bad else ""


def _prepared(task: DcpTask, case: worker._Case) -> tuple[DcpStep | None, str]:
    """This rank's step over the case's inputs, or why it could not be prepared (no
    collective runs before every rank has said)."""
    inputs, rank = case.inputs, dist.get_rank()
    q_local = inputs.q[:, local_heads(rank, task.problem.num_heads)].contiguous()
    try:
        step = prepare_dcp_step(routes.get(task.candidate.route_id), task.problem, q_local,
                                inputs.shards[rank], inputs.seq_lens, scheme=task.scheme,
                                params=task.candidate.params, q_scale=inputs.q_scale,
                                kv_scale=inputs.kv_scale, softmax_scale=inputs.sm_scale)
        return step, ""
    except Exception as exc:
        return None, worker.raised(exc)


def _timed(step: DcpStep, task: DcpTask, case: worker._Case, settings: Settings,
           device: torch.device) -> dict[str, Any]:
    """The step and the attention alone, each the slowest rank's median; ``time_us`` is the
    step's, ``comm_us`` what the collectives and the correction add to the attention. From
    CUDA graphs with ``settings.graph`` where the route's launch is graph-safe (the
    replay checked first: a wrong one rejects the task), else eagerly."""
    budget = timers.Budget(**settings.budget)
    reps = max(1, min(max(budget.min_reps, 20), budget.max_reps))
    if settings.graph and dcp_graph.capturable(step):
        graphs, error = _captured(step)
        failed = _first_failure(error)
        if failed:
            return {"status": "crashed", "reason": f"CUDA-graph capture: {failed}"}
        step_graph, attention_graph = graphs
        errors, failed = _checked(step_graph.replay, step, task, case, settings)
        if failed:
            return {"status": "rejected_accuracy", "reason": f"CUDA-graph replay, {failed}",
                    **errors}
        step_us = dcp_graph.time_replay(step_graph, device, reps, budget.warmup)
        attention_us = dcp_graph.time_replay(attention_graph, device, reps, budget.warmup)
        timer = dcp_graph.GRAPH_TIMER
    else:
        step_us = time_slowest(lambda: step(plan=False), device, reps, budget.warmup)
        attention_us = time_slowest(step.prepared.run, device, reps, budget.warmup)
        timer = dcp_graph.EAGER_TIMERS[device.type]
    timing = timers.Timing(step_us, float("nan"), float("nan"), reps, timer)
    return {**worker._timing_fields(task.problem, timing),
            "comm_us": max(0.0, step_us - attention_us)}


def _captured(step: DcpStep) -> tuple[tuple[Any, Any], str]:
    """The whole step's graph and the attention's alone, or why capturing failed."""
    try:
        return (dcp_graph.capture(lambda: step(plan=False)),
                dcp_graph.capture(step.prepared.run)), ""
    except Exception as exc:
        return (None, None), worker.raised(exc)


def _gathered(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _first_failure(error: str) -> str:
    """The first rank's error, on every rank ("" when none failed)."""
    failed = [(rank, e) for rank, e in enumerate(_gathered(error)) if e]
    return f"rank {failed[0][0]}: {failed[0][1]}" if failed else ""


def _exit_with_parent() -> None:
    """Leave as soon as this rank's parent (the sweep, or torchrun) dies: the rank of a
    killed sweep must not hold its GPU, nor wait forever in a collective."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def run_tasks(tasks: list[DcpTask], settings: Settings, device: torch.device,
              emit_event: Emit, emit_record: Callable[[Record], None]) -> None:
    """Every task in order, in lockstep on every rank; rank 0 emits."""
    rank = dist.get_rank()
    cache = worker._ProblemCache()
    say = emit_event if rank == 0 else (lambda event: None)
    say({"event": "ready"})
    for task in tasks:
        try:
            result = measure(task, settings, device, cache,
                             lambda task=task: say({"event": "inputs", "id": task.id}))
        except Exception as exc:  # mid-collective: the group cannot go on together
            print(f"mlatune dcp rank {rank}: {worker.raised(exc)}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        if rank == 0:
            say({"event": "result", "id": task.id, "result": result})
            emit_record(task.record(**result))


def _appender(path: Path) -> Emit:
    def emit(obj: dict[str, Any]) -> None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(obj, allow_nan=True) + "\n")

    return emit


def _journal_tasks(args: argparse.Namespace, header: journals.JournalHeader,
                   records: list[Record], world: int) -> tuple[Settings, list[DcpTask]]:
    """By hand: the tasks of a sweep's journal not yet done there, for a group of ``world``."""
    from mlatune.sweep import spec as specs  # tomllib: in the group worker only

    spec = specs.load(args.spec or header.spec, gpu=header.vendor != "cpu")
    if not args.spec and spec.sha256 != header.spec_sha256:
        raise SystemExit(f"{header.spec} changed since the sweep: pass --spec")
    done = {r.id for r in records}
    top_k = spec.dcp_top_k if args.top_k is None else args.top_k
    tasks = [t for t in dcp_stage.plan(records, [world], top_k) if t.id not in done]
    return Settings.of(spec, graph=args.graph), tasks


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", help="the sweep's task file (with --results)")
    parser.add_argument("--results", help="where rank 0 appends events and results")
    parser.add_argument("--journal", help="by hand: a finished sweep's journal; results are "
                                          "appended to it")
    parser.add_argument("--spec", help="with --journal: the spec, if not the header's")
    parser.add_argument("--top-k", type=int, default=None,
                        help="with --journal: routes measured per problem, fastest simulated "
                             f"first (default: the spec's dcp_top_k, else {DEFAULT_DCP_TOP_K})")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--graph", action="store_true",
                        help="with --journal: time each step from a CUDA graph (NCCL only)")
    args = parser.parse_args(argv)
    if bool(args.tasks) == bool(args.journal) or bool(args.tasks) != bool(args.results):
        parser.error("pass --tasks and --results, or --journal")
    if args.graph and dcp_graph.refusal(torch.device(args.device), _backend(args.device)):
        parser.error(dcp_graph.REFUSAL)
    _exit_with_parent()
    device = _device(args.device)
    dist.init_process_group(_backend(device.type))
    try:
        if args.tasks:
            settings, tasks = dcp_stage.read_tasks(Path(args.tasks))
            if settings.graph and dcp_graph.refusal(device):
                raise SystemExit(f"mlatune dcp rank {dist.get_rank()}: {dcp_graph.REFUSAL}")
            run_tasks(tasks, settings, device, _appender(Path(args.results)), lambda r: None)
        else:
            _by_hand(args, device)
    finally:
        dist.destroy_process_group()


def _by_hand(args: argparse.Namespace, device: torch.device) -> None:
    header, records = journals.read_records(Path(args.journal))
    settings, tasks = _journal_tasks(args, header, records, dist.get_world_size())
    dist.barrier()  # every rank has read the journal before rank 0 appends to it
    journal = None
    if dist.get_rank() == 0:
        journal = Journal(Path(args.journal), header, resume=True)
        print(f"{len(tasks)} DCP task(s) for a group of {dist.get_world_size()}", flush=True)

    def record(r: Record) -> None:
        assert journal is not None
        journal.append(r)
        time_us = "" if r.time_us is None else r.time_us
        print(f"{r.status.value:>17} {r.route} {r.dcp_scheme} {time_us} {r.problem_key}",
              flush=True)

    try:
        run_tasks(tasks, settings, device, lambda event: None, record)
    finally:
        if journal is not None:
            journal.close()


if __name__ == "__main__":
    main()
