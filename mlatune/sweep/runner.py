"""Running a sweep: candidates out to worker processes, results into the journal.

One worker process per device, started with ``spawn``. Each gets one
candidate at a time; candidates of a problem go to the same worker so its
inputs and reference are made once. A worker that dies (abort, segfault,
illegal memory access) scores its candidate ``crashed``, one that overruns the
timeout is killed and scores ``timeout``; either way a fresh worker takes over
and the sweep goes on. Every result is journaled as it arrives, so a killed
sweep resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait
from typing import Any, Protocol

from mlatune.arch import DeviceInfo
from mlatune.problem import MLAProblem
from mlatune.sweep import compile_ahead, worker
from mlatune.sweep.candidates import (  # noqa: F401  (the names callers import from here)
    REFERENCE,
    Candidate,
    Shard,
    plan,
    problem_seed,
    stable_hash,
)
from mlatune.sweep.journal import Journal
from mlatune.sweep.records import problem_key, step_us, table_rows  # noqa: F401
from mlatune.sweep.spec import SweepSpec

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 300.0  # importing torch and creating a CUDA context
SETUP_TIMEOUT_S = 900.0  # a problem's inputs and fp32 references, before the route's timeout


class Observer(Protocol):
    """Told what a sweep runs. ``started`` counts candidates that run (a progress bar's
    whole), never the (problem, route) pairs a rule refuses: those are recorded at once
    and run nothing. An observer may also have ``refused(count)``, told their number."""

    def started(self, total: int, already_done: int, what: str = "sweep") -> None: ...
    def finished(self, record: dict[str, Any]) -> None: ...


# Where a sweep's worker time went: the worker reports these; the rest of elapsed_s
# (from handing a candidate over to its result) is "other" (transfer, a crash or
# timeout).
COST_PARTS = ("setup_s", "first_check_s", "check_s", "bench_s")


@dataclass
class SweepResult:
    records: list[dict[str, Any]]
    wall_s: float
    ran: int  # candidates run in this invocation, reference fallbacks included
    seconds: dict[str, float] = field(default_factory=dict)  # this invocation's cost, by part
    planned: int = 0  # candidates of the spec (what the progress bar counts)
    resumed: int = 0  # of those, found in the journal: not run again
    refused: int = 0  # (problem, route) pairs a rule refuses: recorded, not run
    fallbacks: int = 0  # reference runs where every route that served a problem failed
    measured_dcp: int = 0  # DCP tasks measured across processes now (dcp_stage)

    @property
    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        return counts


class _Worker:
    def __init__(self, ctx, device: str):
        self.device = device
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker.serve, args=(child, device), daemon=True)
        _start_ignoring_sigint(self.proc)
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.candidate: Candidate | None = None
        self.deadline = math.inf
        self.awaiting = ""  # "inputs" or "result" while a candidate runs
        self.group: deque[Candidate] = deque()
        self.sent_at = 0.0

    def send(self, candidate: Candidate, task: dict) -> None:
        """Hand over a task; until its inputs exist, the setup allowance applies."""
        self.candidate = candidate
        self.sent_at = time.monotonic()
        self.deadline = self.sent_at + SETUP_TIMEOUT_S
        self.awaiting = "inputs"
        self.conn.send(task)

    def ask_to_stop(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self.conn.send(None)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()

    def death_reason(self) -> str:
        self.proc.join(timeout=10)
        code = self.proc.exitcode
        if code is not None and code < 0:
            return f"worker died with {signal.Signals(-code).name}"
        return f"worker exited with code {code}"


def _start_ignoring_sigint(proc) -> None:
    """Start ``proc`` with SIGINT ignored, which it inherits through spawn's exec and
    Python keeps. Ctrl-C reaches the whole process group; the parent handles it and
    kills its workers, which must not die mid-import or mid-run with a traceback."""
    if threading.current_thread() is not threading.main_thread():
        proc.start()  # handlers can be set from the main thread only; Ctrl-C goes there
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _shut_down(pool: list[_Worker], gently: bool) -> None:
    """Gently: ask every worker to stop, then wait for each (they exit side by side).
    Whatever is alive after that, or when interrupted meanwhile, is killed."""
    try:
        if gently:
            for w in pool:
                w.ask_to_stop()
            for w in pool:
                w.proc.join(timeout=10)
    finally:
        for w in pool:
            w.kill()


def run(spec: SweepSpec, device: DeviceInfo, journal: Journal, *, workers: int = 1,
        timeout_s: float = 300.0, only: Iterable[str] | None = None,
        observer: Observer | None = None, compile_workers: int | None = None) -> SweepResult:
    """Run every candidate of ``spec`` not already in ``journal``.

    First, ``compile_workers`` processes per device (default: on a GPU, the spare
    cores; none on the CPU) check one small problem per route, parameter set and
    bucket, so the kernels are compiled before the timing workers need them.
    Then, unless routes were named, the reference runs for every problem where
    all the routes that served it failed, so the table holds an ok row there.
    """
    t0 = time.monotonic()
    candidates, refused = plan(spec, device, only)
    done = journal.done_ids
    journal.extend([r for r in refused if r["id"] not in done])
    todo = [c for c in candidates if c.id not in done]
    if observer and hasattr(observer, "refused"):
        observer.refused(len(refused))
    seconds: dict[str, float] = {}
    if compile_workers is None:
        compile_workers = compile_ahead.default_workers(workers) if device.is_gpu else 0
    if compile_workers and todo:
        t_compile = time.monotonic()
        _compile_ahead(spec, device, workers, compile_workers, todo, timeout_s, observer)
        seconds["compile_ahead_wall_s"] = time.monotonic() - t_compile
    if observer:
        observer.started(len(candidates), len(candidates) - len(todo))

    def journal_it(record: dict[str, Any]) -> None:
        journal.append(record)
        if observer:
            observer.finished(record)

    execute = _Executor(spec, _devices(device, workers), timeout_s, on_result=journal_it)
    execute(todo)
    fallbacks = []
    if not only and not spec.routes:
        fallbacks = [c for c in _reference_fallbacks(spec.problems, journal.records)
                     if c.id not in journal.done_ids]
        if fallbacks and observer:
            observer.started(len(fallbacks), 0, "reference fallbacks")
        execute(fallbacks)
    return SweepResult(journal.records, time.monotonic() - t0, len(todo) + len(fallbacks),
                       {**execute.seconds, **seconds}, planned=len(candidates),
                       resumed=len(candidates) - len(todo), refused=len(refused),
                       fallbacks=len(fallbacks))


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
        _Executor(spec, devices, timeout_s, check_only=True,
                  on_result=observer.finished if observer else lambda record: None)(firsts)
    except RuntimeError as exc:  # a worker that would not start
        log.warning("mlatune: compiling ahead stopped (%s); the sweep compiles as it goes", exc)


def _devices(device: DeviceInfo, workers: int) -> list[str]:
    """One worker per GPU; on the CPU ``workers`` processes share it (tests use that)."""
    return [f"cuda:{i}" for i in range(workers)] if device.is_gpu else ["cpu"] * workers


def _reference_fallbacks(problems: Iterable[MLAProblem], records: list[dict[str, Any]]
                         ) -> list[Candidate]:
    """The reference for each problem whose every run failed (it had none of its own)."""
    ok, tried = set(), set()
    for r in records:
        key = problem_key(r)
        if r["status"] == "ok":
            ok.add(key)
        if r["status"] != "unsupported":
            tried.add(key)
    return [Candidate(p, REFERENCE) for p in problems if p.key in tried and p.key not in ok]


class _Executor:
    """Runs candidates on a pool of worker processes (one per entry of ``devices``),
    handing each result record to ``on_result``. With ``check_only`` the workers
    stop after the first accuracy check (compiling ahead) and results are dropped."""

    def __init__(self, spec: SweepSpec, devices: list[str], timeout_s: float, *,
                 on_result: Callable[[dict[str, Any]], None] = lambda record: None,
                 check_only: bool = False):
        self.spec, self.devices, self.timeout_s = spec, devices, timeout_s
        self.on_result, self.check_only = on_result, check_only
        self.budget = asdict(spec.budget)
        self.seconds = dict.fromkeys((*COST_PARTS, "other_s"), 0.0)

    def task(self, c: Candidate) -> dict[str, Any]:
        return {"problem": c.problem.as_dict(), "route": c.route_id, "params": c.params,
                "seed": problem_seed(self.spec.seed, c.problem), "budget": self.budget,
                "tolerances": self.spec.tolerances, "check_only": self.check_only}

    def __call__(self, candidates: list[Candidate]) -> None:
        if not candidates:
            return
        groups: deque[deque[Candidate]] = deque()
        for c in candidates:  # a problem's candidates come together
            if not groups or groups[-1][0].problem != c.problem:
                groups.append(deque())
            groups[-1].append(c)
        ctx = mp.get_context("spawn")
        pool = [_Worker(ctx, d) for d in self.devices]

        def finish(w: _Worker, result: dict[str, Any]) -> None:
            result.pop("restart", None)
            result["elapsed_s"] = time.monotonic() - w.sent_at
            # Where and when it ran: how busy each GPU was (benchmarks/sweep_cost.py).
            result["device"], result["finished_at"] = w.device, round(time.time(), 3)
            parts = [result.get(p, 0.0) for p in COST_PARTS]
            for part, spent in zip(COST_PARTS, parts, strict=True):
                self.seconds[part] += spent
            self.seconds["other_s"] += max(0.0, result["elapsed_s"] - sum(parts))
            self.on_result(w.candidate.record(**result))
            w.candidate, w.deadline = None, math.inf

        def replace(w: _Worker) -> None:
            w.kill()
            fresh = _Worker(ctx, w.device)
            fresh.group = w.group
            pool[pool.index(w)] = fresh

        try:
            while True:
                for w in list(pool):
                    if w.ready and w.candidate is None:
                        if not w.group and groups:
                            w.group = groups.popleft()
                        if w.group:
                            c = w.group.popleft()
                            try:
                                w.send(c, self.task(c))
                            except OSError:  # it died while idle: a fresh one takes over
                                w.group.appendleft(c)
                                w.candidate = None
                                replace(w)
                busy = [w for w in pool if w.candidate is not None or not w.ready]
                if not busy:
                    break
                now = time.monotonic()
                next_deadline = min(w.deadline if w.ready else w.started + WORKER_START_TIMEOUT_S
                                    for w in busy)
                for conn in wait([w.conn for w in busy], timeout=max(0.0, next_deadline - now)):
                    w = next(w for w in pool if w.conn is conn)
                    try:
                        message = w.conn.recv()
                    except (EOFError, OSError):
                        if not w.ready:
                            raise RuntimeError(f"sweep worker on {w.device} failed to start: "
                                               f"{w.death_reason()}") from None
                        if w.candidate is not None:
                            finish(w, {"status": "crashed", "reason": w.death_reason()})
                        replace(w)
                        continue
                    if not w.ready:
                        w.ready = True
                    elif message.get("inputs_ready"):
                        w.deadline, w.awaiting = time.monotonic() + self.timeout_s, "result"
                    else:
                        restart = message.get("restart", False)
                        finish(w, message)
                        if restart:
                            replace(w)
                now = time.monotonic()
                for w in list(pool):
                    if not w.ready and now > w.started + WORKER_START_TIMEOUT_S:
                        raise RuntimeError(f"sweep worker on {w.device} did not start within "
                                           f"{WORKER_START_TIMEOUT_S:.0f}s")
                    if w.candidate is not None and now > w.deadline:
                        reason = (f"no result within the {self.timeout_s:g}s timeout"
                                  if w.awaiting == "result" else
                                  f"inputs and references not made within {SETUP_TIMEOUT_S:g}s")
                        finish(w, {"status": "timeout", "reason": reason})
                        replace(w)
        except BaseException:  # interrupted: what is in flight is not worth waiting for
            _shut_down(pool, gently=False)
            raise
        _shut_down(pool, gently=True)


