"""Typed sweep records: every journal line written so far reads as a Record and writes
back the same; a committed journal resumes; statuses have one owner."""

import gzip
import json
import math
from pathlib import Path

import pytest

from mlatune.arch import DeviceInfo
from mlatune.problem import MLAProblem
from mlatune.sweep.candidates import Candidate
from mlatune.sweep.journal import Journal, JournalError, read, read_records
from mlatune.sweep.records import Record, Status, Task, table_rows
from mlatune.table.schema import STATUSES

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# The oldest line format (no step kinds, worker seconds, device or racing) and today's.
OLD = RESULTS / "h200-table-20261129" / "sm_90-h200.journal.jsonl.gz"
NEW = RESULTS / "h200-gluon-sweep-20261201" / "sm_90-heldout-gluon.journal.jsonl.gz"


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


def test_a_committed_journal_resumes(tmp_path):
    path = tmp_path / "old.journal.jsonl"
    path.write_bytes(gzip.decompress(NEW.read_bytes()))
    header = {k: v for k, v in read(path)[0].items() if k != "kind"}
    journal = Journal(path, header, resume=True)
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


def test_statuses_have_one_owner():
    assert STATUSES == ("ok", "rejected_accuracy", "crashed", "timeout", "unsupported")
    assert Status.OK == "ok" and json.dumps(Status.CRASHED) == '"crashed"'
