"""Faults of issue 17: oversized specs, budgets that never end, damaged journals, two
sweeps on one journal, damaged tables at model load, formulas in exported CSV, planted
symlinks, and outputs that cannot be written. Each failure must be one clear exception
(SpecError, JournalError, TableError, OutputError), never a traceback of another type."""

from __future__ import annotations

import csv
import errno
import gzip
import json
import logging
import os
import random
import re
import time
from pathlib import Path

import pytest

from mlatune import table
from mlatune.dispatch import Dispatcher, bundled
from mlatune.dispatch import dispatcher as dispatch_module
from mlatune.errors import JournalError, OutputError, SpecError, TableError
from mlatune.problem import MLAProblem
from mlatune.sweep import spec
from mlatune.sweep.journal import Journal, lock_path, read
from mlatune.table import outputs
from tests import processes
from tests.helpers import lock_is_free
from tests.table_helpers import H200, make_table, reference_slow, result_row, small_batch_fast

# Specs: size and budget -------------------------------------------------------------


def spec_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "big.toml"
    path.write_text(text)
    return path


def values(n: int, start: int = 1) -> str:
    return "[" + ", ".join(str(start + i) for i in range(n)) + "]"


def test_a_million_problem_grid_is_refused_before_it_is_built(tmp_path):
    path = spec_file(tmp_path, f"[[grid]]\nbatch = {values(1000)}\nkv_len = "
                               f"{values(1000, 4096)}\nnum_heads = 16\n")
    t0 = time.monotonic()
    with pytest.raises(SpecError) as err:
        spec.load(path)
    assert time.monotonic() - t0 < 2.0  # counted, not built
    message = str(err.value)
    assert str(path) in message and "grid[0]" in message and "1,000,000" in message
    assert "batch 1000 x kv_len 1000" in message and "\n" not in message


def test_a_billion_problems_across_grids_are_refused_at_once(tmp_path):
    grid = f"[[grid]]\nbatch = {values(1000)}\nkv_len = {values(1000, 4096)}\n" \
           f"num_heads = {values(1000)}\n"
    with pytest.raises(SpecError, match=r"grid\[0\].*1,000,000,000 combinations"):
        spec.load(spec_file(tmp_path, grid))
    small = f"[[grid]]\nbatch = {values(300)}\nkv_len = {values(400, 4096)}\n"
    with pytest.raises(SpecError, match=r"'grid'.*240,000 combinations in 2 grids"):
        spec.load(spec_file(tmp_path, small + small))


def test_the_size_limit_is_set_by_the_spec_and_overridden_by_the_environment(tmp_path,
                                                                           monkeypatch):
    text = "max_problems = 3\n[[grid]]\nbatch = [1, 2]\nkv_len = [64, 128]\n"
    monkeypatch.delenv(spec.MAX_PROBLEMS_ENV, raising=False)
    with pytest.raises(SpecError, match=r"4 combinations.*limit of 3 problems"):
        spec.load(spec_file(tmp_path, text))
    monkeypatch.setenv(spec.MAX_PROBLEMS_ENV, "4")
    assert len(spec.load(spec_file(tmp_path, text)).problems) == 4
    monkeypatch.setenv(spec.MAX_PROBLEMS_ENV, "many")
    with pytest.raises(SpecError, match=spec.MAX_PROBLEMS_ENV):
        spec.load(spec_file(tmp_path, text))
    monkeypatch.delenv(spec.MAX_PROBLEMS_ENV)
    with pytest.raises(SpecError, match="max_problems"):
        spec.load(spec_file(tmp_path, text.replace("3", "0", 1)))


def test_the_bundled_specs_fit_the_default_limit(monkeypatch):
    monkeypatch.delenv(spec.MAX_PROBLEMS_ENV, raising=False)
    for name in ("smoke.toml", "deepseek-v3-tp8.toml", "h200.toml", "h200-heldout.toml",
                 "gfx950.toml"):
        assert spec.load(spec.bundled_spec_path(name)).problems


@pytest.mark.parametrize(("key", "value"), [
    ("max_seconds", "nan"), ("max_seconds", "inf"), ("max_seconds", "-inf"),
    ("max_seconds", "-1.0"), ("max_seconds", "'2'"), ("max_seconds", "true"),
    ("max_seconds", "1e9"), ("max_seconds", "[1.0]"), ("settle", "nan"), ("settle", "1.0"),
    ("race_ratio", "nan"), ("race_ratio", "inf"), ("race_ratio", "-1.0"),
    ("max_reps", "1000000000000"), ("warmup", "-1"), ("min_reps", "2.5"),
    ("max_seconds", "1" + "0" * 400),
])
def test_budget_values_that_never_end_a_candidate_are_refused(tmp_path, key, value):
    path = spec_file(tmp_path, f"[budget]\n{key} = {value}\n[[grid]]\nkv_len = 8\n")
    with pytest.raises(SpecError) as err:
        spec.load(path)
    assert f"budget.{key}" in str(err.value) and str(path) in str(err.value)


def test_reasonable_budgets_still_load(tmp_path):
    path = spec_file(tmp_path, "[budget]\nmax_seconds = 0\nsettle = 0.0\nrace_ratio = 0\n"
                               "max_reps = 1000\n[[grid]]\nkv_len = 8\n")
    budget = spec.load(path).budget
    assert (budget.max_seconds, budget.race_ratio, budget.max_reps) == (0, 0, 1000)


# Journals: damaged lines and one sweep at a time --------------------------------------

HEADER = {"spec_sha256": "x", "arch": "cpu", "device_name": "cpu"}
KEY = MLAProblem(kv_len=64).key_dict()


def record(i: int) -> dict:
    return {"id": f"c{i}", "key": KEY, "route": "reference/torch", "route_params": "{}",
            "status": "ok", "time_us": 10.0 + i}


def journal_with(tmp_path: Path, middle: bytes) -> Path:
    path = tmp_path / "t.journal.jsonl"
    journal = Journal(path, HEADER, resume=False)
    journal.append(record(1))
    journal.close()
    with path.open("ab") as f:
        f.write(middle + b"\n")
        f.write((json.dumps({"kind": "result", **record(2)}) + "\n").encode())
    return path


@pytest.mark.parametrize("middle", [
    b"[1, 2]", b'"text"', b"17", b"null", b'{"kind": "result", "status": "ok"}',
    b'{"kind": "result", "id": 5, "status": "ok"}',
    b'{"kind": "result", "id": "x", "status": "ok", "key": [1]}',
    b'{"kind": "result", "id": "x", "status": "ok", "time_us": "fast"}',
    b'{"kind": "result", "id": "x", "status": "ok", "time_us": null}',
    b'{"kind": "result", "id": "x", "status": ["ok"]}',
    b'{"kind": "result", "id": "x", "status": "ok", "route_params": {}}',
    b"\xff\xfe not utf-8", b'{"id": "x", "sta', b"[" * 100_000,
])
def test_a_damaged_middle_line_is_one_error_naming_the_file_and_line(tmp_path, middle):
    path = journal_with(tmp_path, middle)
    with pytest.raises(JournalError) as err:
        Journal(path, HEADER, resume=True)
    message = str(err.value)
    assert str(path) in message and "line 3" in message and "\n" not in message
    assert lock_is_free(path)  # refused: the lock is given back


def test_read_refuses_a_line_that_is_not_an_object(tmp_path):
    with pytest.raises(JournalError, match="line 3 is damaged"):
        read(journal_with(tmp_path, b"[1, 2]"))


def test_a_torn_last_line_is_still_dropped_and_a_wrong_shaped_one_is_not(tmp_path):
    path = tmp_path / "t.journal.jsonl"
    journal = Journal(path, HEADER, resume=False)
    journal.append(record(1))
    journal.close()
    with path.open("ab") as f:
        f.write(b'{"kind": "result", "id": "c2", "status": "o\xe2\x82')  # cut inside a char
    journal = Journal(path, HEADER, resume=True)
    assert [r.id for r in journal.records] == ["c1"]
    journal.append(record(3))
    journal.close()
    assert [r["id"] for r in read(path)[1]] == ["c1", "c3"]
    with path.open("ab") as f:
        f.write(b"[1]\n")  # whole JSON, not a torn write
    with pytest.raises(JournalError, match="line 4"):
        read(path)


def test_a_cut_gzip_journal_is_one_error(tmp_path):
    path = tmp_path / "t.journal.jsonl.gz"
    data = gzip.compress(b"".join(json.dumps(record(i)).encode() + b"\n" for i in range(50)))
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(JournalError, match="not a readable gzip journal"):
        read(path)




def test_a_second_sweep_on_the_journal_is_refused_at_once(tmp_path):
    path = tmp_path / "t.journal.jsonl"
    first = Journal(path, HEADER, resume=False)
    try:
        for resume in (True, False):
            with pytest.raises(JournalError) as err:
                Journal(path, HEADER, resume=resume)
            assert str(err.value) == f"journal {path} is in use by another sweep"
    finally:
        first.close()
    assert lock_is_free(path)
    Journal(path, HEADER, resume=True).close()  # closed: free again


def _hold_journal(path: str, ready, release) -> None:
    journal = Journal(Path(path), HEADER, resume=True)
    ready.set()
    release.wait(30)
    journal.close()


def test_the_lock_of_a_killed_sweep_does_not_block_a_resume(tmp_path):
    path = tmp_path / "t.journal.jsonl"
    ctx = processes.context()
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_journal, args=(str(path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(JournalError, match="in use by another sweep"):
            Journal(path, HEADER, resume=True)
    finally:
        holder.kill()  # SIGKILL: no close, the lock file stays; the kernel drops the lock
        holder.join()
    assert lock_path(path).exists()
    journal = Journal(path, HEADER, resume=True)
    journal.append(record(1))
    journal.close()
    assert [r["id"] for r in read(path)[1]] == ["c1"]


def _race_to_create(path: str, start, results) -> None:
    start.wait(60)  # every racer imported and waiting: they try together
    try:
        journal = Journal(Path(path), HEADER, resume=True)
    except JournalError as exc:
        results.put(("refused", str(exc)))
        return
    results.put(("created", ""))
    time.sleep(2.0)  # hold it while the others try
    journal.close()


def test_sweeps_that_start_together_create_the_journal_once(tmp_path):
    path = tmp_path / "t.journal.jsonl"
    ctx = processes.context()
    racers = 6
    start, results = ctx.Barrier(racers), ctx.Queue()
    procs = [ctx.Process(target=_race_to_create, args=(str(path), start, results))
             for _ in range(racers)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(30)
    assert sorted(kind for kind, _ in outcomes).count("created") == 1
    assert all("in use by another sweep" in text for kind, text in outcomes if kind == "refused")
    assert path.read_text().count('"kind": "header"') == 1


def test_a_full_disk_is_one_output_error_and_nothing_is_glued_after_it(tmp_path, monkeypatch):
    path = tmp_path / "t.journal.jsonl"
    journal = Journal(path, HEADER, resume=False)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    journal._synced = -1e9  # the next write syncs
    with pytest.raises(OutputError, match="No space left on device"):
        journal.append(record(1))
    with pytest.raises(OutputError, match="an earlier write failed"):
        journal.append(record(2))
    with pytest.raises(OutputError):
        journal.close()
    monkeypatch.undo()
    assert lock_is_free(path)
    assert [r.id for r in Journal(path, HEADER, resume=True).records] == ["c1"]


# Damaged tables at model load ----------------------------------------------------------

def fuzz_frame():
    base = MLAProblem(num_heads=16, qlen=1)
    rows = [result_row(base.with_(batch=b, kv_len=k), route, t(base.with_(batch=b, kv_len=k)),
                       params={"splits": 4})
            for b in (1, 8) for k in (1024, 8192)
            for route, t in (("fast-small/fake", small_batch_fast),
                             ("reference/torch", reference_slow))]
    rows.append(result_row(base.with_(batch=3, kv_len=300), "fast-small/fake", None,
                           status="crashed", reason="raised"))
    return make_table(rows)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0:  # truncation
        return data[: rng.randrange(len(data))]
    buf = bytearray(data)
    if kind == 1:  # bit flips
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if kind == 2:  # a run of 0xff or 0x7f: huge lengths and counts in binary headers
        i = rng.randrange(len(buf))
        n = rng.randint(1, 8)
        buf[i:i + n] = bytes([rng.choice((0xFF, 0x7F, 0x80))]) * n
        return bytes(buf)
    i = rng.randrange(len(buf))  # huge numbers, deep nesting, stray text
    insert = rng.choice((b"9" * 400, b"1e999", b"-1e999", b"[" * 50_000, b'{"a":' * 30_000,
                         b"NaN", b"\x00" * 64, b"=cmd|' /C calc'!A0"))
    return bytes(buf[:i] + insert + buf[i:])


def mutate_json(document: dict, rng: random.Random) -> bytes:
    """A structural mutation of a winners map: a value replaced by a huge, deep or
    wrongly typed one somewhere in the tree."""
    doc = json.loads(json.dumps(document))
    deep: object = {}
    for _ in range(rng.choice((10, 900, 5000))):
        deep = {"x": deep}
    replacement = rng.choice([10 ** 400, -(10 ** 400), 1e308 * 10, float("nan"), -1, 0,
                              True, None, "", "x" * 10_000, [], {}, [1, 2], deep,
                              2 ** 63, 2 ** 64 + 1])
    node = doc
    for _ in range(rng.randint(1, 8)):
        children = list(node.items()) if isinstance(node, dict) else \
            list(enumerate(node)) if isinstance(node, list) else []
        if not children:
            break
        where, child = rng.choice(children)
        if not isinstance(child, (dict, list)) or rng.random() < 0.3:
            node[where] = replacement
            break
        node = child
    try:
        return json.dumps(doc).encode()
    except RecursionError:
        return b"[" * 100_000


def assert_only_table_error(path: Path) -> None:
    try:
        Dispatcher.load(path, device=H200)
    except TableError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc), str(exc)


@pytest.fixture(scope="module")
def clean_files(tmp_path_factory):
    where = tmp_path_factory.mktemp("clean")
    frame = fuzz_frame()
    return {"parquet": table.write(frame, where / "t.parquet").read_bytes(),
            "csv": table.write(frame, where / "t.csv").read_bytes(),
            "json": table.winners_json(frame)}


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json"])
def test_only_table_error_escapes_loading_a_damaged_table(tmp_path, clean_files, fmt):
    rng = random.Random(17)
    path = tmp_path / f"sm_90.{fmt}"
    for i in range(120):
        if fmt == "json":
            clean = json.dumps(clean_files["json"]).encode()
            data = mutate_json(clean_files["json"], rng) if i % 2 else mutate_bytes(clean, rng)
        else:
            data = mutate_bytes(clean_files[fmt], rng)
        path.write_bytes(data)
        assert_only_table_error(path)


def huge_time(document: dict) -> bytes:
    document = json.loads(json.dumps(document))
    winner = next(iter(document["devices"][0]["winners"].values()))
    winner["time_us"] = 10 ** 400  # JSON ints are unbounded; no float holds this one
    return json.dumps(document).encode()


@pytest.mark.parametrize("damage", ["deep", "huge"])
def test_known_damage_is_a_table_error(tmp_path, clean_files, damage):
    path = tmp_path / "sm_90.json"
    # RecursionError in json.loads; OverflowError in math.isfinite
    path.write_bytes(b"[" * 100_000 if damage == "deep" else huge_time(clean_files["json"]))
    with pytest.raises(TableError, match=re.escape(str(path))):
        Dispatcher.load(path, device=H200)


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json"])
def test_a_damaged_bundled_table_never_fails_a_model_load(tmp_path, clean_files, monkeypatch,
                                                          caplog, fmt):
    monkeypatch.delenv(dispatch_module.TABLE_ENV, raising=False)
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: tmp_path)
    rng = random.Random(1700)
    path = tmp_path / f"sm_90.{fmt}"
    clean = json.dumps(clean_files["json"]).encode() if fmt == "json" else clean_files[fmt]
    damaged = [b"[" * 100_000 if fmt == "json" else clean[: len(clean) // 3]]
    damaged += [mutate_bytes(clean, rng) for _ in range(20)]
    for data in damaged:
        path.write_bytes(data)
        with caplog.at_level(logging.WARNING, logger="mlatune"):
            dispatcher = Dispatcher.from_bundled(H200)
        assert dispatcher.source in ("", str(path))  # rules, or a table the damage spared
    assert "bundled table unusable" in caplog.text


# CSV exports: formulas neutralised, the table round-trips -----------------------------

FORMULAS = ["=HYPERLINK(\"http://x\",\"y\")", "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx",
            "'quoted", "''", "plain", "a=b"]


def test_formula_cells_are_neutralised_and_the_table_round_trips(tmp_path):
    base = MLAProblem(num_heads=16, qlen=1)
    rows = [result_row(base.with_(batch=i + 1), "reference/torch", None, status="crashed",
                       reason=text) for i, text in enumerate(FORMULAS)]
    rows.append(result_row(base.with_(batch=99), "reference/torch", 12.5))
    frame = make_table(rows)
    frame["driver"] = "=DRIVER()"
    path = table.write(frame, tmp_path / "t.csv")
    with path.open(newline="") as f:
        cells = [c for row in csv.reader(f) for c in row]
    assert not [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r")]
    assert "'=HYPERLINK(\"http://x\",\"y\")" in cells and "'''" in cells and "12.5" in cells
    back = table.read(path)
    assert back.equals(table.read(table.write(frame, tmp_path / "t.parquet")))
    assert sorted(back["reason"]) == sorted(["", *FORMULAS])


def test_outputs_write_csv_neutralises_text_and_keeps_numbers(tmp_path):
    path = outputs.write_csv(tmp_path / "plan.csv", ["route", "reason", "n"],
                             [["a/b", "=1+2", -3], ["c/d", "-x", 4.5]])
    with path.open(newline="") as f:
        assert list(csv.reader(f)) == [["route", "reason", "n"], ["a/b", "'=1+2", "-3"],
                                       ["c/d", "'-x", "4.5"]]
    assert [outputs.csv_text_value(outputs.csv_text_cell(t)) for t in FORMULAS] == FORMULAS


# Writes: planted symlinks, directories, read-only and full disks -------------------------

@pytest.mark.parametrize("name", ["t.parquet", "t.csv", "t.json"])
def test_table_writes_never_follow_a_planted_symlink(tmp_path, name):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / f".{name}.tmp").symlink_to(victim)
    (out / name).symlink_to(victim)  # the target itself too: replaced, not written through
    frame = fuzz_frame()
    if name.endswith(".json"):
        table.write_json(table.winners_json(frame), out / name)
    else:
        table.write(frame, out / name)
    assert victim.read_text() == "keep"
    assert not (out / name).is_symlink() and (out / name).stat().st_size > 0
    assert (out / f".{name}.tmp").is_symlink()  # left alone
    outputs.write_csv(out / "plan.csv", ["a"], [["b"]])
    assert victim.read_text() == "keep"


def test_check_writable_output_refuses_up_front(tmp_path, monkeypatch):
    (tmp_path / "dir.parquet").mkdir()
    (tmp_path / "file").write_text("x")
    for path, why in [(tmp_path / "dir.parquet", "is a directory"),
                      (tmp_path / "file" / "t.parquet", "is not a directory"),
                      (tmp_path / "file" / "sub" / "t.parquet", "is not a directory")]:
        with pytest.raises(OutputError, match=why) as err:
            outputs.check_writable_output(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    outputs.check_writable_output(tmp_path / "new" / "deeper" / "t.parquet")
    assert not (tmp_path / "new").exists()  # a check makes nothing
    outputs.check_writable_output(tmp_path / "t.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.parquet", "file"]
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(OutputError, match="cannot write into"):
        outputs.check_writable_output(tmp_path / "t.parquet")
    with pytest.raises(OutputError, match=r"cannot create .*new in"):
        outputs.check_writable_output(tmp_path / "new" / "t.parquet")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_check_writable_output_refuses_a_read_only_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        with pytest.raises(OutputError, match="no permission"):
            outputs.check_writable_output(locked / "t.parquet")
    finally:
        locked.chmod(0o755)


def test_a_read_only_file_system_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    monkeypatch.setattr(outputs, "_read_only", lambda d: True)
    with pytest.raises(OutputError, match="read-only file system"):
        outputs.check_writable_output(tmp_path / "t.parquet")


@pytest.mark.parametrize(("code", "text"), [(errno.ENOSPC, "No space left on device"),
                                            (errno.EROFS, "Read-only file system"),
                                            (errno.EACCES, "Permission denied")])
def test_a_failed_table_write_is_one_output_error(tmp_path, monkeypatch, code, text):
    path = table.write(fuzz_frame(), tmp_path / "t.csv")
    before = path.read_bytes()

    def fail(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OutputError) as err:
        table.write(fuzz_frame(), path)
    assert str(err.value) == f"cannot write {path}: {text}"
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["t.csv"]


def test_writing_a_table_over_a_directory_is_one_output_error(tmp_path):
    (tmp_path / "t.parquet").mkdir()
    with pytest.raises(OutputError, match=re.escape(f"cannot write {tmp_path / 't.parquet'}: ")):
        table.write(fuzz_frame(), tmp_path / "t.parquet")
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]  # no temporary left


def test_a_number_too_long_for_python_is_a_spec_error(tmp_path):
    path = spec_file(tmp_path, "[budget]\nmax_reps = 1" + "0" * 5000 + "\n[[grid]]\nkv_len = 8\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        spec.load(path)


def test_a_journal_whose_header_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    path = tmp_path / "t.journal.jsonl"
    with pytest.raises(OutputError, match="No space left on device"):
        Journal(path, HEADER, resume=False)
    assert not path.exists() and lock_is_free(path)  # no journal left, its lock given back


def test_a_journal_killed_before_its_header_is_resumed_as_new(tmp_path):
    path = tmp_path / "t.journal.jsonl"
    path.write_bytes(b'{"kind": "hea')  # the kill came mid-header
    journal = Journal(path, HEADER, resume=True)
    journal.append(record(1))
    journal.close()
    header, records = read(path)
    assert header["spec_sha256"] == "x" and [r["id"] for r in records] == ["c1"]
