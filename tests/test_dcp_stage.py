"""The sweep's DCP stage on the CPU: real DCP-2 steps across two gloo processes, started by
`mlatune sweep --gpus 2`; resumed after a kill; crashes and hangs recorded as such."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlatune import table
from mlatune.arch import cpu_device
from mlatune.dcp import SCHEMES
from mlatune.measure.records import Record
from mlatune.problem import MLAProblem
from mlatune.sweep import dcp_stage, spec
from mlatune.sweep.journal import Journal, read
from mlatune.sweep.runner import Candidate

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "MLATUNE_PLUGINS": "tests.fault_routes", "PYTHONPATH": str(ROOT)}
TINY = """routes = {routes}
[budget]
warmup = 0
min_reps = 1
max_reps = 2
max_seconds = 0.1
[[grid]]
num_heads = 2
batch = 2
kv_len = 24
page_size = 8
q_dtype = "fp16"
kv_dtype = "fp16"
dcp_size = [1, 2]
"""
TINY_PROBLEM = MLAProblem(num_heads=2, batch=2, kv_len=24, page_size=8, q_dtype="fp16",
                          kv_dtype="fp16", dcp_size=2)


def sweep(tmp_path: Path, routes: list[str], *args: str) -> subprocess.CompletedProcess:
    spec_file = tmp_path / "tiny.toml"
    spec_file.write_text(TINY.format(routes=json.dumps(routes)))
    cmd = [sys.executable, "-m", "mlatune", "sweep", str(spec_file), "--out",
           str(tmp_path / "t.parquet"), *args]
    done = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def measured(journal: Path) -> list[dict]:
    return [r for r in read(journal)[1] if dcp_stage.is_measured(r)]


def test_the_sweep_measures_dcp_problems_across_two_processes(tmp_path):
    done = sweep(tmp_path, ["reference/torch", "fault-slow/test"], "--gpus", "2",
                 "--dcp-top-k", "1")
    assert "DCP steps measured across processes now: 2" in done.stdout
    records = read(tmp_path / "t.journal.jsonl")[1]
    simulated = {r["route"]: r for r in records if r["key"]["dcp_size"] == 2
                 and not dcp_stage.is_measured(r)}
    got = measured(tmp_path / "t.journal.jsonl")
    # Top 1: only the fastest simulated route (the reference; fault-slow sleeps), each scheme.
    assert sorted((r["route"], r["dcp_scheme"]) for r in got) == [
        ("reference/torch", s) for s in sorted(SCHEMES)]
    for r in got:
        assert r["status"] == "ok" and r["key"]["dcp_size"] == 2, r
        assert r["time_us"] > 0 and 0 <= r["comm_us"] <= r["time_us"]
        assert r["simulated_us"] == simulated["reference/torch"]["time_us"]
        assert r["rel_err"] < 1e-2
    frame = table.read(tmp_path / "t.parquet")
    dcp2 = frame[frame["dcp_size"] == 2].set_index("route")
    assert dcp2.loc["reference/torch", "dcp_timing"] == "measured"
    assert dcp2.loc["reference/torch", "dcp_scheme"] in SCHEMES
    assert dcp2.loc["reference/torch", "time_us"] == min(r["time_us"] for r in got)
    assert dcp2.loc["fault-slow/test", "dcp_timing"] == "simulated"
    assert set(frame.loc[frame["dcp_size"] == 1, "dcp_timing"]) == {""}


def test_without_two_gpus_nothing_is_measured_across_processes(tmp_path):
    sweep(tmp_path, ["reference/torch"])
    assert measured(tmp_path / "t.journal.jsonl") == []
    frame = table.read(tmp_path / "t.parquet")
    assert set(frame.loc[frame["dcp_size"] == 2, "dcp_timing"]) == {"simulated"}


def _simulated(route: str, time_us: float, problem: MLAProblem = TINY_PROBLEM) -> Record:
    return Candidate(problem, route).record(status="ok", reason="", time_us=time_us)


def _journal(path: Path, records: list[Record]) -> Journal:
    """A journal holding ``records`` as a finished one-GPU pass would."""
    device = cpu_device()
    journal = Journal(path, {"spec_sha256": "x", "arch": device.arch,
                             "device_name": device.name}, resume=False)
    journal.extend(records)
    return journal


def run_stage(path: str, timeout_s: float = 60.0) -> int:
    """The DCP stage over the journal at ``path``, as the sweep runs it after its pass."""
    header = read(Path(path))[0]
    journal = Journal(Path(path), {k: v for k, v in header.items() if k != "kind"},
                      resume=True)
    tiny = spec.parse({"budget": {"warmup": 0, "min_reps": 1, "max_reps": 2},
                       "grid": [{"num_heads": 2}]}, "t.toml")
    try:
        return dcp_stage.run(tiny, journal, 2, gpu=False, top_k=5, timeout_s=timeout_s)
    finally:
        journal.close()


def test_a_killed_stage_resumes_without_running_done_tasks_again(tmp_path):
    path = tmp_path / "j.jsonl"
    _journal(path, [_simulated("fault-slow/test", 1.0, TINY_PROBLEM.with_(batch=b))
                    for b in (1, 2)]).close()
    stage = [sys.executable, "-c", f"from tests.test_dcp_stage import run_stage; "
                                   f"run_stage({str(path)!r})"]
    env = {**ENV, "TMPDIR": str(tmp_path)}  # the killed stage's exchange folder stays here
    proc = subprocess.Popen(stage, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not measured(path):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = measured(path)
    assert 1 <= len(before) < 4, "the kill should land mid-stage"
    subprocess.run(stage, env=env, cwd=ROOT, check=True, capture_output=True, timeout=120)
    after = measured(path)
    ids = [r["id"] for r in after]
    assert len(ids) == len(set(ids)) == 4  # 2 problems x 2 schemes, none run twice
    assert after[:len(before)] == before  # what was done stays as it was
    assert {r["status"] for r in after} == {"ok"}


def test_a_crash_a_hang_and_a_wrong_answer_are_recorded_and_the_rest_go_on(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("MLATUNE_PLUGINS", "tests.fault_routes")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    # Simulated times order the tasks: each failure comes before a route that works.
    _journal(tmp_path / "j.jsonl", [
        _simulated("fault-abort/test", 1.0), _simulated("fault-hang/test", 2.0),
        _simulated("fault-wrong/test", 3.0), _simulated("fault-raise/test", 4.0),
        _simulated("reference/torch", 5.0)]).close()
    assert run_stage(str(tmp_path / "j.jsonl"), timeout_s=2.0) == 10
    status = {(r["route"], r["dcp_scheme"]): (r["status"], r["reason"])
              for r in measured(tmp_path / "j.jsonl")}
    for scheme in SCHEMES:
        assert status[("fault-abort/test", scheme)][0] == "crashed"
        assert "SIGABRT" in status[("fault-abort/test", scheme)][1]
        assert status[("fault-hang/test", scheme)] == (
            "timeout", "no result within the 2s timeout (the group was killed)")
        assert status[("fault-wrong/test", scheme)][0] == "rejected_accuracy"
        assert status[("fault-raise/test", scheme)][0] == "crashed"
        assert "always raises" in status[("fault-raise/test", scheme)][1]
        assert status[("reference/torch", scheme)] == ("ok", "")


def test_tasks_are_the_top_k_routes_of_each_problem_with_their_best_params():
    other = TINY_PROBLEM.with_(batch=3)
    records = [
        Candidate(TINY_PROBLEM, "a/x", {"p": 1}).record(status="ok", time_us=5.0),
        Candidate(TINY_PROBLEM, "a/x", {"p": 2}).record(status="ok", time_us=3.0),
        Candidate(TINY_PROBLEM, "b/x").record(status="ok", time_us=4.0),
        # The fastest launch, but an eager caller pays its unshared host plan every call.
        Candidate(TINY_PROBLEM, "c/x").record(status="ok", time_us=2.0, plan_on="host",
                                              plan_host_us=9.0),
        Candidate(TINY_PROBLEM, "d/x").record(status="crashed"),
        Candidate(other.with_(dcp_size=4), "a/x").record(status="ok", time_us=1.0),
        Candidate(other.with_(dcp_size=1), "a/x").record(status="ok", time_us=1.0),
    ]
    tasks = dcp_stage.plan(records, [2], top_k=2)
    assert [(t.candidate.route_id, t.candidate.params, t.scheme) for t in tasks] == [
        ("a/x", {"p": 2}, s) for s in SCHEMES] + [("b/x", {}, s) for s in SCHEMES]
    assert tasks[0].simulated["simulated_us"] == 3.0
    assert len({t.id for t in tasks}) == 4
    assert dcp_stage.plan(records, [2, 4], top_k=1)[-1].problem.dcp_size == 4
    assert dcp_stage.plan(records, [2], top_k=0) == []


@pytest.mark.parametrize("top_k", [-1, "3", True])
def test_a_bad_dcp_top_k_in_a_spec_is_refused(top_k):
    with pytest.raises(spec.SpecError, match="dcp_top_k"):
        spec.parse({"dcp_top_k": top_k, "grid": [{"num_heads": 2}]}, "t.toml")
