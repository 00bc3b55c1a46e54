"""Schema v2: per-step plan columns, the v1 converter, `mlatune upgrade`, the JSON map."""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from mlatune import table
from mlatune.cli import app
from mlatune.dispatch import Dispatcher, dispatcher
from mlatune.problem import MLAProblem
from mlatune.routes import FACTS as KINDS
from mlatune.table import winners_map
from mlatune.table.schema import (
    COLUMNS,
    DCP_COLUMNS,
    PROVENANCE_TYPES,
    SCHEMA_VERSION,
    STEP_COST_COLUMNS,
    STEP_KIND_COLUMNS,
)
from tests.table_helpers import H200, PROVENANCE, make_table, result_row
from tests.test_table import refused, write_raw

REPO = Path(__file__).resolve().parents[1]
DECODE = MLAProblem(num_heads=16, qlen=1, batch=4, kv_len=2048)
PREFILL = MLAProblem(phase="prefill", num_heads=16, qlen=128, kv_len=128)
PERSISTENT = {"block_m": 16, "block_n": 64, "num_stages": 2, "num_warps": 4,
              "persistent": True}
SPLIT = {"block_m": 16, "block_n": 64, "num_splits": 8, "num_stages": 2, "num_warps": 4}
# (problem, route, params, time_us or None) -> the (plan_on, capturable) it declares
DECLARED = {
    (DECODE, "padded/triton", json.dumps(PERSISTENT), 10.0): ("device", True),
    (DECODE.with_(batch=8), "padded/triton", json.dumps(SPLIT), 12.0): ("none", True),
    (DECODE, "reference/torch", "{}", 400.0): ("none", False),
    (PREFILL, "sdpa/torch", "{}", 30.0): ("host", False),
    (DECODE, "plugin/absent", "{}", 9.0): ("host", False),  # not registered here
    (DECODE.with_(batch=8), "reference/torch", "{}", None): ("none", False),  # crashed
}
STEP_COLUMNS = (*STEP_KIND_COLUMNS, *STEP_COST_COLUMNS)
V1_PROVENANCE = {**{k: v for k, v in PROVENANCE.as_dict().items() if k != "converted_from"},
                 "schema_version": 1}


def v2_table(**step: object) -> pd.DataFrame:
    rows = [result_row(p, route, t, params=json.loads(params)) | step
            for p, route, params, t in DECLARED]
    return make_table(rows)


def write_v1(frame: pd.DataFrame, path: Path) -> Path:
    """``frame`` as mlatune 0.1 wrote it: no step or DCP columns, schema_version 1."""
    old = frame.drop(columns=[*STEP_COLUMNS, *DCP_COLUMNS, "converted_from"]).assign(
        schema_version=1)
    write_raw(old, path, metadata={"schema_version": 1, "provenance": [V1_PROVENANCE]})
    return path


def declared(frame: pd.DataFrame) -> dict[str, tuple[str, bool]]:
    rows = frame.drop_duplicates(["route", "route_params"])
    return {(r, p): (o, bool(c)) for r, p, o, c in zip(
        rows["route"], rows["route_params"], rows["plan_on"], rows["capturable"], strict=True)}


EXPECTED = {(route, params): kind for (_, route, params, _), kind in DECLARED.items()}


# The converter --------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_a_v1_table_reads_as_v2_with_the_declared_step_kinds(tmp_path, suffix):
    native = v2_table()
    frame, stored = table.read_versioned(write_v1(native, tmp_path / f"t.{suffix}"),
                                         facts=KINDS)
    assert stored == 1 and list(frame.columns) == list(COLUMNS)
    assert table.validate(frame) == []
    assert declared(frame) == EXPECTED
    assert frame[list(STEP_COST_COLUMNS)].isna().all().all()  # never measured
    assert (frame["schema_version"] == SCHEMA_VERSION).all()
    assert (frame["converted_from"] == "v1").all()
    # Everything v1 held is kept as it was.
    kept = [c for c in COLUMNS if c not in (*STEP_COLUMNS, *PROVENANCE_TYPES)]
    pd.testing.assert_frame_equal(frame[kept], native[kept], check_exact=True)
    assert table.provenances(frame) == [{**PROVENANCE.as_dict(), "converted_from": "v1"}]


def test_a_native_v2_table_says_so(tmp_path):
    frame, stored = table.read_versioned(table.write(v2_table(), tmp_path / "t.parquet"),
                                         facts=KINDS)
    assert stored == SCHEMA_VERSION and (frame["converted_from"] == "").all()


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_a_newer_table_is_still_refused_with_or_without_the_step_columns(tmp_path, suffix):
    newer = v2_table().assign(schema_version=SCHEMA_VERSION + 1)
    write_raw(newer, tmp_path / f"t.{suffix}")
    assert f"schema_version {SCHEMA_VERSION + 1} is newer than this mlatune reads" in refused(
        tmp_path / f"t.{suffix}")
    write_raw(newer.drop(columns=list(STEP_COLUMNS)), tmp_path / f"u.{suffix}")
    assert "is newer than this mlatune reads" in refused(tmp_path / f"u.{suffix}")


def test_a_table_mixing_versions_is_refused():
    mixed = v2_table()
    mixed.loc[0, "schema_version"] = 1
    assert any(f"schema_version 1 rows in a schema v{SCHEMA_VERSION} table" in p
               for p in table.validate(mixed))


def test_a_v1_parquet_whose_metadata_disagrees_is_still_refused(tmp_path):
    old = v2_table().drop(columns=[*STEP_COLUMNS, *DCP_COLUMNS, "converted_from"]).assign(
        schema_version=1)
    write_raw(old, tmp_path / "t.parquet", metadata={
        "schema_version": 1, "provenance": [{**V1_PROVENANCE, "torch_version": "1.0"}]})
    assert "metadata provenance does not match" in refused(tmp_path / "t.parquet")


def test_the_table_shipped_before_v2_loads_as_before():
    # The v1 table shipped before 2026-11-30 (the rows of every 40th problem, and of every
    # 40th with a persistent padded/triton row).
    old = REPO / "tests" / "data" / "sm_90-h200-v1.parquet"
    frame, stored = table.read_versioned(old, facts=KINDS)
    assert stored == 1 and (frame["converted_from"] == "v1").all()
    persistent = frame["route_params"].str.contains('"persistent": true')
    padded = frame["route"] == "padded/triton"
    assert (frame.loc[padded & persistent, "plan_on"] == "device").all()
    assert (frame.loc[padded & ~persistent, "plan_on"] == "none").all()
    assert frame.loc[padded, "capturable"].all()
    assert (frame.loc[frame["route"].str.endswith("/aiter"), "plan_on"] == "host").all()
    assert frame["plan_us"].isna().all()  # never measured: v1 had no plan costs


def test_the_shipped_table_has_measured_plan_costs_and_simulated_dcp_rows(monkeypatch, tmp_path):
    # Measured as v2, joined by `mlatune merge` with a re-time of FlashMLA measured as v3,
    # then ranked by step cost as v4, then routes re-swept as today's schema (no conversion):
    # each row's provenance says what it was measured as.
    frame, stored = table.read_versioned(REPO / "tables" / "sm_90-h200.parquet",
                                         facts=KINDS)
    assert stored == SCHEMA_VERSION and set(frame["converted_from"]) == {"v2", "v3", ""}
    dcp = frame["dcp_size"] > 1
    assert dcp.any() and (frame.loc[dcp, "dcp_timing"] == "simulated").all()
    assert (frame.loc[~dcp, "dcp_timing"] == "").all() and frame["simulated_us"].isna().all()
    from_csv = table.read(table.write(frame, tmp_path / "t.csv.gz"), facts=KINDS)
    pd.testing.assert_frame_equal(from_csv, frame, check_exact=True)
    ok = frame["status"] == "ok"
    persistent = frame["route_params"].str.contains('"persistent": true')
    padded = frame["route"] == "padded/triton"
    device_planned = ok & ((padded & persistent) | (frame["route"] == "dense/flashmla"))
    assert device_planned.any() and (frame.loc[device_planned, "plan_on"] == "device").all()
    assert (frame.loc[device_planned, "plan_us"] > 0).all()
    host_planned = ok & frame["route"].str.endswith("/flashinfer")
    assert host_planned.any() and (frame.loc[host_planned, "plan_on"] == "host").all()
    assert (frame.loc[host_planned, "plan_host_us"] > 0).all()
    assert not frame.loc[host_planned, "capturable"].any()

    monkeypatch.delenv(dispatcher.TABLE_ENV, raising=False)
    bundled = Dispatcher.from_bundled(H200)
    assert bundled.source.endswith("sm_90-h200.parquet")
    won = table.winners(frame)
    won = won[won["route"] == "padded/triton"].iloc[[0]]
    choice = bundled.select(MLAProblem.from_key(table.key_strings(won)[0]))
    assert choice.source == "table"


# Building from sweep records -----------------------------------------------------------

def test_a_record_with_the_step_fields_keeps_them():
    measured = {"plan_on": "device", "capturable": True, "plan_us": 1.5, "plan_host_us": 9.0,
                "launch_host_us": 20.0}
    rows = [result_row(DECODE, "padded/triton", 10.0, params=PERSISTENT) | measured,
            # A route's record is believed over the declaration here (it measured the step).
            result_row(DECODE, "other/fake", 11.0) | measured,
            result_row(DECODE, "reference/torch", None, status="crashed")]
    frame = make_table(rows).set_index("route")
    for name, value in measured.items():
        assert frame.loc["padded/triton", name] == value
        assert frame.loc["other/fake", name] == value
    crashed = frame.loc["reference/torch"]
    assert (crashed["plan_on"], crashed["capturable"]) == ("none", False)  # declared
    assert all(math.isnan(crashed[c]) for c in STEP_COST_COLUMNS)


def test_a_record_without_the_step_fields_gets_the_declaration_and_nan_costs():
    frame = v2_table()
    assert declared(frame) == EXPECTED
    assert frame[list(STEP_COST_COLUMNS)].isna().all().all()
    assert frame["capturable"].dtype == bool and table.validate(frame) == []


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_step_columns_round_trip(tmp_path, suffix):
    frame = v2_table(plan_us=0.0, plan_host_us=3.25, launch_host_us=0.1 + 0.2)
    frame.loc[frame["plan_on"] == "device", "plan_us"] = 2.5
    frame.loc[frame["status"] != "ok", list(STEP_COST_COLUMNS)] = np.nan
    back = table.read(table.write(frame, tmp_path / f"t.{suffix}"), facts=KINDS)
    pd.testing.assert_frame_equal(back, frame, check_exact=True)


# Validation ----------------------------------------------------------------------------

def test_each_invalid_step_value_is_named(tmp_path):
    frame = v2_table()
    host = frame.index[frame["plan_on"] == "host"][0]
    planless = frame.index[(frame["plan_on"] == "none") & (frame["status"] == "ok")][0]
    cases = {
        "unknown plan_on 'gpu'": lambda f: f.assign(
            plan_on=f["plan_on"].mask(f.index == 0, "gpu")),
        "1 rows planned on the host are capturable": lambda f: f.assign(
            capturable=f["capturable"].mask(f.index == host, True)),
        "1 ok rows with plan_on 'none' have a plan_us other than 0": lambda f: f.assign(
            plan_us=f["plan_us"].mask(f.index == planless, 4.0)),
        "column launch_host_us has 1 values that are not a finite duration": lambda f: f.assign(
            launch_host_us=f["launch_host_us"].mask(f.index == 0, -1.0)),
        "column plan_host_us has 1 values that are not a finite duration": lambda f: f.assign(
            plan_host_us=f["plan_host_us"].mask(f.index == 0, math.inf)),
        "column capturable has dtype boolean, expected bool": lambda f: f.assign(
            capturable=f["capturable"].astype("boolean").mask(f.index == 0, pd.NA)),
    }
    for expected, damage in cases.items():
        problems = table.validate(damage(frame.copy()))
        assert any(expected in p for p in problems), (expected, problems)
    # A file with such a row is refused as it is read.
    write_raw(cases["1 rows planned on the host are capturable"](frame.copy()),
              tmp_path / "t.csv")
    assert "planned on the host are capturable" in refused(tmp_path / "t.csv")


# mlatune upgrade -----------------------------------------------------------------------

runner = CliRunner()


def test_upgrade_writes_current_parquet_and_csv_that_read_as_the_converter_reads(tmp_path):
    source = write_v1(v2_table(), tmp_path / "old.parquet")
    expected = table.read(source, facts=KINDS)
    result = runner.invoke(app, ["upgrade", str(source), "--out", str(tmp_path / "new.csv")])
    assert result.exit_code == 0, result.output
    assert f"from schema v1 to v{SCHEMA_VERSION}" in result.output
    assert "new.parquet" in result.output
    for suffix in ("parquet", "csv"):
        back, stored = table.read_versioned(tmp_path / f"new.{suffix}", facts=KINDS)
        assert stored == SCHEMA_VERSION
        pd.testing.assert_frame_equal(back, expected, check_exact=True)
    before = (tmp_path / "new.parquet").read_bytes()
    again = runner.invoke(app, ["upgrade", str(tmp_path / "new.parquet")])
    assert again.exit_code == 0 and f"already v{SCHEMA_VERSION}; nothing written" in again.output
    assert (tmp_path / "new.parquet").read_bytes() == before


def test_upgrade_in_place_and_refusals(tmp_path):
    source = write_v1(v2_table(), tmp_path / "t.csv")
    result = runner.invoke(app, ["upgrade", str(source)])
    assert result.exit_code == 0, result.output
    assert table.read_versioned(source, facts=KINDS)[1] == SCHEMA_VERSION
    assert table.read_versioned(tmp_path / "t.parquet", facts=KINDS)[1] == SCHEMA_VERSION
    bad = runner.invoke(app, ["upgrade", str(source), "--out", str(tmp_path / "t.json")])
    assert bad.exit_code != 0 and "name the table .parquet or .csv" in bad.output
    newer = tmp_path / "newer.parquet"
    write_raw(v2_table().assign(schema_version=SCHEMA_VERSION + 1), newer)
    refused_newer = runner.invoke(app, ["upgrade", str(newer)])
    assert refused_newer.exit_code != 0 and "is newer than this mlatune" in refused_newer.output


# The JSON winners map -------------------------------------------------------------------

def test_the_json_map_carries_the_step_fields_per_option(tmp_path):
    frame = v2_table(plan_us=0.0, plan_host_us=3.0, launch_host_us=7.0)
    document = table.winners_json(frame)
    assert document["schema_version"] == SCHEMA_VERSION
    options = [o for d in document["devices"] for w in d["winners"].values()
               for o in (w, *w["alternatives"])]
    assert options and all(set(STEP_COLUMNS) <= set(o) for o in options)
    assert {(o["route"], o["plan_on"], o["capturable"]) for o in options} >= {
        ("padded/triton", "device", True), ("sdpa/torch", "host", False)}
    unmeasured = table.winners_json(v2_table())  # NaN costs are null, never NaN
    path = table.write_json(unmeasured, tmp_path / "sm_90.json")
    winners = winners_map.read(path, facts=KINDS).document["devices"][0]["winners"]
    first = next(iter(winners.values()))
    assert all(first[c] is None for c in STEP_COST_COLUMNS)


def test_a_v1_json_map_is_upgraded_as_it_is_read(tmp_path):
    document = table.winners_json(v2_table())
    document["schema_version"] = 1
    for device in document["devices"]:
        device["provenance"] = [V1_PROVENANCE]
        for winner in device["winners"].values():
            for option in (winner, *winner["alternatives"]):
                for name in STEP_COLUMNS:
                    del option[name]
    path = table.write_json(document, tmp_path / "sm_90.json")
    read = winners_map.read(path, facts=KINDS).document
    assert read["schema_version"] == SCHEMA_VERSION
    assert read["devices"][0]["provenance"][0]["converted_from"] == "v1"
    options = {(o["route"], json.dumps(o["params"], sort_keys=True)): o
               for d in read["devices"] for w in d["winners"].values()
               for o in (w, *w["alternatives"])}
    for (route, params), option in options.items():
        assert (option["plan_on"], option["capturable"]) == EXPECTED[(route, params)]
        assert all(option[c] is None for c in STEP_COST_COLUMNS)
    assert Dispatcher.load(path, device=H200).select(DECODE).route_id == "padded/triton"


def test_a_v2_json_map_with_a_bad_step_is_refused(tmp_path):
    document = table.winners_json(v2_table())
    assert winners_map.problems(document) == []
    winner = next(iter(document["devices"][0]["winners"].values()))
    for damage in ({"plan_on": "host", "capturable": True}, {"plan_on": "gpu"},
                   {"plan_us": -1.0}, {"capturable": "yes"}):
        broken = json.loads(json.dumps(document))
        next(iter(broken["devices"][0]["winners"].values())).update(damage)
        assert winners_map.problems(broken), damage
    del winner["launch_host_us"]
    assert winners_map.problems(document)


def test_a_converted_table_merges_with_a_measured_one_of_the_same_environment(tmp_path):
    converted = table.read(write_v1(v2_table(), tmp_path / "old.parquet"), facts=KINDS)
    measured = make_table([result_row(DECODE.with_(batch=64), "padded/triton", 30.0,
                                      params=PERSISTENT) | {"plan_us": 2.0}])
    merged = table.merge([converted, measured])
    assert sorted(set(merged["converted_from"])) == ["", "v1"]  # per row, honestly
    assert table.validate(merged) == []


# The JSON map's failures ------------------------------------------------------------------

OTHER_DEVICE = replace(H200, name="NVIDIA H100")


def failing_table() -> pd.DataFrame:
    """DECODE: one winner, one crash, two timeouts; batch 8: nothing ok; and a device of
    the same arch where nothing was ever ok."""
    nothing = DECODE.with_(batch=8)
    return make_table([
        result_row(DECODE, "padded/triton", 10.0), result_row(DECODE, "reference/torch", 400.0),
        result_row(DECODE, "sdpa/torch", None, status="crashed", reason="boom"),
        result_row(DECODE, "segmented/triton", None, status="timeout"),
        result_row(DECODE, "gluon/triton", None, status="timeout"),
        result_row(nothing, "padded/triton", None, status="rejected_accuracy"),
        result_row(nothing, "reference/torch", None, status="unsupported"),
        result_row(DECODE, "padded/triton", None, status="crashed", device=OTHER_DEVICE)])


@pytest.mark.parametrize("winners_only", [False, True])
def test_the_json_map_keeps_every_failure(tmp_path, winners_only):
    document = table.winners_json(failing_table(), winners_only)
    h100, h200 = document["devices"]
    assert (h100["device_name"], h100["winners"]) == ("NVIDIA H100", {})
    assert h100["all_failed"] == {DECODE.key: {"crashed": ["padded/triton"]}}
    winner = h200["winners"][DECODE.key]
    assert winner["route"] == "padded/triton"
    assert winner["failed"] == {"crashed": ["sdpa/torch"],
                                "timeout": ["gluon/triton", "segmented/triton"]}
    assert h200["all_failed"] == {DECODE.with_(batch=8).key: {
        "rejected_accuracy": ["padded/triton"], "unsupported": ["reference/torch"]}}
    path = table.write_json(document, tmp_path / "sm_90.json")
    assert winners_map.read(path, facts=KINDS).document == document
    loaded = Dispatcher.load(path, device=H200)
    assert loaded._failed[DECODE.key] == (("gluon/triton", "timeout"), ("sdpa/torch", "crashed"),
                                          ("segmented/triton", "timeout"))


def test_a_map_written_before_failures_were_kept_still_loads(tmp_path):
    document = table.winners_json(failing_table())
    for device in document["devices"]:
        del device["all_failed"]
        for entry in device["winners"].values():
            entry.pop("failed", None)
    loaded = Dispatcher.load(table.write_json(document, tmp_path / "sm_90.json"), device=H200)
    assert loaded.select(DECODE).route_id == "padded/triton" and not loaded._failed


@pytest.mark.parametrize("damage", [
    {"failed": {"ok": ["sdpa/torch"]}},  # not a failure
    {"failed": {"exploded": ["sdpa/torch"]}},
    {"failed": {"crashed": "sdpa/torch"}},
    {"failed": {"crashed": []}},
    {"failed": {}},
    {"failed": {"crashed": ["sdpa/torch"], "timeout": ["sdpa/torch"]}},  # twice
    {"failed": {"crashed": ["padded/triton"]}},  # the winner itself
    {"failed": {"crashed": ["reference/torch"]}},  # an alternative
    {"failed": {"crashed": [3]}},
])
def test_a_map_with_a_bad_failure_is_refused(damage):
    document = table.winners_json(failing_table())
    document["devices"][1]["winners"][DECODE.key].update(damage)
    assert winners_map.problems(document), damage


@pytest.mark.parametrize("damage", [
    lambda d: d.update(all_failed=[]),
    lambda d: d["all_failed"].update({DECODE.key: {"crashed": ["sdpa/torch"]}}),  # has a winner
    lambda d: d["all_failed"].update({"batch=1": {"crashed": ["sdpa/torch"]}}),
    lambda d: d["all_failed"].update({DECODE.with_(batch=2).key: {"crashed": "x"}}),
])
def test_a_map_with_a_bad_all_failed_is_refused(damage):
    document = table.winners_json(failing_table())
    damage(document["devices"][1])
    assert any("all_failed" in p for p in winners_map.problems(document))
