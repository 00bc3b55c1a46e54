"""The worker pool: candidates out to worker processes, their results back.

``WorkerProcess`` is one process on one device with small verbs (``start``, ``alive``,
``put``, ``get`` with a timeout, ``stop``, ``wait``, ``kill``), as PyTorch Inductor's
autotune processes have; what ``get`` returns is typed (``Ready``, ``InputsReady``,
``Answer``, ``Gone``), so a process that died is an outcome, not an exception.

``WorkerPool`` runs a list of candidates on one process per entry of its devices.
Candidates of a problem go to the same process so its inputs and reference are made
once. A process that dies (abort, segfault, illegal memory access) scores its candidate
``crashed``, one that overruns the timeout is killed and scores ``timeout``; either way a
fresh process takes over and the pool goes on. Processes start with SIGINT ignored:
Ctrl-C is the sweep's to handle, and it kills them.

With a ``deadline`` (tuning at model load) the pool starts no problem it does not expect
to finish by then (from the mean time of the candidates finished so far) and kills what is
still running when it comes; the candidates it did not finish are in ``cut``, unrecorded.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from mlatune.measure.records import COST_PARTS, KILLED_FROM_OUTSIDE, Record, Result, Status, Task
from mlatune.sweep import worker_entry
from mlatune.sweep.candidates import Candidate

# Signals a route does not send itself (a crash is SIGSEGV, SIGABRT, SIGBUS, ...): the
# OOM killer's or an operator's SIGKILL, a SIGTERM. Such a candidate is run again once on
# resume (``sweep.journal``), as the failure says nothing of the route.
_FROM_OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP})
WORKER_START_TIMEOUT_S = 300.0  # importing torch and creating a CUDA context
SETUP_TIMEOUT_S = 900.0  # a problem's inputs and fp32 references, before the route's timeout



@dataclass(frozen=True)
class Ready:
    """The process has started and takes tasks."""


@dataclass(frozen=True)
class InputsReady:
    """The task's inputs and references exist: the route's own timeout starts."""


@dataclass(frozen=True)
class Answer:
    """The task's result (``worker.evaluate``'s)."""

    result: Result


@dataclass(frozen=True)
class Gone:
    """The process died or closed its end; ``reason`` says how it ended."""

    reason: str


Event = Ready | InputsReady | Answer | Gone


class WorkerProcess:
    """One worker process (``worker.serve``, through ``worker_entry``) on one device, over
    a pipe."""

    def __init__(self, device: str):
        self.device = device
        self.started_at = math.inf
        self._proc: Any = None
        self._conn: Any = None

    def start(self) -> None:
        ctx = _context()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=worker_entry.main,
                                 args=(child, self.device, dict(os.environ)), daemon=True)
        _start_ignoring_sigint(self._proc, ctx)
        child.close()
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def connection(self) -> Any:
        """What ``multiprocessing.connection.wait`` waits on."""
        return self._conn

    def put(self, task: Task) -> None:
        """Hand over a task; OSError when the process is gone."""
        self._conn.send(task.to_json())

    def get(self, timeout: float = 0.0) -> Event | None:
        """The process's next event, or None when none came within ``timeout`` seconds."""
        try:
            if not self._conn.poll(timeout):
                return None
            message = self._conn.recv()
        except (EOFError, OSError):
            return Gone(self.death_reason())
        if message.get("ready"):
            return Ready()
        if message.get("inputs_ready"):
            return InputsReady()
        return Answer(Result.from_json(message))

    def stop(self) -> None:
        """Ask the process to exit after its task; returns at once (``wait`` for it)."""
        with contextlib.suppress(OSError):  # already gone
            self._conn.send(None)

    def wait(self, timeout: float) -> None:
        self._proc.join(timeout=timeout)

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=10)
        self._conn.close()

    def death_reason(self) -> str:
        self._proc.join(timeout=10)
        code = self._proc.exitcode
        if code is not None and -code in _FROM_OUTSIDE:  # the pool's own kills are timeouts
            return f"{KILLED_FROM_OUTSIDE} ({signal.Signals(-code).name})"
        if code is not None and code < 0:
            return f"worker died with {signal.Signals(-code).name}"
        return f"worker exited with code {code}"


def _context() -> Any:
    """The forkserver where the platform has one: a worker is a fork of a process that
    imported torch once (a start, and a crashed worker's replacement, skip that import:
    about 2 s each), given the sweep's environment of now (``worker_entry``); else spawn.
    Either way the worker's CUDA context is its own."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def _start_ignoring_sigint(proc: Any, ctx: Any) -> None:
    """Start ``proc`` so that it ignores SIGINT: Ctrl-C reaches the whole process group;
    the parent handles it and kills its workers, which must not die mid-import or mid-run
    with a traceback. Spawned, it inherits SIGINT ignored through exec, and Python keeps
    that; forked by the forkserver, it ignores it itself (``worker_entry``), and the
    forkserver is started with it ignored. The parent ignores Ctrl-C only while it starts a
    process, not while it waits for the forkserver's first import of torch."""
    forked = ctx.get_start_method() == "forkserver"
    if threading.current_thread() is not threading.main_thread():
        proc.start()  # handlers can be set from the main thread only; Ctrl-C goes there
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if forked:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        else:
            proc.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    if forked:
        proc.start()


def shut_down(processes: Iterable[WorkerProcess], gently: bool) -> None:
    """Gently: ask every process to stop, then wait for each (they exit side by side).
    Whatever is alive after that, or when interrupted meanwhile, is killed."""
    processes = list(processes)
    try:
        if gently:
            for p in processes:
                p.stop()
            for p in processes:
                p.wait(timeout=10)
    finally:
        for p in processes:
            p.kill()


@dataclass
class Slot:
    """A process and what it is doing: the candidate in flight and the problem's rest."""

    process: WorkerProcess
    ready: bool = False
    candidate: Candidate | None = None
    sent_at: float = 0.0
    deadline: float = math.inf
    awaiting: str = ""  # "inputs" or "result" while a candidate runs
    group: deque[Candidate] = field(default_factory=deque)

    @property
    def busy(self) -> bool:
        return self.candidate is not None or not self.ready

    def next_deadline(self) -> float:
        return self.deadline if self.ready else self.process.started_at + WORKER_START_TIMEOUT_S


class WorkerPool:
    """Runs candidates on one worker process per entry of ``devices``, handing each
    result record to ``on_result``. ``task_of`` makes a candidate's task. With
    ``check_only`` tasks the workers stop after the first accuracy check (compiling
    ahead). ``seconds`` sums where the workers' time went, by ``COST_PARTS``.
    ``deadline`` (``time.monotonic()``'s clock): past it nothing runs; ``cut`` then holds
    the candidates not run or killed unfinished, and ``started`` counts the processes."""

    def __init__(self, devices: list[str], timeout_s: float, task_of: Callable[[Candidate], Task],
                 on_result: Callable[[Record], None] = lambda record: None,
                 deadline: float = math.inf):
        self.devices, self.timeout_s, self.deadline = devices, timeout_s, deadline
        self.task_of, self.on_result = task_of, on_result
        self.seconds = dict.fromkeys((*COST_PARTS, "other_s"), 0.0)
        self.cut: list[Candidate] = []
        self.started = 0
        self._slots: list[Slot] = []
        self._groups: deque[deque[Candidate]] = deque()
        self._finished: list[float] = []  # each finished candidate's seconds

    def __call__(self, candidates: list[Candidate]) -> None:
        if not candidates:
            return
        self._groups = _by_problem(candidates)
        if time.monotonic() >= self.deadline:
            self.cut += candidates
            return
        self._slots = [self._started(d) for d in self.devices]
        try:
            while self._step():
                pass
        except BaseException:  # interrupted: what is in flight is not worth waiting for
            shut_down((s.process for s in self._slots), gently=False)
            raise
        self._cut_the_rest()
        in_time = time.monotonic() < self.deadline  # past it, no process exit is awaited
        shut_down((s.process for s in self._slots if s.ready), gently=in_time)
        shut_down((s.process for s in self._slots if not s.ready), gently=False)

    def _step(self) -> bool:
        """Hand out work, take what arrives, expire what overran; False once all is done
        or the deadline has come."""
        if time.monotonic() >= self.deadline:
            return False
        self._hand_out()
        busy = [s for s in self._slots if s.busy]
        if not busy:
            return False
        until = min(self.deadline, *(s.next_deadline() for s in busy))
        timeout = max(0.0, until - time.monotonic())
        for conn in wait([s.process.connection for s in busy], timeout=timeout):
            slot = next(s for s in self._slots if s.process.connection is conn)
            event = slot.process.get()
            if event is not None:
                self._receive(slot, event)
        self._expire(time.monotonic())
        return True

    def _hand_out(self) -> None:
        now = time.monotonic()
        for slot in list(self._slots):
            if not slot.ready or slot.candidate is not None:
                continue
            if not slot.group and self._groups and self._fits(self._groups[0], now):
                slot.group = self._groups.popleft()
            if slot.group:
                self._send(slot, slot.group.popleft())

    def _fits(self, group: deque[Candidate], now: float) -> bool:
        """Whether a problem's candidates are expected to finish by the deadline, at the
        mean time of those finished so far (the first problem always starts)."""
        if self.deadline == math.inf or not self._finished:
            return True
        mean = sum(self._finished) / len(self._finished)
        return now + mean * len(group) <= self.deadline

    def _cut_the_rest(self) -> None:
        """What the deadline left: problems not started, the rest of those started, and a
        candidate still running (its process killed: it says nothing of its route)."""
        for slot in self._slots:
            if slot.candidate is not None:
                self.cut.append(slot.candidate)
                slot.process.kill()
                slot.candidate = None
            self.cut += slot.group
            slot.group = deque()
        self.cut += [c for group in self._groups for c in group]
        self._groups = deque()

    def _send(self, slot: Slot, candidate: Candidate) -> None:
        """Hand over a task; until its inputs exist, the setup allowance applies."""
        # The clock starts before the hand-over: a worker may finish a quick candidate
        # before this process is scheduled again, and elapsed_s must cover its parts.
        task = self.task_of(candidate)
        sent_at = time.monotonic()
        try:
            slot.process.put(task)
        except OSError:  # it died while idle: a fresh one takes over
            slot.group.appendleft(candidate)
            self._replace(slot)
            return
        slot.candidate, slot.sent_at = candidate, sent_at
        slot.deadline, slot.awaiting = slot.sent_at + SETUP_TIMEOUT_S, "inputs"
        self.handed_over(slot)

    def _receive(self, slot: Slot, event: Event) -> None:
        if isinstance(event, Gone):
            if self.worker_lost(slot, event):
                return
            if not slot.ready:
                raise RuntimeError(f"sweep worker on {slot.process.device} failed to start: "
                                   f"{event.reason}")
            if slot.candidate is not None:
                self._finish(slot, Result(status=Status.CRASHED, reason=event.reason))
            self._replace(slot)
        elif not slot.ready:
            slot.ready = True
        elif isinstance(event, InputsReady):
            slot.deadline, slot.awaiting = time.monotonic() + self.timeout_s, "result"
        elif isinstance(event, Answer):
            self._finish(slot, event.result)
            if event.result.restart:  # its CUDA context is lost
                self._replace(slot)

    def _expire(self, now: float) -> None:
        for slot in list(self._slots):
            if not slot.ready and now > slot.process.started_at + WORKER_START_TIMEOUT_S:
                raise RuntimeError(f"sweep worker on {slot.process.device} did not start "
                                   f"within {WORKER_START_TIMEOUT_S:.0f}s")
            if slot.candidate is not None and now > slot.deadline:
                reason = (f"no result within the {self.timeout_s:g}s timeout"
                          if slot.awaiting == "result" else
                          f"inputs and references not made within {SETUP_TIMEOUT_S:g}s")
                self._finish(slot, Result(status=Status.TIMEOUT, reason=reason))
                self._replace(slot)

    def _finish(self, slot: Slot, result: Result) -> None:
        assert slot.candidate is not None
        elapsed = time.monotonic() - slot.sent_at
        parts = [result.cost(p) for p in COST_PARTS]
        for part, spent in zip(COST_PARTS, parts, strict=True):
            self.seconds[part] += spent
        self.seconds["other_s"] += max(0.0, elapsed - sum(parts))
        self._finished.append(elapsed)
        # Where and when it ran: how busy each GPU was (bench.py --routine sweep-cost).
        self.on_result(slot.candidate.record(**result.fields(), elapsed_s=elapsed,
                                             device=slot.process.device,
                                             finished_at=round(time.time(), 3)))
        slot.candidate, slot.deadline = None, math.inf

    def _replace(self, slot: Slot) -> None:
        slot.process.kill()
        fresh = self._started(slot.process.device)
        fresh.group = slot.group
        self._slots[self._slots.index(slot)] = fresh

    def worker_lost(self, slot: Slot, event: Gone) -> bool:
        """Take over a worker gone for a reason outside its candidate (its machine, not its
        route); True when handled. The local pool has none: a worker gone crashed its
        candidate."""
        return False

    def handed_over(self, slot: Slot) -> None:
        """Called once ``slot``'s worker has its candidate: a pool may give it the next one
        ahead, which stays in ``slot.group`` until sent. The local pool does not."""

    def start_worker(self, device: str) -> WorkerProcess:
        """A worker for ``device``, started (its ``Ready`` still to come). A pool of other
        workers overrides it with one that has ``WorkerProcess``'s verbs and ``connection``."""
        process = WorkerProcess(device)
        process.start()
        return process

    def _started(self, device: str) -> Slot:
        process = self.start_worker(device)
        self.started += 1
        return Slot(process)


def _by_problem(candidates: list[Candidate]) -> deque[deque[Candidate]]:
    """Consecutive candidates of one problem, grouped: a worker makes its inputs once."""
    groups: deque[deque[Candidate]] = deque()
    for c in candidates:
        if not groups or groups[-1][0].problem != c.problem:
            groups.append(deque())
        groups[-1].append(c)
    return groups
