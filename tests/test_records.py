"""Typed sweep records: every journal line written so far reads as a Record and writes
back the same; a committed journal resumes; statuses have one owner."""

import gzip
import json
import math
from pathlib import Path

import pytest

from mlatune.arch import DeviceInfo
from mlatune.measure.records import Record, Result, Status, Task, table_rows
from mlatune.problem import MLAProblem
from mlatune.sweep.candidates import Candidate
from mlatune.sweep.journal import Journal, JournalError, JournalHeader, read, read_records
from mlatune.table.schema import STATUSES

DATA = Path(__file__).resolve().parent / "data"
# The oldest line format (no step kinds, worker seconds, device or racing; every 40th problem
# of the first H200 sweep, 2026-11-29) and today's (a held-out sweep of 2026-12-01).
OLD = DATA / "journal-2026-11-29.jsonl.gz"
NEW = DATA / "journal-2026-12-01.jsonl.gz"


@pytest.mark.parametrize("path", [OLD, NEW], ids=["2026-11-29", "2026-12-01"])
def test_committed_journals_read_as_records_and_write_back_the_same_lines(path):
    header, lines = read(path)
    records = read_records(path)[1]
    assert len(records) == len(lines) > 0
    for line, record in zip(lines, records, strict=True):
        assert {"kind": "result", **record.to_json()} == line
        assert not record.extra  # every field a sweep ever wrote has its name
    assert {r.status for r in records} <= set(Status)
    device = DeviceInfo(**{k: header[k] for k in ("arch", "name", "vendor", "cu_count",
                                                    "index", "memory_bytes")})
    rows = table_rows(records, device)
    # One row per (problem, route); an ok row holds the pair's cheapest ok step.
    cheapest: dict[tuple[str, str], float] = {}
    for line in lines:
        pair = (MLAProblem.from_key_dict(line["key"]).key, line["route"])
        step = line.get("time_us", math.inf) + (line.get("plan_us") or 0.0) \
            if line["status"] == "ok" else math.inf
        cheapest[pair] = min(cheapest.get(pair, math.inf), step)
    assert len(rows) == len(cheapest)
    for row in rows:
        if row["status"] == "ok":
            step = row["time_us"] + (0.0 if math.isnan(row["plan_us"]) else row["plan_us"])
            assert step == cheapest[(MLAProblem.from_key_dict(row).key, row["route"])]


@pytest.mark.parametrize("path", [OLD, NEW], ids=["2026-11-29", "2026-12-01"])
def test_committed_journal_headers_read_typed_and_write_back_the_same_line(path):
    raw = read(path)[0]
    header = read_records(path)[0]
    assert isinstance(header, JournalHeader) and not header.extra
    assert header.to_json() == raw
    assert header.device.name == header.device_name and header.shard is None
    assert JournalHeader.of(header.spec_sha256, header.spec, header.device) == header


def test_a_journal_header_names_what_a_resume_refuses(tmp_path):
    device = DeviceInfo("cpu", "cpu", "cpu", 2)
    whole = JournalHeader.of("s", "t.toml", device)
    share = JournalHeader.of("s", "t.toml", device, shard="1/2")
    assert whole.to_json() == {"kind": "header", "spec_sha256": "s", "spec": "t.toml",
                               **device.as_dict(), "device_name": "cpu"}
    assert share.to_json()["shard"] == "1/2" and not whole.mismatch(whole)
    assert "shard 1/2" in share.mismatch(whole)
    assert "spec_sha256='s'" in whole.mismatch(JournalHeader.of("other", "t.toml", device))
    path = tmp_path / "j.jsonl"
    Journal(path, share, resume=False).close()
    assert json.loads(path.read_text().splitlines()[0]) == share.to_json()
    with pytest.raises(JournalError, match="written for shard 1/2"):
        Journal(path, whole, resume=True)
    resumed = Journal(path, share.to_json(), resume=True)  # a raw header too
    resumed.close()
    assert resumed.header == share


def test_a_committed_journal_resumes(tmp_path):
    path = tmp_path / "old.journal.jsonl"
    path.write_bytes(gzip.decompress(NEW.read_bytes()))
    journal = Journal(path, read_records(path)[0], resume=True)
    try:
        assert journal.done_ids == {r["id"] for r in read(NEW)[1]}
        assert all(isinstance(r, Record) for r in journal.records)
    finally:
        journal.close()


def test_a_line_with_an_unknown_status_is_damage(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"kind": "header"}\n{"kind": "result", "id": "a", "status": "meh"}\n'
                    '{"kind": "result", "id": "b", "status": "ok"}\n')
    with pytest.raises(JournalError, match="line 2 is damaged"):
        read_records(path)


def test_a_line_whose_key_is_no_problem_is_damage(tmp_path):
    """A result line's key fields must name a valid problem (a hand-edited or foreign
    journal), else resuming from it would fail later with a traceback."""
    first = next(line for line in read(NEW)[1])
    bad = {**first, "key": {**first["key"], "num_heads": -1}}
    path = tmp_path / "j.jsonl"
    path.write_text(json.dumps(read(NEW)[0]) + "\n" + json.dumps(first) + "\n"
                    + json.dumps(bad) + "\n" + json.dumps(first) + "\n")
    with pytest.raises(JournalError, match=r"line 3 is damaged.*num_heads must be a positive"):
        read_records(path)


def test_fields_a_line_lacks_stay_none_and_unknown_ones_are_kept():
    line = {"id": "x", "status": "ok", "time_us": 3.0, "someday": [1, 2]}
    record = Record.from_json({"kind": "result", **line})
    assert record.status is Status.OK and record.plan_us is None and record.reps is None
    assert record.extra == {"someday": [1, 2]}
    assert record.to_json() == {**line, "key": {}, "route": "", "route_params": "{}",
                                "reason": ""}
    assert record.step_us == 3.0 and math.isnan(Record(status=Status.CRASHED).step_us)


def test_a_candidate_record_takes_what_the_route_ran_with():
    c = Candidate(MLAProblem(kv_len=64), "r/x", {"split": 2})
    record = c.record(status="ok", route_params='{"split": 2, "backend": "y"}', time_us=1.0)
    assert record.id == c.id and record.problem == c.problem
    assert record.route_params == '{"split": 2, "backend": "y"}'


def test_a_task_travels_as_plain_data():
    task = Task(MLAProblem(kv_len=64), "r/x", {"split": 2}, 7, {"warmup": 0}, {"rtol": 0.1},
                check_only=True)
    assert Task.from_json(json.loads(json.dumps(task.to_json()))) == task


def test_a_worker_result_travels_as_json_and_becomes_the_record_it_measured():
    result = Result(status=Status.CRASHED, reason="raised X", setup_s=0.5, bench_s=0.0,
                    restart=True)
    sent = json.loads(json.dumps(result.to_json()))
    assert sent == {"status": "crashed", "reason": "raised X", "setup_s": 0.5, "bench_s": 0.0,
                    "restart": True}
    assert Result.from_json(sent) == result
    assert Result.from_json(Result(status=Status.OK).to_json()).restart is False
    c = Candidate(MLAProblem(kv_len=64), "r/x", {"split": 2})
    record = c.record(**result.fields(), elapsed_s=1.0)
    assert record.to_json() == {"id": c.id, "key": c.problem.key_dict(), "route": "r/x",
                                "route_params": c.params_json, "status": "crashed",
                                "reason": "raised X", "setup_s": 0.5, "bench_s": 0.0,
                                "elapsed_s": 1.0}
    assert result.cost("setup_s") == 0.5 and result.cost("check_s") == 0.0


def test_statuses_have_one_owner():
    assert STATUSES == ("ok", "rejected_accuracy", "crashed", "timeout", "unsupported", "stale",
                        "pruned")
    assert Status.OK == "ok" and json.dumps(Status.CRASHED) == '"crashed"'
