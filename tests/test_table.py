import json
import math
import os
import pickle
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlatune import table
from mlatune.errors import TableError
from mlatune.problem import DTYPES, KEY_FIELDS, MLAProblem
from mlatune.table.schema import COLUMN_TYPES, COLUMNS, KEY_COLUMNS, SCHEMA_VERSION
from tests.table_helpers import (
    H200,
    MI355,
    PROVENANCE,
    grid_rows,
    large_batch_fast,
    make_table,
    reference_slow,
    result_row,
    small_batch_fast,
)

BASE = MLAProblem(num_heads=16, qlen=1, kv_dtype="bf16")
TIMINGS = {"fast-small/fake": small_batch_fast, "fast-large/fake": large_batch_fast,
           "reference/torch": reference_slow}


def small_table() -> pd.DataFrame:
    rows = grid_rows([BASE, BASE.with_(qlen=2, kv_dtype="fp8_e4m3fn", causal=False)],
                     [1, 8, 64], [1024, 8192], TIMINGS)
    odd = BASE.with_(batch=3, kv_len=300)
    rows += [result_row(odd, "fast-small/fake", None, status="rejected_accuracy",
                        reason='rel_l2 0.93 > 0.01, "bad", line\nbreak, ünïcode'),
             result_row(odd, "reference/torch", 17.25, params={"splits": 4, "note": "a,b"})]
    rows += grid_rows([BASE], [2], [2048], TIMINGS, device=MI355)
    return make_table(rows)


def write_raw(frame: pd.DataFrame, path, metadata: dict | None = None) -> None:
    """Write without validation, as a damaged or foreign table would arrive."""
    if str(path).endswith(".csv"):
        frame.to_csv(path, index=False, na_rep="", lineterminator="\n")
        return
    t = pa.Table.from_pandas(frame, preserve_index=False)
    meta = metadata if metadata is not None else {
        "schema_version": SCHEMA_VERSION, "provenance": table.provenances(frame)}
    t = t.replace_schema_metadata({**(t.schema.metadata or {}),
                                   b"mlatune": json.dumps(meta).encode()})
    pq.write_table(t, path)


def refused(path) -> str:
    with pytest.raises(TableError) as info:
        table.read(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


# Building and ranking --------------------------------------------------------------

def test_build_ranks_ok_rows_by_time_and_leaves_the_rest_at_zero():
    frame = small_table()
    assert list(frame.columns) == list(COLUMNS)
    assert table.validate(frame) == []
    for _, rows in frame.groupby(list(KEY_COLUMNS)):
        ok = rows[rows["status"] == "ok"].sort_values("time_us")
        assert ok["rank"].tolist() == list(range(1, len(ok) + 1))
        assert (rows.loc[rows["status"] != "ok", "rank"] == 0).all()
    # The winner really changes with the shape in this table.
    winners = set(table.winners(frame)["route"])
    assert {"fast-small/fake", "fast-large/fake"} <= winners


@settings(max_examples=30, deadline=None)
@given(st.lists(st.builds(
    MLAProblem, num_heads=st.integers(1, 128), qlen=st.integers(1, 8),
    kv_dtype=st.sampled_from(["bf16", "fp8_e4m3fn"]), batch=st.integers(1, 512),
    kv_len=st.integers(8, 1 << 17), dcp_size=st.integers(1, 8), causal=st.booleans(),
    page_size=st.sampled_from([1, 16, 64])), min_size=1, max_size=12,
    unique_by=lambda p: p.key))
def test_key_strings_equal_problem_keys(problems):
    frame = make_table([result_row(p, "reference/torch", 5.0) for p in problems])
    keys = table.key_strings(frame)
    assert len(keys) == len(problems) and sorted(keys) == sorted(p.key for p in problems)


# Round trips -----------------------------------------------------------------------

@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_round_trip_is_exact(tmp_path, suffix):
    frame = small_table()
    frame.loc[0, "rel_err"] = 0.1 + 0.2  # not representable in short decimal
    frame.loc[1, "max_abs_err"] = 5e-324  # subnormal
    path = table.write(frame, tmp_path / f"t.{suffix}")
    back = table.read(path)
    pd.testing.assert_frame_equal(back, frame, check_exact=True)
    for name, kind in COLUMN_TYPES.items():
        assert back[name].dtype == pd.api.types.pandas_dtype(kind), name
    assert back["causal"].dtype == bool and not back["causal"].all()
    assert back["time_us"].isna().any()  # NaN survives as NaN
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []


@settings(max_examples=20, deadline=None)
@given(reason=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")),
       err=st.floats(allow_nan=True, allow_infinity=True), params=st.dictionaries(
           st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3))
def test_round_trip_holds_any_text_and_float(tmp_path_factory, reason, err, params):
    problem = BASE.with_(batch=2, kv_len=64)
    rows = [result_row(problem, "reference/torch", 3.0, params=params),
            {**result_row(problem, "other/fake", None, status="crashed"), "reason": reason,
             "rel_err": err}]
    frame = make_table(rows)
    base = tmp_path_factory.mktemp("rt")
    for suffix in ("parquet", "csv"):
        back = table.read(table.write(frame, base / f"t.{suffix}"))
        pd.testing.assert_frame_equal(back, frame, check_exact=True)


def test_parquet_carries_provenance_as_file_metadata(tmp_path):
    path = table.write(small_table(), tmp_path / "t.parquet")
    meta = json.loads(pq.read_schema(path).metadata[b"mlatune"])
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["provenance"] == [PROVENANCE.as_dict()]


def test_write_refuses_an_invalid_table_and_leaves_the_old_file(tmp_path):
    good = table.write(small_table(), tmp_path / "t.parquet")
    before = good.read_bytes()
    bad = small_table().drop(columns=["status"])
    with pytest.raises(TableError, match="missing columns: status"):
        table.write(bad, good)
    assert good.read_bytes() == before


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = table.write(small_table(), tmp_path / "t.parquet")
    before = path.read_bytes()

    def half_then_fail(t, handle, **kw):
        handle.write(b"PAR1 partial")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        table.write(small_table(), path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["t.parquet"]


# Damage: each kind refused, in one line -------------------------------------------

def test_truncated_parquet_is_refused(tmp_path):
    path = table.write(small_table(), tmp_path / "t.parquet")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert "not a readable Parquet table" in refused(path)


def test_truncated_csv_is_refused(tmp_path):
    path = table.write(small_table(), tmp_path / "t.csv")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])  # inside the last row
    assert "truncated" in refused(path)


@pytest.mark.parametrize("content", [b"", b"\x00\x01garbage", b"PAR1" + b"x" * 50])
def test_garbage_and_empty_files_are_refused(tmp_path, content):
    for suffix in ("parquet", "csv"):
        path = tmp_path / f"t.{suffix}"
        path.write_bytes(content)
        refused(path)


def test_missing_file_and_unknown_format_are_refused(tmp_path):
    assert "no such file" in refused(tmp_path / "absent.parquet")
    other = tmp_path / "t.txt"
    other.write_text("hello\n")
    with pytest.raises(TableError, match="unknown table format"):
        table.read(other)


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_missing_column_is_refused(tmp_path, suffix):
    path = tmp_path / f"t.{suffix}"
    write_raw(small_table().drop(columns=["time_us"]), path)
    assert "missing columns: time_us" in refused(path)


def test_wrong_dtype_is_refused(tmp_path):
    frame = small_table()
    frame["batch"] = frame["batch"].astype("float64")
    write_raw(frame, tmp_path / "t.parquet")
    assert "column batch has dtype float64, expected int64" in refused(tmp_path / "t.parquet")
    text = small_table().to_csv(index=False, lineterminator="\n")
    lines = text.splitlines()
    header = lines[0].split(",")
    cells = lines[1].split(",")
    cells[header.index("num_heads")] = "sixteen"
    (tmp_path / "t.csv").write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    assert "column num_heads has values that are not int64 (e.g. 'sixteen')" in refused(
        tmp_path / "t.csv")


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_duplicate_key_is_refused(tmp_path, suffix):
    frame = small_table()
    write_raw(pd.concat([frame, frame.iloc[[0]]], ignore_index=True), tmp_path / f"t.{suffix}")
    assert "repeat a (device, problem, route) key" in refused(tmp_path / f"t.{suffix}")


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_future_schema_version_is_refused(tmp_path, suffix):
    frame = small_table()
    frame["schema_version"] = SCHEMA_VERSION + 1
    write_raw(frame, tmp_path / f"t.{suffix}")
    assert f"schema_version {SCHEMA_VERSION + 1} is newer" in refused(tmp_path / f"t.{suffix}")


def test_each_invalid_value_kind_is_named():
    frame = small_table()
    first_winner = frame.index[frame["rank"] == 1][0]
    first_h200 = frame.index[frame["arch"] == "sm_90"][0]
    cases = {
        "unknown status 'fast'": lambda f: f.assign(status=f["status"].mask(f.index == 0,
                                                                            "fast")),
        "winners (rank 1) are not ok": lambda f: f.assign(
            status=f["status"].mask(f.index == first_winner, "timeout")),
        "ranks contradict the step costs": lambda f: f.assign(
            time_us=f["time_us"].mask(f.index == first_winner, 1e9)),
        "not JSON objects": lambda f: f.assign(
            route_params=f["route_params"].mask(f.index == 0, "[1, 2]")),
        "not shaped '<family>/<backend>'": lambda f: f.assign(
            route=f["route"].mask(f.index == 0, "NoSlash")),
        "qlen must not exceed kv_len": lambda f: f.assign(
            qlen=f["qlen"].mask(f.index == 0, 100_000)),
        "page_size must be a power of two": lambda f: f.assign(
            page_size=f["page_size"].mask(f.index == 0, 48)),
        "unexpected columns: extra": lambda f: f.assign(extra=1),
        "mixed provenance for sm_90 NVIDIA H200: torch_version": lambda f: f.assign(
            torch_version=f["torch_version"].mask(f.index == first_h200, "2.99")),
        "has 1 missing values": lambda f: f.assign(
            reason=f["reason"].mask(f.index == 0, pd.NA)),
        "arch not shaped sm_<n>, gfx<id> or cpu: ''": lambda f: f.assign(arch=""),
        "arch not shaped sm_<n>, gfx<id> or cpu: 'nvidia'": lambda f: f.assign(arch="nvidia"),
        "rows with an empty device_name": lambda f: f.assign(device_name=" "),
        "cu_count below 1: 0": lambda f: f.assign(cu_count=0),
        "cu_count below 1: -3": lambda f: f.assign(cu_count=-3),
        "hardware that are not JSON objects: '{bad'": lambda f: f.assign(hardware="{bad"),
        "backend_versions that are not JSON objects": lambda f: f.assign(
            backend_versions="garbage"),
        "created_utc not an ISO 8601 time: 'yesterday'": lambda f: f.assign(
            created_utc="yesterday"),
        "kv_len must be a positive integer at most 2147483647": lambda f: f.assign(
            kv_len=f["kv_len"].mask(f.index == 0, 3_000_000_000)),
        "batch must be a positive integer at most 2147483647": lambda f: f.assign(
            batch=f["batch"].mask(f.index == 0, 2**31)),
        "ok rows lack a finite time_us of at least 0.001 us: 5e-324": lambda f: f.assign(
            time_us=f["time_us"].mask(f.index == first_winner, 5e-324)),
        "ok rows with an infinite or negative rel_err: inf": lambda f: f.assign(
            rel_err=f["rel_err"].mask(f.index == first_winner, float("inf"))),
        "ok rows with an infinite or negative lse_err: -1.0": lambda f: f.assign(
            lse_err=f["lse_err"].mask(f.index == first_winner, -1.0)),
        "unexpected columns: 'a\\x1b[31mRED'": lambda f: f.assign(**{"a\x1b[31mRED": 1}),
    }
    for expected, damage in cases.items():
        problems = table.validate(damage(frame.copy()))
        assert any(expected in p for p in problems), (expected, problems)
        assert all("\n" not in p for p in problems)


def test_validate_reports_every_problem_at_once(tmp_path):
    frame = small_table()
    frame = pd.concat([frame, frame.iloc[[0]]], ignore_index=True)
    frame.loc[1, "status"] = "exploded"
    frame["schema_version"] = 7
    frame = frame.drop(columns=["tflops"])
    problems = table.validate(frame)
    for expected in ("missing columns: tflops", "unknown status", "repeat a (device",
                     "schema_version 7 is newer"):
        assert any(expected in p for p in problems), (expected, problems)
    write_raw(frame, tmp_path / "t.parquet")
    message = refused(tmp_path / "t.parquet")
    assert f"({len(problems)} problems)" in message


def test_parquet_metadata_that_disagrees_with_the_columns_is_refused(tmp_path):
    other = {**PROVENANCE.as_dict(), "torch_version": "1.0"}
    write_raw(small_table(), tmp_path / "t.parquet",
              metadata={"schema_version": 1, "provenance": [other]})
    assert "metadata provenance does not match" in refused(tmp_path / "t.parquet")


@settings(max_examples=60, deadline=None)
@given(phase=st.sampled_from(["decode", "prefill", "train"]), num_heads=st.integers(-1, 64),
       qlen=st.integers(-1, 9), q_dtype=st.sampled_from([*DTYPES, "int8"]),
       kv_dtype=st.sampled_from([*DTYPES, "int8"]), causal=st.booleans(),
       dcp_size=st.integers(0, 4), page_size=st.sampled_from([0, 1, 3, 16, 64]),
       batch=st.sampled_from([-1, 0, 1, 4, 2**31 - 1, 2**31]),
       kv_len=st.sampled_from([-1, 0, 1, 5, 12, 2**31 - 1, 2**31]),
       dims=st.sampled_from([(576, 512), (512, 512), (192, 128), (0, 0)]))
def test_problem_check_agrees_with_mlaproblem(phase, num_heads, qlen, q_dtype, kv_dtype,
                                              causal, dcp_size, page_size, batch, kv_len,
                                              dims):
    key = dict(phase=phase, num_heads=num_heads, qlen=qlen, q_dtype=q_dtype, kv_dtype=kv_dtype,
               causal=causal, dcp_size=dcp_size, page_size=page_size, batch=batch,
               kv_len=kv_len, d_qk=dims[0], d_v=dims[1])
    try:
        MLAProblem.from_key_dict(key)
        valid = True
    except ValueError:
        valid = False
    frame = make_table([{**result_row(BASE, "reference/torch", 2.0), **key}])
    problems = [p for p in table.validate(frame) if "invalid problem" in p]
    assert (problems == []) == valid, (key, problems)


# Merge, summary, diff, JSON ----------------------------------------------------------

def test_merge_keeps_the_best_row_per_key_and_route_and_reranks():
    p = BASE.with_(batch=4, kv_len=2048)
    run_a = make_table([result_row(p, "a/fake", 10.0), result_row(p, "b/fake", None),
                        result_row(p, "reference/torch", 90.0)])
    later = replace(PROVENANCE, created_utc="2026-02-01T00:00:00Z", spec_sha256="cd" * 32)
    run_b = make_table([result_row(p, "a/fake", 12.0), result_row(p, "b/fake", 8.0),
                        result_row(p.with_(batch=8), "a/fake", 30.0)], later)
    other_gpu = make_table([result_row(p, "a/fake", 5.0, device=MI355)])
    merged = table.merge([run_a, run_b, other_gpu])
    assert table.validate(merged) == []
    h200 = merged[(merged["arch"] == "sm_90") & (merged["batch"] == 4)].set_index("route")
    assert h200.loc["a/fake", "time_us"] == 10.0  # the faster of the two runs
    assert h200.loc["b/fake", "status"] == "ok"  # an ok row beats a crash
    assert h200.loc["b/fake", "rank"] == 1 and h200.loc["a/fake", "rank"] == 2
    assert len(merged[merged["arch"] == "gfx950"]) == 1
    assert len(merged) == 5


def test_merge_refuses_one_device_measured_in_two_environments():
    p = BASE.with_(batch=4, kv_len=2048)
    other_torch = replace(PROVENANCE, torch_version="2.14.0")
    with pytest.raises(TableError, match=r"mixed provenance.*torch_version"):
        table.merge([make_table([result_row(p, "a/fake", 10.0)]),
                     make_table([result_row(p, "b/fake", 9.0)], other_torch)])


def test_summary_gives_winner_runner_up_and_margin():
    frame = small_table()
    summary = table.summary(frame)
    assert len(summary) == len(frame.drop_duplicates(list(KEY_COLUMNS)))
    for _, row in summary.iterrows():
        rows = frame[(frame[list(KEY_COLUMNS)] == row[list(KEY_COLUMNS)]).all(axis=1)]
        ok = rows[rows["status"] == "ok"].sort_values("time_us")
        assert row["winner"] == ok["route"].iloc[0]
        if len(ok) > 1:
            assert row["runner_up"] == ok["route"].iloc[1]
            assert row["margin"] == pytest.approx(ok["time_us"].iloc[1] / ok["time_us"].iloc[0]
                                                  - 1)
        else:
            assert row["runner_up"] == "" and math.isnan(row["margin"])


def test_diff_names_changed_winners_and_by_how_much():
    a = small_table()
    b = a.copy()
    key = b.index[(b["rank"] == 1) & (b["arch"] == "sm_90")][0]
    # Make the reference route win this key in B, at a known time.
    same_key = (b[list(KEY_COLUMNS)] == b.loc[key, list(KEY_COLUMNS)]).all(axis=1)
    ref = b.index[same_key & (b["route"] == "reference/torch")][0]
    b.loc[ref, "time_us"] = b.loc[key, "time_us"] / 2
    b = table.assign_ranks(b)
    changed, counts = table.diff(a, b)
    assert counts["changed"] == 1 and counts["only_a"] == counts["only_b"] == 0
    assert counts["same"] == len(table.winners(a)) - 1
    row = changed.iloc[0]
    assert row["route_b"] == "reference/torch" and row["route_a"] != "reference/torch"
    assert row["change"] == pytest.approx(-0.5)


def test_winners_json_lists_each_key_once_with_alternatives_in_rank_order():
    frame = small_table()
    document = table.winners_json(frame)
    assert json.loads(json.dumps(document)) == document  # plain JSON, nothing else
    devices = {d["arch"]: d for d in document["devices"]}
    assert set(devices) == {"sm_90", "gfx950"}
    h200 = frame[(frame["arch"] == "sm_90") & (frame["status"] == "ok")]
    entries = devices["sm_90"]["winners"]
    assert len(entries) == len(h200.drop_duplicates(list(KEY_FIELDS)))
    for key, entry in entries.items():
        problem = MLAProblem.from_key_dict(dict(p.split("=") for p in key.split("|")))
        assert problem.key == key
        rows = h200[(h200[list(KEY_FIELDS)] == pd.Series(problem.key_dict())).all(axis=1)]
        ordered = rows.sort_values("rank")
        got = [entry["route"]] + [a["route"] for a in entry["alternatives"]]
        assert got == ordered["route"].tolist()
    only = table.winners_json(frame, winners_only=True)
    assert all("alternatives" not in e for d in only["devices"] for e in d["winners"].values())


# Tables are data, never code ---------------------------------------------------------

def test_reading_never_unpickles(tmp_path, monkeypatch):
    from mlatune.dispatch import Dispatcher

    frame = small_table()
    paths = [table.write(frame, tmp_path / "sm_90.parquet"),
             table.write(frame, tmp_path / "sm_90.csv"),
             table.write_json(table.winners_json(frame), tmp_path / "sm_90.json")]

    def forbidden(*args, **kwargs):
        raise AssertionError("a table was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(np, "load", forbidden)  # allow_pickle lives here too
    for path in paths:
        if path.suffix != ".json":
            table.read(path)
        Dispatcher.load(path, device=H200)
    package = Path(table.__file__).parent.parent
    for module in ("table/frame", "table/files", "table/checks", "dispatch/dispatcher",
                   "dispatch/sources", "table/winners_map"):
        source = (package / f"{module}.py").read_text()
        assert not re.search(r"import pickle|pickle\.|\beval\(|\bexec\(|allow_pickle", source)
