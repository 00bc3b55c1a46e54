"""Schema v3's DCP columns: measured rows rank first, older tables read as simulated, the
sweep's rows, merge, and `mlatune report` / `show` / `export` over measured rows."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from typer.testing import CliRunner

from mlatune import table
from mlatune.cli import app
from mlatune.measure.records import table_rows
from mlatune.problem import MLAProblem
from mlatune.sweep.runner import Candidate
from mlatune.table.schema import DCP_COLUMNS, SCHEMA_VERSION
from tests.table_helpers import H200, PROVENANCE, make_table, result_row
from tests.test_table import write_raw

DCP2 = MLAProblem(num_heads=16, qlen=1, batch=8, kv_len=4096, dcp_size=2)
PLAIN = DCP2.with_(dcp_size=1)


def measured_row(problem: MLAProblem, route: str, time_us: float, simulated_us: float,
                 scheme: str = "ag_rs", comm_us: float = 20.0) -> dict:
    return result_row(problem, route, time_us) | {
        "dcp_timing": "measured", "dcp_scheme": scheme, "comm_us": comm_us,
        "simulated_us": simulated_us}


def dcp_table() -> pd.DataFrame:
    return make_table([
        result_row(DCP2, "gluon/triton", 10.0),  # simulated, fastest
        measured_row(DCP2, "padded/triton", 50.0, 30.0),
        measured_row(DCP2, "cprr/triton", 40.0, 25.0, scheme="a2a", comm_us=16.0),
        result_row(PLAIN, "padded/triton", 12.0),
    ])


def ranks(frame: pd.DataFrame, problem: MLAProblem) -> dict[str, int]:
    rows = frame[frame["dcp_size"] == problem.dcp_size]
    return dict(zip(rows["route"], rows["rank"], strict=True))


def test_measured_rows_rank_ahead_of_faster_simulated_ones():
    frame = dcp_table()
    assert table.validate(frame) == []
    assert ranks(frame, DCP2) == {"cprr/triton": 1, "padded/triton": 2, "gluon/triton": 3}
    timing = dict(zip(frame["route"] + frame["dcp_size"].astype(str), frame["dcp_timing"],
                      strict=True))
    assert timing == {"gluon/triton2": "simulated", "padded/triton2": "measured",
                      "cprr/triton2": "measured", "padded/triton1": ""}
    assert table.winners(frame).set_index("dcp_size").loc[2, "route"] == "cprr/triton"


def test_ranks_by_time_alone_are_refused_where_a_row_was_measured():
    frame = dcp_table()
    by_time = frame.assign(rank=frame.groupby("dcp_size")["time_us"].rank().astype("int64"))
    assert any("measured DCP rows rank after simulated ones" in p
               for p in table.validate(by_time))


@pytest.mark.parametrize(("route", "change", "problem"), [
    ("gluon/triton", {"dcp_timing": ""}, "does not fit their dcp_size"),
    ("gluon/triton", {"dcp_timing": "guessed"}, "unknown dcp_timing"),
    ("cprr/triton", {"dcp_scheme": "ring"}, "dcp_scheme that does not fit"),
    ("gluon/triton", {"dcp_scheme": "a2a"}, "dcp_scheme that does not fit"),
])
def test_dcp_columns_that_contradict_each_other_are_refused(route, change, problem):
    frame = dcp_table()
    at = (frame["route"] == route) & (frame["dcp_size"] == 2)
    for column, value in change.items():
        frame.loc[at, column] = value
    assert any(problem in p for p in table.validate(frame)), table.validate(frame)


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_a_v2_table_reads_with_its_dcp_rows_simulated(tmp_path, suffix):
    v2 = make_table([result_row(DCP2, "gluon/triton", 10.0),
                     result_row(PLAIN, "padded/triton", 12.0)])
    v2 = v2.drop(columns=list(DCP_COLUMNS)).assign(schema_version=2)
    provenance = {**PROVENANCE.as_dict(), "schema_version": 2}
    write_raw(v2, tmp_path / f"t.{suffix}",
              metadata={"schema_version": 2, "provenance": [provenance]})
    frame, stored = table.read_versioned(tmp_path / f"t.{suffix}")
    assert stored == 2 and (frame["schema_version"] == SCHEMA_VERSION).all()
    assert (frame["converted_from"] == "v2").all() and table.validate(frame) == []
    assert dict(zip(frame["dcp_size"], frame["dcp_timing"], strict=True)) == {
        2: "simulated", 1: ""}
    assert (frame["dcp_scheme"] == "").all()
    assert frame[["comm_us", "simulated_us"]].isna().all().all()
    upgraded = CliRunner().invoke(app, ["upgrade", str(tmp_path / f"t.{suffix}"), "--out",
                                        str(tmp_path / "new.parquet")], terminal_width=250)
    assert upgraded.exit_code == 0, upgraded.output
    assert f"from schema v2 to v{SCHEMA_VERSION}" in upgraded.output
    assert "DCP rows timed 'simulated'" in upgraded.output
    assert table.read_versioned(tmp_path / "new.parquet")[1] == SCHEMA_VERSION


def test_the_sweep_row_is_the_measured_run_even_when_it_failed():
    simulated = Candidate(DCP2, "padded/triton").record(status="ok", reason="", time_us=30.0)
    measured = [{**simulated.to_json(), "id": f"m{i}", "dcp_timing": "measured",
                 "dcp_scheme": scheme, "status": status, "time_us": t, "comm_us": 9.0,
                 "simulated_us": 30.0}
                for i, (scheme, status, t) in enumerate([("ag_rs", "ok", 50.0),
                                                         ("a2a", "ok", 45.0)])]
    rows = table_rows([simulated, *measured], H200)
    assert len(rows) == 1
    assert (rows[0]["dcp_timing"], rows[0]["dcp_scheme"], rows[0]["time_us"]) == (
        "measured", "a2a", 45.0)
    crashed = {**simulated.to_json(), "id": "c", "dcp_timing": "measured", "dcp_scheme": "ag_rs",
               "status": "crashed", "reason": "a DCP rank died with SIGSEGV"}
    row = table_rows([simulated, crashed], H200)[0]
    assert (row["status"], row["dcp_timing"]) == ("crashed", "measured")
    plain = table_rows([simulated], H200)[0]
    assert "dcp_timing" not in plain and math.isnan(plain["simulated_us"])
    built = make_table([plain])
    assert built.loc[0, "dcp_timing"] == "simulated"


def test_merge_keeps_the_measured_row_over_a_simulated_one():
    simulated = make_table([result_row(DCP2, "padded/triton", 30.0),
                            result_row(DCP2, "gluon/triton", 10.0)])
    measured = make_table([measured_row(DCP2, "padded/triton", 50.0, 30.0)])
    merged = table.merge([simulated, measured])
    padded = merged[merged["route"] == "padded/triton"].iloc[0]
    assert (padded["dcp_timing"], padded["time_us"], padded["rank"]) == ("measured", 50.0, 1)
    assert table.validate(merged) == []


def test_report_show_and_export_with_measured_rows(tmp_path):
    path = table.write(dcp_table(), tmp_path / "t.parquet")
    cli = CliRunner()
    report = cli.invoke(app, ["report", str(path), "--out", str(tmp_path / "report")],
                        terminal_width=250)
    assert report.exit_code == 0, report.output
    assert "DCP measured across processes against its one-GPU simulation" in report.output
    # cprr/triton: 40 us measured over 25 us simulated, 16 of its 40 us communication.
    assert "1.60x" in report.output and "40%" in report.output
    page = (tmp_path / "report" / "report.html").read_text()
    assert 'id="dcp-measured"' in page and "cprr/triton" in page
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert {(r["route"], r["scheme"]) for r in summary["dcp_measured"]} == {
        ("cprr/triton", "a2a"), ("padded/triton", "ag_rs")}
    show = cli.invoke(app, ["show", str(path)], terminal_width=250)
    assert show.exit_code == 0 and "cprr/triton" in show.output, show.output
    exported = cli.invoke(app, ["export", str(path), "--format", "json", "--out",
                                str(tmp_path / "t.json")])
    assert exported.exit_code == 0, exported.output
    document = json.loads((tmp_path / "t.json").read_text())
    winners = document["devices"][0]["winners"]
    assert any(w["route"] == "cprr/triton" for w in winners.values())


def test_an_upgrade_over_the_table_leaves_another_file_beside_it(tmp_path):
    """`mlatune upgrade t.csv` writes t.csv and t.parquet beside it, but a t.parquet already
    there may be another table: it is left as it is, not overwritten."""
    v2 = make_table([result_row(PLAIN, "padded/triton", 12.0)])
    v2 = v2.drop(columns=list(DCP_COLUMNS)).assign(schema_version=2)
    provenance = {**PROVENANCE.as_dict(), "schema_version": 2}
    write_raw(v2, tmp_path / "t.csv", metadata={"schema_version": 2, "provenance": [provenance]})
    other = tmp_path / "t.parquet"
    other.write_bytes(b"another table's bytes")
    upgraded = CliRunner().invoke(app, ["upgrade", str(tmp_path / "t.csv"), "--json"])
    assert upgraded.exit_code == 0, upgraded.output
    assert json.loads(upgraded.output)["written"] == [str(tmp_path / "t.csv")]
    assert other.read_bytes() == b"another table's bytes"
    assert table.read_versioned(tmp_path / "t.csv")[1] == SCHEMA_VERSION
    (tmp_path / "t.parquet").unlink()  # nothing there: both formats, as a sweep writes them
    write_raw(v2, tmp_path / "t.csv", metadata={"schema_version": 2, "provenance": [provenance]})
    upgraded = CliRunner().invoke(app, ["upgrade", str(tmp_path / "t.csv"), "--json"])
    assert sorted(json.loads(upgraded.output)["written"]) == sorted(
        str(tmp_path / f"t.{s}") for s in ("csv", "parquet"))
