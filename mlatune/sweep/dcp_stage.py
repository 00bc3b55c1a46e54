"""The sweep's DCP stage: DCP problems measured for real across a group of processes.

The one-GPU pass times a DCP problem as a simulation (rank 0's attention plus the LSE
merge of every rank's partials, ``worker._timed_step``). Once it is done and the sweep
has at least ``dcp_size`` GPUs, this stage measures the real step (``mlatune.dcp``: q
all-gather, attention on the rank's round-robin shard, output and LSE exchange) in a
group of ``dcp_size`` processes (``mlatune.sweep.dcp_group``, started here with torchrun's
environment variables; NCCL on GPUs, gloo on the CPU). To bound the GPU time only each
problem's ``top_k`` routes by simulated step time run, with the parameters of their best
simulated run, once per scheme.

Each result is journaled as it arrives (the group's rank 0 writes it to a results file
this process reads), so a killed sweep resumes losing only the task in flight. A group
that dies scores its task ``crashed``, one that overruns the timeout is killed and scores
``timeout``; a new group takes the remaining tasks. The environment passes through
unchanged: whatever NCCL_* variables the machine sets stay set.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mlatune.dcp import SCHEMES
from mlatune.measure.records import Record, Status, as_record
from mlatune.problem import MLAProblem
from mlatune.sweep.candidates import Candidate
from mlatune.sweep.dcp_graph import REFUSAL
from mlatune.sweep.journal import Journal
from mlatune.sweep.pool import SETUP_TIMEOUT_S, WORKER_START_TIMEOUT_S
from mlatune.sweep.progress import Observer
from mlatune.sweep.spec import DEFAULT_DCP_TOP_K, SweepSpec
from mlatune.table.schema import DCP_MEASURED

log = logging.getLogger(__name__)

# The simulated run's step fields a measured record keeps (the route's per-step plan).
_STEP_FIELDS = ("plan_on", "capturable", "plan_us", "plan_host_us", "launch_host_us")
_POLL_S = 0.05


@dataclass(frozen=True)
class DcpTask:
    """One route with its best simulated parameters, on one DCP problem, in one scheme."""

    candidate: Candidate
    scheme: str
    simulated: dict[str, Any]  # simulated_us and the simulated run's step fields

    @property
    def id(self) -> str:
        text = f"{self.candidate.id}#dcp-{DCP_MEASURED}#{self.scheme}"
        return hashlib.sha1(text.encode()).hexdigest()[:20]

    @property
    def problem(self) -> MLAProblem:
        return self.candidate.problem

    def record(self, **result: Any) -> Record:
        return replace(self.candidate.record(**self.simulated, **result,
                                             dcp_timing=DCP_MEASURED, dcp_scheme=self.scheme),
                       id=self.id)

    def as_json(self) -> dict[str, Any]:
        return {"problem": self.problem.as_dict(), "route": self.candidate.route_id,
                "params": self.candidate.params, "scheme": self.scheme,
                "simulated": self.simulated}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DcpTask:
        candidate = Candidate(MLAProblem(**data["problem"]), data["route"], data["params"])
        return cls(candidate, data["scheme"], data["simulated"])


def is_measured(record: Record | Mapping[str, Any]) -> bool:
    return as_record(record).measured_dcp


def plan(records: Iterable[Record], sizes: Iterable[int], top_k: int = DEFAULT_DCP_TOP_K
         ) -> list[DcpTask]:
    """The tasks for the DCP problems of ``sizes``: per problem the ``top_k`` routes with an
    ok simulated run (their runs returned an LSE: the merge needs one), fastest simulated
    step first, each with its best parameters, in every scheme."""
    wanted = set(sizes)
    best: dict[tuple[str, str], Record] = {}  # (problem key, route) -> fastest run
    for r in records:
        if not r.ok or r.measured_dcp or r.key.get("dcp_size") not in wanted \
                or r.key.get("phase") != "decode":
            continue
        pair = (r.problem_key, r.route)
        if pair not in best or r.step_us < best[pair].step_us:
            best[pair] = r
    by_problem: dict[str, list[Record]] = {}
    for (key, _), r in best.items():
        by_problem.setdefault(key, []).append(r)
    tasks = []
    for runs in by_problem.values():
        for r in sorted(runs, key=lambda r: (r.step_us, r.route))[:top_k]:
            candidate = Candidate(r.problem, r.route, json.loads(r.route_params))
            simulated = {"simulated_us": r.time_us,
                         **{f: getattr(r, f) for f in _STEP_FIELDS
                            if getattr(r, f) is not None}}
            tasks += [DcpTask(candidate, scheme, simulated) for scheme in SCHEMES]
    return tasks


@dataclass(frozen=True)
class Settings:
    """What every task of a group shares: the spec's seed, timing budget and tolerances,
    and whether steps are timed from CUDA graphs (``mlatune.sweep.dcp_graph``)."""

    seed: int
    budget: dict[str, Any]
    tolerances: dict[str, float]
    graph: bool = False  # absent from task files written before graph timing: eager

    @classmethod
    def of(cls, spec: SweepSpec, graph: bool = False) -> Settings:
        return cls(spec.seed, asdict(spec.budget), dict(spec.tolerances), graph)


def write_tasks(path: Path, settings: Settings, tasks: list[DcpTask]) -> None:
    path.write_text(json.dumps({**asdict(settings), "tasks": [t.as_json() for t in tasks]}))


def read_tasks(path: Path) -> tuple[Settings, list[DcpTask]]:
    data = json.loads(Path(path).read_text())
    tasks = [DcpTask.from_json(t) for t in data.pop("tasks")]
    return Settings(**data), tasks


class GroupStartError(RuntimeError):
    """A group that never became ready: nothing to blame on its first task."""


def run(spec: SweepSpec, journal: Journal, processes: int, *, gpu: bool,
        top_k: int = DEFAULT_DCP_TOP_K, timeout_s: float = 300.0,
        observer: Observer | None = None, graph: bool = False) -> int:
    """Measure every DCP task of the journal's records that fits in ``processes`` and is
    not journaled yet; returns how many ran. A group that will not start stops the stage
    with a warning: the one-GPU results stand. ``graph``: each step timed from a CUDA
    graph (GPUs only: ValueError, ``dcp_graph.REFUSAL``, without)."""
    if graph and not gpu:
        raise ValueError(REFUSAL)
    sizes = range(2, processes + 1)
    every = plan(journal.records, sizes, top_k)
    todo = [t for t in every if t.id not in journal.done_ids]
    if observer and every:
        observer.started(len(every), len(every) - len(todo), "DCP across processes")

    def journal_it(record: Record) -> None:
        journal.append(record)
        if observer:
            observer.finished(record)

    log_path = journal.path.with_suffix(".dcp.log")
    ran = 0
    try:
        for size in sorted({t.problem.dcp_size for t in todo}):
            group = [t for t in todo if t.problem.dcp_size == size]
            while group:
                used = _run_group(group, size, Settings.of(spec, graph), gpu=gpu,
                                  timeout_s=timeout_s, on_result=journal_it, log_path=log_path)
                ran += used
                group = group[used:]
    except GroupStartError as exc:
        log.warning("mlatune: the DCP stage stopped: %s (log: %s); DCP rows stay simulated",
                    exc, log_path)
    return ran


def rank_command(tasks: Path, results: Path, gpu: bool) -> list[str]:
    """One rank of the group, as torchrun would start it (the rank, world size and
    rendezvous come from the environment, as torchrun sets them)."""
    return [sys.executable, "-m", "mlatune.sweep.dcp_group", "--tasks", str(tasks),
            "--results", str(results), "--device", "cuda" if gpu else "cpu"]


class _Group:
    """``size`` rank processes started here, each in a session of its own (a Ctrl-C at
    the terminal reaches only the sweep, which kills them); torchrun's environment
    variables, a free port on this machine for the rendezvous."""

    def __init__(self, size: int, command: list[str], log_file):
        port = _free_port()
        self.procs = []
        for rank in range(size):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            self.procs.append(subprocess.Popen(command, env=env, stdout=log_file,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def exit_code(self) -> int | None:
        """None while every rank runs; else the first failed rank's code (0: all done)."""
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return 0 if all(c == 0 for c in codes) else None

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(tasks: list[DcpTask], size: int, settings: Settings, *, gpu: bool,
               timeout_s: float, on_result: Callable[[Record], None],
               log_path: Path) -> int:
    """Run ``tasks`` in order in one group until they are done or the group fails; the
    count that got a record (the one in flight when it failed included)."""
    with tempfile.TemporaryDirectory(prefix="mlatune-dcp-") as folder:
        tasks_path, results_path = Path(folder, "tasks.json"), Path(folder, "results.jsonl")
        write_tasks(tasks_path, settings, tasks)
        results_path.touch()
        with log_path.open("a", encoding="utf-8") as group_log:
            group_log.write(f"--- DCP group of {size}, {len(tasks)} tasks, "
                            f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
            group_log.flush()
            group = _Group(size, rank_command(tasks_path, results_path, gpu), group_log)
            # Where and when each ran, as the one-GPU pass records (bench.py sweep-cost).
            where = ",".join(f"cuda:{rank}" for rank in range(size)) if gpu else "cpu"
            try:
                return _follow(group, tasks, results_path, timeout_s,
                               _stamped(on_result, where), log_path)
            finally:
                group.kill()


def _stamped(on_result: Callable[[Record], None], device: str) -> Callable[[Record], None]:
    """``on_result`` with each record's device, finish time and seconds since the last."""
    last = time.monotonic()

    def stamp(record: Record) -> None:
        nonlocal last
        now = time.monotonic()
        on_result(replace(record, device=device, finished_at=round(time.time(), 3),
                          elapsed_s=now - last))
        last = now

    return stamp


def _follow(group: _Group, tasks: list[DcpTask], results: Path, timeout_s: float,
            on_result: Callable[[Record], None], log_path: Path) -> int:
    """Journal the group's results as they come; score the task in flight when the group
    dies or overruns its deadline."""
    done, ready = 0, False
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    lines = _Lines(results)
    while done < len(tasks):
        code = group.exit_code()  # before reading: a dead group's last lines are there
        for event in lines.new():
            if event["event"] == "ready":
                ready, deadline = True, time.monotonic() + SETUP_TIMEOUT_S
            elif event["event"] == "inputs":  # the route's own timeout from here
                deadline = time.monotonic() + timeout_s
            elif event["event"] == "result" and event["id"] == tasks[done].id:
                on_result(tasks[done].record(**event["result"]))
                done, deadline = done + 1, time.monotonic() + SETUP_TIMEOUT_S
        if done == len(tasks):
            break
        if code is not None or time.monotonic() > deadline:
            if not ready:
                raise GroupStartError(_start_failure(code))
            group.kill()
            reason = (_death_reason(code, log_path) if code is not None else
                      f"no result within the {timeout_s:g}s timeout (the group was killed)")
            status = Status.CRASHED if code is not None else Status.TIMEOUT
            on_result(tasks[done].record(status=status, reason=reason))
            return done + 1
        time.sleep(_POLL_S)
    return done


def _start_failure(code: int | None) -> str:
    if code is not None:
        return f"a rank exited with code {code} before the group was ready"
    return f"the group was not ready within {WORKER_START_TIMEOUT_S:.0f}s"


def _death_reason(code: int, log_path: Path) -> str:
    """What the group's log says about its death: a rank's own error line, else how the
    first rank to fail ended."""
    said = [line.split("mlatune dcp rank", 1)[1].strip()
            for line in _tail(log_path).splitlines() if "mlatune dcp rank" in line]
    if said:
        return f"DCP group died: rank {said[-1]}"[:500]
    if code < 0:
        return f"a DCP rank died with {signal.Signals(-code).name}"
    return f"a DCP rank exited with code {code}"


def _tail(path: Path, size: int = 64 << 10) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class _Lines:
    """The complete JSON lines appended to a file since the last look."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def new(self) -> list[dict[str, Any]]:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]
