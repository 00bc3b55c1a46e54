"""Tuning at model load on the CPU (the Triton routes in the interpreter): unmeasured shapes
timed within a budget into the user table, served from it at the next load without timing;
two processes merging into one user table; a crashing candidate; a crashed tuner's journal."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

import mlatune
from mlatune import routes, table
from mlatune.arch import cpu_device
from mlatune.dispatch import Dispatcher
from mlatune.measure.records import Record, Status
from mlatune.problem import MLAProblem
from mlatune.sweep import at_load, pool, user_table
from mlatune.sweep.at_load import ServingShapes, TuneOptions
from mlatune.sweep.candidates import Candidate
from mlatune.sweep.journal import Journal, JournalHeader, read_records
from tests import processes

ROUTE = "padded/triton"  # the CPU's quickest Triton route in the interpreter
QUICK = TuneOptions(routes=(ROUTE,), max_params_per_route=1)
# The twenty shapes' route: the torch one, whose candidates cost a tenth of the interpreter's,
# so the 10 s budget holds on two cores shared with another test process.
TWENTY_ROUTE = "reference/torch"
# 2 batches x 10 KV lengths: 20 problems of about a quarter of a second each in the interpreter
TWENTY = ServingShapes(batches=(1, 2), num_heads=1, context=(8, 64), kv_points=10,
                       q_dtype="fp16", kv_dtype="fp16", page_size=8)
BUDGET_S = 10.0
MARGIN_S = 1.5  # a worker killed at the deadline, the merge past its reserve


def ok_rows(path, problems):
    """The user table's ok rows of ``problems``, by problem key."""
    frame = table.read(path, facts=routes.FACTS)
    frame = frame[frame["status"] == Status.OK.value]
    keys = table.key_strings(frame)
    wanted = {p.key for p in problems}
    return {k: t for k, t in zip(keys, frame["time_us"].tolist(), strict=True) if k in wanted}


def test_shapes_expand_to_problems_over_the_context_range():
    shapes = ServingShapes(batches=(1, 8), num_heads=16, context=(1024, 16384), qlens=(1, 2))
    assert shapes.kv_lens() == [1024, 4096, 16384]  # the ends and the geometric middle
    problems = at_load.problems_of([shapes, shapes.problems()[0]])
    assert len(problems) == 2 * 2 * 3
    assert {(p.batch, p.qlen) for p in problems} == {(1, 1), (1, 2), (8, 1), (8, 2)}
    ordered = at_load.cheapest_first(problems)
    assert [p.min_bytes() for p in ordered] == sorted(p.min_bytes() for p in problems)


def test_twenty_shapes_tuned_within_the_budget_then_served_without_timing(tmp_path,
                                                                          monkeypatch):
    path = tmp_path / "user.parquet"
    monkeypatch.setenv("MLATUNE_USER_TABLE", str(path))
    problems = TWENTY.problems()
    assert len(problems) == 20
    assert not any(Dispatcher.from_bundled(cpu_device()).select(p).source == "table"
                   for p in problems)
    t0 = time.monotonic()
    options = replace(QUICK, routes=(TWENTY_ROUTE,))
    report = mlatune.tune_at_load(TWENTY, Dispatcher.from_bundled, budget_s=BUDGET_S,
                                  progress=False, options=options)
    wall = time.monotonic() - t0
    assert report.error == "" and wall <= BUDGET_S + MARGIN_S, (wall, report.summary())
    assert len(report.tuned) == 20 and report.left == [], report.summary()
    times = ok_rows(path, problems)
    assert set(times) == {p.key for p in problems}
    assert all(t > 0 for t in times.values())
    assert report.journal is None  # every result is in the table

    dispatcher = Dispatcher.from_bundled(cpu_device())  # the next load
    assert {dispatcher.select(p).source for p in problems} == {"table"}
    assert {dispatcher.select(p).route_id for p in problems} == {TWENTY_ROUTE}

    def no_worker(self):
        raise AssertionError("a worker started")

    monkeypatch.setattr(pool.WorkerProcess, "start", no_worker)
    again = mlatune.tune_at_load(TWENTY, Dispatcher.from_bundled, budget_s=BUDGET_S,
                                  progress=False, options=options)
    assert (again.measured_before, again.tuned, again.workers_started) == (20, [], 0)
    assert again.error == ""


def _tune_in_a_process(path: str, batch: int) -> None:
    shapes = ServingShapes(batches=(batch,), num_heads=2, context=(8, 16), kv_points=2,
                           q_dtype="fp16", kv_dtype="fp16", page_size=8)
    report = at_load.tune(shapes, lambda p: False, path, budget_s=60.0, progress=False,
                          options=QUICK)
    assert report.error == "" and len(report.tuned) == 2, report.summary()


def _at_once(target, path: Path, firsts: tuple[int, int]) -> list[int | None]:
    """``target(path, first)`` in two separate processes at once; their exit codes."""
    ctx = processes.context()
    procs = [ctx.Process(target=target, args=(str(path), first)) for first in firsts]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    return [p.exitcode for p in procs]


def test_two_processes_tuning_into_one_user_table_lose_no_rows(tmp_path):
    path = tmp_path / "user.parquet"
    assert _at_once(_tune_in_a_process, path, (1, 2)) == [0, 0]
    problems = [p for b in (1, 2) for p in ServingShapes(
        batches=(b,), num_heads=2, context=(8, 16), kv_points=2, q_dtype="fp16",
        kv_dtype="fp16", page_size=8).problems()]
    assert set(ok_rows(path, problems)) == {p.key for p in problems}


def _ok_record(problem: MLAProblem, time_us: float) -> Record:
    return Candidate(problem, ROUTE).record(status=Status.OK.value, time_us=time_us,
                                            rel_err=1e-3, max_abs_err=1e-3)


def _merge_many(path: str, first_batch: int) -> None:
    for i in range(8):
        problem = MLAProblem(num_heads=2, q_dtype="fp16", kv_dtype="fp16", page_size=8,
                             kv_len=64, batch=first_batch + i)
        user_table.merge_into(Path(path), [_ok_record(problem, 10.0 + i)],
                              cpu_device())


def test_merges_racing_from_two_processes_keep_every_row(tmp_path):
    """Read-modify-writes of one table, many at once: the lock keeps each one's rows."""
    path = tmp_path / "user.csv"
    assert _at_once(_merge_many, path, (1, 101)) == [0, 0]
    frame = table.read(path, facts=routes.FACTS)
    assert sorted(frame["batch"].tolist()) == [*range(1, 9), *range(101, 109)]


def test_a_newer_row_replaces_the_same_route_and_problem(tmp_path):
    path = tmp_path / "user.parquet"
    problem = MLAProblem(num_heads=2, q_dtype="fp16", kv_dtype="fp16", page_size=8, kv_len=64)
    user_table.merge_into(path, [_ok_record(problem, 5.0)], cpu_device())
    user_table.merge_into(path, [_ok_record(problem, 7.0)], cpu_device())
    assert ok_rows(path, [problem]) == {problem.key: 7.0}


@pytest.fixture
def fault_plugins(monkeypatch):
    """The fault routes in the workers (through the environment) and here, for planning."""
    from tests import fault_routes

    monkeypatch.setenv("MLATUNE_PLUGINS", "tests.fault_routes")
    fault_routes.register_all()
    yield
    fault_routes.unregister_all()


def test_a_crashing_candidate_is_recorded_and_the_call_returns(tmp_path, fault_plugins):
    path = tmp_path / "user.parquet"
    shapes = ServingShapes(batches=(2,), num_heads=2, context=(16, 16), q_dtype="fp16",
                           kv_dtype="fp16", page_size=8)
    options = TuneOptions(routes=("fault-raise/test", "fault-abort/test", ROUTE),
                          max_params_per_route=1)
    report = at_load.tune(shapes, lambda p: False, path, budget_s=60.0, progress=False,
                          options=options)
    assert report.error == "" and len(report.tuned) == 1
    failed = {route: (status, reason) for _, route, status, reason in report.failed}
    assert failed["fault-raise/test"][0] == "crashed"
    assert "always raises" in failed["fault-raise/test"][1]
    assert failed["fault-abort/test"] == ("crashed", "worker died with SIGABRT")
    frame = table.read(path, facts=routes.FACTS)
    assert dict(zip(frame["route"], frame["status"], strict=True)) == {
        "fault-raise/test": "crashed", "fault-abort/test": "crashed", ROUTE: "ok"}


def _dead_journal(path, problem: MLAProblem):
    """A tuner's journal beside the user table at ``path`` holding an ok result of
    ``problem`` (the route's first set, 42 us), left as its process's death leaves it: the
    file there, its lock released. Returns the journals' folder."""
    device = cpu_device()
    params = routes.get(ROUTE).param_space(problem, device)[0]
    folder = user_table.journals_dir(path)
    folder.mkdir()
    dead = Journal(folder / "dead.jsonl", JournalHeader.of("at-load", "at-load", device),
                   resume=False)
    dead.append(Candidate(problem, ROUTE, params).record(
        status="ok", time_us=42.0, rel_err=1e-3, max_abs_err=1e-3, elapsed_s=0.5))
    dead.close()
    return folder


def test_a_crashed_tuners_journal_is_adopted_by_the_next(tmp_path, monkeypatch):
    """A journal no process holds any longer: its results reach the table, nothing reruns."""
    path = tmp_path / "user.parquet"
    problem = MLAProblem(num_heads=2, q_dtype="fp16", kv_dtype="fp16", page_size=8, kv_len=16,
                         batch=3)
    folder = _dead_journal(path, problem)
    monkeypatch.setattr(pool.WorkerProcess, "start", lambda self: pytest.fail("a worker ran"))
    report = at_load.tune(problem, lambda p: False, path, budget_s=30.0, progress=False,
                          options=QUICK)
    assert report.error == "" and report.tuned == [problem]
    assert ok_rows(path, [problem]) == {problem.key: 42.0}
    assert list(folder.glob("*.jsonl")) == []


def test_a_damaged_user_table_is_left_alone_and_the_results_kept(tmp_path, monkeypatch):
    path = tmp_path / "user.parquet"
    path.write_bytes(b"not a table")
    problem = MLAProblem(num_heads=2, q_dtype="fp16", kv_dtype="fp16", page_size=8, kv_len=16)
    _dead_journal(path, problem)
    monkeypatch.setattr(pool.WorkerProcess, "start", lambda self: pytest.fail("a worker ran"))
    report = at_load.tune(problem, lambda p: False, path, budget_s=30.0, progress=False,
                          options=QUICK)
    assert "TableError" in report.error and path.read_bytes() == b"not a table"
    assert report.journal is not None and report.journal.exists()
    kept = [r for r in read_records(report.journal)[1] if r.ok]
    assert [(r.problem_key, r.time_us) for r in kept] == [(problem.key, 42.0)]


def test_a_table_that_cannot_be_loaded_stops_the_tuning_not_the_call(tmp_path, monkeypatch):
    path = tmp_path / "user.parquet"
    monkeypatch.setenv("MLATUNE_USER_TABLE", str(path))

    def broken():
        raise OSError("the table's disk is gone")

    report = mlatune.tune_at_load(TWENTY, broken, progress=False)
    assert report.error == "OSError: the table's disk is gone"
    assert (report.asked, report.tuned, report.workers_started) == (20, [], 0)
    assert not path.exists()


class _Estimating:
    """A dispatcher's two answers the tuner asks: nothing measured; the estimates given."""

    def __init__(self, times: dict[str, float]):
        self.times = times

    def select(self, problem: MLAProblem):
        from mlatune.dispatch import Choice

        return Choice(ROUTE, {}, "law", problem.key, 1.0)

    def estimates(self, problem: MLAProblem):
        from mlatune.dispatch import Choice

        return [Choice(r, {}, "law", problem.key, t) for r, t in self.times.items()]


@pytest.mark.parametrize("ratio, ran", [(1.5, {ROUTE}), (None, {ROUTE, "reference/torch"})])
def test_routes_estimated_far_behind_are_not_timed(tmp_path, ratio, ran):
    shapes = ServingShapes(batches=(2,), num_heads=2, context=(16, 16), kv_points=1,
                           q_dtype="fp16", kv_dtype="fp16", page_size=8)
    options = TuneOptions(routes=(ROUTE, "reference/torch"), max_params_per_route=1,
                          prune_ratio=ratio)
    report = at_load.tune(shapes, _Estimating({ROUTE: 10.0, "reference/torch": 40.0}),
                          tmp_path / "user.parquet", budget_s=60.0, progress=False,
                          options=options)
    assert report.error == "" and len(report.tuned) == 1, report.summary()
    frame = table.read(tmp_path / "user.parquet", facts=routes.FACTS)
    statuses = dict(zip(frame["route"], frame["status"], strict=True))
    assert {r for r, s in statuses.items() if s == Status.OK.value} == ran
    if ratio is not None:
        assert statuses["reference/torch"] == Status.PRUNED.value


@pytest.mark.parametrize("budget", [float("nan"), -5.0, float("inf"), 1e300, True, "30"])
def test_a_budget_that_is_no_number_of_seconds_is_refused_by_name(tmp_path, budget):
    """A budget past a day overflows the workers' clocks; NaN and negative ones tune nothing
    meaningful: each is refused by name before anything runs."""
    with pytest.raises(ValueError, match=r"^budget_s must be a number of seconds in \[0, "):
        at_load.tune(TWENTY, lambda p: False, tmp_path / "u.parquet", budget_s=budget,
                     progress=False, options=QUICK)
    with pytest.raises(ValueError, match=r"^options.timeout_s must be a number of seconds"):
        at_load.tune(TWENTY, lambda p: False, tmp_path / "u.parquet", progress=False,
                     options=replace(QUICK, timeout_s=float("inf")))


@pytest.mark.parametrize("context", [(0, 4096), (float("nan"), 16), (-8, 16), (16,), 16])
def test_serving_shapes_of_no_context_range_are_refused_by_name(context):
    with pytest.raises(ValueError, match=r"^invalid ServingShapes: context must be"):
        ServingShapes(batches=(1,), num_heads=2, context=context)


@pytest.mark.parametrize("name", ["u.txt", "folder"])
def test_a_user_table_no_merge_could_write_stops_before_any_timing(tmp_path, monkeypatch, name):
    (tmp_path / "folder").mkdir()
    monkeypatch.setattr(pool.WorkerProcess, "start", lambda self: pytest.fail("a worker ran"))
    problem = MLAProblem(num_heads=2, q_dtype="fp16", kv_dtype="fp16", page_size=8, kv_len=16)
    report = at_load.tune(problem, lambda p: False, tmp_path / name, budget_s=30.0,
                          progress=False, options=QUICK)
    assert report.error.startswith("TableError") and report.tuned == []


def test_problems_whose_merge_failed_are_left_not_tuned(tmp_path, monkeypatch):
    """``tuned`` is what the user table holds: where the merge fails, every problem timed is
    left (its rows stay in the journal, which the next call adopts)."""
    from mlatune.errors import OutputError

    def unwritable(*args, **kwargs):
        raise OutputError("the disk is full")

    monkeypatch.setattr(user_table, "merge_into", unwritable)
    problem = MLAProblem(num_heads=2, q_dtype="fp16", kv_dtype="fp16", page_size=8, kv_len=16)
    report = at_load.tune(problem, lambda p: False, tmp_path / "u.parquet", budget_s=30.0,
                          progress=False, options=replace(QUICK, routes=(TWENTY_ROUTE,)))
    assert report.error == "OutputError: the disk is full"
    assert (report.tuned, report.left, report.rows_written) == ([], [problem], 0)
    assert report.journal is not None and report.journal.exists()
