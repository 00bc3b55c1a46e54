"""`mlatune plan` and ``route.supports`` give the same answer, for every registered route over
every bundled spec's problems on every arch the capability model knows (issue 15).

Both ask ``mlatune.capability``, which owns every route's rules; ``supports`` adds its probe
of the machine it runs on (the installed AITER, FlashMLA, FlashInfer, Triton), which a plan
for another machine cannot apply. Here every probe is faked to find its library, so the two
must agree problem by problem, reasons included.
"""

from __future__ import annotations

import csv
import json
import types
from collections import Counter

import pytest
from typer.testing import CliRunner

from mlatune import capability, routes
from mlatune.cli import app
from mlatune.routes import aiter as aiter_routes
from mlatune.routes import flashinfer, flashmla, gluon_hopper, triton_support
from mlatune.routes.aiter_probe import AiterBuild
from mlatune.sweep import planning
from mlatune.sweep import spec as specs

BUNDLED = sorted(specs.bundled_spec_path().parent.glob("*.toml"))
VENDOR_ROUTES = {"dense/flashmla", "fa3/flashinfer", "fa2/flashinfer"}
OWN_KERNEL_ROUTES = {"wgmma/gluon"}  # mlatune's kernels past the portable Triton ones


@pytest.fixture
def libraries_found(monkeypatch):
    """Every route's probe finds its library (this machine has none of AITER, FlashMLA,
    FlashInfer; Triton may be absent too, or not the 3.6 the Gluon decode needs)."""
    monkeypatch.setattr(aiter_routes, "probe", lambda arch: AiterBuild(arch, None, "fake"))
    monkeypatch.setattr(flashmla, "library",
                        lambda: flashmla.FlashMLALib("legacy", "fake", ""))
    monkeypatch.setattr(flashinfer, "library",
                        lambda: (types.SimpleNamespace(__version__="fake"), ""))
    monkeypatch.setattr(triton_support, "triton_present", lambda: True)
    monkeypatch.setattr(gluon_hopper, "triton_version", lambda: "3.6.0")


def _problems() -> dict[str, list]:
    """Each bundled spec's problems as `mlatune plan` reads them (the GPU variant)."""
    return {path.stem: specs.load(path, gpu=True).problems for path in BUNDLED}


@pytest.fixture(scope="module")
def bundled_problems():
    return _problems()


def test_capability_owns_every_registered_route():
    ids = {r.id for r in routes.all_routes()}
    assert ids >= VENDOR_ROUTES | OWN_KERNEL_ROUTES
    assert {"padded/triton", "gluon/triton", "cprr/triton", "segmented/triton",
            "fp8-ps/triton", "bf16-ps/triton", "sdpa/torch", "reference/torch"} <= ids
    assert not [i for i in ids if not capability.known(i)]


def _supports(route, problem, device) -> tuple[bool, str]:
    answer = route.supports(problem, device)
    return answer.ok, answer.reason


@pytest.mark.parametrize("arch", list(capability.ARCHS))
def test_plan_equals_supports_over_every_bundled_spec(arch, bundled_problems, libraries_found):
    device = capability.device_for_arch(arch)
    every = routes.all_routes()
    checked = 0
    for name, problems in bundled_problems.items():
        seen = set()
        for problem in problems:
            if problem.key in seen:
                continue
            seen.add(problem.key)
            for route in every:
                planned = planning.verdict(route, problem, device)
                told = _supports(route, problem, device)
                assert planned[0] == told[0], (name, arch, route.id, problem.key, planned, told)
                if not told[0]:  # a refusal is worded alike; an ok one names the library
                    assert planned[1] == told[1], (name, arch, route.id, problem.key)
                checked += 1
    assert checked >= 10_000 * len(every)


def test_the_issue_cases(libraries_found):
    """The disagreements issue 15 names: gluon/triton at 128 heads and cprr/triton at dcp 1
    on sm_90; bf16-ps/triton on gfx950, refused for prefill and viable for decode."""
    from mlatune.problem import MLAProblem

    cases = [
        ("sm_90", "gluon/triton", MLAProblem(num_heads=128), False),
        ("sm_90", "cprr/triton", MLAProblem(num_heads=16, qlen=3), False),
        ("gfx950", "bf16-ps/triton", MLAProblem(num_heads=16), False),
        ("gfx950", "bf16-ps/triton",
         MLAProblem(phase="prefill", num_heads=16, qlen=256, kv_len=256, page_size=1), True),
    ]
    for arch, route_id, problem, ok in cases:
        device = capability.device_for_arch(arch)
        route = routes.get(route_id)
        assert planning.verdict(route, problem, device)[0] is ok, (arch, route_id)
        assert route.supports(problem, device).ok is ok, (arch, route_id)


@pytest.mark.parametrize("arch", list(capability.ARCHS))
def test_the_plan_command_equals_supports(arch, tmp_path, libraries_found):
    """Through the real command: --json's per-route counts and the --out CSV's row per
    problem and route match what every route's supports says."""
    path = specs.bundled_spec_path("deepseek-v3-tp8.toml")
    problems = specs.load(path, gpu=True).problems
    out = tmp_path / "plan.csv"
    result = CliRunner().invoke(app, ["plan", str(path), "--arch", arch, "--json",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    device = capability.device_for_arch(arch)
    every = routes.all_routes()
    viable = Counter()
    for problem in problems:
        for route in every:
            viable[route.id] += route.supports(problem, device).ok
    assert {r["route"]: r["viable"] for r in document["routes"]} == \
        {r.id: viable[r.id] for r in every}
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(problems) * len(every)
    by_route = {r.id: r for r in every}
    for row, (problem, route_id) in zip(
            rows, ((p, r.id) for p in problems for r in every), strict=True):
        assert row["route"] == route_id
        ok, reason = _supports(by_route[route_id], problem, device)
        assert (row["status"] == "viable") == ok, (arch, route_id, problem.key)
        if not ok:
            assert row["reason"] == reason
