"""The benchmark driver (benchmarks/bench.py) run as a user runs it, on the CPU: sweep-cost
over a small journal, whose every result line ends with a command that, run again, prints
that line alone; what it refuses; its list of routines and cases."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MARK = "  $ "  # between a result and the command that reproduces it


def _bench(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/bench.py", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _results(argv: list[str]) -> list[str]:
    done = _bench(argv)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("# routine ")  # the run's header: machine, versions, commit
    return [line for line in lines if not line.startswith("#")]


def _repro(line: str) -> list[str]:
    """The driver's arguments in a result line's command."""
    _, command = line.split(MARK)
    argv = shlex.split(command)
    assert argv[0].startswith("python") and argv[1] == "benchmarks/bench.py"
    return argv[2:]


def _journal(tmp_path: Path) -> Path:
    def rec(device: str, start: float, elapsed: float, heads: int, status: str = "ok") -> dict:
        return {"route": "padded/triton", "status": status, "key": {"num_heads": heads},
                "device": device, "finished_at": start + elapsed, "elapsed_s": elapsed,
                "setup_s": 0.25, "bench_s": elapsed / 2, "time_us": 100.0, "reps": 1000}

    records = [rec("cuda:0", 0, 2, 16), rec("cuda:0", 3, 1, 16),  # 3 s of work in 4 s
               rec("cuda:0", 500, 2, 128),  # after a pause (a resumed call): 2 s in use
               rec("cuda:1", 0, 5, 128, "rejected_accuracy"),
               {"route": "padded/triton", "status": "ok", "key": {"num_heads": 16},
                "time_us": 50.0, "reps": 10},  # a record from before the timing fields
               {"route": "padded/triton", "status": "unsupported", "key": {"num_heads": 8}}]
    path = tmp_path / "sweep.journal.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"kind": "header"}, *records]))
    return path


def test_sweep_cost_sums_each_group_and_how_busy_each_device_was(tmp_path):
    lines = _results(["--routine", "sweep-cost", "--journal", str(_journal(tmp_path))])
    text = [line.split(MARK)[0] for line in lines]
    assert [t.split(": ")[0].rsplit(" ", 1)[1] for t in text] == [
        "16", "128", "total", "cuda:0", "cuda:1"]  # groups, the total, then each device
    assert "num_heads 16: 3 candidates (0 raced); setup 0.5 s," in text[0]
    assert text[0].endswith("kernel 0.2 s")  # 2 x 1000 x 100 us + 10 x 50 us
    assert "num_heads 128: 2 candidates" in text[1] and text[1].endswith("kernel 0.1 s")
    assert "total: 5 candidates" in text[2]
    assert text[3].endswith("cuda:0: 3 candidates, 5.0 s of work in 6.0 s in use (83% busy)")
    assert text[4].endswith("cuda:1: 1 candidates, 5.0 s of work in 5.0 s in use (100% busy)")
    for line in (lines[1], lines[3]):
        assert _results(_repro(line)) == [line]


def test_a_routine_refuses_what_it_cannot_run_here():
    done = _bench(["--routine", "sweep-cost", "--journal", "/nonexistent/journal.jsonl"])
    assert done.returncode == 2 and "/nonexistent/journal.jsonl" in done.stderr
    done = _bench(["--routine", "decode", "--case", "no-such-case"])
    assert done.returncode == 2 and "no-such-case" in done.stderr
    if not torch.cuda.is_available():
        done = _bench(["--routine", "decode", "--case", "quick"])
        assert done.returncode == 2 and "needs a GPU" in done.stderr


def test_every_routine_is_listed_with_its_cases():
    done = _bench(["--list"])
    assert done.returncode == 0
    listed = [line.split(":")[0] for line in done.stdout.splitlines() if line[:1].isalpha()]
    assert listed == ["decode", "prefill", "dcp-step", "select-cost", "step-cost", "sweep-cost"]
    assert "  --case quick: " in done.stdout
