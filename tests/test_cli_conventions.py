"""One interface convention across commands, checked over every command the app has: a
new command fails here until it is classified below and keeps the convention.

- a command that reads one table takes it as its first positional argument (TABLE);
  where it may be left out (lookup, coverage) both resolve the same default table;
- a command that writes a file takes --out, never a positional output;
- --json prints one JSON object, {"schema": "mlatune.<command>", "version": 1, ...};
- usage errors (an input that does not exist, a value of the wrong form, flags that
  exclude each other) exit 2; runtime failures exit 1;
- --help shows metavars a person reads, never Python types.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from mlatune import table
from mlatune.cli import app, inputs
from tests.test_cli_tables import coverage_spec, fakes, frame  # noqa: F401

runner = CliRunner()
CLICK_APP = typer.main.get_command(app)

# command: (how it takes its one table: "TABLE", "[TABLE]" or None; writes a file)
CONVENTIONS = {
    "sweep": (None, True),
    "plan": (None, True),
    "coverage": ("[TABLE]", False),
    "show": ("TABLE", False),
    "lookup": ("[TABLE]", False),
    "validate": ("TABLE", False),
    "diff": (None, False),  # two tables, A and B
    "merge": (None, True),  # any number of tables
    "export": ("TABLE", True),
    "upgrade": ("TABLE", True),
    "report": ("TABLE", True),
    "doctor": (None, False),
}
LOOKUP = ["--heads", "16", "--batch", "8", "--kv-len", "1024", "--arch", "sm_90"]


def tiny_spec(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text('routes = ["reference/torch"]\n'
                    "[budget]\nwarmup = 0\nmin_reps = 1\nmax_reps = 1\n"
                    "[[grid]]\nnum_heads = 2\nbatch = 1\nkv_len = 24\n"
                    'page_size = 8\nq_dtype = "fp16"\nkv_dtype = "fp16"\n')
    return path


def working_call(command: str, tmp: Path, good: Path) -> list[str]:
    """A call of ``command`` that succeeds, writing under ``tmp``."""
    return {
        "sweep": ["sweep", tiny_spec(tmp), "--out", tmp / "swept.parquet"],
        "plan": ["plan", "smoke", "--arch", "sm_90", "--out", tmp / "plan.csv"],
        "coverage": ["coverage", good, coverage_spec(tmp), "--arch", "sm_90"],
        "show": ["show", good],
        "lookup": ["lookup", good, *LOOKUP],
        "validate": ["validate", good],
        "diff": ["diff", good, good],
        "merge": ["merge", good, good, "--out", tmp / "merged.parquet"],
        "export": ["export", good, "--format", "json", "--out", tmp / "winners.json"],
        "upgrade": ["upgrade", good, "--out", tmp / "upgraded.parquet"],
        "report": ["report", good, "--out", tmp / "report"],
        "doctor": ["doctor"],
    }[command]


def missing_input(command: str, tmp: Path) -> list[str]:
    """A call of ``command`` naming an input that does not exist (doctor reads none: an
    unknown option instead)."""
    absent = tmp / "absent.parquet"
    return {
        "sweep": ["sweep", tmp / "absent.toml"],
        "plan": ["plan", tmp / "absent.toml", "--arch", "sm_90"],
        "coverage": ["coverage", absent, "smoke"],
        "show": ["show", absent],
        "lookup": ["lookup", absent, *LOOKUP],
        "validate": ["validate", absent],
        "diff": ["diff", absent, absent],
        "merge": ["merge", absent, "--out", tmp / "merged.parquet"],
        "export": ["export", absent, "--format", "json", "--out", tmp / "w.json"],
        "upgrade": ["upgrade", absent],
        "report": ["report", absent, "--out", tmp / "r"],
        "doctor": ["doctor", "--no-such-option"],
    }[command]


def invoke(args: list, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


@pytest.fixture
def good(tmp_path) -> Path:
    return table.write(frame(), tmp_path / "sm_90.parquet")


def test_every_command_is_classified():
    assert set(CLICK_APP.commands) == set(CONVENTIONS), \
        "a new command: classify it in CONVENTIONS and give it working and failing calls"


@pytest.mark.parametrize("command", sorted(CONVENTIONS))
def test_outputs_are_out_and_a_table_is_the_first_argument(command):
    takes_table, writes = CONVENTIONS[command]
    cmd = CLICK_APP.commands[command]
    ctx = cmd.make_context(command, ["--help"], resilient_parsing=True)
    arguments = [p for p in cmd.params if p.param_type_name == "argument"]
    options = {opt for p in cmd.params if p.param_type_name == "option" for opt in p.opts}
    assert ("--out" in options) == writes
    assert not [a for a in arguments if a.name in ("out", "output")]
    if takes_table:  # as the usage line shows it: TABLE, or [TABLE] where it may be left out
        assert arguments[0].get_usage_pieces(ctx)[0].split()[0] == takes_table


@pytest.mark.parametrize("command", sorted(CONVENTIONS))
def test_help_shows_metavars_a_person_reads(command):
    cmd = CLICK_APP.commands[command]
    ctx = cmd.make_context(command, ["--help"], resilient_parsing=True)
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    assert not re.search(r"[<>{}]", usage), usage
    for param in cmd.params:
        record = param.get_help_record(ctx)
        if record is None:  # hidden
            continue
        for tag in re.findall(r"<([^>]*)>", record[0]):
            assert "|" in tag, (command, record[0])  # only a fixed set's values: <a|b|c>
        assert not re.search(r"list\[|Path|\bint\b|\bstr\b|float", record[0]), record[0]
    assert "<list[" not in invoke([command, "--help"]).output


@pytest.mark.parametrize("command", sorted(CONVENTIONS))
def test_json_is_one_object_on_every_command(command, tmp_path, good, fakes):  # noqa: F811
    if command == "report":
        pytest.importorskip("matplotlib")
        pytest.importorskip("jinja2")
    result = invoke([*working_call(command, tmp_path, good), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)  # nothing else on stdout, or this fails
    assert isinstance(document, dict)
    assert document["schema"] == f"mlatune.{command}" and document["version"] == 1
    assert document["ok"] is True  # a script checks one field, as failures set it false


@pytest.mark.parametrize("command", sorted(CONVENTIONS))
def test_an_input_that_does_not_exist_is_a_usage_error(command, tmp_path):
    result = invoke(missing_input(command, tmp_path))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert not [p for p in tmp_path.iterdir()]  # nothing written


@pytest.mark.parametrize("args", [
    ["sweep", "smoke", "--resume", "--fresh"],
    ["sweep", "smoke", "--refine", "10", "--fresh"],
    ["sweep", "smoke", "--refine", "10", "--shard", "0/2"],
    ["sweep", "smoke", "--shard", "2/2"],
    ["sweep", "smoke", "--routes", "nope/none"],
    ["sweep", "smoke", "--routes", ",,,"],
    ["sweep", "smoke", "--out", "{tmp}/t.txt"],
    ["sweep", "smoke", "--gpus", "0"],
    ["plan", "smoke", "--arch", "sm_80"],
    ["coverage", "{good}", "smoke", "--require", "exact"],
    ["coverage", "{good}", "{good}", "smoke"],
    ["lookup", "{good}", "--heads", "many", "--batch", "1", "--kv-len", "1"],
    ["show", "{good}", "--limit", "all"],
    ["export", "{good}", "--format", "csv", "--out", "{tmp}/t.parquet"],
    ["upgrade", "{good}", "--out", "{tmp}/t.json"],
    ["merge", "{good}", "--out", "{tmp}/t.json"],
    ["merge", "{good}"],
], ids=lambda args: " ".join(a for a in args if "{" not in a))
def test_values_of_the_wrong_form_and_flags_that_exclude_each_other_exit_2(args, tmp_path,
                                                                          good):
    result = invoke([a.format(tmp=tmp_path, good=good) for a in args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]


@pytest.mark.parametrize("args", [
    ["sweep", "smoke", "--routes", ",,,"],
    ["show", "{good}", "--limit", "all"],
    ["lookup", "{good}", "--no-such-option"],
], ids=lambda args: " ".join(a for a in args if "{" not in a))
def test_a_usage_error_under_json_answers_in_json_too(args, good):
    result = invoke([*(a.format(good=good) for a in args), "--json"])
    assert result.exit_code == 2, result.output
    document = json.loads(result.stdout)
    assert document["schema"] == f"mlatune.{args[0]}"
    assert document["ok"] is False and document["usage"] is True and document["error"]


def test_the_old_forms_say_the_new_ones(tmp_path, good):
    old_merge = invoke(["merge", tmp_path / "joined.parquet", good])
    assert old_merge.exit_code == 2
    text = " ".join(old_merge.output.split())
    assert "--out" in text and "mlatune merge TABLE... --out OUT" in text
    old_coverage = invoke(["coverage", coverage_spec(tmp_path), "--table", good])
    assert old_coverage.exit_code == 2
    assert "mlatune coverage TABLE SPEC" in " ".join(old_coverage.output.split())


def test_a_runtime_failure_exits_1(tmp_path):
    damaged = tmp_path / "sm_90.parquet"
    damaged.write_bytes(b"PAR1" + bytes(range(200)) + b"PAR1")
    for args in (["show", damaged], ["validate", damaged], ["lookup", damaged, *LOOKUP],
                 ["merge", damaged, "--out", tmp_path / "m.parquet"]):
        result = invoke(args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith("error:") and str(damaged) in result.stderr


# The default table ----------------------------------------------------------------------

def test_lookup_and_coverage_default_to_the_table_the_dispatcher_loads(tmp_path, monkeypatch):
    from mlatune.dispatch import Dispatcher, device_for_arch

    monkeypatch.delenv("MLATUNE_TABLE", raising=False)
    monkeypatch.delenv("MLATUNE_USER_TABLE", raising=False)
    bundled = Dispatcher.from_bundled(device_for_arch("sm_90")).source  # no GPU model named
    assert bundled and Path(bundled) == inputs.default_table("sm_90")
    looked = json.loads(invoke(["lookup", *LOOKUP, "--json"]).stdout)
    covered = json.loads(invoke(["coverage", coverage_spec(tmp_path), "--arch", "sm_90",
                                 "--json"]).stdout)
    assert looked["table"] == covered["table"] == bundled
    # Named or defaulted, the same table gives the same answers.
    named = json.loads(invoke(["coverage", bundled, coverage_spec(tmp_path), "--arch",
                               "sm_90", "--json"]).stdout)
    assert named["answered"] == covered["answered"]


def test_the_default_follows_mlatune_table(tmp_path, good, monkeypatch, fakes):  # noqa: F811
    monkeypatch.setenv("MLATUNE_TABLE", str(good))
    assert inputs.default_table("sm_90") == good
    looked = json.loads(invoke(["lookup", *LOOKUP, "--json"]).stdout)
    covered = json.loads(invoke(["coverage", coverage_spec(tmp_path), "--arch", "sm_90",
                                 "--json"]).stdout)
    assert looked["table"] == covered["table"] == str(good)


def test_a_damaged_user_table_is_left_out_as_an_engine_leaves_it(tmp_path, monkeypatch,
                                                                  caplog):
    monkeypatch.delenv("MLATUNE_TABLE", raising=False)
    damaged = tmp_path / "mine.parquet"
    damaged.write_bytes(b"PAR1 not a table")
    monkeypatch.setenv("MLATUNE_USER_TABLE", str(damaged))
    result = invoke(["lookup", *LOOKUP, "--json"])
    assert result.exit_code == 0, result.output
    looked = json.loads(result.stdout)
    assert looked["table"] == str(inputs.default_table("sm_90")) and looked["source"] != "rule"
    assert f"MLATUNE_USER_TABLE={damaged} not overlaid" in caplog.text


def test_without_a_table_for_the_arch_both_answer_by_rule(tmp_path, monkeypatch):
    monkeypatch.delenv("MLATUNE_TABLE", raising=False)
    assert inputs.default_table("gfx1250") is None
    looked = json.loads(invoke(["lookup", "--heads", "16", "--batch", "8", "--kv-len", "1024",
                                "--arch", "gfx1250", "--json"]).stdout)
    assert looked["table"] is None and looked["source"] == "rule"
    covered = invoke(["coverage", coverage_spec(tmp_path), "--arch", "gfx1250", "--json"])
    assert json.loads(covered.stdout)["table"] is None


def test_json_numbers_that_json_cannot_hold_are_null():
    """NaN (not measured) and an infinity (a ratio over a time rounding to 0) both come out
    null: the document stays valid JSON (emit_json refuses NaN and inf)."""
    import math

    import numpy

    from mlatune.cli.app import num

    assert [num(v) for v in (math.nan, math.inf, -math.inf, numpy.float64("inf"), 2, None)] \
        == [None, None, None, None, 2.0, None]
