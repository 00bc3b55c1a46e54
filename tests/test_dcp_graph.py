"""Timing the DCP step from a CUDA graph, on the CPU: every way of asking for it without
GPUs refuses with one clear line, task files written before it read as eager, and the
report says which measured rows were graph-timed. (The capture itself:
tests/test_dcp_graph_gpu.py, on a GPU.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from mlatune import report
from mlatune.cli import app
from mlatune.sweep import dcp_graph, dcp_group, dcp_stage, spec
from mlatune.sweep.dcp_stage import Settings
from mlatune.sweep.journal import Journal
from mlatune.sweep.runner import Candidate
from tests.table_helpers import make_table, result_row
from tests.test_dcp_stage import ENV, ROOT, TINY, TINY_PROBLEM
from tests.test_dcp_table import DCP2, measured_row


def test_a_cpu_or_gloo_group_cannot_time_from_a_graph():
    assert dcp_graph.refusal(torch.device("cpu"), "gloo") == dcp_graph.REFUSAL
    assert "gloo" in dcp_graph.REFUSAL and "NCCL" in dcp_graph.REFUSAL


def test_the_sweep_refuses_dcp_graph_without_gpus(tmp_path):
    result = CliRunner().invoke(app, ["sweep", "--gpus", "2", "--dcp-graph", "--out",
                                      str(tmp_path / "t.parquet")])
    assert result.exit_code == 1
    assert "--dcp-graph" in result.output and "gloo" in result.output
    assert not (tmp_path / "t.journal.jsonl").exists()


def test_the_stage_refuses_a_graph_on_cpu_processes(tmp_path):
    spec_file = tmp_path / "tiny.toml"
    spec_file.write_text(TINY.format(routes='["reference/torch"]'))
    tiny = spec.load(spec_file, gpu=False)
    journal = Journal(tmp_path / "j.jsonl", {"spec": "smoke"}, resume=False)
    try:
        with pytest.raises(ValueError, match="gloo"):
            dcp_stage.run(tiny, journal, 2, gpu=False, graph=True)
    finally:
        journal.close()


def test_a_rank_started_by_hand_refuses_graph_on_the_cpu(tmp_path):
    with pytest.raises(SystemExit) as exited:
        dcp_group.main(["--journal", str(tmp_path / "j.jsonl"), "--device", "cpu", "--graph"])
    assert exited.value.code == 2


def test_the_benchmark_refuses_graph_on_the_cpu():
    done = subprocess.run([sys.executable, "benchmarks/bench.py", "--routine", "dcp-step",
                           "--cpu", "--graph"],
                          env={**ENV, "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": "0"},
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "gloo" in done.stderr, done.stderr


def test_task_files_from_before_graph_timing_read_as_eager(tmp_path):
    task = dcp_stage.DcpTask(Candidate(TINY_PROBLEM, "reference/torch"), "ag_rs", {})
    path = tmp_path / "tasks.json"
    dcp_stage.write_tasks(path, Settings(seed=1, budget={}, tolerances={}), [task])
    old = json.loads(path.read_text())
    del old["graph"]
    path.write_text(json.dumps(old))
    settings, tasks = dcp_stage.read_tasks(path)
    assert settings.graph is False and tasks == [task]


def test_the_report_says_which_measured_rows_were_graph_timed():
    frame = make_table([result_row(DCP2, "gluon/triton", 10.0),
                        measured_row(DCP2, "padded/triton", 50.0, 30.0),
                        measured_row(DCP2, "cprr/triton", 40.0, 25.0, scheme="a2a")
                        | {"timer": "cuda_event"}])
    rows = report.dcp_measured(frame).set_index("route")["timed"].to_dict()
    assert rows == {"padded/triton": "graph", "cprr/triton": "eager"}
