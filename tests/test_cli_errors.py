"""The command line's outputs and errors (issue 17's loose ends): every output a command
writes is checked before any work, and every library error (SpecError, JournalError,
TableError, OutputError) ends as one line on stderr and exit 1, never a traceback."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlatune import table
from mlatune.cli import app, doctor, frames
from mlatune.errors import JournalError, OutputError, TableError
from mlatune.problem import MLAProblem
from mlatune.sweep import runner, stages
from mlatune.sweep.journal import Journal
from mlatune.sweep.spec import bundled_spec_path
from mlatune.table import outputs
from tests.helpers import lock_is_free
from tests.table_helpers import MI355, make_table, result_row
from tests.test_cli_tables import assert_one_line_error, coverage_spec, fakes, frame  # noqa: F401

cli_runner = CliRunner()  # not a terminal: one error is one line
wide = CliRunner(env={"COLUMNS": "250"})


def invoke(*args: str, env: dict[str, str] | None = None):
    return cli_runner.invoke(app, [str(a) for a in args], env=env)


def tiny_spec(tmp_path: Path) -> Path:
    """Two decode problems the reference runs on the CPU."""
    path = tmp_path / "tiny.toml"
    path.write_text('routes = ["reference/torch"]\n'
                    "[budget]\nwarmup = 0\nmin_reps = 1\nmax_reps = 1\n"
                    "[[grid]]\nnum_heads = 2\nbatch = [1, 2]\nkv_len = 24\n"
                    'page_size = 8\nq_dtype = "fp16"\nkv_dtype = "fp16"\n')
    return path


@pytest.fixture
def good(tmp_path) -> Path:
    return table.write(frame(), tmp_path / "sm_90.parquet")


@pytest.fixture
def read_only_fs(monkeypatch, tmp_path):
    """What check_writable_output sees when tmp_path is on a read-only file system (root
    ignores modes; typer asks os.access whether an input is readable, which stays true)."""
    real = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and Path(path) == tmp_path:
            return False
        return real(path, mode, *args, **kwargs)

    def arm():
        monkeypatch.setattr(os, "access", access)
        monkeypatch.setattr(outputs, "_read_only", lambda directory: True)
    return arm


def assert_error_line(result, *needles: str) -> None:
    """Exit 1, no traceback, and exactly one line on stderr: the error, naming needles."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# 1. Outputs are checked before any work ---------------------------------------------

def bad_outputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Per kind of bad output: a path to write, and what the error says."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "afile").write_text("x")
    return {"a directory in the way": (tmp_path / "dir", "is a directory"),
            "a parent that is a file": (tmp_path / "afile" / "t", "not a directory"),
            "a read-only file system": (tmp_path / "t", "read-only file system")}


SWEEP_CASES = {  # (--out, the path the error names, what it says), under tmp_path
    "the table is a directory": ("d/t.parquet", "d/t.parquet", "is a directory"),
    "its csv is a directory": ("d/t.parquet", "d/t.csv", "is a directory"),
    "its journal is a directory": ("d/t.parquet", "d/t.journal.jsonl", "is a directory"),
    "a parent that is a file": ("afile/t.parquet", "afile/t.parquet", "not a directory"),
    "a read-only file system": ("ro/t.parquet", "ro/t.parquet", "read-only file system"),
}


@pytest.mark.parametrize("case", sorted(SWEEP_CASES))
def test_sweep_refuses_a_bad_output_before_it_runs(tmp_path, monkeypatch, read_only_fs, case):
    out, named, why = SWEEP_CASES[case]
    (tmp_path / "afile").write_text("x")
    if why == "is a directory":
        (tmp_path / named).mkdir(parents=True)
    if why == "read-only file system":
        read_only_fs()

    def never(*args, **kwargs):
        raise AssertionError("the sweep ran")

    monkeypatch.setattr(runner, "run", never)
    result = invoke("sweep", tiny_spec(tmp_path), "--out", tmp_path / out)
    assert result.exit_code == 1
    assert_one_line_error(result, why, str(tmp_path / named))
    assert not [p for p in tmp_path.rglob("*.journal.jsonl*") if p.is_file()]  # no journal


@pytest.mark.parametrize("kind", ["a directory in the way", "a parent that is a file",
                                  "a read-only file system"])
def test_export_upgrade_plan_and_report_refuse_a_bad_out_first(tmp_path, good, read_only_fs,
                                                               monkeypatch, kind):
    path, why = bad_outputs(tmp_path)[kind]
    if kind == "a read-only file system":
        read_only_fs()
    read = []
    monkeypatch.setattr(frames, "read_table", lambda p: read.append(p))  # never reached
    commands = {
        "export": ["export", good, "--format", "csv", "--out", path.with_suffix(".csv")],
        "upgrade": ["upgrade", good, "--out", path.with_suffix(".parquet")],
        "plan": ["plan", "smoke", "--arch", "gfx950", "--out", path.with_suffix(".csv")],
    }
    if kind == "a directory in the way":  # the path itself is the directory
        (tmp_path / "dir.csv").mkdir()
        (tmp_path / "dir.parquet").mkdir()
    for name, args in commands.items():
        result = invoke(*args)
        assert result.exit_code == 1, (name, result.output)
        assert_one_line_error(result, why)
        assert "plan for" not in result.output  # refused before planning
    assert not read
    # report --out names a directory: a file there, or one that cannot be made
    folder = {"a directory in the way": tmp_path / "afile",  # a file where the folder goes
              "a parent that is a file": tmp_path / "afile" / "r",
              "a read-only file system": tmp_path / "ro" / "r"}[kind]
    result = invoke("report", good, "--out", folder)
    assert result.exit_code == 1
    assert_one_line_error(result, str(folder))
    assert not (tmp_path / "ro").exists()


def test_plan_out_into_a_missing_folder_is_one_line(tmp_path):
    result = invoke("plan", "smoke", "--arch", "gfx950", "--out", tmp_path / "no" / "p.csv")
    assert_one_line_error(result, "cannot write", "no such directory")
    assert not (tmp_path / "no").exists()


def test_upgrade_over_a_current_table_needs_no_writable_folder(good, read_only_fs):
    read_only_fs()
    result = invoke("upgrade", good)
    assert result.exit_code == 0 and "nothing written" in result.output


def test_upgrade_of_a_current_table_to_a_named_out_writes_it(good, tmp_path):
    out = tmp_path / "copy.parquet"
    result = invoke("upgrade", good, "--out", out)
    assert result.exit_code == 0 and "copied" in result.output, result.output
    assert table.read(out).equals(table.read(good))
    assert out.with_suffix(".csv").is_file()


def test_report_into_a_new_folder_still_works(tmp_path, good):
    pytest.importorskip("matplotlib")
    pytest.importorskip("jinja2")
    result = wide.invoke(app, ["report", str(good), "--out", str(tmp_path / "new" / "r")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "new" / "r" / "report.html").is_file()


# 2. Library errors: one line, exit 1 -------------------------------------------------

def test_a_damaged_journal_line_is_one_line(tmp_path):
    spec, out = tiny_spec(tmp_path), tmp_path / "t.parquet"
    journal = out.with_suffix(".journal.jsonl")
    held = Journal(journal, {"spec_sha256": "x"}, resume=False)
    held.append({"id": "a", "status": "ok"})
    held.close()
    with journal.open("a") as f:
        f.write("[1, 2]\n" + json.dumps({"kind": "result", "id": "b", "status": "ok"}) + "\n")
    result = invoke("sweep", spec, "--out", out)
    assert_error_line(result, str(journal), "line 3", "--fresh starts over")
    assert result.exit_code == 1 and lock_is_free(journal)


# The commands that read a spec, as (spec, tmp_path) -> arguments.
SPEC_COMMANDS = [
    lambda spec, tmp: ["sweep", spec, "--out", tmp / "t.parquet"],
    lambda spec, tmp: ["plan", spec, "--arch", "gfx950"],
    lambda spec, tmp: ["coverage", spec, "--arch", "sm_90"],
]


@pytest.mark.parametrize("command", SPEC_COMMANDS, ids=["sweep", "plan", "coverage"])
def test_a_spec_over_the_problem_limit_is_one_line(tmp_path, command):
    spec = tiny_spec(tmp_path)  # two problems
    result = invoke(*command(spec, tmp_path), env={"MLATUNE_MAX_PROBLEMS": "1"})
    assert result.exit_code == 1
    assert_one_line_error(result, str(spec), "more than the limit of 1")
    assert not list(tmp_path.glob("*.journal.jsonl"))


def test_a_spec_that_is_a_directory_is_one_line(tmp_path):
    (tmp_path / "folder.toml").mkdir()
    result = invoke("plan", tmp_path / "folder.toml", "--arch", "gfx950")
    assert result.exit_code == 1
    assert_one_line_error(result, "folder.toml")


@pytest.mark.parametrize("command", SPEC_COMMANDS, ids=["sweep", "plan", "coverage"])
def test_a_spec_that_is_a_device_or_a_pipe_is_refused_unread(tmp_path, command):
    pipe = tmp_path / "pipe.toml"
    os.mkfifo(pipe)  # reading it would wait for a writer forever
    for spec, words in (("/dev/zero", "not a regular file (a character device)"),
                        (pipe, "not a regular file (a pipe)")):
        result = invoke(*command(spec, tmp_path))
        assert result.exit_code == 1
        assert_one_line_error(result, str(spec), words)


def test_a_spec_over_the_size_limit_is_refused_unparsed(tmp_path):
    from mlatune.sweep.spec import MAX_SPEC_BYTES

    spec = tmp_path / "huge.toml"
    spec.write_text("# " + "x" * MAX_SPEC_BYTES + "\n" + tiny_spec(tmp_path).read_text())
    result = invoke("plan", spec, "--arch", "gfx950")
    assert result.exit_code == 1
    assert_one_line_error(result, str(spec), f"limit of {MAX_SPEC_BYTES:,} bytes")
    spec.write_text(tiny_spec(tmp_path).read_text())  # the same spec, small: served
    assert invoke("plan", spec, "--arch", "gfx950").exit_code == 0


def damaged_table_args(tmp_path: Path, command: str) -> tuple[Path, list]:
    """A damaged Parquet table, and ``command``'s arguments that read it."""
    damaged = tmp_path / "sm_90.parquet"
    damaged.write_bytes(b"PAR1" + bytes(range(200)) + b"PAR1")
    return damaged, {
        "show": ["show", damaged],
        "lookup": ["lookup", damaged, "--heads", "16", "--batch", "4", "--kv-len", "2048",
                   "--arch", "sm_90"],
        "validate": ["validate", damaged],
        "diff": ["diff", damaged, damaged],
        "coverage": ["coverage", damaged, coverage_spec(tmp_path), "--arch", "sm_90"],
        "export": ["export", damaged, "--format", "csv", "--out", tmp_path / "o.csv"],
        "upgrade": ["upgrade", damaged, "--out", tmp_path / "o.parquet"],
        "report": ["report", damaged, "--out", tmp_path / "r"]}[command]


@pytest.mark.parametrize("command", ["show", "lookup", "validate", "diff", "coverage",
                                     "export", "upgrade", "report"])
def test_a_damaged_table_is_one_line_to_every_command(tmp_path, command):
    damaged, args = damaged_table_args(tmp_path, command)
    result = invoke(*args)
    assert result.exit_code == 1
    assert_one_line_error(result, str(damaged))
    assert not (tmp_path / "o.csv").exists() and not (tmp_path / "o.parquet").exists()


@pytest.mark.parametrize("command", ["show", "lookup", "validate", "diff", "coverage",
                                     "export", "upgrade"])
def test_a_failure_under_json_is_one_json_object_on_stdout(tmp_path, command):
    """A script that asked for --json reads JSON on a failure too: {"ok": false, "error"},
    the same line stderr has; exit 1 as without --json."""
    damaged, args = damaged_table_args(tmp_path, command)
    result = invoke(*args, "--json")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["schema"] == f"mlatune.{command}" and document["ok"] is False
    assert str(damaged) in document["error"] and str(damaged) in result.stderr


@pytest.mark.parametrize("fault", ["append", "close"])
def test_a_journal_that_cannot_be_written_mid_sweep_is_one_line(tmp_path, monkeypatch, fault):
    def full(self, *args):
        raise OutputError(f"cannot write journal {self.path}: No space left on device")

    real_close = Journal.close

    def close_then_fail(self):
        real_close(self)
        full(self)

    monkeypatch.setattr(Journal, fault, full if fault == "append" else close_then_fail)
    out = tmp_path / "t.parquet"
    result = invoke("sweep", tiny_spec(tmp_path), "--out", out)
    assert_error_line(result, "No space left on device", "rerun to continue")
    assert not out.exists()  # no table from a sweep whose journal failed


def test_a_table_the_sweep_cannot_write_is_one_line(tmp_path, monkeypatch):
    def refuse(frame, path, fmt=None):
        raise TableError(f"refusing to write an invalid table to {path}: a reason")

    monkeypatch.setattr(table, "write", refuse)
    out = tmp_path / "t.parquet"
    result = invoke("sweep", tiny_spec(tmp_path), "--out", out)
    assert_error_line(result, "refusing to write", "every result is in")


def test_a_worker_that_will_not_start_is_one_line(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("sweep worker on cpu failed to start: worker exited with code 1")

    monkeypatch.setattr(runner, "run", broken)
    result = invoke("sweep", tiny_spec(tmp_path), "--out", tmp_path / "t.parquet")
    assert_error_line(result, "failed to start")
    assert lock_is_free(tmp_path / "t.journal.jsonl")  # the journal was closed


@pytest.mark.parametrize("error", [JournalError, TableError, OutputError])
def test_any_library_error_a_command_lets_through_is_still_one_line(monkeypatch, error):
    def damaged():
        raise error("some/file: damaged in a way no command foresaw")

    monkeypatch.setattr(doctor, "bundled_tables", damaged)
    result = invoke("doctor")
    assert result.exit_code == 1
    assert_one_line_error(result, "some/file: damaged")


# 3. plan --out writes atomically, never through a planted name -------------------------

def test_plan_out_never_writes_through_a_planted_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / ".plan.csv.tmp").symlink_to(victim)
    out = tmp_path / "plan.csv"
    result = invoke("plan", bundled_spec_path("smoke.toml"), "--arch", "gfx950", "--out", out)
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "keep me"
    assert out.read_text().startswith("arch,device_name,cu_count,")


# 4. doctor reads bundled tables as the dispatcher does ------------------------------

def test_doctor_says_a_damaged_bundled_table_in_one_line(tmp_path, monkeypatch):
    from mlatune.dispatch import bundled

    (tmp_path / "sm_90-x.parquet").write_bytes(b"PAR1 damaged PAR1")
    odd = replace(MI355, name="=MI355X")  # a spreadsheet would call it a formula
    table.write(make_table([result_row(MLAProblem(), "reference/torch", 5.0, device=odd)]),
                tmp_path / "gfx950-x.csv")
    assert "'=MI355X" in (tmp_path / "gfx950-x.csv").read_text()  # neutralised on disk
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: tmp_path)
    result = invoke("doctor", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    found = {e["arch"]: e for e in document["bundled_tables"]}
    broken = found["sm_90"]["error"]
    assert broken.startswith(f"{tmp_path / 'sm_90-x.parquet'}: ") and "\n" not in broken
    assert found["gfx950"]["error"] is None
    assert [d["device_name"] for d in found["gfx950"]["devices"]] == ["=MI355X"]
    text = wide.invoke(app, ["doctor"])
    assert text.exit_code == 0 and "=MI355X" in text.output and "'=MI355X" not in text.output


# 5. --fresh holds the journal's lock while it moves the earlier run aside ------------



def test_fresh_moves_aside_under_the_journal_lock(tmp_path, monkeypatch):
    spec, out = tiny_spec(tmp_path), tmp_path / "t.parquet"
    journal = out.with_suffix(".journal.jsonl")
    assert invoke("sweep", spec, "--out", out).exit_code == 0
    seen = []
    real = stages.move_aside

    def move_aside(table_path, journal_path):
        seen.append("free" if lock_is_free(journal_path) else "held")  # a second sweep's try
        return real(table_path, journal_path)

    monkeypatch.setattr(stages, "move_aside", move_aside)
    result = invoke("sweep", spec, "--out", out, "--fresh")
    assert result.exit_code == 0, result.output
    assert seen == ["held"] and "the earlier run moved to" in result.output
    assert lock_is_free(journal)  # given back, and the new sweep's closed too


# 6. report's speedup table: the renamed column, numbers right-aligned ------------------

@pytest.mark.usefixtures("fakes")
def test_report_prints_the_largest_speedup_right_aligned(tmp_path, good):
    pytest.importorskip("matplotlib")
    pytest.importorskip("jinja2")
    result = wide.invoke(app, ["report", str(good), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    [header] = [line for line in lines if "largest speedup" in line and "┃" in line]
    names = [cell.strip() for cell in header.split("┃")]
    column = names.index("largest speedup")
    rows = [line for line in lines if line.startswith("│") and line.count("│") == len(names) - 1
            and line.split("│")[column].strip().endswith("x")]
    assert rows, result.output
    for row in rows:
        cell = row.split("│")[column]
        assert cell.startswith("  ") and cell.endswith("x "), row  # right-justified
    assert "worst" not in result.output


def test_a_bad_plugins_setting_is_one_line_from_any_command():
    """MLATUNE_PLUGINS naming a module that does not import: one line naming the variable,
    exit 1, from a command that does not catch it itself (a fresh process: plugins load
    when the routes are first imported)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mlatune", "doctor"], capture_output=True,
                          text=True, env={**os.environ, "MLATUNE_PLUGINS": "no_such_plugin"})
    assert done.returncode == 1
    assert "MLATUNE_PLUGINS: plugin module 'no_such_plugin' does not import" in done.stderr
    assert "Traceback" not in done.stderr
