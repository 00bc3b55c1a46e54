"""Running a sweep: the spec's candidates through the worker pool (``pool``), one
worker per device, every result journaled as it arrives, so a killed sweep resumes
where it stopped. Before the timed pass, processes compile kernels ahead
(``compile_ahead``); after it, the reference runs where every route failed. With a
``deadline`` nothing runs past it (tuning at model load: ``pool``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field

from mlatune.arch import DeviceInfo
from mlatune.measure.records import Record, Status, Task
from mlatune.problem import MLAProblem
from mlatune.sweep import compile_ahead
from mlatune.sweep.candidates import (  # noqa: F401  (Shard: callers import it from here)
    REFERENCE,
    Candidate,
    Prior,
    Shard,
    plan,
    problem_seed,
)
from mlatune.sweep.journal import Journal
from mlatune.sweep.pool import WorkerPool
from mlatune.sweep.progress import Observer
from mlatune.sweep.spec import SweepSpec

log = logging.getLogger(__name__)

# The pool the passes run on: the local worker processes, or, while a backend has set
# it (``ray_pool.serving``), that backend's pool with the same interface.
POOL: ContextVar[Callable[..., WorkerPool]] = ContextVar("POOL", default=WorkerPool)


@dataclass
class SweepResult:
    records: list[Record]
    wall_s: float
    ran: int  # candidates run in this invocation, reference fallbacks included
    seconds: dict[str, float] = field(default_factory=dict)  # this invocation's cost, by part
    planned: int = 0  # candidates of the spec (what the progress bar counts)
    resumed: int = 0  # of those, found in the journal: not run again
    refused: int = 0  # (problem, route) pairs a rule refuses: recorded, not run
    pruned: int = 0  # candidates a prior table prunes (--prune-from): recorded, not run
    fallbacks: int = 0  # reference runs where every route that served a problem failed
    measured_dcp: int = 0  # DCP tasks measured across processes now (dcp_stage)
    cut: list[Candidate] = field(default_factory=list)  # not run or not finished by the deadline
    workers_started: int = 0  # worker processes started (crashes replaced included)
    # The candidates of this run's plan (refused, pruned and reference fallbacks included);
    # None: every record's.
    plan_ids: frozenset[str] | None = None

    @property
    def counts(self) -> dict[str, int]:
        """The plan's candidates per status, each once by its latest record (a rerun of a
        crashed candidate replaces it; records of candidates outside the plan, another
        route set's, are not counted)."""
        latest = {r.id: r.status for r in self.records
                  if self.plan_ids is None or r.id in self.plan_ids}
        counts: dict[str, int] = {}
        for status in latest.values():
            counts[status] = counts.get(status, 0) + 1
        return counts


def run(spec: SweepSpec, device: DeviceInfo, journal: Journal, *, workers: int = 1,
        timeout_s: float = 300.0, only: Iterable[str] | None = None,
        observer: Observer | None = None, compile_workers: int | None = None,
        prior: Prior | None = None, deadline: float = math.inf) -> SweepResult:
    """Run every candidate of ``spec`` not already in ``journal``.

    First, ``compile_workers`` processes per device (default: on a GPU, the spare
    cores; none on the CPU) check one small problem per route, parameter set and
    bucket, so the kernels are compiled before the timing workers need them.
    Then, unless routes were named, the reference runs for every problem where
    all the routes that served it failed, so the table holds an ok row there.
    ``prior``: a measured table that prunes the routes far behind a problem's best.
    ``deadline`` (``time.monotonic()``'s clock): past it nothing runs; the candidates it
    left are the result's ``cut``.
    """
    t0 = time.monotonic()
    candidates, refused = plan(spec, device, only, prior)
    done = journal.done_ids
    recorded = {r.id for r in journal.records}
    journal.extend([r for r in refused if r.id not in recorded])
    todo = [c for c in candidates if c.id not in done]
    pruned = sum(r.status is Status.PRUNED for r in refused)
    if observer and hasattr(observer, "refused"):
        observer.refused(len(refused) - pruned)
    seconds: dict[str, float] = {}
    if compile_workers is None:
        compile_workers = compile_ahead.default_workers(workers) if device.is_gpu else 0
    if compile_workers and todo:
        t_compile = time.monotonic()
        _compile_ahead(spec, device, workers, compile_workers, todo, timeout_s, observer)
        seconds["compile_ahead_wall_s"] = time.monotonic() - t_compile
    if observer:
        observer.started(len(candidates), len(candidates) - len(todo))

    def journal_it(record: Record) -> None:
        journal.append(record)
        if observer:
            observer.finished(record)

    execute = _pool(spec, _devices(device, workers), timeout_s, on_result=journal_it,
                    deadline=deadline)
    execute(todo)
    fallbacks = []
    if not only and not spec.routes:
        fallbacks = [c for c in _reference_fallbacks(spec.problems, journal.records)
                     if c.id not in journal.done_ids]
        if fallbacks and observer:
            observer.started(len(fallbacks), 0, "reference fallbacks")
        execute(fallbacks)
    ran = len(todo) + len(fallbacks) - len(execute.cut)
    return SweepResult(journal.records, time.monotonic() - t0, ran,
                       {**execute.seconds, **seconds}, planned=len(candidates),
                       resumed=len(candidates) - len(todo), refused=len(refused) - pruned,
                       pruned=pruned, fallbacks=len(fallbacks), cut=execute.cut,
                       workers_started=execute.started,
                       plan_ids=frozenset(c.id for c in (*candidates, *refused, *fallbacks)))


def _compile_ahead(spec: SweepSpec, device: DeviceInfo, workers: int, per_device: int,
                   todo: list[Candidate], timeout_s: float, observer: Observer | None) -> None:
    """Kernels compile on the CPU, one at a time per process: compiling them first,
    in many processes at once, keeps the timing workers from waiting on it. Only an
    optimisation: whatever goes wrong here, the timed pass still runs every candidate."""
    firsts = compile_ahead.representatives(todo)
    n_problems = len({c.problem for c in firsts})
    per_device = max(1, min(per_device, -(-n_problems // workers)))
    devices = [d for d in _devices(device, workers) for _ in range(per_device)]
    if observer:
        observer.started(len(firsts), 0, "compiling")
    try:
        _pool(spec, devices, timeout_s, check_only=True,
              on_result=observer.finished if observer else lambda record: None)(firsts)
    except RuntimeError as exc:  # a worker that would not start
        log.warning("mlatune: compiling ahead stopped (%s); the sweep compiles as it goes", exc)


def _devices(device: DeviceInfo, workers: int) -> list[str]:
    """One worker per GPU (one alone: ``device``'s own); on the CPU ``workers`` processes
    share it (tests use that)."""
    if device.is_gpu and workers == 1 and device.index >= 0:
        return [device.torch_device]
    return [f"cuda:{i}" for i in range(workers)] if device.is_gpu else ["cpu"] * workers


def _reference_fallbacks(problems: Iterable[MLAProblem], records: list[Record]
                         ) -> list[Candidate]:
    """The reference for each problem whose every run failed (it had none of its own)."""
    ok, tried = set(), set()
    for r in records:
        if r.ok:
            ok.add(r.problem_key)
        if r.status is not Status.UNSUPPORTED:
            tried.add(r.problem_key)
    return [Candidate(p, REFERENCE) for p in problems if p.key in tried and p.key not in ok]


def _pool(spec: SweepSpec, devices: list[str], timeout_s: float, *,
          on_result: Callable[[Record], None] = lambda record: None,
          check_only: bool = False, deadline: float = math.inf) -> WorkerPool:
    """A pool whose tasks carry the spec's seed, budget and tolerances. With
    ``check_only`` the workers stop after the first accuracy check (compiling ahead)."""
    budget = asdict(spec.budget)

    def task_of(c: Candidate) -> Task:
        return Task(c.problem, c.route_id, c.params, problem_seed(spec.seed, c.problem), budget,
                    spec.tolerances, check_only)

    return POOL.get()(devices, timeout_s, task_of, on_result, deadline)
