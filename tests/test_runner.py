"""The sweep engine on the CPU: statuses for every kind of failure, journal, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from mlatune.arch import cpu_device
from mlatune.measure.records import Record, Status, Task, table_rows
from mlatune.routes.torch_ref import TorchReferenceRoute
from mlatune.sweep import compile_ahead, pool, runner, spec
from mlatune.sweep.journal import Journal, JournalError, read, read_records

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ["fault-abort/test", "fault-hang/test", "fault-wrong/test", "fault-raise/test"]
TINY_BUDGET = {"warmup": 0, "min_reps": 1, "max_reps": 2, "max_seconds": 0.1}


@pytest.fixture(autouse=True)
def fault_plugins(monkeypatch):
    """Fault routes in the workers (through the environment) and here, for plan();
    unregistered afterwards so that no other test's dispatcher can pick them."""
    from tests import fault_routes

    monkeypatch.setenv("MLATUNE_PLUGINS", "tests.fault_routes")
    fault_routes.register_all()
    yield
    fault_routes.unregister_all()


def tiny_spec(routes, **axes):
    grid = {"num_heads": 2, "batch": [1, 2], "kv_len": 24, "page_size": 8, "q_dtype": "fp16",
            "kv_dtype": "fp16", **axes}
    return spec.parse({"routes": routes, "budget": TINY_BUDGET, "grid": [grid]}, "test.toml")


def header():
    device = cpu_device()
    return {"spec_sha256": "x", "arch": device.arch, "device_name": device.name}


def test_every_fault_is_recorded_and_the_sweep_goes_on(tmp_path):
    s = tiny_spec(["reference/torch", *FAULTS])
    journal = Journal(tmp_path / "j.jsonl", header(), resume=False)
    # Each hang waits out the timeout; the others finish well within it (the DCP stage's
    # test gives its groups as long).
    result = runner.run(s, cpu_device(), journal, timeout_s=2)
    journal.close()
    by_route: dict[str, list[Record]] = {}
    for r in result.records:
        by_route.setdefault(r.route, []).append(r)
    assert all(len(v) == 2 for v in by_route.values())  # both problems, every route
    assert {r.status for r in by_route["reference/torch"]} == {Status.OK}
    assert all(r.time_us > 0 for r in by_route["reference/torch"])
    assert all(r.status is Status.CRASHED and "SIGABRT" in r.reason
               for r in by_route["fault-abort/test"])
    assert all(r.status is Status.TIMEOUT for r in by_route["fault-hang/test"])
    assert all(r.status is Status.REJECTED_ACCURACY and r.rel_err > 0.1
               for r in by_route["fault-wrong/test"])
    assert all(r.status is Status.CRASHED and "always raises" in r.reason
               for r in by_route["fault-raise/test"])
    # The journal on disk holds exactly what the run returned, line for line.
    assert read_records(tmp_path / "j.jsonl")[1] == result.records
    assert read(tmp_path / "j.jsonl")[1] == [{"kind": "result", **r.to_json()}
                                             for r in result.records]


def test_two_workers_share_the_problems_and_survive_faults(tmp_path):
    s = tiny_spec(["reference/torch", "fault-abort/test", "fault-wrong/test"],
                  batch=[1, 2, 3], kv_len=[16, 24])
    journal = Journal(tmp_path / "j.jsonl", header(), resume=False)
    records = runner.run(s, cpu_device(), journal, workers=2, timeout_s=20).records
    journal.close()
    statuses = {(r.route, r.problem_key): r.status for r in records}
    assert len(records) == len(statuses) == 6 * 3  # every (problem, route) exactly once
    assert {s for (route, _), s in statuses.items() if route == "reference/torch"} == {"ok"}
    assert {s for (route, _), s in statuses.items() if route == "fault-abort/test"} == {"crashed"}
    assert {s for (route, _), s in statuses.items()
            if route == "fault-wrong/test"} == {"rejected_accuracy"}


def test_unsupported_routes_are_recorded_with_the_reason(tmp_path):
    from mlatune.routes import no, register, unregister
    from mlatune.routes.torch_ref import TorchReferenceRoute

    class Never(TorchReferenceRoute):
        id = "never/test"

        def supports(self, problem, device):
            return no("never serves anything")

    register(Never())
    try:
        s = tiny_spec(["never/test"])
        journal = Journal(tmp_path / "j.jsonl", header(), resume=False)
        records = runner.run(s, cpu_device(), journal).records
    finally:
        unregister("never/test")
    assert [r.status for r in records] == [Status.UNSUPPORTED, Status.UNSUPPORTED]
    assert records[0].reason == "never serves anything"


def test_table_rows_keep_the_fastest_ok_parameters():
    device = cpu_device()
    c = runner.Candidate(spec.parse({"grid": [{"kv_len": 64}]}, "t").problems[0], "r/x")
    records = [
        c.record(status="ok", time_us=5.0, route_params='{"s": 1}'),
        c.record(status="ok", time_us=3.0, route_params='{"s": 2}'),
        c.record(status="rejected_accuracy", reason="bad", route_params='{"s": 4}'),
    ]
    (row,) = table_rows(records, device)
    assert row["route_params"] == '{"s": 2}' and row["time_us"] == 3.0
    assert row["arch"] == "cpu" and row["kv_len"] == 64


def test_journal_refuses_to_overwrite_or_mix(tmp_path):
    path = tmp_path / "j.jsonl"
    Journal(path, header(), resume=False).close()
    with pytest.raises(JournalError, match="--resume"):
        Journal(path, header(), resume=False)
    with pytest.raises(JournalError, match="spec_sha256"):
        Journal(path, {**header(), "spec_sha256": "other"}, resume=True)
    # Results without the header line above them: refused, saying so.
    path.write_text('{"kind": "result", "id": "a", "status": "ok"}\n')
    with pytest.raises(JournalError, match="has no header line"):
        Journal(path, header(), resume=True)


def test_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "j.jsonl"
    j = Journal(path, header(), resume=False)
    j.append({"id": "a", "status": "ok"})
    j.close()
    with path.open("a") as f:
        f.write('{"kind": "result", "id": "b", "sta')
    assert [r["id"] for r in read(path)[1]] == ["a"]
    # Resuming cuts the torn line, so what is appended next reads back whole.
    j = Journal(path, header(), resume=True)
    j.append({"id": "c", "status": "ok"})
    j.close()
    assert [r["id"] for r in read(path)[1]] == ["a", "c"]


def _sweep_cmd(spec_file, out):
    return [sys.executable, "-m", "mlatune", "sweep", str(spec_file), "--out", str(out)]


def _result_ids(journal_path):
    return sorted((r["id"], r["status"]) for r in read(journal_path)[1])


_FAULT_ENV = {**os.environ, "MLATUNE_PLUGINS": "tests.fault_routes", "PYTHONPATH": str(ROOT)}


def _slow_spec(tmp_path, routes: str, batches: str):
    """A spec of one-repetition runs of the given routes over batches x 2 KV lengths."""
    spec_file = tmp_path / "slow.toml"
    spec_file.write_text(
        f"routes = {routes}\n[budget]\nwarmup = 0\nmin_reps = 1\nmax_reps = 1\n"
        f"[[grid]]\nnum_heads = 2\nbatch = {batches}\nkv_len = [16, 32]\npage_size = 8\n"
        'q_dtype = "fp16"\nkv_dtype = "fp16"\n')
    return spec_file


def _planned_ids(spec_file) -> list[tuple[str, str]]:
    """(id, status) of every candidate a whole sweep of ``spec_file`` records here: its
    fault routes run ok, the rest as refused."""
    from mlatune.sweep import candidates

    todo, refused = candidates.plan(spec.load(spec_file, gpu=False), cpu_device())
    return sorted([(c.id, "ok") for c in todo] + [(r.id, r.status.value) for r in refused])


def test_sigkill_then_resume_gives_the_same_rows(tmp_path):
    spec_file = _slow_spec(tmp_path, '["fault-slow/test", "reference/torch"]', "[1, 2, 3]")
    env = _FAULT_ENV
    killed = tmp_path / "killed.parquet"
    journal = killed.with_suffix(".journal.jsonl")
    log = tmp_path / "killed.log"
    proc = subprocess.Popen(_sweep_cmd(spec_file, killed), env=env, cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if journal.exists() and len(read(journal)[1]) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(2)  # the orphaned worker finds its sweep gone and leaves, quietly
    assert "Traceback" not in log.read_text(), log.read_text()
    partial = _result_ids(journal)
    assert 3 <= len(partial) < 12, "the kill should land mid-sweep"
    resumed = subprocess.run([*_sweep_cmd(spec_file, killed), "--resume"], env=env, cwd=ROOT,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _result_ids(journal) == _planned_ids(spec_file)
    assert len(_result_ids(journal)) == 12
    from mlatune import table

    parquet, csv = table.read(killed), table.read(killed.with_suffix(".csv"))
    assert len(parquet) == len(csv) == 12 and set(parquet.route) == set(csv.route)
    assert set(partial) <= set(_result_ids(journal))
    # Candidates finished before the kill were not run again.
    ids = [r["id"] for r in read(journal)[1]]
    assert len(ids) == len(set(ids))
    assert json.loads(journal.read_text().splitlines()[0])["kind"] == "header"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(spec_file, out, when, *args):
    """Run a sweep, send SIGINT to its whole process group (as Ctrl-C in a terminal does)
    once ``when()`` holds, and return (seconds from the signal to exit, exit code, output).
    The sweep starts with SIGINT's default action, as from a terminal: a test run started in
    the background of a shell (``pytest &``) has it ignored, and a child would inherit that."""
    proc = subprocess.Popen([*_sweep_cmd(spec_file, out), *args], env=_FAULT_ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 120
    while not when(proc) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    output, _ = proc.communicate(timeout=60)
    return time.monotonic() - t0, proc.returncode, output


def test_ctrl_c_stops_the_sweep_at_once_and_resume_finishes_it(tmp_path):
    # Per problem (2) the slow route runs, then the hanging one: once the first result is in,
    # a worker hangs, which the sweep must not wait for (stopping it gently takes 10 s).
    spec_file = _slow_spec(tmp_path, '["fault-slow/test", "fault-hang/test"]', "[1]")
    out = tmp_path / "t.parquet"
    journal = out.with_suffix(".journal.jsonl")

    def hanging(proc):
        if journal.exists() and read(journal)[1]:
            time.sleep(0.5)  # the next candidate, the hanging one, is under way
            return True
        return False

    seconds, code, output = _interrupt(spec_file, out, hanging, "--timeout", "60")
    assert seconds < 8, "a candidate in flight is not waited for"
    assert code != 0
    assert "rerun with --resume" in output and "Traceback" not in output, output
    partial = _result_ids(journal)
    assert [status for _, status in partial] == ["ok"]
    resumed = subprocess.run([*_sweep_cmd(spec_file, out), "--resume", "--timeout", "1"],
                             env=_FAULT_ENV, cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    final = _result_ids(journal)
    assert sorted(status for _, status in final) == ["ok"] * 2 + ["timeout"] * 2
    assert set(partial) <= set(final)


def test_ctrl_c_while_a_worker_starts_prints_no_traceback(tmp_path):
    # The worker is importing torch 0.3 s after it appears; before workers were started
    # with SIGINT ignored, this printed its KeyboardInterrupt traceback in about half
    # the runs.
    spec_file = _slow_spec(tmp_path, '["fault-slow/test"]', "[1]")

    def worker_started(proc):
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        if children.exists() and children.read_text().split():
            time.sleep(0.3)
            return True
        return False

    _, code, output = _interrupt(spec_file, tmp_path / "t.parquet", worker_started)
    assert code != 0 and "rerun with --resume" in output
    assert "Traceback" not in output, output


def test_shut_down_kills_every_worker_even_when_interrupted_midway():
    class Process:
        def __init__(self, interrupts: bool):
            self.interrupts, self.asked, self.killed = interrupts, False, False

        def stop(self):
            self.asked = True

        def wait(self, timeout=None):
            if self.interrupts:
                raise KeyboardInterrupt

        def kill(self):
            self.killed = True

    processes = [Process(False), Process(True), Process(False)]
    with pytest.raises(KeyboardInterrupt):
        pool.shut_down(processes, gently=True)
    assert all(p.asked and p.killed for p in processes)
    processes = [Process(False), Process(False)]
    pool.shut_down(processes, gently=False)
    assert all(p.killed and not p.asked for p in processes)


def test_a_worker_process_reports_typed_events(fault_plugins):
    """start, alive, put, get (with a timeout), stop: the pool's verbs on one process;
    a process that dies is a Gone event, not an exception."""
    s = tiny_spec(["reference/torch"])
    worker = pool.WorkerProcess("cpu")
    worker.start()
    try:
        assert isinstance(worker.get(timeout=120), pool.Ready) and worker.alive()
        worker.put(Task(s.problems[0], "reference/torch", {}, 1, asdict(s.budget)))
        assert isinstance(worker.get(timeout=120), pool.InputsReady)
        answer = worker.get(timeout=120)
        assert isinstance(answer, pool.Answer) and answer.result.status is Status.OK
        assert worker.get(timeout=0.01) is None  # nothing more within the timeout
        worker.put(Task(s.problems[0], "fault-abort/test", {}, 1, asdict(s.budget)))
        event = worker.get(timeout=120)
        if isinstance(event, pool.InputsReady):
            event = worker.get(timeout=120)
        assert isinstance(event, pool.Gone) and "SIGABRT" in event.reason
        assert not worker.alive()
    finally:
        worker.kill()


def test_plan_drops_the_reference_where_others_serve_and_cuts_params(monkeypatch):
    from mlatune import routes
    from mlatune.routes import YES, register, unregister
    from mlatune.routes.torch_ref import TorchReferenceRoute

    class Tunable(TorchReferenceRoute):
        id = "tunable/test"

        def supports(self, problem, device):
            return YES if problem.batch == 1 else no_route("batch 1 only")

        def param_space(self, problem, device):
            return [{"split": s} for s in (8, 4, 2, 1)]

    from mlatune.routes import no as no_route

    register(Tunable())
    # Only these two routes exist for this test, whatever else this machine registers.
    real_verdicts = routes.verdicts
    monkeypatch.setattr(routes, "verdicts", lambda problem, device, only=None: real_verdicts(
        problem, device, only or ["reference/torch", "tunable/test"]))
    try:
        s = spec.parse({"max_params_per_route": 2, "grid": [{"batch": [1, 2], "kv_len": 8}]},
                       "t.toml")
        candidates, refused = runner.plan(s, cpu_device(), only=None)
        by_batch = {b: [(c.route_id, c.params) for c in candidates if c.problem.batch == b]
                    for b in (1, 2)}
        # batch 1: the tunable route serves, so the reference is not timed; first 2 params kept
        assert [(r, p) for r, p in by_batch[1] if r == "tunable/test"] == [
            ("tunable/test", {"split": 8}), ("tunable/test", {"split": 4})]
        assert not any(r == "reference/torch" for r, _ in by_batch[1])
        # batch 2: nothing else serves, so the reference runs
        assert [r for r, _ in by_batch[2]] == ["reference/torch"]
        assert any(r.route == "tunable/test" and r.key["batch"] == 2 for r in refused)
        # Naming routes runs exactly those, the reference included.
        named, _ = runner.plan(s, cpu_device(), only=["reference/torch", "tunable/test"])
        assert sum(c.route_id == "reference/torch" for c in named) == 2
        # A route's own cut ([max_params]) overrides the spec's.
        one = spec.parse({"max_params_per_route": 2, "max_params": {"tunable/test": 1},
                          "grid": [{"batch": 1, "kv_len": 8}]}, "t.toml")
        kept, _ = runner.plan(one, cpu_device(), only=None)
        assert [(c.route_id, c.params) for c in kept] == [("tunable/test", {"split": 8})]
        assert one.params_kept("reference/torch") == 2
    finally:
        unregister("tunable/test")


def test_reference_runs_where_every_route_failed(tmp_path, monkeypatch):
    from mlatune import routes

    real_verdicts = routes.verdicts
    monkeypatch.setattr(routes, "verdicts", lambda problem, device, only=None: real_verdicts(
        problem, device, only or ["reference/torch", "fault-wrong/test"]))
    s = spec.parse({"budget": TINY_BUDGET, "grid": [{"num_heads": 2, "batch": [1, 2],
                    "kv_len": 24, "page_size": 8, "q_dtype": "fp16", "kv_dtype": "fp16"}]},
                   "t.toml")
    journal = Journal(tmp_path / "j.jsonl", header(), resume=False)
    records = runner.run(s, cpu_device(), journal).records
    journal.close()
    by_route = {}
    for r in records:
        by_route.setdefault(r.route, []).append(r.status)
    # The wrong route served both problems and failed; the reference then filled in.
    assert by_route == {"fault-wrong/test": ["rejected_accuracy"] * 2,
                        "reference/torch": ["ok", "ok"]}


def test_evaluate_checks_ragged_and_dcp_merge_in_process():
    import torch

    from mlatune.problem import MLAProblem
    from mlatune.sweep.worker import _ProblemCache, evaluate

    problem = MLAProblem(num_heads=2, qlen=2, batch=3, kv_len=30, page_size=4,
                         q_dtype="fp16", kv_dtype="fp16", dcp_size=2)
    calls = []
    task = {"problem": problem.as_dict(), "params": {}, "seed": 3, "budget": TINY_BUDGET,
            "tolerances": {}}
    ok = evaluate({**task, "route": "reference/torch"}, torch.device("cpu"), _ProblemCache(),
                  lambda: calls.append(1))
    assert ok.status is Status.OK and ok.rel_err < 2e-3 and calls == [1]
    assert ok.lse_err is not None and 0 <= ok.lse_err < 1e-2  # DCP: every rank's LSE checked
    alone = evaluate({**task, "route": "reference/torch",
                      "problem": problem.with_(dcp_size=1).as_dict()}, torch.device("cpu"),
                     _ProblemCache())
    # Without DCP the untimed (model-like) case asks for the LSE, so its error is recorded too.
    assert alone.status is Status.OK and alone.lse_err is not None and alone.lse_err < 1e-2
    wrong = evaluate({**task, "route": "fault-wrong/test"}, torch.device("cpu"), _ProblemCache())
    assert wrong.status is Status.REJECTED_ACCURACY
    assert wrong.reason.startswith("model-like inputs, ragged lengths: ")
    # Compiling ahead makes and checks the ragged case only; the timed pass makes both.
    cache = _ProblemCache()
    ahead = evaluate({**task, "route": "reference/torch", "check_only": True},
                     torch.device("cpu"), cache)
    assert ahead.status is Status.CHECKED
    assert [c.name for c in cache.cases.values()] == ["model-like inputs, ragged lengths"]
    assert evaluate({**task, "route": "reference/torch"}, torch.device("cpu"),
                    cache).status is Status.OK
    assert [c.name for c in cache.cases.values()] == ["model-like inputs, ragged lengths",
                                                      "normal inputs, uniform lengths"]
    # Where the cases would not fit together on the GPU, one is held at a time: same verdict.
    lean = _ProblemCache()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mlatune.sweep.worker._too_big", lambda *_: True)
        again = [evaluate({**task, "route": "reference/torch"}, torch.device("cpu"), lean)
                 for _ in range(2)]
        wrong = evaluate({**task, "route": "fault-wrong/test"}, torch.device("cpu"), lean)
    assert [r.status for r in again] == [Status.OK] * 2 and lean.lean
    assert again[0].rel_err == again[1].rel_err == ok.rel_err
    assert list(lean.cases) == [0] and wrong.status is Status.REJECTED_ACCURACY


def test_worker_time_is_split_into_setup_checks_and_timing(tmp_path):
    """Setup is paid by a problem's first candidate only; the sweep sums every part."""
    s = tiny_spec(["reference/torch", "fault-wrong/test"])
    journal = Journal(tmp_path / "j.jsonl", header(), resume=False)
    result = runner.run(s, cpu_device(), journal, timeout_s=20)
    journal.close()
    records = read(tmp_path / "j.jsonl")[1]
    first, second = records[0], records[1]  # a problem's two candidates, in plan order
    assert first["key"] == second["key"] and first["setup_s"] > 0 and second["setup_s"] == 0
    for r in records:
        parts = r["setup_s"] + r["first_check_s"] + r["check_s"] + r["bench_s"]
        assert r["first_check_s"] > 0 and 0 < parts <= r["elapsed_s"]
        assert (r["bench_s"] > 0) == (r["status"] == "ok")
        # fault-wrong fails its first (ragged) check; the reference passes both.
        assert (r["check_s"] > 0) == (r["status"] == "ok")
    assert set(result.seconds) == {"setup_s", "first_check_s", "check_s", "bench_s", "other_s"}
    for part in ("setup_s", "first_check_s", "check_s", "bench_s"):
        assert result.seconds[part] == pytest.approx(sum(r[part] for r in records))
    assert sum(result.seconds.values()) == pytest.approx(sum(r["elapsed_s"] for r in records))


@pytest.mark.parametrize(("spec_text", "extra", "message", "code"), [
    ('routes = ["nope/none"]\n[[grid]]\nkv_len = 8\n', [], "nope/none", 1),  # a bad spec
    ("[[grid]]\nkv_len = 8\n", ["--routes", "nope/none"], "nope/none", 2),  # bad usage
    ("[[grid]]\nkv_len = 8\n", ["--out", "{tmp}/table.txt"], ".parquet or .csv", 2),
])
def test_sweep_refuses_bad_routes_and_outputs_before_writing(tmp_path, spec_text, extra, message,
                                                            code):
    from typer.testing import CliRunner

    from mlatune.cli import app

    spec_file = tmp_path / "s.toml"
    spec_file.write_text(spec_text)
    args = ["sweep", str(spec_file), *[a.format(tmp=tmp_path) for a in extra]]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "t.parquet")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == code and message in result.output
    assert "Traceback" not in result.output
    assert not list(tmp_path.glob("*.journal.jsonl"))  # nothing started


def test_compile_representatives_are_the_smallest_problem_per_route_params_and_bucket():
    s = tiny_spec(["reference/torch"], batch=[4, 1, 2], kv_len=[16, 8], num_heads=[2, 4])
    cands = [runner.Candidate(p, r, params) for p in s.problems
             for r, params in (("reference/torch", {}), ("fault-wrong/test", {"x": 1}),
                               ("fault-wrong/test", {"x": 2}))]
    firsts = compile_ahead.representatives(cands)
    # 2 buckets (heads) x 3 (route, params): each with its batch-1, kv_len-8 problem.
    assert len(firsts) == 6
    assert {(c.problem.num_heads, c.route_id, c.params_json) for c in firsts} == {
        (h, c.route_id, c.params_json) for h in (2, 4) for c in cands[:3]}
    assert all((c.problem.batch, c.problem.kv_len) == (1, 8) for c in firsts)
    # Shuffled, a problem's representatives still come together (inputs made once).
    firsts = compile_ahead.representatives(cands[::-1])
    problems = [c.problem for c in firsts]
    assert problems == sorted(problems, key=problems.index) and len(set(problems)) == 2


def test_compiling_ahead_changes_no_result(tmp_path):
    """The compile pass checks one problem per group in extra workers and journals
    nothing; the sweep after it records what a sweep without it records."""
    s = tiny_spec(["reference/torch", "fault-wrong/test", "fault-abort/test"], kv_len=16)
    seen = []

    class Seen:
        def started(self, total, already_done, what="sweep"):
            seen.append((what, total, already_done))

        def finished(self, record):
            seen.append(record.status)

    results = {}
    for ahead in (0, 2):
        journal = Journal(tmp_path / f"j{ahead}.jsonl", header(), resume=False)
        out = runner.run(s, cpu_device(), journal, timeout_s=20, compile_workers=ahead,
                         observer=Seen() if ahead else None)
        journal.close()
        results[ahead] = {r["id"]: r["status"] for r in read(tmp_path / f"j{ahead}.jsonl")[1]}
        assert ("compile_ahead_wall_s" in out.seconds) == bool(ahead)
    assert results[0] == results[2] and len(results[0]) == 3 * 2
    # Compile pass: one problem (batch 1, kv_len 16) per route; the abort crashes its worker
    # there too, and the sweep goes on to record it properly.
    assert seen[0] == ("compiling", 3, 0)
    assert sorted(seen[1:4]) == ["checked", "crashed", "rejected_accuracy"]
    assert seen[4] == ("sweep", 6, 0)


def test_a_failed_compile_pass_does_not_stop_the_sweep(tmp_path, monkeypatch):
    real_call = pool.WorkerPool.__call__

    def call(self, candidates):
        if candidates and self.task_of(candidates[0]).check_only:
            raise RuntimeError("sweep worker on cpu did not start within 300s")
        return real_call(self, candidates)

    monkeypatch.setattr(pool.WorkerPool, "__call__", call)
    s = tiny_spec(["reference/torch"])
    journal = Journal(tmp_path / "j.jsonl", header(), resume=False)
    result = runner.run(s, cpu_device(), journal, timeout_s=20, compile_workers=1)
    journal.close()
    assert [r.status for r in result.records] == [Status.OK, Status.OK]
    assert "compile_ahead_wall_s" in result.seconds


def test_compile_representatives_bring_new_kernels_first():
    from mlatune.problem import MLAProblem

    base = MLAProblem(num_heads=2, batch=1, kv_len=24, page_size=8, q_dtype="fp16",
                      kv_dtype="fp16")
    p1, p2 = base, base.with_(num_heads=4)  # same route, params and dtypes: likely one kernel
    p3 = base.with_(q_dtype="bf16", kv_dtype="fp8_e4m3fn")  # other dtypes: a new kernel
    cands = [runner.Candidate(p, "reference/torch") for p in (p1, p2, p3)]
    assert [c.problem for c in compile_ahead.representatives(cands)] == [p1, p3, p2]


class SaturatingRoute(TorchReferenceRoute):
    """A wrong route that standard normal data cannot tell from a right one: it clips q at
    8 of q's standard deviations (as a static quantizer calibrated on normal activations
    would), which normal values never reach and outlier channels do."""

    id = "fault-saturating/test"

    def prepare(self, problem, inputs, **kwargs):
        reach = 8 * float(inputs.q.float().std())
        clipped = inputs.q.float().clamp(-reach, reach).to(inputs.q.dtype)
        return super().prepare(problem, replace(inputs, q=clipped), **kwargs)


def test_a_route_right_on_normal_inputs_is_rejected_on_model_like_ones():
    import torch

    from mlatune import routes
    from mlatune.check import reference
    from mlatune.check.accuracy import check
    from mlatune.check.inputs import make_inputs
    from mlatune.problem import MLAProblem
    from mlatune.sweep.worker import _Case, _ProblemCache, _run_checked, evaluate

    problem = MLAProblem(num_heads=4, qlen=2, batch=3, kv_len=200, page_size=16,
                         q_dtype="fp16", kv_dtype="fp16")
    task = {"problem": problem.as_dict(), "params": {}, "seed": 5, "budget": TINY_BUDGET,
            "tolerances": {}}

    def errors(route, cases):
        return [check(problem, _run_checked(problem, route, {}, case, torch.device("cpu")).out,
                      case.ref[0]) for case in cases]

    saturating = SaturatingRoute()
    routes.register(saturating)
    try:
        cache = _ProblemCache()
        wrong = evaluate({**task, "route": saturating.id}, torch.device("cpu"), cache)
        # Standard normal inputs, on uniform lengths (the sweep's) and on ragged ones.
        ragged = make_inputs(problem, 11, ragged=True)
        uniform = cache.case(problem, task["seed"], torch.device("cpu"), 1)
        normal = errors(saturating, [uniform, _Case("ragged", ragged, reference.run(ragged))])
    finally:
        routes.unregister(saturating.id)
    assert wrong.status is Status.REJECTED_ACCURACY
    assert wrong.reason.startswith("model-like inputs, ragged lengths: rel_l2")
    assert uniform.name == "normal inputs, uniform lengths"
    assert all(acc.ok and acc.rel_l2 < 1e-3 for acc in normal)
    # A right route passes both families; its record keeps the worse of the two checks.
    ok = evaluate({**task, "route": "reference/torch"}, torch.device("cpu"), cache)
    worst = max(acc.rel_l2 for acc in errors(routes.get("reference/torch"),
                                              cache.cases.values()))
    assert ok.status is Status.OK and ok.rel_err == worst > 0


def test_status_counts_take_each_planned_candidate_once_by_its_latest_record():
    """A candidate rerun after a crash counts as its rerun's status; a record of a candidate
    outside this run's plan (another --routes) is not counted: the statuses add up to the
    candidates."""
    from mlatune.problem import MLAProblem
    from mlatune.sweep.candidates import Candidate
    from mlatune.sweep.runner import SweepResult

    problem = MLAProblem(num_heads=4, q_dtype="fp16", kv_dtype="fp16", page_size=8, kv_len=16)
    planned = Candidate(problem, "reference/torch", {})
    other = Candidate(problem, "padded/triton", {"num_splits": 1})
    records = [planned.record(status="crashed", reason="killed"),
               planned.record(status="ok", time_us=5.0, rel_err=0.0, max_abs_err=0.0),
               other.record(status="ok", time_us=4.0, rel_err=0.0, max_abs_err=0.0)]
    result = SweepResult(records, 1.0, 1, planned=1, plan_ids=frozenset({planned.id}))
    assert result.counts == {Status.OK: 1}
