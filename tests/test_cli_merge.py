"""`mlatune merge BASE NEW --out OUT --replace-routes ROUTE[,ROUTE]`: BASE's rows of those
routes where NEW holds the route's row for the problem are dropped, then the tables are
joined, so NEW's rows of those routes stand whatever their times."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
from typer.testing import CliRunner

from mlatune import table
from mlatune.cli import app
from mlatune.problem import MLAProblem
from tests.table_helpers import MI355, PROVENANCE, make_table, result_row

runner = CliRunner()
BASE = MLAProblem(num_heads=16, qlen=1)
P, Q = BASE.with_(batch=4, kv_len=2048), BASE.with_(batch=8, kv_len=2048)
LATER = replace(PROVENANCE, created_utc="2026-02-01T00:00:00Z", spec_sha256="cd" * 32)


def write(path: Path, rows: list[dict], provenance=PROVENANCE) -> Path:
    return table.write(make_table(rows, provenance), path)


def merge(*args) -> object:
    return runner.invoke(app, ["merge", *map(str, args)])


def by_route(path: Path) -> pd.DataFrame:
    return table.read(path).set_index(["arch", "batch", "route"])


def old_and_new(tmp_path: Path) -> tuple[Path, Path]:
    """The old table: P by a/fake (10) and b/fake (12), Q by a/fake (20). The new sweep
    re-ran P only: a/fake slower now (15), b/fake slower too (13)."""
    old = write(tmp_path / "old.parquet", [result_row(P, "a/fake", 10.0),
                                            result_row(P, "b/fake", 12.0),
                                            result_row(Q, "a/fake", 20.0)])
    new = write(tmp_path / "new.parquet", [result_row(P, "a/fake", 15.0),
                                            result_row(P, "b/fake", 13.0)], LATER)
    return old, new


def test_the_newer_rows_of_the_named_routes_stand_even_when_slower(tmp_path):
    old, new = old_and_new(tmp_path)
    out = tmp_path / "out.parquet"
    result = merge(old, new, "--out", out, "--replace-routes", "a/fake")
    assert result.exit_code == 0, result.output
    assert "replaced: 1 rows" in result.output
    rows = by_route(out)
    assert len(rows) == 3
    assert rows.loc[("sm_90", 4, "a/fake"), "time_us"] == 15.0  # newer and slower: kept
    assert rows.loc[("sm_90", 4, "b/fake"), "time_us"] == 12.0  # not named: the faster
    assert rows.loc[("sm_90", 4, "b/fake"), "rank"] == 1
    assert rows.loc[("sm_90", 4, "a/fake"), "rank"] == 2
    assert rows.loc[("sm_90", 8, "a/fake"), "time_us"] == 20.0  # a problem NEW lacks
    assert table.validate(table.read(out)) == []


def test_a_plain_merge_keeps_the_faster_row_and_refuses_other_specs(tmp_path):
    old, new = old_and_new(tmp_path)
    out = tmp_path / "out.parquet"
    refused = merge(old, new, "--out", out)
    assert refused.exit_code == 1 and "different specs" in refused.output
    assert merge(old, new, "--out", out, "--allow-different-specs").exit_code == 0
    assert by_route(out).loc[("sm_90", 4, "a/fake"), "time_us"] == 10.0


def test_several_routes_and_json(tmp_path):
    old, new = old_and_new(tmp_path)
    out = tmp_path / "out.csv"
    result = merge(old, new, "--out", out, "--replace-routes", "b/fake, a/fake", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["replaced"] == {"routes": ["a/fake", "b/fake"], "rows": 2}
    assert document["rows"] == 3
    rows = by_route(out)
    assert rows.loc[("sm_90", 4, "a/fake"), "time_us"] == 15.0
    assert rows.loc[("sm_90", 4, "b/fake"), "time_us"] == 13.0
    plain = json.loads(merge(old, old, "--out", out, "--json").stdout)
    assert plain["replaced"] is None


def test_problems_are_per_device(tmp_path):
    old = write(tmp_path / "old.parquet", [result_row(P, "a/fake", 10.0),
                                            result_row(P, "a/fake", 30.0, device=MI355)])
    new = write(tmp_path / "new.parquet", [result_row(P, "a/fake", 35.0, device=MI355)],
                LATER)
    out = tmp_path / "out.parquet"
    assert merge(old, new, "--out", out, "--replace-routes", "a/fake").exit_code == 0
    rows = by_route(out)
    assert rows.loc[("gfx950", 4, "a/fake"), "time_us"] == 35.0
    assert rows.loc[("sm_90", 4, "a/fake"), "time_us"] == 10.0  # NEW holds no H200 row


def test_every_row_replaced_leaves_the_new_table(tmp_path):
    _, new = old_and_new(tmp_path)
    out = tmp_path / "out.parquet"
    result = merge(new, new, "--out", out, "--replace-routes", "a/fake,b/fake")
    assert result.exit_code == 0, result.output
    assert len(table.read(out)) == 2


def test_what_cannot_be_replaced_is_a_usage_error(tmp_path):
    old, new = old_and_new(tmp_path)
    out = tmp_path / "out.parquet"
    absent = merge(old, new, "--out", out, "--replace-routes", "c/fake")
    assert absent.exit_code == 2 and "c/fake: no rows in the newer tables" in absent.output
    alone = merge(old, "--out", out, "--replace-routes", "a/fake")
    assert alone.exit_code == 2 and "at least one newer table" in alone.output
    empty = merge(old, new, "--out", out, "--replace-routes", ",")
    assert empty.exit_code == 2
    assert not out.exists()


def test_where_picks_the_newer_rows_that_replace(tmp_path):
    old = write(tmp_path / "old.parquet", [result_row(P, "a/fake", 10.0),
                                            result_row(P, "b/fake", 12.0),
                                            result_row(Q, "a/fake", 20.0)])
    new = write(tmp_path / "new.parquet", [result_row(P, "a/fake", 15.0),
                                            result_row(Q, "a/fake", 25.0)], LATER)
    out = tmp_path / "out.parquet"
    result = merge(old, new, "--out", out, "--replace-routes", "a/fake", "--where",
                   "batch == 4")
    assert result.exit_code == 0, result.output
    rows = by_route(out)
    assert len(rows) == 3
    assert rows.loc[("sm_90", 4, "a/fake"), "time_us"] == 15.0
    assert rows.loc[("sm_90", 4, "a/fake"), "rank"] == 2
    assert rows.loc[("sm_90", 8, "a/fake"), "time_us"] == 20.0  # not picked: the old row
    out.unlink()
    none = merge(old, new, "--out", out, "--replace-routes", "a/fake", "--where", "batch == 99")
    assert none.exit_code == 2 and "that match --where" in none.output
    bad = merge(old, new, "--out", out, "--replace-routes", "a/fake", "--where", "batch ==")
    assert bad.exit_code == 2 and "--where" in bad.output
    alone = merge(old, new, "--out", out, "--where", "batch == 4")
    assert alone.exit_code == 2 and "only with --replace-routes" in alone.output
    assert not out.exists()


def test_a_table_joined_from_several_specs_merges_again(tmp_path):
    """A table that already holds two specs (as the shipped one does) joins alone and with
    tables of the same specs; beside a table of other specs it is refused in one line."""
    old, _ = old_and_new(tmp_path)
    other = write(tmp_path / "other.parquet", [result_row(BASE.with_(batch=2), "a/fake", 5.0)],
                  LATER)
    joined = tmp_path / "joined.parquet"
    assert merge(old, other, "--out", joined, "--allow-different-specs").exit_code == 0
    for inputs in ([joined], [joined, joined]):
        out = tmp_path / "out.parquet"
        result = merge(*inputs, "--out", out, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["spec_sha256"] == sorted(["ab" * 32, "cd" * 32])
        assert len(table.read(out)) == len(table.read(joined))
        out.unlink()
    refused = merge(joined, old, "--out", tmp_path / "out.parquet")
    assert refused.exit_code == 1
    assert refused.output.count("\n") == 1 and "different specs" in refused.output


def test_a_route_the_newer_sweep_left_out_at_a_problem_keeps_its_row(tmp_path):
    """Replacing is per (problem, route): where the newer rows (those --where keeps: here
    not the crashed one) hold no row of a named route at a problem, the old row stays."""
    old = write(tmp_path / "old.parquet", [result_row(P, "a/fake", 10.0),
                                            result_row(P, "b/fake", 12.0)])
    new = write(tmp_path / "new.parquet", [
        result_row(P, "a/fake", 15.0),
        result_row(P, "b/fake", None, status="crashed", reason="out of memory"),
        result_row(Q, "b/fake", 9.0)], LATER)
    out = tmp_path / "out.parquet"
    result = merge(old, new, "--out", out, "--replace-routes", "a/fake,b/fake", "--where",
                   "status != 'crashed'", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["replaced"] == {"routes": ["a/fake", "b/fake"], "rows": 1}
    rows = by_route(out)
    assert rows.loc[("sm_90", 4, "a/fake"), "time_us"] == 15.0
    assert rows.loc[("sm_90", 4, "b/fake"), "time_us"] == 12.0
    assert rows.loc[("sm_90", 4, "b/fake"), "status"] == "ok"
    assert rows.loc[("sm_90", 8, "b/fake"), "time_us"] == 9.0
