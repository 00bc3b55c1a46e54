"""What a new user hit on the command line (issue 17): reruns, progress, piped output,
--json, fixed value sets, bundled specs by name, messages, exit codes."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlatune import routes, table
from mlatune.cli import app, inputs
from mlatune.cli.sweep import rate_eta_column
from mlatune.dispatch import Dispatcher
from mlatune.sweep.journal import read
from tests.table_helpers import H200, MI355, FakeRoute, grid_rows, make_table
from tests.test_cli_tables import BASE, TIMINGS, coverage_spec, fakes, frame, good  # noqa: F401

runner = CliRunner()  # not a terminal, as a pipe or a CI log


def tiny_spec(tmp_path, kv_len: int = 24):
    """Two decode problems: the reference runs on both, sdpa/torch (prefill only) refuses."""
    path = tmp_path / "tiny.toml"
    path.write_text(f'routes = ["reference/torch", "sdpa/torch"]\n'
                    f"[budget]\nwarmup = 0\nmin_reps = 1\nmax_reps = 1\n"
                    f"[[grid]]\nnum_heads = 2\nbatch = [1, 2]\nkv_len = {kv_len}\n"
                    f'page_size = 8\nq_dtype = "fp16"\nkv_dtype = "fp16"\n')
    return path


def sweep(spec, out, *flags):
    return runner.invoke(app, ["sweep", str(spec), "--out", str(out), *flags])


# 1. A rerun resumes; --fresh starts over --------------------------------------------

def test_a_rerun_resumes_and_fresh_moves_the_earlier_run_aside(tmp_path):
    spec, out = tiny_spec(tmp_path), tmp_path / "t.parquet"
    journal = out.with_suffix(".journal.jsonl")
    first = sweep(spec, out)
    assert first.exit_code == 0, first.output
    assert f"new journal {journal}" in first.output
    recorded = read(journal)[1]
    again = sweep(spec, out)  # refused before: "exists: pass --resume"
    assert again.exit_code == 0, again.output
    assert f"resuming {journal}: {len(recorded)} results recorded before" in again.output
    assert read(journal)[1] == recorded  # nothing ran twice
    assert sweep(spec, out, "--resume").exit_code == 0  # scripts' flag works as before

    fresh = sweep(spec, out, "--fresh")
    assert fresh.exit_code == 0, fresh.output
    assert "starting over; the earlier run moved to" in fresh.output
    aside = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("t.2"))
    assert len(aside) == 3 and [a.split(".", 2)[2] for a in aside] == [
        "csv", "journal.jsonl", "parquet"]
    moved_journal = tmp_path / next(a for a in aside if a.endswith(".journal.jsonl"))
    assert read(moved_journal)[1] == recorded  # nothing deleted
    assert len(read(journal)[1]) == len(recorded)  # the new run's own


def test_resume_and_fresh_exclude_each_other_and_another_spec_is_refused(tmp_path):
    spec, out = tiny_spec(tmp_path), tmp_path / "t.parquet"
    both = sweep(spec, out, "--resume", "--fresh")
    assert both.exit_code == 2 and "exclude each other" in both.output
    assert sweep(spec, out).exit_code == 0
    other = sweep(tiny_spec(tmp_path, kv_len=16), out)  # same --out, another spec
    assert other.exit_code == 1
    assert "spec_sha256" in other.output and "--fresh starts over" in other.output


def test_fresh_leaves_a_journal_another_sweep_holds_alone(tmp_path):
    from mlatune.sweep.journal import Journal

    spec, out = tiny_spec(tmp_path), tmp_path / "t.parquet"
    journal = out.with_suffix(".journal.jsonl")
    held = Journal(journal, {"spec_sha256": "x"}, resume=False)  # a sweep under way
    try:
        result = sweep(spec, out, "--fresh")
    finally:
        held.close()
    assert result.exit_code == 1 and "in use by another sweep" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "t.journal.jsonl", "t.journal.jsonl.lock", "tiny.toml"]  # nothing moved aside


@pytest.mark.parametrize("journal", ["none", "empty", "header only"])
def test_a_table_no_journal_holds_is_not_overwritten(tmp_path, journal):
    """Someone's table at --out without a journal of its results (copied there, or its
    journal lost) is refused by name; --fresh moves it aside and sweeps."""
    spec, out = tiny_spec(tmp_path), tmp_path / "t.parquet"
    assert sweep(spec, out).exit_code == 0
    kept = out.read_bytes()
    path = out.with_suffix(".journal.jsonl")
    header = path.read_text().splitlines()[0]
    {"none": path.unlink, "empty": lambda: path.write_text(""),
     "header only": lambda: path.write_text(header + "\n")}[journal]()
    refused = sweep(spec, out)
    assert refused.exit_code == 1
    assert f"{out} exists and no journal of its results is beside it" in refused.output
    assert out.read_bytes() == kept
    assert sweep(spec, out, "--fresh").exit_code == 0
    assert any(p.name.startswith("t.2") and p.suffix == ".parquet" for p in tmp_path.iterdir())


@pytest.mark.parametrize("timeout", ["inf", "3e6", "nan", "0"])
def test_a_timeout_no_timer_holds_is_a_usage_error(tmp_path, timeout):
    spec, out = tiny_spec(tmp_path), tmp_path / "t.parquet"
    result = sweep(spec, out, "--timeout", timeout)
    assert result.exit_code == 2 and "--timeout" in result.output
    assert not out.with_suffix(".journal.jsonl").exists()  # refused before anything began


# 2. Progress counts the candidates that run -----------------------------------------

def test_the_bar_counts_candidates_that_run_and_the_summary_agrees(tmp_path):
    result = sweep(tiny_spec(tmp_path), tmp_path / "t.parquet")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # 2 problems: the reference runs on both, sdpa/torch refuses both.
    assert "2 (problem, route) pairs refused by a rule: recorded, not run" in lines
    [bar] = [line for line in lines if line.startswith("sweep ") and "cand/s" in line]
    assert " 2/2 " in bar and "ETA" in bar
    assert any(line.startswith("sweep tiny: 2 candidates; 2 run now in") for line in lines)
    [ok] = [line for line in lines if line.startswith("│ ok ")]
    [refused] = [line for line in lines if "refused by a rule (not run)" in line and "│" in line]
    assert ok.split("│")[2].strip() == "2" and refused.split("│")[2].strip() == "2"


def test_the_observer_is_told_refusals_apart_from_the_candidates(tmp_path):
    from mlatune.arch import cpu_device
    from mlatune.sweep import runner as sweeps
    from mlatune.sweep import spec as specs
    from mlatune.sweep.journal import Journal

    seen = []

    class Seen:
        def refused(self, count):
            seen.append(("refused", count))

        def started(self, total, already_done, what="sweep"):
            seen.append((what, total, already_done))

        def finished(self, record):
            seen.append(record.status)

    spec = specs.load(tiny_spec(tmp_path), gpu=False)
    journal = Journal(tmp_path / "j.jsonl", {"spec_sha256": spec.sha256}, resume=False)
    result = sweeps.run(spec, cpu_device(), journal, observer=Seen())
    journal.close()
    assert seen == [("refused", 2), ("sweep", 2, 0), "ok", "ok"]
    assert (result.planned, result.ran, result.resumed, result.refused) == (2, 2, 0, 2)


def test_rate_and_eta_are_this_runs_mean_rate_and_the_time_left_at_it():
    from rich.progress import Progress

    now = [0.0]
    column = rate_eta_column()
    progress = Progress(column, get_time=lambda: now[0])
    task = progress.add_task("sweep", total=10, completed=4, ran=0)  # 4 from the journal
    assert column.render(progress.tasks[0]).plain == "- cand/s, ETA -"
    now[0] = 10.0
    progress.update(task, advance=2, ran=2)
    assert column.render(progress.tasks[0]).plain == "0.20 cand/s, ETA 0:00:20"


# 3. Piped output is never wrapped or cut ---------------------------------------------

def test_piped_output_keeps_long_paths_route_ids_and_numbers_on_one_line(tmp_path):
    long_id = "a-route-family-with-a-long-descriptive-name/some-backend"
    routes.register(FakeRoute(long_id))
    try:
        rows = grid_rows([BASE], [8], [1024], {
            long_id: lambda p: 10.0, "reference/torch": lambda p: 24.01})
        deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 4)
        deep.mkdir(parents=True)
        path = table.write(make_table(rows), deep / "a-table-with-a-long-name-sm_90.parquet")
        result = CliRunner(env={"COLUMNS": None}).invoke(app, ["show", str(path)])
    finally:
        routes.unregister(long_id)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(str(path) in line for line in lines), result.output
    [row] = [line for line in lines if long_id in line]
    assert "reference/torch" in row and "+140.1%" in row


# 4. --json: one document on stdout ---------------------------------------------------

def parse(result, command: str) -> dict:
    document = json.loads(result.stdout)  # nothing else on stdout, or this fails
    assert document["schema"] == f"mlatune.{command}" and document["version"] == 1
    return document


def test_show_json(good, fakes):  # noqa: F811
    document = parse(runner.invoke(app, ["show", str(good), "--json", "--limit", "1"]), "show")
    summary = table.summary(frame())
    assert document["table"] == str(good) and document["rows"] == len(frame())
    assert document["devices"] == [{"arch": "sm_90", "device_name": "NVIDIA H200",
                                    "cu_count": 132}]
    assert len(document["problems"]) == len(summary)  # --limit shapes the printed table only
    first = document["problems"][0]
    assert first["winner"] == summary.loc[0, "winner"]
    assert first["margin"] == pytest.approx(summary.loc[0, "margin"])
    assert first["problem"]["batch"] == int(summary.loc[0, "batch"])


def test_lookup_json(good, fakes):  # noqa: F811
    result = runner.invoke(app, ["lookup", str(good), "--heads", "16", "--batch", "5",
                                 "--kv-len", "1024", "--arch", "sm_90", "--json"])
    document = parse(result, "lookup")
    choice = Dispatcher.load(good, device=H200).select(BASE.with_(batch=5, kv_len=1024))
    assert (document["route"], document["source"]) == (choice.route_id, "nearest")
    assert document["key"] == BASE.with_(batch=5, kv_len=1024).key and document["why"]
    assert document["table_device"]["device_name"] == "NVIDIA H200"


def test_coverage_json_and_its_exit_status(good, tmp_path, fakes):  # noqa: F811
    args = ["coverage", str(good), str(coverage_spec(tmp_path)), "--arch", "sm_90",
            "--json"]
    document = parse(ok := runner.invoke(app, args), "coverage")
    assert ok.exit_code == 0 and document["ok"] and document["problems"] == 5
    assert {s: a["problems"] for s, a in document["answered"].items()} == {
        "table": 1, "predicted": 0, "nearest": 3, "law": 1, "rule": 0}
    strict = runner.invoke(app, [*args, "--require", "nearest"])
    document = parse(strict, "coverage")
    assert strict.exit_code == 1 and not document["ok"] and "error:" in strict.stderr
    assert [b["source"] for b in document["below_require"]] == ["law"]


def test_diff_json(good, tmp_path):  # noqa: F811
    document = parse(runner.invoke(app, ["diff", str(good), str(good), "--json"]), "diff")
    assert document["comparable"] and document["changed"] == []
    assert document["counts"] == {"same": 12, "changed": 0, "only_a": 0, "only_b": 0}


def test_plan_json():
    document = parse(runner.invoke(app, ["plan", "smoke", "--arch", "gfx950", "--json"]),
                     "plan")
    assert document["device"]["arch"] == "gfx950" and not document["probe_applied"]
    by_route = {r["route"]: r for r in document["routes"]}
    assert by_route["reference/torch"]["refused"] == 0
    assert by_route["gluon/aiter"]["top_refusal"]["reason"].startswith("rule gluon")
    assert sum(len(g["batches"]) >= 1 for g in document["groups"]) == len(document["groups"])


def test_doctor_json():
    document = parse(runner.invoke(app, ["doctor", "--json"]), "doctor")
    assert {"libraries", "gpus", "dispatch_table", "bundled_tables", "backends"} <= set(document)
    by_model = {(t["arch"], t["model"]): t for t in document["bundled_tables"]}
    assert by_model["sm_90", "h200"]["table"] == "sm_90-h200.parquet"
    assert by_model["sm_90", "h200"]["devices"] == [{"arch": "sm_90", "device_name": "NVIDIA H200",
                                                    "cu_count": 132}]
    assert by_model["sm_90", "h100"]["devices"][0]["device_name"] == "NVIDIA H100 80GB HBM3"
    assert by_model["gfx950", None]["table"] is None
    # Every registered route under its backend (the Gluon routes were left out).
    from mlatune.routes import all_routes

    listed = {r for b in document["backends"] for r in b["routes"]}
    assert listed == {r.id for r in all_routes()}
    gluon = next(b for b in document["backends"] if b["backend"] == "gluon")
    assert "seesaw/gluon" in gluon["routes"]


# 5. Fixed value sets -------------------------------------------------------------------

@pytest.mark.parametrize(("command", "option", "values"), [
    ("export", "--format", "<parquet|csv|json>"),
    ("lookup", "--phase", "<decode|prefill>"),
    ("lookup", "--kv-dtype", "<bf16|fp16|fp8_e4m3fn|fp8_e4m3fnuz>"),
    ("coverage", "--require", "<table|predicted|nearest|law|rule>"),
    ("plan", "--arch", "<gfx942|gfx950|gfx1250|sm_90|sm_100>"),
    ("lookup", "--arch", "<gfx942|gfx950|gfx1250|sm_90|sm_100|cpu>"),
    ("sweep", "--arch", "<gfx942|gfx950|gfx1250|sm_90|sm_100|cpu>"),
])
def test_help_lists_the_values_and_typer_refuses_others(good, command, option, values):  # noqa: F811
    helped = CliRunner(env={"COLUMNS": "200"}).invoke(app, [command, "--help"])
    assert f"{option} {values}" in helped.output
    base = {"export": ["export", str(good), "--out", "x.json"],
            "lookup": ["lookup", str(good), "--heads", "16", "--batch", "1", "--kv-len", "64"],
            "coverage": ["coverage", "smoke"], "plan": ["plan", "smoke", "--arch", "sm_90"],
            "sweep": ["sweep"]}[command]
    refused = runner.invoke(app, [*base, option, "bogus"])
    assert refused.exit_code == 2 and "'bogus' is not one of" in refused.output


def test_flags_have_no_type_tag():
    for args in (["--help"], ["sweep", "--help"], ["plan", "--help"]):
        text = CliRunner(env={"COLUMNS": "200"}).invoke(app, args).output
        assert "<bool>" not in text
    top = runner.invoke(app, ["--help"]).output
    assert any(line.split() == ["--version", "Print", "the", "version", "and", "exit."]
               for line in top.splitlines())


def test_the_value_sets_are_their_owners():
    from mlatune import problem
    from mlatune.arch import CPU_ARCH
    from mlatune.capability import ARCHS
    from mlatune.check.policy import POLICIES

    def values(choice):
        return tuple(c.value for c in choice)

    assert values(inputs.Arch) == tuple(ARCHS)
    assert values(inputs.DeviceArch) == (*ARCHS, CPU_ARCH)
    assert values(inputs.Dtype) == tuple(problem.DTYPES)
    assert values(inputs.Phase) == typing.get_args(problem.Phase)
    assert values(inputs.Format) == (*table.FORMATS, "json")
    assert values(inputs.Accuracy) == tuple(POLICIES)


# 6. Bundled specs by name -------------------------------------------------------------

def test_a_bare_name_is_a_bundled_spec(tmp_path):
    result = runner.invoke(app, ["plan", "deepseek-v3-tp8", "--arch", "sm_90"])
    assert result.exit_code == 0, result.output
    assert "sweeps/deepseek-v3-tp8.toml" in result.output
    assert runner.invoke(app, ["coverage", "smoke", "--arch", "sm_90"]).exit_code in (0, 1)
    # sweep resolves it too: it stops at an --out in the way, after loading the spec.
    (tmp_path / "x.parquet").mkdir()
    stopped = runner.invoke(app, ["sweep", "smoke.toml", "--out", str(tmp_path / "x.parquet")])
    assert stopped.exit_code == 1 and "is a directory" in stopped.output


def test_a_folder_of_a_bundled_specs_name_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").mkdir()  # e.g. `mlatune sweep --out smoke/t.parquet` made it
    result = runner.invoke(app, ["plan", "smoke", "--arch", "sm_90"])
    assert result.exit_code == 0, result.output
    assert "sweeps/smoke.toml" in result.output


@pytest.mark.parametrize("command", [["plan", "no-such-spec", "--arch", "sm_90"],
                                     ["sweep", "no-such-spec"], ["coverage", "no-such-spec"]])
def test_an_unknown_name_lists_the_bundled_specs(command):
    result = CliRunner(env={"COLUMNS": "400"}).invoke(app, command)
    assert result.exit_code == 2
    assert "no-such-spec: no such spec file, nor a bundled spec of that name" in result.output
    bundled = sorted(f.stem for f in (Path(__file__).parent.parent / "sweeps").glob("*.toml"))
    assert "smoke" in bundled and ", ".join(bundled) in result.output


# 7-10. Messages, exit codes, plan summary, doctor's tables ------------------------------

def test_lookup_for_another_arch_names_the_option_not_the_python_argument(good):  # noqa: F811
    result = runner.invoke(app, ["lookup", str(good), "--heads", "16", "--batch", "8",
                                 "--kv-len", "1024"])
    assert result.exit_code == 1
    assert "pass --arch sm_90 to plan for it" in result.output
    assert "allow_arch" not in result.output


def test_diff_of_tables_that_share_no_device_fails_clearly(good, tmp_path):  # noqa: F811
    rows = grid_rows([BASE, BASE.with_(qlen=2)], [1, 8, 64], [1024, 8192], TIMINGS,
                     device=MI355)
    other = table.write(make_table(rows), tmp_path / "gfx950.parquet")
    result = runner.invoke(app, ["diff", str(good), str(other)])
    assert result.exit_code == 1
    assert "A and B share no device" in result.stderr and "nothing was compared" in result.stderr
    document = parse(runner.invoke(app, ["diff", str(good), str(other), "--json"]), "diff")
    assert not document["comparable"] and document["counts"]["only_a"] == 12
    both = table.write(make_table(grid_rows([BASE], [1], [1024], TIMINGS)
                                  + rows), tmp_path / "both.parquet")
    partly = runner.invoke(app, ["diff", str(good), str(both)])
    assert partly.exit_code == 0 and "only B holds gfx950" in partly.stderr
    assert "Exit status: 0" in CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["diff", "--help"]).output


def test_plan_prints_a_summary_per_route_and_the_problems_only_with_detail():
    short = runner.invoke(app, ["plan", "h200", "--arch", "sm_90"])
    assert short.exit_code == 0 and "per route on sm_90" in short.output
    assert "routes per problem" not in short.output and len(short.output.splitlines()) < 40
    assert "--detail prints them" in short.output
    detail = runner.invoke(app, ["plan", "h200", "--arch", "sm_90", "--detail"])
    assert "routes per problem" in detail.output
    assert len(detail.output.splitlines()) > len(short.output.splitlines())


def test_doctor_names_the_bundled_tables_and_what_each_arch_loads(monkeypatch):
    monkeypatch.delenv("MLATUNE_TABLE", raising=False)
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    h100, h200 = [line for line in lines if line.startswith("│ sm_90 ")]
    assert "sm_90-h200.parquet" in h200 and "NVIDIA H200 (132 SMs)" in h200
    assert "sm_90-h100.parquet" in h100 and "NVIDIA H100 80GB HBM3" in h100
    [gfx950] = [line for line in lines if line.startswith("│ gfx950 ")]
    assert "none: the dispatcher answers by rule" in gfx950
