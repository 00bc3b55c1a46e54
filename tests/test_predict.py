"""mlatune.dispatch.predict on synthetic tables whose times follow known laws."""

from __future__ import annotations

import gzip
import heapq
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from mlatune.dispatch import device_for_arch
from mlatune.dispatch.observations import rows_from_journal
from mlatune.dispatch.predict import (
    LOST_PENALTY,
    Prediction,
    Predictor,
    Row,
)
from mlatune.problem import MLAProblem
from mlatune.routes import params_at
from mlatune.routes.flashinfer import FlashInferRoute
from mlatune.routes.gluon_hopper import WgmmaGluonRoute
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


def cost(b: int, k: int) -> float:
    """The model's law for a balanced route: a fixed cost, a cost per request and one per
    KV token (W = b x k / SMs, C = b / SMs)."""
    return 12.0 + 0.5 * b + b * k / 2e3


BETWEEN = [(8, 2048), (3, 1500), (160, 11000), (40, 60000)]


@pytest.mark.parametrize("shape", [*BETWEEN, (2, 512), (512, 262144), (1024, 4096)])
def test_a_cost_law_is_reproduced_between_and_beyond_the_grid(shape):
    (only,) = Predictor(rows({"a": cost}), {}, DEVICE).predict(at(*shape))
    assert only.time_us == pytest.approx(cost(*shape), rel=1e-6)
    assert only.slowness == 0.0 and only.spread < 1e-6


@pytest.mark.parametrize("shape", BETWEEN)
def test_a_power_law_is_approximated_between_grid_points_and_the_misfit_is_said(shape):
    # A power law is no sum of fixed, per-request and per-token costs: the law misses it
    # and the correction from the neighbours makes up most of that
    (only,) = Predictor(rows({"a": power}), {}, DEVICE).predict(at(*shape))
    assert only.time_us == pytest.approx(power(*shape), rel=0.03)
    assert only.spread > 0.05  # the law's misfit nearby, in the uncertainty
    assert only.uncertainty > abs(math.log(only.time_us / power(*shape)))


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
    assert prediction.time_us == pytest.approx(laws[winner](*shape), rel=1e-6)


def test_usable_leaves_out_routes_that_refuse():
    laws = {"a": power, "b": lambda b, k: 1.3 * power(b, k)}
    prediction, _ = Predictor(rows(laws), {}, DEVICE).choose(at(3, 1500),
                                                             lambda r: r != "a/fake")
    assert prediction.route_id == "b/fake"
    assert Predictor(rows(laws), {}, DEVICE).choose(at(3, 1500), lambda r: False) is None


def test_a_recipe_measured_once_grows_with_the_problem_and_does_not_win_flat():
    """A route the sweep ran at one point only (pruned as slower everywhere else) has a law
    one point cannot fit: taken as half fixed cost, half streaming there, its prediction
    grows with the tokens rather than staying at that one time (which would put it under
    the bandwidth floor at 8x the tokens)."""
    measured = rows({"a": cost})
    once = (at(16, 1024), "once/fake", {"tile": "once"}, 0.9 * cost(16, 1024))
    predictor = Predictor([*measured, once], {}, DEVICE)
    far = at(32, 4096)  # 8x the tokens of its one point, as near the others' points
    by_route = {p.route_id: p.time_us for p in predictor.predict(far)}
    assert by_route["once/fake"] > 4 * once[3]
    assert predictor.choose(far)[0].route_id == "a/fake"
    # At its one point it keeps its measured time.
    assert predictor.predict(at(16, 1024))[0].time_us == pytest.approx(once[3])


def test_nothing_is_predicted_for_a_bucket_never_measured():
    predictor = Predictor(rows({"a": power}), {}, DEVICE)
    assert predictor.predict(at(3, 1500).with_(num_heads=32)) == []
    assert predictor.choose(at(3, 1500).with_(num_heads=32)) is None


def test_uncertainty_grows_with_distance_from_the_measured_points():
    predictor = Predictor(rows({"a": cost}), {}, DEVICE)
    found = [predictor.predict(at(256, 65536 * 2 ** n))[0] for n in range(4)]
    assert found[0].distance == 0.0 and found[0].uncertainty < 1e-6  # measured there
    distances = [p.distance for p in found]
    uncertainties = [p.uncertainty for p in found]
    assert distances == sorted(distances) and len(set(distances)) == 4
    assert uncertainties == sorted(uncertainties) and len(set(uncertainties)) == 4


def test_spread_says_when_the_neighbours_disagree():
    def checkered(b: int, k: int) -> float:  # 25% slower and 20% faster, alternately
        return cost(b, k) * (1.25 if (BATCHES.index(b) + KV_LENS.index(k)) % 2 else 0.8)

    agree = Predictor(rows({"a": cost, "b": lambda b, k: 1.1 * cost(b, k)}), {}, DEVICE)
    disagree = Predictor(rows({"a": cost, "b": checkered}), {}, DEVICE)
    shape = at(8, 4096)
    assert max(p.spread for p in agree.predict(shape)) < 1e-6
    assert max(p.spread for p in disagree.predict(shape)) > 0.1

    def b_of(predictor: Predictor) -> Prediction:
        return next(p for p in predictor.predict(shape) if p.route_id == "b/fake")

    assert b_of(disagree).uncertainty > b_of(agree).uncertainty + 0.1


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
             rows({"narrow": cost}) if (problem.batch, problem.kv_len) != (256, 65536)]
    table.append((at(256, 65536), "r/fake", {"tile": "wide"}, 0.9 * cost(256, 65536)))
    predictor = Predictor(table, {}, DEVICE, complete=False)
    narrow, wide = predictor.predict(at(8, 2048))
    assert narrow.recipe == {"tile": "narrow"}
    assert narrow.time_us == pytest.approx(cost(8, 2048), rel=1e-3)
    # Far from its win, "wide" is as much slower as where it lost
    assert wide.slowness == pytest.approx(LOST_PENALTY - 1, rel=0.05)
    assert wide.params == {"tile": "wide"} and wide.nearest == at(256, 65536)  # where it ran
    # At its win it is the faster
    assert predictor.predict(at(200, 60000))[0].recipe == {"tile": "wide"}


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


# Waves: a split-KV route launches batch x splits programs over the 132 SMs ------------
PADDED = PaddedTritonRoute()


def wave_time(problem: MLAProblem, params: dict) -> float:
    """padded/triton's time under the model's law with its launch: a plain recipe runs
    ceil(programs / SMs) waves, each as long as one program's share of the KV (whole
    block_n tiles); the persistent one spreads the same work evenly, for a larger fixed
    cost; both pay 2 us per program per SM."""
    if params.get("persistent"):
        programs = problem.batch
        return 10.0 + 0.01 * programs * problem.shard_len / 132 + 2.0 * programs / 132
    programs = problem.batch * params["num_splits"]
    share = -(-problem.shard_len // (params["num_splits"] * params["block_n"])) \
        * params["block_n"]
    return 8.0 + 0.0095 * math.ceil(programs / 132) * share + 2.0 * programs / 132


def wave_recipes(problem: MLAProblem) -> list[dict]:
    """The first tile at its device-filling split, and its persistent variant."""
    space = PADDED.param_space(problem, DEVICE)
    return [space[0], next(p for p in space if p.get("persistent")
                           and p["block_n"] == space[0]["block_n"])]


def wave_rows(table: bool = False) -> list[Row]:
    """Both recipes at every grid point (a journal), or the route's best there (a table)."""
    measured = [(at(b, k), PADDED.id, p, wave_time(at(b, k), p))
                for b in BATCHES for k in KV_LENS for p in wave_recipes(at(b, k))]
    if table:
        best: dict[str, Row] = {}
        for row in measured:
            if row[0].key not in best or row[3] < best[row[0].key][3]:
                best[row[0].key] = row
        measured = list(best.values())
    return measured


def test_wave_time_is_the_law_the_test_means():
    # 16 heads fill one 16-row block per request: a batch of 64 runs 4 splits, 256
    # programs, two full waves; 67 runs 2 splits, 134 programs: a second wave of 2
    plain = wave_recipes(at(64, 65536))[0]
    assert (plain["block_m"], plain["num_splits"]) == (16, 4)
    assert wave_recipes(at(67, 65536))[0]["num_splits"] == 2
    # At the grid's large points the plain recipe wins: no wave is left nearly empty
    for b, k in ((64, 65536), (256, 16384), (256, 65536)):
        plain, persistent = (wave_time(at(b, k), p) for p in wave_recipes(at(b, k)))
        assert plain < persistent


@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("shape, persistent", [((67, 65536), True), ((67, 16384), True),
                                               ((128, 65536), False), ((130, 4096), False)])
def test_a_batch_that_leaves_the_last_wave_nearly_empty_gets_the_persistent_variant(
        table, shape, persistent):
    # At batch 67 the plain recipe's second wave holds 2 of 134 programs: it takes twice
    # as long as its neighbours' trend says; at 128 and 130 the last wave is full again
    predictor = Predictor(wave_rows(table), {PADDED.id: PADDED}, DEVICE, complete=not table)
    problem = at(*shape)
    prediction, params = predictor.choose(problem)
    assert bool(prediction.recipe.get("persistent")) == persistent
    want = min(wave_recipes(problem), key=lambda p: wave_time(problem, p))
    assert params == want
    if not table:  # every recipe measured everywhere: each is predicted exactly
        for found in predictor.predict(problem):
            truth = next(p for p in wave_recipes(problem)
                         if bool(p.get("persistent")) == bool(found.recipe.get("persistent")))
            assert found.time_us == pytest.approx(wave_time(problem, truth), rel=1e-6)


def test_a_table_s_lost_recipe_is_as_slow_as_its_launch_makes_it():
    # 16 heads x 3 queries over 4 DCP ranks: 3 row blocks a request, so batches 16 and 64
    # launch 192 programs, 2 waves on 132 SMs: there the plain recipe loses to the
    # persistent one by 20-28%, and a table keeps only the winner. Its lost points are
    # counted from the winner's law on its own launch, not LOST_PENALTY over the winner.
    base = MLAProblem(num_heads=16, qlen=3, kv_dtype="bf16", page_size=64, dcp_size=4)

    def time_of(problem: MLAProblem, params: dict) -> float:
        blocks = problem.with_(batch=3 * problem.batch)  # programs = 3 x batch
        return wave_time(blocks, params)

    table = []
    for b in BATCHES:
        for k in KV_LENS:
            problem = base.with_(batch=b, kv_len=k)
            params = min(wave_recipes(problem), key=lambda p: time_of(problem, p))
            table.append((problem, PADDED.id, params, time_of(problem, params)))
    slow = time_of(base.with_(batch=16, kv_len=65536), wave_recipes(base.with_(batch=16,
                                                                               kv_len=65536))[0])
    assert slow > 1.2 * min(t for p, _, _, t in table if (p.batch, p.kv_len) == (16, 65536))
    predictor = Predictor(table, {PADDED.id: PADDED}, DEVICE, complete=False)
    for shape in [(24, 20000), (6, 9000), (40, 40000)]:
        problem = base.with_(batch=shape[0], kv_len=shape[1])
        truth = {bool(p.get("persistent")): time_of(problem, p) for p in wave_recipes(problem)}
        found = {bool(p.recipe.get("persistent")): p.time_us for p in predictor.predict(problem)}
        assert predictor.choose(problem)[0].recipe.get("persistent")
        assert found[False] == pytest.approx(truth[False], rel=0.1)
        assert found[True] == pytest.approx(truth[True], rel=0.05)


GLUON = WgmmaGluonRoute()


def gluon_time(problem: MLAProblem, splits: int) -> float:
    """wgmma/gluon under the model's law: batch x row blocks x splits programs in waves of
    one per SM, each walking its split's 64-key tiles; each program adds 3 us per SM (the
    partials it writes and the reduce reads)."""
    programs = problem.batch * -(-problem.num_heads * problem.qlen // 64) * splits
    share = -(-problem.shard_len // (splits * 64)) * 64
    return 6.0 + 0.004 * math.ceil(programs / 132) * share + 3.0 * programs / 132


def gluon_best(problem: MLAProblem) -> tuple[int, float]:
    """(the fastest split the route lists at ``problem``, its time)."""
    return min(((p["num_splits"], gluon_time(problem, p["num_splits"]))
                for p in GLUON.param_space(problem, DEVICE)), key=lambda st: st[1])


@pytest.mark.parametrize("shape", [(5, 16384), (7, 4096), (3, 2048), (24, 20000), (100, 8000)])
def test_a_listed_split_is_chosen_by_its_law_not_carried_from_the_neighbour(shape):
    # A table keeps the route's fastest split per point (its rule's pick, half or twice):
    # between batches the split the law makes fastest is passed, with its predicted time
    table = []
    for b in BATCHES:
        for k in KV_LENS:
            split, time_us = gluon_best(at(b, k))
            table.append((at(b, k), GLUON.id, {"num_splits": split}, time_us))
    predictor = Predictor(table, {GLUON.id: GLUON}, DEVICE, complete=False)
    problem = at(*shape)
    prediction, params = predictor.choose(problem)
    split, time_us = gluon_best(problem)
    assert params == {"num_splits": split}
    assert prediction.time_us == pytest.approx(time_us, rel=0.02)
    assert predictor.sized(predictor.predict(problem)[0], problem) == params


def flashmla_time(problem: MLAProblem) -> float:
    """dense/flashmla under the model's law with its metadata: each of 132 SM parts walks
    an even share of the requests' 64-key blocks (5 blocks more a request, plus 5), and the
    combine walks a request's pieces in turn (0.1 us each): a request cut over every part
    at batch 1 costs more than four at batch 4."""
    blocks = -(-problem.shard_len // 64)
    share = -(-problem.batch * (blocks + 5) // 132)
    return 8.0 + 0.01 * 64 * (share + 5) + 0.1 * -(-blocks // share)


@pytest.mark.parametrize("shape", [(2, 4096), (5, 4096), (3, 16384), (40, 9000)])
def test_flashmla_s_law_follows_its_metadata_between_batches(shape):
    from mlatune.routes import get

    route = get("dense/flashmla")
    assert flashmla_time(at(1, 4096)) > flashmla_time(at(4, 4096))
    table = [(at(b, k), route.id, {}, flashmla_time(at(b, k))) for b in BATCHES for k in KV_LENS]
    predictor = Predictor(table, {route.id: route}, DEVICE, complete=False)
    prediction, _ = predictor.choose(at(*shape))
    assert prediction.time_us == pytest.approx(flashmla_time(at(*shape)), rel=0.01)


@pytest.mark.parametrize("table", [False, True])
def test_sized_parameters_are_what_params_at_gives(table):
    predictor = Predictor(wave_rows(table), {PADDED.id: PADDED}, DEVICE, complete=not table)
    for shape in [(67, 65536), (3, 1500), (130, 4096), (1, 300), (500, 70000)]:
        problem = at(*shape)
        for prediction in predictor.predict(problem):
            assert predictor.sized(prediction, problem) == params_at(
                PADDED, dict(prediction.params), prediction.nearest, problem, DEVICE)


def test_the_choice_is_the_fastest_of_all_predictions():
    # choose() evaluates the split recipes' laws only while a bound says they could win
    balanced = [(at(b, k), "c/fake", {}, 9.0 + 0.0098 * b * k / 132 + 2.0 * b / 132)
                for b in BATCHES for k in KV_LENS]
    predictor = Predictor([*wave_rows(), *balanced], {PADDED.id: PADDED}, DEVICE)
    for b in (1, 2, 3, 5, 12, 33, 67, 100, 130, 200, 300):
        for k in (700, 1500, 3000, 9000, 30000, 70000):
            chosen, _ = predictor.choose(at(b, k))
            first = predictor.predict(at(b, k))[0]
            assert (chosen.route_id, chosen.recipe) == (first.route_id, first.recipe)
            assert chosen.time_us == pytest.approx(first.time_us)


# FlashInfer's plan: whole requests handed out in rounds over the SMs ------------------
def greedy_plan(tiles: int, kv: int, clusters: int) -> int:
    """FlashInfer's MLAPlan played chunk by chunk: each tile's KV cut at kv_len_limit (the
    mean per cluster, rounded up to 256), each chunk to the least loaded cluster; the
    largest load."""
    mean = -(-tiles * kv // clusters)
    limit = 32 if mean <= 8 else 64 if mean <= 16 else 128 if mean <= 32 else \
        192 if mean <= 64 else -(-mean // 256) * 256
    loads = [(0, c) for c in range(clusters)]
    for _ in range(tiles):
        left = kv
        while left > 0:
            load, cluster = heapq.heappop(loads)
            heapq.heappush(loads, (load + min(left, limit), cluster))
            left -= min(left, limit)
    return max(load for load, _ in loads)


@pytest.mark.parametrize("clusters", [132, 66])
def test_the_plan_s_rounds_are_counted_as_flashinfer_hands_chunks_out(clusters):
    from mlatune.routes.geometry import _plan_makespan

    for tiles in (1, 5, 40, 61, 100, 131, 133, 160, 200, 264, 300, 517):
        for kv in (100, 1500, 4096, 9000, 47000, 65536):
            assert _plan_makespan(tiles, kv, clusters)[0] == greedy_plan(tiles, kv, clusters)


def flashinfer_time(b: int, k: int) -> float:
    """16 heads x 1 query: one 64-row tile per request, 132 clusters."""
    return 9.0 + 0.0098 * greedy_plan(b, k, 132)


def balanced_time(b: int, k: int) -> float:
    return 10.0 + 0.0102 * b * k / 132


@pytest.mark.parametrize("shape", [(160, 11000), (160, 47000), (200, 3000), (97, 30000),
                                   (40, 9000), (3, 1500)])
def test_a_batch_past_one_request_per_sm_costs_flashinfer_a_round(shape):
    # FlashInfer is the faster at the grid's largest batch (256 requests fill two rounds of
    # 132); at batch 160 its plan gives 28 SMs a second request, 1.65x the even share, and
    # the balanced route wins
    measured = [(at(b, k), "fa3/flashinfer", {"backend": "fa3"}, flashinfer_time(b, k))
                for b in BATCHES for k in KV_LENS]
    measured += [(at(b, k), "dense/fake", {}, balanced_time(b, k))
                 for b in BATCHES for k in KV_LENS]
    assert all(flashinfer_time(256, k) < balanced_time(256, k) for k in KV_LENS)
    assert balanced_time(160, 11000) < flashinfer_time(160, 11000) / 1.3
    predictor = Predictor(measured, {"fa3/flashinfer": FlashInferRoute("fa3")}, DEVICE)
    chosen, _ = predictor.choose(at(*shape))
    laws = {"fa3/flashinfer": flashinfer_time, "dense/fake": balanced_time}
    assert chosen.route_id == min(laws, key=lambda r: laws[r](*shape))
    for found in predictor.predict(at(*shape)):
        assert found.time_us == pytest.approx(laws[found.route_id](*shape), rel=1e-6)


# Routes that failed nearby ------------------------------------------------------------
AROUND = [(4, 1024), (4, 4096), (16, 1024), (16, 4096)]  # the grid points around (8, 2048)


def test_a_route_that_failed_at_the_points_around_is_not_chosen_there():
    laws = {"a": cost, "b": lambda b, k: 1.2 * cost(b, k)}
    measured = [r for r in rows(laws)
                if not (r[1] == "a/fake" and (r[0].batch, r[0].kv_len) in AROUND)]
    failed = [(at(*shape), "a/fake") for shape in AROUND]
    predictor = Predictor(measured, {}, DEVICE, failed=failed)
    assert predictor.choose(at(8, 2048))[0].route_id == "b/fake"
    assert "a/fake" not in {p.route_id for p in predictor.predict(at(8, 2048))}
    assert predictor.choose(at(200, 50000))[0].route_id == "a/fake"  # far from them
    # Without the failures "a" is predicted from its other points and chosen
    assert Predictor(measured, {}, DEVICE).choose(at(8, 2048))[0].route_id == "a/fake"


def test_one_failure_among_the_points_around_does_not_rule_a_route_out():
    measured = rows({"a": cost, "b": lambda b, k: 1.2 * cost(b, k)})
    predictor = Predictor(measured, {}, DEVICE, failed=[(at(4, 1024), "a/fake")])
    assert predictor.choose(at(8, 2048))[0].route_id == "a/fake"


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


# The dispatcher's answer at unmeasured shapes (``unmeasured="predict"``, the default) ---
# "a" starts sooner, "b" streams faster: a wins below about 600k KV tokens, b above.
CROSSING = {"a": lambda b, k: 5.0 + b * k / 1e4, "b": lambda b, k: 35.0 + b * k / 2e4}


def _crossing_table(tmp_path: Path, fakes) -> Path:
    """A table where ``a`` wins small sizes and ``b`` large ones (the laws above)."""
    from mlatune import table
    from tests.table_helpers import make_table, result_row

    frame = make_table([result_row(p, route, t, params=params)
                        for p, route, params, t in rows(CROSSING)])
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
    from mlatune.dispatch.observations import rows_from_table

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
    laws = {f"{name}/fake": law for name, law in CROSSING.items()}
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


@pytest.mark.parametrize("status, chosen", [("rejected_accuracy", "b/fake"),
                                            ("crashed", "b/fake"), ("unsupported", "a/fake")])
def test_the_dispatcher_does_not_predict_a_route_that_failed_at_the_points_around(
        status, chosen, tmp_path, crossing_routes):
    # "a" is the faster at (8, 2048) by the laws; it failed at the four grid points around
    # it. A refusal by rule is no failure: there "a" is still predicted (and supports() has
    # the last word).
    from mlatune import table
    from mlatune.dispatch import Dispatcher
    from tests.table_helpers import make_table, result_row

    made = [result_row(p, route, t, params=params) if (p.batch, p.kv_len) not in AROUND
            or route != "a/fake" else result_row(p, route, None, status=status, params=params)
            for p, route, params, t in rows(CROSSING)]
    path = table.write(make_table(made), tmp_path / "sm_90.parquet")
    assert CROSSING["a"](8, 2048) < CROSSING["b"](8, 2048)
    choice = Dispatcher.load(path, device=DEVICE).select(at(8, 2048))
    assert (choice.source, choice.route_id) == ("predicted", chosen)


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
    result = CliRunner().invoke(app, ["coverage", str(path), str(spec), "--arch", "sm_90",
                                      "--json"])
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
