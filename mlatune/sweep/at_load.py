"""Tuning at model load: an engine declares the shapes it will serve (``ServingShapes``), and
the ones its table does not measure are timed now, within a budget, into the user table.

``tune`` is handed what says whether a problem is measured (a dispatcher, whose answer's
source is then "table", or a predicate): the tuner never loads one. The unmeasured problems
run cheapest first (fewest bytes a step must read, then fewest FLOPs): the fixed costs of
a candidate (worker start, inputs, compiling) are alike, so on a budget the cheap problems
measure the most of the engine's buckets, and the dispatcher predicts the rest from them.
Every viable route runs (each route's first ``max_params_per_route`` sets) through the
sweep's worker pool, one process on the engine's device: a candidate that crashes or hangs
is recorded so, its process replaced, and the call returns normally. No problem starts that
is not expected to finish by the deadline; at the deadline what runs is killed. The
problems whose every candidate finished are merged into the user table
(``user_table.merge_into``); the others stay in this call's journal, which the next call
adopts. Nothing here runs at serving time: a serving step reads the table only.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlatune.arch import DeviceInfo, current_device
from mlatune.measure.records import Record
from mlatune.measure.timers import Budget
from mlatune.problem import MLAProblem
from mlatune.sweep import runner
from mlatune.sweep import user_table as user_tables
from mlatune.sweep.candidates import Prior
from mlatune.sweep.progress import Observer
from mlatune.sweep.spec import SweepSpec
from mlatune.table.user import USER_TABLE_ENV

log = logging.getLogger("mlatune")

DEFAULT_BUDGET_S = 30.0
# A candidate's timing at load: a few reps, as the first-sight timer does; a sweep's are longer.
GPU_BUDGET = Budget(warmup=1, min_reps=5, max_reps=50, max_seconds=0.2)
CPU_BUDGET = Budget(warmup=0, min_reps=1, max_reps=2, max_seconds=0.1)


MAX_SECONDS = 86_400.0  # a day: past it a time limit is a mistake (and overflows the clocks)


def check_seconds(name: str, value: float, zero_ok: bool = False) -> None:
    """ValueError, naming ``name``, unless ``value`` is a number of seconds in (0, a day]
    (``zero_ok``: [0, a day]: 0 tunes nothing)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not (value >= 0 if zero_ok else value > 0) or not value <= MAX_SECONDS:
        raise ValueError(f"{name} must be a number of seconds in {'[' if zero_ok else '('}0, "
                         f"{MAX_SECONDS:g}], got {value!r}")


def merge_reserve_s(budget_s: float) -> float:
    """The end of the budget kept for merging into the user table (candidates stop before)."""
    return min(3.0, 0.1 * budget_s)


@dataclass(frozen=True)
class ServingShapes:
    """The decode shapes one model serves on one rank: its batch buckets, query heads per
    rank, query lengths (1; more with speculative verify), dtypes, page size, DCP size and
    the context lengths it serves (``context``: shortest and longest), measured at
    ``kv_points`` KV lengths spread geometrically over that range (3: its ends and middle)."""

    batches: Sequence[int]
    num_heads: int
    context: tuple[int, int]
    qlens: Sequence[int] = (1,)
    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    page_size: int = 64
    dcp_size: int = 1
    kv_points: int = 3

    def __post_init__(self) -> None:
        context = self.context
        if not (isinstance(context, tuple | list) and len(context) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                        for n in context)):
            raise ValueError(f"invalid ServingShapes: context must be (shortest, longest) "
                             f"KV lengths, ints >= 1, got {context!r}")
        if not isinstance(self.kv_points, int) or isinstance(self.kv_points, bool) \
                or self.kv_points < 1:
            raise ValueError(f"invalid ServingShapes: kv_points must be an int >= 1, got "
                             f"{self.kv_points!r}")

    def kv_lens(self) -> list[int]:
        lo, hi = sorted(self.context)
        if self.kv_points <= 1 or lo == hi:
            return [hi]
        steps = self.kv_points - 1
        return sorted({round(lo * (hi / lo) ** (i / steps)) for i in range(self.kv_points)})

    def problems(self) -> list[MLAProblem]:
        """Every (qlen, batch, KV length) of these shapes that is a valid problem."""
        found = []
        for qlen in self.qlens:
            for batch in self.batches:
                for kv_len in self.kv_lens():
                    if qlen > kv_len:
                        continue
                    found.append(MLAProblem(
                        num_heads=self.num_heads, qlen=qlen, q_dtype=self.q_dtype,
                        kv_dtype=self.kv_dtype, batch=batch, kv_len=kv_len,
                        dcp_size=self.dcp_size, page_size=self.page_size))
        return found


Shapes = ServingShapes | MLAProblem | Iterable[ServingShapes | MLAProblem]


@dataclass(frozen=True)
class TuneOptions:
    """How candidates run: the routes (None: every viable), each route's parameter sets
    kept (0: all), the timing ``budget`` per candidate (None: ``GPU_BUDGET`` or
    ``CPU_BUDGET``), the seconds one candidate may take once its inputs exist (None:
    half the call's budget; past it the candidate is recorded ``timeout``, so that one
    slow candidate, a vendor library compiling on first use, cannot hold its problem back
    at every load), and ``prune_ratio``: a route the dispatcher estimates (``estimates``)
    over this many times the fastest of its numeric class at a problem is not timed, and a
    route timed runs its estimated recipe and its first set (the sweep's ``--prune-from``,
    by estimates; None: every viable route and set)."""

    routes: Sequence[str] | None = None
    max_params_per_route: int = 2
    budget: Budget | None = None
    timeout_s: float | None = None
    prune_ratio: float | None = 1.5


@dataclass
class TuneReport:
    """What ``tune`` did. ``tuned``: measured now and in the user table; ``left``: not
    measured within the budget (the dispatcher predicts them; begun ones are in
    ``journal``, which the next call adopts); ``failed``: (problem key, route, status,
    reason) of candidates that crashed, hung or were rejected; ``error``: what stopped
    tuning (the engine goes on without it)."""

    user_table: Path
    budget_s: float
    asked: int = 0
    measured_before: int = 0
    tuned: list[MLAProblem] = field(default_factory=list)
    left: list[MLAProblem] = field(default_factory=list)
    candidates: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    failed: list[tuple[str, str, str, str]] = field(default_factory=list)
    rows_written: int = 0
    workers_started: int = 0
    wall_s: float = 0.0
    journal: Path | None = None
    error: str = ""

    def summary(self) -> str:
        text = (f"mlatune: {len(self.tuned)} of {self.asked} shapes tuned in "
                f"{self.wall_s:.1f} s (budget {self.budget_s:g} s), {self.measured_before} "
                f"already measured, {len(self.left)} left to prediction; "
                f"{len(self.failed)} candidates failed; user table {self.user_table}")
        return text + (f"; stopped: {self.error}" if self.error else "")


def problems_of(shapes: Shapes) -> list[MLAProblem]:
    """The distinct problems of ``shapes``, in order."""
    items = [shapes] if isinstance(shapes, ServingShapes | MLAProblem) else list(shapes)
    found: dict[str, MLAProblem] = {}
    for item in items:
        for p in item.problems() if isinstance(item, ServingShapes) else [item]:
            found.setdefault(p.key, p)
    return list(found.values())


def cheapest_first(problems: Iterable[MLAProblem]) -> list[MLAProblem]:
    return sorted(problems, key=lambda p: (p.min_bytes(), p.flops(), p.key))


def measured_by(measured: Any) -> Callable[[MLAProblem], bool]:
    """A predicate from a dispatcher (measured: its answer comes from the table) or one."""
    if hasattr(measured, "select"):
        return lambda p: measured.select(p).source == "table"
    return measured


def tune_at_load(shapes: Shapes, dispatcher: Any, budget_s: float = DEFAULT_BUDGET_S,
                 user_table: str | os.PathLike | None = None, device: DeviceInfo | None = None,
                 progress: bool | Observer = True, options: TuneOptions | None = None,
                 group: Any = None) -> TuneReport:
    """At model load: time the candidates of the serving ``shapes`` that the table does not
    measure, within ``budget_s`` seconds, into the user table (``user_table``; default
    ``MLATUNE_USER_TABLE``, else ``~/.cache/mlatune/user-table.parquet``, which
    ``MLATUNE_USER_TABLE`` is then set to, so that ``Dispatcher.from_bundled()`` overlays it).
    ``dispatcher``: what says which problems the table measures, a dispatcher or what loads
    one (``Dispatcher.from_bundled``), called once the user table is named. ``group``: the
    torch.distributed group whose ranks load one table (``Dispatcher.load(group=)``): its
    first rank tunes into the user table they share, the others wait for it, and every rank
    returns that rank's report."""
    if group is not None:
        return _tuned_by_first_rank(group, lambda: tune_at_load(
            shapes, dispatcher, budget_s, user_table, device, progress, options))
    path = Path(user_table or os.environ.get(USER_TABLE_ENV) or user_tables.default_path())
    if not os.environ.get(USER_TABLE_ENV):  # unset or empty: none overlaid yet
        os.environ[USER_TABLE_ENV] = str(path)
    if os.environ[USER_TABLE_ENV] != str(path):
        log.warning("mlatune: tuning into %s, but %s=%s is the user table a dispatcher "
                    "overlays", path, USER_TABLE_ENV, os.environ[USER_TABLE_ENV])
    loaded = dispatcher if hasattr(dispatcher, "select") else _Loaded(dispatcher)
    return tune(shapes, loaded, path, budget_s=budget_s, device=device, progress=progress,
                options=options)


def _tuned_by_first_rank(group: Any, tuned: Callable[[], TuneReport]) -> TuneReport:
    """``tuned()`` on ``group``'s first rank, its report on every rank once it returns (the
    ranks' loads then read the same user table bytes)."""
    import torch.distributed as dist

    first = dist.get_process_group_ranks(group)[0]
    shared: list[TuneReport | None] = [tuned() if dist.get_rank() == first else None]
    dist.broadcast_object_list(shared, src=first, group=group)
    return shared[0]


class _Loaded:
    """A dispatcher loaded on first use, inside ``tune``'s guard: a table that cannot be
    loaded stops the tuning (``report.error``), never the model load."""

    def __init__(self, load: Callable[[], Any]):
        self._load, self._dispatcher = load, None

    def select(self, problem: MLAProblem) -> Any:
        return self._loaded().select(problem)

    def estimates(self, problem: MLAProblem) -> list:
        return self._loaded().estimates(problem)

    def _loaded(self) -> Any:
        if self._dispatcher is None:
            self._dispatcher = self._load()
        return self._dispatcher


def tune(shapes: Shapes, measured: Any, user_table_path: str | os.PathLike, *,
         budget_s: float = DEFAULT_BUDGET_S, device: DeviceInfo | None = None,
         progress: bool | Observer = True, options: TuneOptions | None = None) -> TuneReport:
    """Time the candidates of the problems of ``shapes`` that ``measured`` (a dispatcher or
    a predicate) says the table lacks, for ``budget_s`` seconds of wall time, and merge them
    into the user table at ``user_table_path``. Never raises for a candidate, a worker or a
    table that fails: the report's ``failed`` and ``error`` say so. Call it under
    ``if __name__ == "__main__":`` (its workers are forked from a fresh forkserver, or
    spawned: either imports the main module)."""
    check_seconds("budget_s", budget_s, zero_ok=True)
    if options is not None and options.timeout_s is not None:
        check_seconds("options.timeout_s", options.timeout_s)
    t0 = time.monotonic()
    report = TuneReport(Path(user_table_path), budget_s)
    asked = problems_of(shapes)
    report.asked = len(asked)
    try:
        user_tables.check_path(report.user_table)  # before anything is timed for it
        is_measured = measured_by(measured)
        todo = cheapest_first(p for p in asked if not is_measured(p))
        report.measured_before = len(asked) - len(todo)
        if todo:
            deadline = t0 + budget_s - merge_reserve_s(budget_s)
            _tune(todo, is_measured, getattr(measured, "estimates", None),
                  device or current_device(), deadline, _observer(progress),
                  options or TuneOptions(), report)
    except Exception as exc:  # tuning is an optimisation: a model load never fails on it
        report.error = f"{type(exc).__name__}: {exc}"
        log.warning("mlatune: tuning at load stopped: %s", report.error)
    report.wall_s = time.monotonic() - t0
    return report


def _tune(todo: list[MLAProblem], measured: Callable[[MLAProblem], bool],
          estimates: Callable[[MLAProblem], list] | None, device: DeviceInfo,
          deadline: float, observer: contextlib.AbstractContextManager[Observer | None],
          options: TuneOptions, report: TuneReport) -> None:
    """Run ``todo``'s candidates (pruned by ``estimates``, a dispatcher's) until
    ``deadline``; merge the finished problems."""
    if not device.is_gpu:  # the Triton routes in the interpreter; its workers are given it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    spec = _spec(todo, device, options)
    # The table's pandas code loads while the worker starts: the merge then takes no import.
    threading.Thread(target=importlib.import_module, args=("mlatune.table.frame",),
                     daemon=True).start()
    journal = user_tables.open_journal(report.user_table, device, measured)
    keep = True
    try:
        with observer as shown:
            timeout_s = options.timeout_s or max(1.0, (deadline - time.monotonic()) / 2)
            result = runner.run(spec, device, journal, timeout_s=timeout_s,
                                observer=shown, compile_workers=0, deadline=deadline,
                                prior=_estimated(todo, estimates, options.prune_ratio))
        cut = {c.problem.key for c in result.cut}
        report.left = list(todo)  # until the merge lands: tuned is what the table holds
        _count(result, report)
        done = {p.key for p in todo if p.key not in cut}
        report.rows_written = user_tables.merge_into(
            report.user_table, [r for r in journal.records if r.problem_key in done], device)
        report.tuned = [p for p in todo if p.key in done]
        report.left = [p for p in todo if p.key in cut]
        keep = any(r.problem_key not in done for r in journal.records)
    finally:
        report.journal = user_tables.close_journal(journal, keep)


def _estimated(todo: list[MLAProblem], estimates: Callable[[MLAProblem], list] | None,
               ratio: float | None) -> Prior | None:
    """The dispatcher's estimates at ``todo``'s problems as a prior that prunes them."""
    if estimates is None or ratio is None:
        return None
    times: dict[tuple[str, str], float] = {}
    params: dict[tuple[str, str], dict[str, Any]] = {}
    for problem in todo:
        for choice in estimates(problem):
            times[problem.key, choice.route_id] = choice.time_us
            params[problem.key, choice.route_id] = dict(choice.params)
    return Prior(times, params, ratio, "the dispatcher's estimates") if times else None


def _count(result: runner.SweepResult, report: TuneReport) -> None:
    ran = [r for r in result.records if r.elapsed_s]
    report.candidates, report.workers_started = result.ran, result.workers_started
    report.statuses = dict(Counter(r.status.value for r in ran))
    report.failed = [(r.problem_key, r.route, r.status.value, r.reason) for r in ran
                     if not r.ok]


def _spec(problems: list[MLAProblem], device: DeviceInfo, options: TuneOptions) -> SweepSpec:
    """A sweep spec of ``problems`` in this order."""
    keys = "\n".join(p.key for p in problems)
    budget = options.budget or (GPU_BUDGET if device.is_gpu else CPU_BUDGET)
    return SweepSpec(name=user_tables.AT_LOAD_SPEC, path=user_tables.AT_LOAD_SPEC,
                     sha256=hashlib.sha256(keys.encode()).hexdigest(), seed=0,
                     routes=tuple(options.routes or ()),
                     max_params_per_route=options.max_params_per_route, budget=budget,
                     tolerances={}, problems=tuple(problems), skipped=())


def _observer(progress: bool | Observer) -> contextlib.AbstractContextManager[Observer | None]:
    if progress is True:
        return _bar()
    return contextlib.nullcontext(progress or None)


@contextlib.contextmanager
def _bar() -> Iterator[Observer | None]:
    """A progress bar on stderr (rich), or none where rich is not installed."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    except ImportError:
        yield None
        return
    columns = (TextColumn("mlatune: tuning at load"), BarColumn(), MofNCompleteColumn(),
               TextColumn("[red]{task.fields[failed]} failed"))
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        yield _BarObserver(bar)


class _BarObserver:
    def __init__(self, bar: Any):
        self.bar, self.task, self.failed = bar, None, 0

    def started(self, total: int, already_done: int, what: str = "sweep") -> None:
        self.task = self.bar.add_task(what, total=total, completed=already_done,
                                      failed=self.failed)

    def finished(self, record: Record) -> None:
        self.failed += not record.ok
        self.bar.update(self.task, advance=1, failed=self.failed)
