"""`mlatune sweep --refine SECONDS`: measure next where the dispatcher is least sure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlatune import table
from mlatune.cli import app
from mlatune.dispatch import Dispatcher
from mlatune.measure.records import Record, Status
from mlatune.problem import MLAProblem
from mlatune.sweep import refine
from tests.test_predict import DEVICE, _crossing_table, at, crossing_routes  # noqa: F401
from tests.test_shards import tiny_spec

runner = CliRunner()


def test_between_points_are_the_geometric_midpoints_of_each_bucket():
    base = MLAProblem(num_heads=16, page_size=64)
    measured = [base.with_(batch=b, kv_len=k) for b in (1, 4, 16) for k in (256, 1024)]
    found = {(p.batch, p.kv_len) for p in refine.between_points(measured)}
    assert found == {(2, 256), (2, 1024), (8, 256), (8, 1024), (1, 512), (4, 512),
                     (16, 512), (2, 512), (8, 512)}
    other = [base.with_(num_heads=8, batch=b, kv_len=1024) for b in (1, 2)]  # no midpoint
    assert refine.between_points(other) == []


def test_the_least_certain_points_come_first_within_the_budget(tmp_path, crossing_routes):  # noqa: F811
    path = _crossing_table(tmp_path, crossing_routes)
    dispatcher = Dispatcher.load(path, device=DEVICE)
    measured = [MLAProblem.from_key_dict(r) for r in
                table.read(path)[["phase", "num_heads", "qlen", "q_dtype", "kv_dtype",
                                  "causal", "dcp_size", "page_size", "batch", "kv_len",
                                  "d_qk", "d_v"]].drop_duplicates().to_dict("records")]
    records = [Record(status=Status.OK, key=p.key_dict(), setup_s=1.0, bench_s=2.0)
               for p in measured]  # 3 worker seconds per problem
    everything = refine.propose(dispatcher, measured, records, budget_s=1e9)
    assert len(everything) == len(refine.between_points(measured))
    uncertainties = [r.uncertainty for r in everything]
    assert uncertainties == sorted(uncertainties, reverse=True)
    some = refine.propose(dispatcher, measured, records, budget_s=10.0)
    assert [r.problem for r in some] == [r.problem for r in everything[:3]]  # 3 x 3 s <= 10
    assert all(r.seconds == pytest.approx(3.0) for r in some)


def test_a_refining_sweep_grows_the_table_between_its_grid_points(tmp_path):
    spec = tiny_spec(tmp_path)  # batch 1-4 x kv_len 16, 24; the reference only, on the CPU
    out = tmp_path / "tiny.parquet"
    grid = runner.invoke(app, ["sweep", str(spec), "--compile-workers", "0", "--out",
                               str(out)])
    assert grid.exit_code == 0, grid.output
    before = {(p["batch"], p["kv_len"]) for p in table.read(out).to_dict("records")}
    refined = runner.invoke(app, ["sweep", str(spec), "--compile-workers", "0", "--out",
                                  str(out), "--refine", "1000"])
    assert refined.exit_code == 0, refined.output
    # Batches 1-4 have no whole geometric midpoints; kv_len 16 and 24 have 20.
    assert "refine: 4 point(s) between the grid's" in refined.output
    after = {(p["batch"], p["kv_len"]) for p in table.read(out).to_dict("records")}
    assert after - before == {(1, 20), (2, 20), (3, 20), (4, 20)} and before < after
    journal = [json.loads(line) for line in out.with_suffix(".journal.jsonl").read_text()
               .splitlines()[1:]]
    assert {(r["key"]["batch"], r["key"]["kv_len"]) for r in journal} == after


def test_refining_needs_a_measured_grid(tmp_path):
    result = runner.invoke(app, ["sweep", str(tiny_spec(tmp_path)), "--out",
                                 str(tmp_path / "none.parquet"), "--refine", "10"])
    assert result.exit_code == 1
    assert "--refine adds points to a measured grid" in result.output


def test_refining_refuses_fresh_and_shard(tmp_path: Path):
    spec = str(tiny_spec(tmp_path))
    for flags in (["--fresh"], ["--shard", "0/2"]):
        result = runner.invoke(app, ["sweep", spec, "--refine", "10", *flags])
        assert result.exit_code == 2 and "not with --fresh or --shard" in result.output
