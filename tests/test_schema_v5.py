"""Schema v5: the LSE error column (``lse_err``); older tables and maps read with it not
measured, a v4 table as it was ranked; journals and records carry it."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mlatune import table
from mlatune.arch import DeviceInfo
from mlatune.errors import JournalError
from mlatune.measure.records import Record, table_rows
from mlatune.problem import MLAProblem
from mlatune.sweep.candidates import Candidate
from mlatune.sweep.journal import Journal, read_records
from mlatune.table import files, winners_map
from mlatune.table.schema import COLUMNS, SCHEMA_VERSION
from tests.table_helpers import PROVENANCE, make_table, result_row
from tests.test_table import write_raw

DATA = Path(__file__).resolve().parent / "data"
# Every 40th problem of the shipped H200 table as the v4 writer wrote it (2026-12-06, from
# commit 3fadbce's tables/sm_90-h200.parquet, with that commit's table.write).
V4_SAMPLE = DATA / "sm_90-h200-v4.parquet"
DECODE = MLAProblem(num_heads=16, qlen=1, batch=4, kv_len=2048)


def v4_file(path: Path) -> Path:
    """A small table as the v4 writer wrote it: no lse_err, schema_version 4."""
    rows = [result_row(DECODE, "padded/triton", 10.0), result_row(DECODE, "reference/torch",
                                                                     400.0),
            result_row(DECODE.with_(batch=8), "padded/triton", None)]
    old = make_table(rows).drop(columns=["lse_err"]).assign(schema_version=4)
    provenance = {**PROVENANCE.as_dict(), "schema_version": 4}
    write_raw(old, path, metadata={"schema_version": 4, "provenance": [provenance]})
    return path


def test_the_v4_writers_table_reads_as_v5_with_lse_err_not_measured(monkeypatch):
    raw = pd.read_parquet(V4_SAMPLE)
    assert "lse_err" not in raw and set(raw["schema_version"]) == {4}

    def no_ranking(*args, **kwargs):
        raise AssertionError("a v4 table is ranked by step cost already")

    monkeypatch.setattr(files, "assign_ranks", no_ranking)
    frame, stored = table.read_versioned(V4_SAMPLE)
    assert stored == 4 and list(frame.columns) == list(COLUMNS)
    assert frame["lse_err"].isna().all() and frame["lse_err"].dtype == np.float64
    assert (frame["schema_version"] == SCHEMA_VERSION).all() and table.validate(frame) == []
    kept = [c for c in raw.columns if c != "schema_version"]
    pd.testing.assert_frame_equal(frame[kept], raw[kept], check_exact=True, check_dtype=False)
    assert set(frame["converted_from"]) == {"v2", "v3"}  # what each row was measured as


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_a_v4_table_measured_as_v4_says_so_and_writes_back_as_v5(tmp_path, suffix):
    frame, stored = table.read_versioned(v4_file(tmp_path / f"t.{suffix}"))
    assert stored == 4 and (frame["converted_from"] == "v4").all()
    assert frame["lse_err"].isna().all() and table.validate(frame) == []
    again, stored = table.read_versioned(table.write(frame, tmp_path / f"new.{suffix}"))
    assert stored == SCHEMA_VERSION
    pd.testing.assert_frame_equal(again, frame, check_exact=True)


def test_a_v5_table_keeps_its_lse_errors(tmp_path):
    rows = [result_row(DECODE, "padded/triton", 10.0) | {"lse_err": 3e-3},
            result_row(DECODE, "reference/torch", 400.0) | {"lse_err": math.nan}]
    frame = table.read(table.write(make_table(rows), tmp_path / "t.csv"))
    by_route = dict(zip(frame["route"], frame["lse_err"], strict=True))
    assert by_route["padded/triton"] == 3e-3 and math.isnan(by_route["reference/torch"])


def test_a_journal_line_carries_lse_err_into_the_row(tmp_path):
    candidate = Candidate(DECODE, "padded/triton", {"num_splits": 2})
    measured = candidate.record(status="ok", time_us=5.0, rel_err=1e-3, max_abs_err=2e-3,
                                lse_err=4e-3)
    unmeasured = Candidate(DECODE, "reference/torch", {}).record(status="ok", time_us=9.0,
                                                                 rel_err=0.0, max_abs_err=0.0)
    path = tmp_path / "j.jsonl"
    journal = Journal(path, {"spec_sha256": "x", "arch": "cpu", "device_name": "cpu"},
                      resume=False)
    for record in (measured, unmeasured):
        journal.append(record)
    journal.close()
    records = read_records(path)[1]
    assert records[0].lse_err == 4e-3 and records[1].lse_err is None
    assert "lse_err" not in json.loads(path.read_text().splitlines()[-1])
    rows = {r["route"]: r for r in table_rows(records, DeviceInfo("cpu", "cpu", "cpu", 2))}
    assert rows["padded/triton"]["lse_err"] == 4e-3
    assert math.isnan(rows["reference/torch"]["lse_err"])
    with path.open("a") as f:
        f.write(json.dumps({**measured.to_json(), "id": "y", "lse_err": "small"}) + "\n")
        f.write(json.dumps(unmeasured.to_json()) + "\n")
    with pytest.raises(JournalError, match="lse_err is not a number"):
        read_records(path)
    assert Record.from_json(measured.to_json()) == measured


def test_winners_map_options_may_carry_the_errors_and_an_older_map_reads_without(tmp_path):
    document = table.winners_json(make_table([result_row(DECODE, "padded/triton", 10.0)]))
    key, option = next(iter(document["devices"][0]["winners"].items()))
    option.update(rel_err=2e-3, max_abs_err=1e-2, lse_err=None)
    assert winners_map.problems(document) == []
    older = json.loads(json.dumps(document))
    older["schema_version"] = 4
    for name in winners_map.ERROR_FIELDS:
        del older["devices"][0]["winners"][key][name]
    path = table.write_json(older, tmp_path / "sm_90.json")
    assert winners_map.read(path).document["devices"][0]["winners"][key]["route"] == \
        "padded/triton"
    for bad in (-1.0, "small", math.inf):
        option["lse_err"] = bad
        assert winners_map.problems(document) != []
