"""mlatune.dispatch.predict on synthetic tables whose times follow known laws, and the
leave-one-out harness of benchmarks/predict_loo.py."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mlatune.dispatch import device_for_arch
from mlatune.dispatch.predict import LOST_PENALTY, Predictor, Row, rows_from_journal
from mlatune.problem import MLAProblem
from mlatune.routes import YES
from mlatune.routes.triton_decode import PaddedTritonRoute

DEVICE = device_for_arch("sm_90", "NVIDIA H200", 132)
BASE = MLAProblem(num_heads=16, qlen=1, kv_dtype="bf16", page_size=64)
BATCHES = (1, 4, 16, 64, 256)
KV_LENS = (1024, 4096, 16384, 65536)
Law = Callable[[int, int], float]


def rows(laws: dict[str, Law], batches=BATCHES, kv_lens=KV_LENS) -> list[Row]:
    """One candidate per recipe (route ``<name>/fake``, params {"tile": name}) per point."""
    return [(BASE.with_(batch=b, kv_len=k), f"{name}/fake", {"tile": name}, law(b, k))
            for name, law in laws.items() for b in batches for k in kv_lens]


def at(batch: int, kv_len: int) -> MLAProblem:
    return BASE.with_(batch=batch, kv_len=kv_len)


def power(b: int, k: int) -> float:
    return 3.0 * b ** 0.8 * k ** 0.9


@pytest.mark.parametrize("shape", [(8, 2048), (3, 1500), (160, 11000), (40, 60000)])
def test_a_power_law_is_reproduced_between_grid_points(shape):
    # log time is a plane in log sizes: the envelope's local plane fits it exactly
    (only,) = Predictor(rows({"a": power}), {}, DEVICE).predict(at(*shape))
    assert only.time_us == pytest.approx(power(*shape), rel=1e-3)
    assert only.slowness == 0.0


def test_a_power_law_is_extrapolated_beyond_the_grid():
    (only,) = Predictor(rows({"a": power}), {}, DEVICE).predict(at(512, 262144))
    assert only.time_us == pytest.approx(power(512, 262144), rel=1e-2)


def test_a_recipe_slower_by_a_constant_factor_is_predicted_so_and_not_chosen():
    laws = {"a": power, "b": lambda b, k: 1.3 * power(b, k)}
    predictor = Predictor(rows(laws), {}, DEVICE)
    fast, slow = predictor.predict(at(3, 1500))
    assert (fast.route_id, slow.route_id) == ("a/fake", "b/fake")
    assert slow.slowness == pytest.approx(0.3)
    assert slow.time_us / fast.time_us == pytest.approx(1.3)
    prediction, params = predictor.choose(at(3, 1500))
    assert prediction.route_id == "a/fake" and params == {"tile": "a"}


@pytest.mark.parametrize("shape, winner", [((2, 2048), "small"), ((8, 8192), "small"),
                                           ((128, 32768), "large"), ((32, 32768), "large")])
def test_the_route_fastest_by_the_law_is_chosen_away_from_the_crossover(shape, winner):
    # overhead + per-token cost: "small" starts sooner, "large" streams faster; they cross
    # at 300k tokens
    laws = {"small": lambda b, k: 5 + b * k / 1e4, "large": lambda b, k: 20 + b * k / 2e4}
    predictor = Predictor(rows(laws), {}, DEVICE)
    prediction, _ = predictor.choose(at(*shape))
    assert prediction.route_id == f"{winner}/fake"
    assert prediction.time_us == pytest.approx(laws[winner](*shape), rel=0.15)


def test_usable_leaves_out_routes_that_refuse():
    laws = {"a": power, "b": lambda b, k: 1.3 * power(b, k)}
    prediction, _ = Predictor(rows(laws), {}, DEVICE).choose(at(3, 1500),
                                                             lambda r: r != "a/fake")
    assert prediction.route_id == "b/fake"
    assert Predictor(rows(laws), {}, DEVICE).choose(at(3, 1500), lambda r: False) is None


def test_nothing_is_predicted_for_a_bucket_never_measured():
    predictor = Predictor(rows({"a": power}), {}, DEVICE)
    assert predictor.predict(at(3, 1500).with_(num_heads=32)) == []
    assert predictor.choose(at(3, 1500).with_(num_heads=32)) is None


def test_uncertainty_grows_with_distance_from_the_measured_points():
    predictor = Predictor(rows({"a": power}), {}, DEVICE)
    found = [predictor.predict(at(256, 65536 * 2 ** n))[0] for n in range(4)]
    assert found[0].distance == 0.0 and found[0].uncertainty == 0.0  # measured there
    distances = [p.distance for p in found]
    uncertainties = [p.uncertainty for p in found]
    assert distances == sorted(distances) and len(set(distances)) == 4
    assert uncertainties == sorted(uncertainties) and len(set(uncertainties)) == 4


def test_spread_says_when_the_neighbours_disagree():
    def checkered(b: int, k: int) -> float:  # 25% slower and 20% faster, alternately
        return power(b, k) * (1.25 if (BATCHES.index(b) + KV_LENS.index(k)) % 2 else 0.8)

    agree = Predictor(rows({"a": power, "b": lambda b, k: 1.1 * power(b, k)}), {}, DEVICE)
    disagree = Predictor(rows({"a": power, "b": checkered}), {}, DEVICE)
    shape = at(8, 4096)
    assert max(p.spread for p in agree.predict(shape)) < 1e-9
    assert max(p.spread for p in disagree.predict(shape)) > 0.1
    assert disagree.predict(shape)[0].uncertainty > agree.predict(shape)[0].uncertainty


def test_without_leaves_out_the_point_and_only_there():
    # "b" is planted fastest at one point only; elsewhere "a" is
    def planted(b: int, k: int) -> float:
        return 0.5 * power(b, k) if (b, k) == (16, 4096) else 1.2 * power(b, k)

    predictor = Predictor(rows({"a": power, "b": planted}), {}, DEVICE)
    point = at(16, 4096)
    assert predictor.measured(point)
    assert predictor.choose(point)[0].route_id == "b/fake"  # measured: the data says b
    rest = predictor.without(point)
    assert not rest.measured(point) and predictor.measured(point)  # the original is kept
    prediction, _ = rest.choose(point)
    assert prediction.route_id == "a/fake" and prediction.distance > 0
    assert rest.measured(at(16, 16384)) and rest.measured(at(4, 4096))


def test_without_a_bucket_s_only_point_forgets_the_bucket():
    predictor = Predictor(rows({"a": power}, batches=(4,), kv_lens=(4096,)), {}, DEVICE)
    assert predictor.without(at(4, 4096)).choose(at(4, 4096)) is None


def test_a_table_s_missing_recipe_counts_as_having_lost_there():
    # A table keeps each route's best only: "wide" is seen only where it won, at one
    # far corner; everywhere else "narrow" was the route's best
    table = [(problem, "r/fake", params, time) for problem, _, params, time in
             rows({"narrow": power}) if (problem.batch, problem.kv_len) != (256, 65536)]
    table.append((at(256, 65536), "r/fake", {"tile": "wide"}, 0.9 * power(256, 65536)))
    predictor = Predictor(table, {}, DEVICE, complete=False)
    narrow, wide = predictor.predict(at(8, 2048))
    assert narrow.recipe == {"tile": "narrow"}
    assert wide.slowness == pytest.approx(LOST_PENALTY - 1, rel=1e-3)
    assert wide.params == {"tile": "wide"} and wide.nearest == at(256, 65536)  # where it ran
    # Taken as complete, "wide" has only its win to go by and looks as fast
    assert Predictor(table, {}, DEVICE).predict(at(8, 2048))[1].slowness < 1e-3


def test_sized_parameters_are_redone_for_the_asked_shape():
    route = PaddedTritonRoute()
    measured = []
    for b in BATCHES:
        for k in KV_LENS:
            problem = at(b, k)
            for params in route.param_space(problem, DEVICE)[:2]:  # two tiles, filling splits
                measured.append((problem, route.id, params, power(b, k) * params["block_n"]))
    predictor = Predictor(measured, {route.id: route}, DEVICE)
    problem = at(24, 3000)  # nearest to (16, 4096), which fills the device with 16 splits
    prediction, params = predictor.choose(problem)
    assert "num_splits" not in prediction.recipe and prediction.recipe["block_n"] == 32
    fill = next(p for p in route.param_space(problem, DEVICE) if p["block_n"] == 32)
    assert params == fill and fill["num_splits"] == 8  # batch 24 fills it with 8
    assert prediction.nearest == at(16, 4096) and prediction.params["num_splits"] == 16


def test_rows_from_journal_reads_ok_candidates(tmp_path: Path):
    lines = [{"kind": "header", "arch": "sm_90"}]
    for status, time_us in (("ok", 12.5), ("crashed", None)):
        record = {"kind": "result", "id": status, "key": at(4, 4096).key_dict(),
                  "route": "a/fake", "route_params": json.dumps({"tile": "a"}),
                  "status": status}
        lines.append(record if time_us is None else {**record, "time_us": time_us})
    path = tmp_path / "sweep.journal.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    assert rows_from_journal(path) == [(at(4, 4096), "a/fake", {"tile": "a"}, 12.5)]


def test_rows_from_journal_keeps_only_replayable_steps_for_a_capturing_caller(tmp_path: Path):
    def record(route_id: str, plan_on: str, capturable: bool) -> dict:
        return {"kind": "result", "id": route_id, "key": at(4, 4096).key_dict(),
                "route": route_id, "route_params": "{}", "status": "ok", "time_us": 10.0,
                "plan_on": plan_on, "capturable": capturable, "plan_us": 2.0,
                "plan_host_us": 30.0}

    path = tmp_path / "sweep.journal.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "header"}, record("host/fake", "host", False),
        record("device/fake", "device", True))))
    eager = {route_id: cost for _, route_id, _, cost in rows_from_journal(path, plan_calls=1)}
    assert eager == {"host/fake": 42.0, "device/fake": 12.0}  # as dispatch.step_cost costs
    graphed = rows_from_journal(path, capturable=True, plan_calls=1)
    assert [(route_id, cost) for _, route_id, _, cost in graphed] == [("device/fake", 12.0)]
    shared = {route_id: cost for _, route_id, _, cost in rows_from_journal(path, plan_calls=4)}
    assert shared == {"host/fake": 40.5, "device/fake": 10.5}  # device plans are shared


def _load_benchmark():
    bench = Path(__file__).parent.parent / "benchmarks"
    sys.path.insert(0, str(bench))  # predict_loo imports nearest_loo, as run from there
    try:
        spec = importlib.util.spec_from_file_location("predict_loo", bench / "predict_loo.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(bench))


class _Fake:
    """A route that serves every problem (the harness asks as the dispatcher does)."""

    def supports(self, problem, device):
        return YES


def test_leave_one_out_judges_each_problem_without_its_own_data():
    bench = _load_benchmark()

    def planted(b: int, k: int) -> float:
        return 0.5 * power(b, k) if (b, k) == (16, 4096) else 1.2 * power(b, k)

    data = rows({"a": power, "b": planted})
    timed: dict = {}
    for problem, route_id, params, time_us in data:
        timed.setdefault((problem.key, route_id), []).append((dict(params), time_us))
    best = bench.best_times(timed)
    entries = [(p.key, p.bucket, p.batch, p.kv_len) for p in {row[0] for row in data}]
    measured = bench.Measured(DEVICE, {"a/fake": _Fake(), "b/fake": _Fake()}, entries, timed,
                              best)
    regrets = bench.predictor_loo(Predictor(data, {}, DEVICE), measured)
    assert len(regrets) == len(BATCHES) * len(KV_LENS)
    # Had the planted point been left in, "b" would be chosen there at no regret
    assert regrets[at(16, 4096).key] == (pytest.approx(1.0), pytest.approx(1.0))
    # Far from it, "a" wins and is chosen
    assert regrets[at(1, 1024).key] == regrets[at(256, 65536).key] == (0.0, 0.0)
    assert all(math.isfinite(r) and math.isfinite(p) for r, p in regrets.values())


# The dispatcher's answer at unmeasured shapes (``unmeasured="predict"``, the default) ---
def _crossing_table(tmp_path: Path, fakes) -> Path:
    """A table where ``a`` wins small sizes and ``b`` large ones (the laws above)."""
    from mlatune import table
    from tests.table_helpers import make_table, result_row

    laws = {"a": power, "b": lambda b, k: 40.0 * b ** 0.6 * k ** 0.75}
    frame = make_table([result_row(p, route, t, params=params)
                        for p, route, params, t in rows(laws)])
    return table.write(frame, tmp_path / "sm_90.parquet")


@pytest.fixture
def crossing_routes():
    from mlatune import routes
    from tests.table_helpers import FakeRoute

    made = [FakeRoute("a/fake"), FakeRoute("b/fake")]
    for route in made:
        routes.register(route)
    yield made
    for route in made:
        routes.unregister(route.id)


@pytest.mark.parametrize("shape", [(3, 1500), (160, 11000), (40, 60000), (8, 2048)])
def test_the_dispatcher_answers_an_unmeasured_shape_from_the_predictions(
        shape, tmp_path, crossing_routes):
    from mlatune import table
    from mlatune.dispatch import Dispatcher
    from mlatune.dispatch.predict import rows_from_table

    path = _crossing_table(tmp_path, crossing_routes)
    dispatcher = Dispatcher.load(path, device=DEVICE)
    predictor = Predictor(rows_from_table(table.read(path)), dispatcher.routes, DEVICE,
                          complete=False)
    want, _ = predictor.choose(at(*shape))
    choice = dispatcher.select(at(*shape))
    assert (choice.source, choice.route_id) == ("predicted", want.route_id)
    assert choice.time_us == pytest.approx(want.time_us)
    # Measured shapes still answer from the table; `nearest` remains a mode.
    assert dispatcher.select(at(4, 4096)).source == "table"
    nearest = Dispatcher.load(path, device=DEVICE, unmeasured="nearest")
    assert nearest.select(at(*shape)).source == "nearest"


def test_the_predicted_answer_beats_the_nearest_one_across_a_crossover(tmp_path,
                                                                        crossing_routes):
    """Between grid points where the winner changes, the nearest point's winner is often
    the wrong one; the predictions follow both laws."""
    from mlatune.dispatch import Dispatcher

    path = _crossing_table(tmp_path, crossing_routes)
    laws = {"a/fake": power, "b/fake": lambda b, k: 40.0 * b ** 0.6 * k ** 0.75}
    predicted = Dispatcher.load(path, device=DEVICE)
    nearest = Dispatcher.load(path, device=DEVICE, unmeasured="nearest")
    asked = [at(b, k) for b in (2, 3, 6, 12, 24, 48, 96, 180) for k in (1500, 3000, 6000,
                                                                        11000, 23000, 47000)]

    def regret(dispatcher) -> float:
        worst = 0.0
        for p in asked:
            best = min(law(p.batch, p.kv_len) for law in laws.values())
            got = laws[dispatcher.select(p).route_id](p.batch, p.kv_len)
            worst = max(worst, got / best - 1)
        return worst

    assert regret(predicted) <= regret(nearest)
    assert regret(predicted) < 0.02


def test_explain_lists_the_predictions_behind_the_choice(tmp_path, crossing_routes):
    from mlatune.dispatch import Dispatcher

    dispatcher = Dispatcher.load(_crossing_table(tmp_path, crossing_routes), device=DEVICE)
    choice, notes = dispatcher.explain(at(160, 11000))
    predicted = [n for n in notes if n.startswith("predicted: ")]
    assert len(predicted) == 2 and predicted[0].startswith(f"predicted: {choice.route_id}")
    assert all("us (+-" in n for n in predicted)


def test_an_unknown_unmeasured_mode_is_refused(tmp_path, crossing_routes):
    from mlatune.dispatch import Dispatcher

    with pytest.raises(ValueError, match="unmeasured must be one of"):
        Dispatcher.load(_crossing_table(tmp_path, crossing_routes), device=DEVICE,
                        unmeasured="guess")


def test_predicted_answers_carry_their_uncertainty_and_coverage_lists_the_large_ones(
        tmp_path, crossing_routes):
    import json as json_

    from typer.testing import CliRunner

    from mlatune.cli import app
    from mlatune.dispatch import Dispatcher

    path = _crossing_table(tmp_path, crossing_routes)
    dispatcher = Dispatcher.load(path, device=DEVICE)
    assert math.isnan(dispatcher.select(at(4, 4096)).uncertainty)  # measured
    near, far = dispatcher.select(at(5, 5000)), dispatcher.select(at(4096, 1 << 21))
    assert near.uncertainty < 0.1 < far.uncertainty  # 4 doublings past the grid each way
    spec = tmp_path / "far.toml"
    spec.write_text('name = "far"\n[[grid]]\nphase = "decode"\nnum_heads = 16\nqlen = 1\n'
                    'kv_dtype = "bf16"\npage_size = 64\nbatch = [5, 4096]\n'
                    'kv_len = [5000, 2097152]\n')
    result = CliRunner().invoke(app, ["coverage", str(spec), "--table", str(path), "--arch",
                                      "sm_90", "--json"])
    assert result.exit_code == 0, result.output
    document = json_.loads(result.output)
    assert document["answered"]["predicted"]["problems"] == 4
    listed = {u["key"]: u["uncertainty"] for u in document["uncertain"]}
    assert at(4096, 1 << 21).key in listed and at(5, 5000).key not in listed
    assert all(u > 0.1 for u in listed.values())


def test_lookup_explain_lists_every_prediction(tmp_path, crossing_routes):
    from typer.testing import CliRunner

    from mlatune.cli import app

    path = _crossing_table(tmp_path, crossing_routes)
    args = ["lookup", str(path), "--heads", "16", "--batch", "160", "--kv-len", "11000",
            "--arch", "sm_90", "--json"]
    result = CliRunner().invoke(app, [*args, "--explain"])
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["why"]
    assert sum(n.startswith("predicted: ") for n in notes) == 2  # every recipe
    from mlatune.dispatch import Dispatcher

    dispatcher = Dispatcher.load(path, device=DEVICE)
    for count, shown in ((1, 1), (None, 2)):
        _, notes = dispatcher.explain(at(160, 11000), predictions=count)
        assert sum(n.startswith("predicted: ") for n in notes) == shown
