"""`mlatune plan`: a device-free view of what a sweep would run on an arch, and why not."""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from mlatune import routes
from mlatune.arch import current_device
from mlatune.cli import app
from mlatune.sweep.spec import bundled_spec_path

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def gfx950_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "gfx950.csv"
    result = invoke("plan", str(bundled_spec_path("gfx950.toml")), "--arch", "gfx950",
                    "--out", str(out))
    with out.open() as f:
        return result, list(csv.DictReader(f))


def find(rows, route, **key):
    want = {k: str(v) for k, v in key.items()}
    return [r for r in rows if r["route"] == route and all(r[k] == v for k, v in want.items())]


def test_plan_prints_routes_reasons_and_says_the_probe_was_not_applied(gfx950_plan):
    result, _ = gfx950_plan
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # rich wraps lines
    assert "MI355X" in out and "256 CUs" in out
    assert "probe" in out and "was not applied" in out
    for route in ("gluon/aiter", "padded/aiter", "cprr/aiter", "segmented/aiter",
                  "fp8-ps/aiter", "reference/torch"):
        assert route in out
    assert "rule gluon.kv" in out and "per route on gfx950" in out


def test_plan_csv_has_a_row_per_problem_and_route(gfx950_plan):
    _, rows = gfx950_plan
    n_routes = len(routes.all_routes())
    assert len(rows) % n_routes == 0 and len(rows) >= 2000
    assert {r["arch"] for r in rows} == {"gfx950"} and {r["cu_count"] for r in rows} == {"256"}
    assert all(r["status"] in ("viable", "unsupported") and r["reason"] for r in rows)
    small = dict(phase="decode", num_heads=4, qlen=1, dcp_size=1, batch=1, kv_len=2048,
                 page_size=1, q_dtype="bf16")
    [gluon] = find(rows, "gluon/aiter", kv_dtype="bf16", **small)
    assert gluon["status"] == "viable"
    [gluon_fp8] = find(rows, "gluon/aiter", kv_dtype="fp8_e4m3fn", **small)
    assert gluon_fp8["status"] == "unsupported" and "gluon.kv" in gluon_fp8["reason"]
    [big] = find(rows, "gluon/aiter", kv_dtype="bf16", **{**small, "batch": 256,
                                                          "kv_len": 32768})
    assert big["status"] == "unsupported" and "gluon.cache" in big["reason"]
    [cprr] = find(rows, "cprr/aiter", phase="decode", num_heads=16, qlen=3, dcp_size=2,
                  kv_dtype="bf16", batch=1, kv_len=2048, page_size=1, q_dtype="bf16")
    assert cprr["status"] == "viable" and "32 kernel heads" in cprr["reason"]


@pytest.mark.parametrize("arch", ["sm_90", "gfx1250"])
def test_plan_other_archs(arch, tmp_path):
    out = tmp_path / "plan.csv"
    result = invoke("plan", str(bundled_spec_path("smoke.toml")), "--arch", arch, "--out",
                    str(out))
    assert result.exit_code == 0, result.output
    with out.open() as f:
        rows = list(csv.DictReader(f))
    gluon = [r for r in rows if r["route"] == "gluon/aiter"]
    assert gluon and all(r["status"] == "unsupported" for r in gluon)
    if arch == "gfx1250":
        assert "unit count unknown" in result.output and {r["cu_count"] for r in rows} == {""}
    else:
        assert all("aiter.amd" in r["reason"] for r in gluon)


def test_plan_errors_are_one_red_line():
    result = invoke("plan", str(bundled_spec_path("smoke.toml")), "--arch", "gfx950",
                    "--out", "/nonexistent/dir/plan.csv")
    assert result.exit_code == 1
    assert "cannot write" in result.output and "error:" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", ["plan.parquet", "spec.toml", "plan"])
def test_plan_writes_only_a_csv(tmp_path, name):
    """--out that is not .csv (a table's name, the spec itself) is refused, untouched."""
    spec = tmp_path / "spec.toml"
    spec.write_bytes(bundled_spec_path("smoke.toml").read_bytes())
    out = tmp_path / name
    if name != "plan":
        out.write_bytes(spec.read_bytes())
    result = invoke("plan", str(spec), "--arch", "sm_90", "--out", str(out))
    assert result.exit_code == 2 and "name it .csv" in result.output
    assert name == "plan" or out.read_bytes() == spec.read_bytes()


def test_plan_and_coverage_refuse_a_route_the_spec_names_that_does_not_exist(tmp_path):
    """A [max_params] entry of an unknown route would never cut anything: refused as the
    routes list's unknown ids are, by plan and coverage as by sweep."""
    spec = tmp_path / "s.toml"
    spec.write_text('[max_params]\n"bogus/route" = 2\n[[grid]]\nkv_len = 64\n')
    for args in (["plan", str(spec), "--arch", "sm_90"], ["coverage", str(spec)]):
        result = invoke(*args)
        assert result.exit_code == 1 and "bogus/route" in result.output, args
        assert "Traceback" not in result.output


def test_plan_says_how_many_combinations_it_skipped(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text("[[grid]]\nnum_heads = [8, 16]\nkv_len = [160, 0]\n")
    result = invoke("plan", str(spec), "--arch", "sm_90")
    assert result.exit_code == 0, result.output
    assert "2 problems from" in result.output
    assert "(2 invalid combinations skipped)" in " ".join(result.output.split())
    assert json.loads(invoke("plan", str(spec), "--arch", "sm_90", "--json").output)[
        "skipped_combinations"] == 2


def test_plan_refuses_an_unknown_arch_as_a_usage_error_listing_the_known():
    result = invoke("plan", str(bundled_spec_path("smoke.toml")), "--arch", "gfx90a")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "'gfx90a' is not one of 'gfx942', 'gfx950', 'gfx1250', 'sm_90', 'sm_100'" \
        in result.output


@pytest.mark.parametrize("text, words", [
    ("name = [", "not valid TOML"),
    ('routes = ["nope/none"]\n[[grid]]\nnum_heads = 16\n', "unknown route 'nope/none'"),
    ("[[grid]]\nnum_heads = 0\n", "no valid problem"),
], ids=["bad-toml", "unknown-route", "no-problem"])
def test_plan_rejects_bad_specs(tmp_path, text, words):
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    result = invoke("plan", str(spec), "--arch", "gfx950")
    assert result.exit_code == 1 and words in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert invoke("plan", str(tmp_path / "missing.toml"), "--arch", "gfx950").exit_code == 2


def test_sweep_for_an_arch_that_is_not_here_points_to_plan():
    if current_device().arch == "gfx950":
        pytest.skip("this machine is a gfx950")
    result = invoke("sweep", "--arch", "gfx950")
    assert result.exit_code == 1
    out = " ".join(result.output.split())
    assert "--arch gfx950 but this machine's device is" in out
    assert "mlatune plan SPEC --arch gfx950" in out


def test_plan_is_the_rules_without_this_machines_probe():
    """A plan for sm_90 calls FlashMLA and FlashInfer viable where their rules allow, whether or
    not they are installed here (the probe belongs to the target machine); gluon/triton at 128
    heads, cprr/triton at dcp 1 and bf16-ps/triton for decode are refused, as the routes refuse
    them (tests/test_capability_agreement.py holds every route to its supports)."""
    from mlatune import capability
    from mlatune.problem import MLAProblem
    from mlatune.sweep import planning

    device = capability.device_for_arch("sm_90")
    decode = MLAProblem(num_heads=128, page_size=64)
    for route_id in ("dense/flashmla", "fa3/flashinfer", "fa2/flashinfer", "padded/triton"):
        assert planning.verdict(routes.get(route_id), decode, device)[0], route_id
    for route_id, problem in (("gluon/triton", decode), ("cprr/triton", decode.with_(qlen=3)),
                              ("bf16-ps/triton", decode)):
        ok, reason = planning.verdict(routes.get(route_id), problem, device)
        assert not ok and reason.startswith("rule triton."), (route_id, reason)
        assert not routes.get(route_id).supports(problem, device)


def test_a_long_plan_says_how_far_it_has_come_on_stderr_only(monkeypatch):
    """Off a terminal, a plan that takes long writes progress lines to stderr; --json's
    stdout stays one JSON document, the same as without progress."""
    import json

    from mlatune.cli import plan

    spec = str(bundled_spec_path("h200.toml"))
    quiet = invoke("plan", spec, "--arch", "sm_90", "--json")
    monkeypatch.setattr(plan, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(plan, "PROGRESS_EVERY_S", 0.0)
    shown = invoke("plan", spec, "--arch", "sm_90", "--json")
    assert quiet.exit_code == shown.exit_code == 0
    assert "planning:" not in quiet.stderr
    problems = json.loads(quiet.stdout)["problems"]
    assert json.loads(shown.stdout) == json.loads(quiet.stdout)
    lines = shown.stderr.splitlines()
    assert lines and all(line.startswith("planning: ") for line in lines)
    assert lines[-1].startswith(f"planning: {problems:,} of {problems:,} problems")


def test_progress_reports_count_the_problems_planned():
    from mlatune.sweep import planning
    from mlatune.sweep.spec import load

    spec = load(bundled_spec_path("h200.toml"))
    seen: list[int] = []
    rows = planning.plan_rows(spec, current_device(), seen.append)
    n = len(spec.problems)
    assert seen == [*range(planning.PROGRESS_STEP, n, planning.PROGRESS_STEP), n]
    assert len(rows) == n * len(routes.all_routes())
