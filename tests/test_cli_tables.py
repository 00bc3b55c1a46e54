import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from mlatune import routes, table
from mlatune.cli import app
from mlatune.dispatch import Dispatcher
from mlatune.dispatch import dispatcher as dispatch_module
from mlatune.problem import MLAProblem
from mlatune.table.schema import SCHEMA_VERSION
from tests.table_helpers import (
    H200,
    FakeRoute,
    grid_rows,
    large_batch_fast,
    make_table,
    reference_slow,
    result_row,
    small_batch_fast,
)
from tests.test_table import write_raw

runner = CliRunner()
wide = CliRunner(env={"COLUMNS": "250"})  # rich reads it: table cells stay on one line
BASE = MLAProblem(num_heads=16, qlen=1)
TIMINGS = {"fast-small/fake": small_batch_fast, "fast-large/fake": large_batch_fast,
           "reference/torch": reference_slow}


def frame() -> pd.DataFrame:
    return make_table(grid_rows([BASE, BASE.with_(qlen=2)], [1, 8, 64], [1024, 8192], TIMINGS))


@pytest.fixture
def fakes(monkeypatch):
    """Two fake routes that trade wins across the grid; shapes the grid misses are
    answered by ``nearest`` here (the commands' plumbing is what these tests pin down;
    ``predict``, the default, has its own tests in tests/test_predict.py)."""
    monkeypatch.setattr(dispatch_module, "DEFAULT_UNMEASURED", "nearest")
    made = [FakeRoute("fast-small/fake"), FakeRoute("fast-large/fake")]
    for route in made:
        routes.register(route)
    yield made
    for route in made:
        routes.unregister(route.id)


@pytest.fixture
def good(tmp_path):
    return table.write(frame(), tmp_path / "sm_90.parquet")


def damaged_files(tmp_path) -> dict[str, str]:
    """One file per kind of damage the issue names, plus unreadable inputs."""
    made = {}
    truncated = table.write(frame(), tmp_path / "truncated.parquet")
    truncated.write_bytes(truncated.read_bytes()[:300])
    made["truncated parquet"] = truncated
    cut = table.write(frame(), tmp_path / "truncated.csv")
    cut.write_bytes(cut.read_bytes()[:-5])
    made["truncated csv"] = cut
    write_raw(frame().drop(columns=["route"]), tmp_path / "missing.parquet")
    made["missing column"] = tmp_path / "missing.parquet"
    wrong = frame()
    wrong["kv_len"] = wrong["kv_len"].astype(str)
    write_raw(wrong, tmp_path / "dtype.parquet")
    made["wrong dtype"] = tmp_path / "dtype.parquet"
    dup = frame()
    write_raw(pd.concat([dup, dup.iloc[[3]]], ignore_index=True), tmp_path / "dup.csv")
    made["duplicate key"] = tmp_path / "dup.csv"
    future = frame()
    future["schema_version"] = SCHEMA_VERSION + 1
    write_raw(future, tmp_path / "future.parquet")
    made["future schema"] = tmp_path / "future.parquet"
    (tmp_path / "table.txt").write_text("arch,route\n")
    made["wrong format"] = tmp_path / "table.txt"
    (tmp_path / "csv-inside.parquet").write_text("arch,route\nsm_90,a/b\n")
    made["csv named parquet"] = tmp_path / "csv-inside.parquet"
    (tmp_path / "bad.json").write_text('{"format": "mlatune-winners", "devices": 3}')
    made["bad json"] = tmp_path / "bad.json"
    (tmp_path / "folder.parquet").mkdir()
    made["a directory"] = tmp_path / "folder.parquet"
    return {k: str(v) for k, v in made.items()}


def assert_one_line_error(result, *needles):
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


COMMANDS = {
    "validate": lambda path, tmp: ["validate", path],
    "show": lambda path, tmp: ["show", path],
    "lookup": lambda path, tmp: ["lookup", path, "--heads", "16", "--batch", "4",
                                 "--kv-len", "2048", "--arch", "sm_90"],
    "export": lambda path, tmp: ["export", path, "--format", "json", "--out",
                                 str(tmp / "out.json")],
    "diff": lambda path, tmp: ["diff", path, path],
    "coverage": lambda path, tmp: ["coverage", path, str(coverage_spec(tmp)),
                                   "--arch", "sm_90"],
}


def coverage_spec(tmp_path):
    """Problems the good table measured, lies between, and never saw (another bucket)."""
    path = tmp_path / "deploy.toml"
    path.write_text('''name = "deploy"
[[grid]]
phase = "decode"
num_heads = 16
qlen = 1
batch = [8, 5]
kv_len = [1024, 2048]
[[grid]]
phase = "decode"
num_heads = 32
qlen = 1
batch = 8
kv_len = 1024
''')
    return path


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_kind_of_damage_is_one_red_line_and_a_failure(tmp_path, command):
    files = damaged_files(tmp_path)
    for kind, path in files.items():
        if kind == "bad json" and command not in ("validate", "lookup", "coverage"):
            continue  # only these two commands read winners maps
        result = runner.invoke(app, COMMANDS[command](path, tmp_path))
        assert_one_line_error(result, path)
        assert not (tmp_path / "out.json").exists(), kind


def test_damage_messages_say_what_is_wrong(tmp_path):
    files = damaged_files(tmp_path)
    expected = {"truncated parquet": "not a readable Parquet table",
                "truncated csv": "truncated", "missing column": "missing columns: route",
                "wrong dtype": "column kv_len has dtype", "duplicate key": "repeat a (device",
                "future schema": "newer than this mlatune reads",
                "wrong format": "unknown table format", "csv named parquet": "Parquet",
                "bad json": "devices is missing or empty",
                "a directory": "a directory, not a table file"}
    for kind, needle in expected.items():
        assert_one_line_error(runner.invoke(app, ["validate", files[kind]]), needle)


def test_lookup_refuses_a_table_for_another_arch_naming_both(good):
    result = runner.invoke(app, ["lookup", str(good), "--heads", "16", "--batch", "8",
                                 "--kv-len", "1024", "--arch", "gfx950"])
    assert_one_line_error(result, "sm_90", "gfx950")
    # Without --arch the CPU is the device here, and the message says how to plan.
    result = runner.invoke(app, ["lookup", str(good), "--heads", "16", "--batch", "8",
                                 "--kv-len", "1024"])
    assert_one_line_error(result, "sm_90", "--arch sm_90")


def test_lookup_of_an_invalid_problem_is_one_line(good):
    result = runner.invoke(app, ["lookup", str(good), "--heads", "16", "--batch", "8",
                                 "--kv-len", "1024", "--page-size", "48", "--arch", "sm_90"])
    assert_one_line_error(result, "page_size must be a power of two")


def test_validate_notes_routes_not_registered_here(good):
    result = runner.invoke(app, ["validate", str(good)])
    assert result.exit_code == 0 and "ok" in result.output and "12 problems" in result.output
    assert "not registered here" in result.output and "fast-small/fake" in result.output


def test_validate_of_a_winners_map_says_its_schema_and_unregistered_routes(good, tmp_path):
    exported = tmp_path / "map.json"
    assert runner.invoke(app, ["export", str(good), "--format", "json", "--out",
                               str(exported)]).exit_code == 0
    said = json.loads(runner.invoke(app, ["validate", str(exported), "--json"]).output)
    assert said["schema_version"] == SCHEMA_VERSION and said["format"] == "winners map"
    assert "fast-small/fake" in said["unregistered_routes"]
    plain = runner.invoke(app, ["validate", str(exported)])
    assert plain.exit_code == 0 and "not registered here" in plain.output


def test_validate_show_lookup_diff_on_a_good_table(good, tmp_path, fakes):
    result = wide.invoke(app, ["validate", str(good)])
    assert result.exit_code == 0 and "not registered" not in result.output

    result = wide.invoke(app, ["show", str(good), "--limit", "0"])
    assert result.exit_code == 0, result.output
    summary = table.summary(frame())
    for route in set(summary["winner"]) | set(summary["runner_up"]):
        assert route in result.output

    dispatcher = Dispatcher.load(good, device=H200)
    for batch, source in ((8, "table"), (5, "nearest")):
        result = wide.invoke(app, ["lookup", str(good), "--heads", "16", "--batch",
                                     str(batch), "--kv-len", "1024", "--arch", "sm_90"])
        assert result.exit_code == 0, result.output
        choice = dispatcher.select(BASE.with_(batch=batch, kv_len=1024))
        assert choice.source == source
        assert choice.route_id in result.output and source in result.output

    changed = frame()
    first = changed.index[changed["rank"] == 1][0]
    a_time = changed.loc[first, "time_us"]
    changed.loc[first, "time_us"] = 1e6  # that winner falls to last place
    changed = table.assign_ranks(changed)
    b = table.write(changed, tmp_path / "b.parquet")
    same_key = changed[(changed[["batch", "kv_len", "qlen"]] ==
                        frame().loc[first, ["batch", "kv_len", "qlen"]]).all(axis=1)]
    b_time = same_key.loc[same_key["rank"] == 1, "time_us"].iloc[0]
    result = wide.invoke(app, ["diff", str(good), str(b)])
    assert result.exit_code == 0, result.output
    assert "11 winners unchanged, 1 changed" in result.output
    assert f"{(b_time / a_time - 1) * 100:+.1f}%" in result.output.replace("\n", "")


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json"])
@pytest.mark.parametrize("winners_only", [False, True])
def test_export_writes_a_usable_table(good, tmp_path, fmt, winners_only, fakes):
    out = tmp_path / f"export.{fmt}"
    args = ["export", str(good), "--format", fmt, "--out", str(out)]
    result = runner.invoke(app, args + (["--winners-only"] if winners_only else []))
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0
    original = table.read(good)
    if fmt == "json":
        document = json.loads(out.read_text())
        entries = document["devices"][0]["winners"]
        assert len(entries) == len(table.winners(original))
        assert all(("alternatives" in e) != winners_only for e in entries.values())
    else:
        exported = table.read(out)
        want = table.winners(original) if winners_only else original
        pd.testing.assert_frame_equal(exported.reset_index(drop=True),
                                      want.reset_index(drop=True))
    reference = Dispatcher.load(good, device=H200)
    loaded = Dispatcher.load(out, device=H200)
    for batch in (1, 5, 64):
        problem = BASE.with_(batch=batch, kv_len=3000)
        assert loaded.select(problem) == reference.select(problem)


def test_export_refuses_a_suffix_that_does_not_match(good, tmp_path):
    result = runner.invoke(app, ["export", str(good), "--format", "csv", "--out",
                                 str(tmp_path / "x.parquet")])
    assert result.exit_code == 2 and "must end in .csv" in result.output
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("path", ["same", "dotted", "link"])
def test_export_refuses_to_write_over_the_table_it_reads(good, tmp_path, path):
    """--out TABLE (or a path to the same file) would replace the input with its cut."""
    source = tmp_path / "t.parquet"
    source.write_bytes(good.read_bytes())
    out = {"same": source, "dotted": tmp_path / "sub" / ".." / "t.parquet",
           "link": tmp_path / "link.parquet"}[path]
    if path == "link":
        out.symlink_to(source)
    result = runner.invoke(app, ["export", str(source), "--format", "parquet", "--out",
                                 str(out), "--winners-only"])
    assert result.exit_code == 2 and "is the table read" in result.output
    assert source.read_bytes() == good.read_bytes()


def test_export_writes_gzipped_csv(good, tmp_path):
    out = tmp_path / "x.csv.gz"
    result = runner.invoke(app, ["export", str(good), "--format", "csv", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:2] == b"\x1f\x8b"  # gzip's magic
    pd.testing.assert_frame_equal(table.read(out), table.read(good))


def test_coverage_counts_how_each_problem_of_a_spec_is_answered(good, tmp_path, fakes):
    spec = str(coverage_spec(tmp_path))
    result = wide.invoke(app, ["coverage", str(good), spec, "--arch", "sm_90"])
    assert result.exit_code == 0, result.output
    dispatcher = Dispatcher.load(good, device=H200)
    expected = {"table": 1, "nearest": 3, "law": 1}  # batch 8 x kv 1024 measured; 32 heads not
    problems = [BASE.with_(batch=b, kv_len=k) for b in (8, 5) for k in (1024, 2048)]
    problems.append(BASE.with_(num_heads=32, batch=8, kv_len=1024))
    assert sorted(dispatcher.select(p).source for p in problems) == sorted(
        s for s, n in expected.items() for _ in range(n))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in result.output.splitlines() if line.count("│") >= 4}
    assert {k: int(rows[k]) for k in expected} == expected
    # --require gates a deployment: the 32-head problem is answered only by law.
    assert wide.invoke(app, ["coverage", str(good), spec, "--arch", "sm_90",
                             "--require", "law"]).exit_code == 0
    strict = wide.invoke(app, ["coverage", str(good), spec, "--arch", "sm_90",
                               "--require", "nearest"])
    assert strict.exit_code == 1 and "1 problem(s)" in strict.output
    assert "law: phase=decode|num_heads=32|" in strict.output


def test_coverage_for_the_cpu_answers_the_specs_cpu_grid(tmp_path):
    """A table swept on the CPU is measured at its spec's CPU grid: --arch cpu answers
    that grid (from the table), not the GPU grid."""
    from mlatune.sweep import spec as specs

    cpu_grid = specs.load(specs.bundled_spec_path("smoke.toml"), gpu=False).problems
    gpu_grid = specs.load(specs.bundled_spec_path("smoke.toml"), gpu=True).problems
    assert len(cpu_grid) != len(gpu_grid)
    result = runner.invoke(app, ["coverage", "smoke", "--arch", "cpu", "--json"])
    assert json.loads(result.output)["problems"] == len(cpu_grid)


def test_coverage_without_arch_on_a_cpu_answers_the_cpu_grid():
    """This machine has no GPU: leaving out --arch is --arch cpu (as `sweep` takes it)."""
    from mlatune.sweep import spec as specs

    cpu_grid = specs.load(specs.bundled_spec_path("smoke.toml"), gpu=False).problems
    result = runner.invoke(app, ["coverage", "smoke", "--json"])
    assert json.loads(result.output)["problems"] == len(cpu_grid)


def test_lookup_on_a_cpu_answers_alike_with_and_without_arch(tmp_path, monkeypatch):
    """A table measured here (Triton in the interpreter) is served here: the CLI turns the
    interpreter on as `sweep` does, so --arch cpu changes nothing."""
    from mlatune.arch import cpu_device

    problem = MLAProblem(num_heads=8, batch=2, kv_len=160, q_dtype="fp16", kv_dtype="fp16",
                         page_size=16)
    path = table.write(make_table([result_row(problem, "padded/triton", 50.0,
                                              device=cpu_device()),
                                   result_row(problem, "reference/torch", 90.0,
                                              device=cpu_device())]), tmp_path / "cpu.parquet")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    asked = ["lookup", str(path), "--heads", "8", "--batch", "2", "--kv-len", "160",
             "--q-dtype", "fp16", "--kv-dtype", "fp16", "--page-size", "16", "--json"]
    plain = json.loads(runner.invoke(app, asked).output)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    planned = json.loads(runner.invoke(app, [*asked, "--arch", "cpu"]).output)
    assert (plain["route"], plain["source"]) == ("padded/triton", "table")
    assert (planned["route"], planned["source"]) == (plain["route"], plain["source"])


def test_coverage_refuses_a_bad_require_and_a_bad_spec(good, tmp_path):
    spec = str(coverage_spec(tmp_path))
    # A value outside the set is typer's usage error (exit 2), naming the values.
    bad = runner.invoke(app, ["coverage", str(good), spec, "--arch", "sm_90",
                              "--require", "exact"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "--require" in bad.output
    assert "'table', 'predicted', 'nearest', 'law', 'rule'" in bad.output
    bad = tmp_path / "bad.toml"
    bad.write_text("name = 3\n[[grid]]\nbogus = 1\n")
    assert_one_line_error(runner.invoke(app, ["coverage", str(good), str(bad),
                                              "--arch", "sm_90"]), str(bad))


def test_coverage_defaults_to_the_table_the_dispatcher_loads(good, tmp_path, fakes,
                                                              monkeypatch):
    spec = str(coverage_spec(tmp_path))
    monkeypatch.setenv("MLATUNE_TABLE", str(good))
    result = wide.invoke(app, ["coverage", spec, "--arch", "sm_90"])
    assert result.exit_code == 0, result.output
    assert f"table: {good}" in result.output
    monkeypatch.delenv("MLATUNE_TABLE")
    # No table ships for gfx1250: every problem is answered by rule.
    result = wide.invoke(app, ["coverage", spec, "--arch", "gfx1250", "--require", "table"])
    assert result.exit_code == 1 and "table: none" in result.output
    assert "5 problem(s) answered by worse" in result.output
