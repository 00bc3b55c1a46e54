"""The accuracy contract: routes declare their numeric class, a policy admits classes, and
the dispatcher serves only rows (and rule answers) the policy admits, from a table or a JSON
winners map, in lookup and export as in select."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlatune import routes, table
from mlatune.check.accuracy import Rounding, tolerance_for
from mlatune.check.policy import ACCURACY_ENV, FAST, FP8_MMA, POLICIES, STRICT, policy_named
from mlatune.cli import app
from mlatune.dispatch import Dispatcher
from mlatune.dispatch.admission import admitted
from mlatune.dispatch.dispatcher import device_for_arch, registered_routes
from mlatune.errors import DecodeArgumentError
from mlatune.problem import MLAProblem
from tests.table_helpers import H200, make_table, result_row

FP8 = "fp8_e4m3fn"
SHIPPED = "tables/sm_90-h200.parquet"
SM90 = device_for_arch("sm_90", "NVIDIA H200", 132)
BASE = MLAProblem(num_heads=16, batch=64, kv_len=4096, q_dtype="bf16", kv_dtype=FP8)
TG, MMA8 = "transposed/gluon", "transposed-mma8/gluon"  # exact; P rounded to fp8
PADDED = {"block_m": 64, "block_n": 64, "num_stages": 1, "num_warps": 8}


def test_policy_names_env_and_errors(monkeypatch):
    monkeypatch.delenv(ACCURACY_ENV, raising=False)
    assert policy_named(None) is STRICT
    assert policy_named("FP8-MMA") is FP8_MMA and policy_named(FAST) is FAST
    monkeypatch.setenv(ACCURACY_ENV, "fast")
    assert policy_named(None) is FAST
    monkeypatch.setenv(ACCURACY_ENV, "loose")
    with pytest.raises(ValueError, match=f"{ACCURACY_ENV}: unknown accuracy policy 'loose'"):
        policy_named(None)
    with pytest.raises(ValueError, match=r"^accuracy: unknown .* strict, fp8-mma, fast"):
        policy_named("exact")


def test_a_policy_admits_classes_and_errors_within_their_bound():
    bf16 = tolerance_for("bf16", "bf16").rel_l2
    assert STRICT.admits_row("bf16", FP8, Rounding.NONE, bf16 * 0.9)
    assert not STRICT.admits_row("bf16", FP8, Rounding.NONE, bf16 * 1.1)  # past its bound
    assert STRICT.admits_row("bf16", FP8, Rounding.NONE, math.nan)  # no error recorded
    assert not STRICT.admits_row("bf16", FP8, Rounding.P_FP8, 1e-3)
    assert FP8_MMA.admits_row("bf16", FP8, Rounding.P_FP8, 2e-2)
    assert not FP8_MMA.admits_row("bf16", FP8, Rounding.Q_FP8, 1e-3)
    assert FAST.admits_row("bf16", FP8, Rounding.Q_FP8, 7e-2)
    # Over an fp8 q every class is the problem's own: the fp8 bound, under every policy.
    assert all(p.admits_row(FP8, FP8, Rounding.Q_FP8, 7e-2) for p in POLICIES.values())


def _rows() -> list[dict]:
    """At two keys of an fp8 cache with a bf16 q: FlashMLA (q quantized) fastest, then
    transposed-mma8/gluon (P rounded to fp8), then padded/triton (exact)."""
    rows = []
    for batch in (32, 64):
        p = BASE.with_(batch=batch)
        rows += [
            {**result_row(p, "dense/flashmla", 100.0, params={"interface": "legacy"}),
             "rel_err": 6e-2},
            {**result_row(p, MMA8, 150.0, params={"form": "mma8", "num_splits": 2}),
             "rel_err": 1.2e-2},
            result_row(p, "padded/triton", 300.0, params={"block_m": 64, "block_n": 64,
                                                           "num_stages": 1, "num_warps": 8}),
        ]
    return rows


@pytest.fixture
def fp8_table(tmp_path):
    path = tmp_path / "t.parquet"
    table.write(make_table(_rows()), path)
    return path


@pytest.mark.parametrize("policy, winner", [("strict", "padded/triton"),
                                            ("fp8-mma", MMA8),
                                            ("fast", "dense/flashmla")])
def test_the_policy_decides_what_serves_a_bf16_q_over_an_fp8_cache(fp8_table, policy, winner,
                                                                   tmp_path):
    """The same measured keys answered by three policies, from the table, from a JSON map
    exported from it, and from a table exported for the policy."""
    json_map = tmp_path / "t.json"
    table.write_json(table.winners_json(table.read(fp8_table)), json_map)
    for path in (fp8_table, json_map):
        d = Dispatcher.load(path, device=H200, allow_arch="sm_90", accuracy=policy)
        for batch in (32, 64):
            choice = d.select(BASE.with_(batch=batch))
            assert (choice.route_id, choice.source) == (winner, "table"), (path, batch)
    exported = tmp_path / f"for-{policy}.json"
    result = CliRunner().invoke(app, ["export", str(fp8_table), "--format", "json", "--out",
                          str(exported), "--accuracy", policy, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["held_back"] == {"strict": 4, "fp8-mma": 2, "fast": 0}[
        policy]
    assert json.loads(exported.read_text())["accuracy"] == policy
    for served_by in ("fast", policy):  # an export holds only its policy's rows
        d = Dispatcher.load(exported, device=H200, allow_arch="sm_90", accuracy=served_by)
        assert d.select(BASE).route_id == winner


def test_explain_names_what_the_policy_held_back_and_its_cost(fp8_table):
    d = Dispatcher.load(fp8_table, device=H200, allow_arch="sm_90", accuracy="strict")
    choice, notes = d.explain(BASE)
    assert choice.route_id == "padded/triton"
    held = [n for n in notes if "held back" in n]
    assert len(held) == 2
    assert held[0].startswith("accuracy policy strict held back dense/flashmla (q-fp8")
    assert "66.7% less time than the answer" in held[0]
    assert "transposed-mma8/gluon (p-fp8" in held[1]


def test_rule_answers_meet_the_policy(monkeypatch):
    """Without a table, the rule order skips routes whose defaults round past the policy."""
    monkeypatch.delenv(ACCURACY_ENV, raising=False)
    problem = BASE
    for name in POLICIES:
        d = Dispatcher.rules_only(SM90, accuracy=name)
        for choice in [d.select(problem), *d.alternatives(problem)]:
            cls = routes.rounding(d.route(choice.route_id), problem)
            assert d.accuracy.admits_class(problem.q_dtype, cls), (name, choice)
    d = Dispatcher.rules_only(SM90)
    _, notes = d.explain(problem)
    assert any("accuracy policy strict holds it back" in n for n in notes)


def test_over_the_shipped_table_strict_serves_only_rows_within_the_own_dtype_bound():
    """Every measured key of the shipped table, answered by the default policy: the served
    route's class is none and its recorded error within the bound of the problem's own
    dtypes; the fp8-cache keys where a looser class won switch when the policy allows."""
    frame = table.read(SHIPPED)
    ok = frame[frame["status"] == "ok"]
    errors = {(k, r): e for k, r, e in zip(table.key_strings(ok), ok["route"], ok["rel_err"],
                                           strict=True)}
    strict = Dispatcher.load(SHIPPED, device=SM90, allow_arch="sm_90")
    fast = Dispatcher.load(SHIPPED, device=SM90, allow_arch="sm_90", accuracy="fast")
    assert strict.accuracy is STRICT
    switched = 0
    for key in dict.fromkeys(table.key_strings(ok)):
        problem = MLAProblem.from_key(key)
        choice = strict.select(problem)
        route = strict.route(choice.route_id)
        assert routes.rounding(route, problem, dict(choice.params)) == Rounding.NONE, key
        if choice.source == "table":
            bound = tolerance_for(problem.q_dtype, problem.kv_dtype).rel_l2
            assert errors[key, choice.route_id] <= bound, (key, choice)
        switched += fast.select(problem).route_id != choice.route_id
    assert switched > 100  # FlashMLA's quantized q wins many fp8-cache keys under fast


def test_admission_asks_each_route_once_per_params_and_dtypes():
    """Every ok row of the shipped table is classed; only FlashMLA's fp8-cache rows with a
    bf16 q and transposed-mma8/gluon's rows round past their dtypes (as mlatune reads the
    table: a stored set under the route it belongs to)."""
    frame = table.read(SHIPPED, facts=routes.FACTS)
    ok = frame[frame["status"] == "ok"]
    mask, classes, _ = admitted(ok, STRICT, registered_routes())
    rounded = {(r, str(c)) for r, c in zip(ok["route"], classes, strict=True)
               if c != Rounding.NONE}
    assert rounded == {("dense/flashmla", "q-fp8"), (MMA8, "p-fp8")}
    assert int((~mask).sum()) == sum(c != Rounding.NONE for c in classes)


def test_decode_names_a_bad_policy_and_a_dispatcher_serving_another(fp8_table):
    import torch

    from mlatune import attention

    with pytest.raises(DecodeArgumentError, match=r"^accuracy: unknown accuracy policy"):
        attention.default_dispatcher(accuracy="nope")
    d = Dispatcher.load(fp8_table, device=H200, allow_arch="sm_90", accuracy="fast")
    q = torch.zeros(1, 16, 576)
    with pytest.raises(DecodeArgumentError, match=r"^accuracy: 'strict' asked, but the "
                                                  "dispatcher given serves 'fast'"):
        attention.decode(q, torch.zeros(4, 64, 576), torch.zeros(1, 4, dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32), num_heads=16, dispatcher=d,
                         accuracy="strict")


def _two_formats(tmp_path, rows):
    path = table.write(make_table(rows), tmp_path / "t.parquet")
    return path, table.write_json(table.winners_json(table.read(path)), tmp_path / "t.json")


def test_a_set_stored_without_params_is_classed_as_its_routes_first_set(tmp_path):
    """A set stored as ``{}`` is its route's first: transposed/gluon's exact (strict serves
    it), transposed-mma8/gluon's P rounded (strict serves padded/triton), alike from the
    table and from its winners map."""
    problems = [BASE, BASE.with_(batch=32)]
    rows = [r for p, route in zip(problems, (TG, MMA8), strict=True)
            for r in (result_row(p, route, 100.0), result_row(p, "padded/triton", 300.0,
                                                              params=PADDED))]
    for path in _two_formats(tmp_path, rows):
        d = Dispatcher.load(path, device=H200, allow_arch="sm_90", accuracy="strict")
        assert [d.select(p).route_id for p in problems] == [TG, "padded/triton"], path


def _both_forms(problem: MLAProblem, mma8_us: float, mma16_us: float) -> list[dict]:
    """The two transposed routes and padded/triton at ``problem``, errors as measured."""
    return [{**result_row(problem, MMA8, mma8_us, params={"form": "mma8", "num_splits": 4}),
             "rel_err": 1.2e-2},
            {**result_row(problem, TG, mma16_us, params={"form": "mma16", "num_splits": 8}),
             "rel_err": 1.8e-3},
            {**result_row(problem, "padded/triton", 174.0, params=PADDED), "rel_err": 1.7e-3}]


def test_strict_serves_the_exact_transposed_row_and_fp8_mma_the_faster(tmp_path):
    """Where both transposed routes have rows (16 heads over an fp8 cache), strict serves
    transposed/gluon's mma16 (not padded/triton); fp8-mma the faster of the two, from the
    table and from its winners map."""
    fast_mma8, fast_mma16 = BASE, BASE.with_(batch=32)
    rows = [*_both_forms(fast_mma8, 59.0, 80.0), *_both_forms(fast_mma16, 90.0, 70.0)]
    for path in _two_formats(tmp_path, rows):
        strict = Dispatcher.load(path, device=H200, allow_arch="sm_90", accuracy="strict")
        loose = Dispatcher.load(path, device=H200, allow_arch="sm_90", accuracy="fp8-mma")
        assert [strict.select(p).route_id for p in (fast_mma8, fast_mma16)] == [TG, TG], path
        assert strict.select(fast_mma8).params["form"] == "mma16"
        assert [loose.select(p).route_id for p in (fast_mma8, fast_mma16)] == [MMA8, TG], path


def test_a_route_held_back_for_its_error_is_not_served_at_that_key_another_way(tmp_path):
    """A row admitted by class but past its bound (a spec that loosened the sweep's bound)
    counts as failed there: neither a neighbour's answer nor a prediction serves its route."""
    padded = {"block_m": 64, "block_n": 64, "num_stages": 1, "num_warps": 8}
    ok, bad = BASE.with_(kv_dtype="bf16", batch=32), BASE.with_(kv_dtype="bf16", batch=64)
    rows = [result_row(ok, "padded/triton", 100.0, params=padded),
            {**result_row(bad, "padded/triton", 150.0, params=padded), "rel_err": 5e-2}]
    for path in _two_formats(tmp_path, rows):
        for unmeasured in ("nearest", "predict"):
            d = Dispatcher.load(path, device=H200, allow_arch="sm_90", unmeasured=unmeasured)
            choice, notes = d.explain(bad)
            assert choice.route_id != "padded/triton", (path, unmeasured)
            assert any("padded/triton rejected_accuracy" in n for n in notes)


def test_a_route_whose_class_cannot_be_told_is_never_served(tmp_path, monkeypatch):
    """A rounding hook that raises holds the route's rows back under every policy."""
    padded = routes.get("padded/triton")

    def broken(problem, params):
        raise RuntimeError("broken hook")

    monkeypatch.setattr(padded, "rounding", broken)
    rows = [result_row(BASE, "padded/triton", 100.0), result_row(BASE, "reference/torch", 900.0)]
    for path in _two_formats(tmp_path, rows):
        for policy in POLICIES:
            d = Dispatcher.load(path, device=H200, allow_arch="sm_90", accuracy=policy)
            assert d.select(BASE).route_id != "padded/triton", (path, policy)


def test_a_bad_policy_in_the_environment_is_a_setting_error(monkeypatch):
    from mlatune.errors import SettingError

    monkeypatch.setenv(ACCURACY_ENV, "loose")
    with pytest.raises(SettingError, match=f"^{ACCURACY_ENV}: unknown accuracy policy"):
        Dispatcher.rules_only(SM90)
    from mlatune import attention

    with pytest.raises(SettingError):  # decode names the variable, not an argument
        attention.default_dispatcher()


def test_a_step_reading_another_plan_is_held_to_the_policy_asked(monkeypatch):
    from mlatune import attention
    from mlatune.arch import cpu_device
    from mlatune.check.inputs import make_decode_inputs

    problem = MLAProblem(num_heads=4, batch=2, kv_len=32, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=1)
    shard = inputs.shards[0]
    args = dict(num_heads=4, max_kv_len=32, dispatcher=Dispatcher.rules_only(cpu_device(),
                                                                             accuracy="fast"))
    planner = attention.prepare_decode(inputs.q, shard.kv_cache, shard.block_table,
                                       inputs.seq_lens, **args)
    attention.prepare_decode(inputs.q.clone(), shard.kv_cache, shard.block_table,
                             inputs.seq_lens, plan_from=planner, accuracy="fast", **args)
    monkeypatch.setattr(planner.route, "rounding", lambda p, params: Rounding.Q_FP8)
    del args["dispatcher"]
    with pytest.raises(DecodeArgumentError, match=r"^accuracy: plan_from serves .* \(q-fp8\), "
                                                  r"which accuracy 'strict' holds back"):
        attention.prepare_decode(inputs.q.clone(), shard.kv_cache, shard.block_table,
                                 inputs.seq_lens, plan_from=planner, accuracy="strict", **args)


def test_without_pandas_only_a_winners_map_is_found(tmp_path, monkeypatch):
    from mlatune.dispatch import bundled

    for name in ("sm_90-nvidia-h200.parquet", "sm_90-h200.json.gz", "sm_90-h200.csv"):
        (tmp_path / name).write_bytes(b"x")
    assert bundled.find_table(tmp_path, "sm_90", "NVIDIA H200").name == \
        "sm_90-nvidia-h200.parquet"
    monkeypatch.setattr(bundled, "reads_frames", lambda: False)
    assert bundled.find_table(tmp_path, "sm_90", "NVIDIA H200").name == "sm_90-h200.json.gz"



def test_without_pandas_a_folder_of_parquet_alone_and_a_user_table_say_what_is_missing(
        tmp_path, monkeypatch):
    from mlatune.dispatch import Dispatcher, bundled
    from mlatune.errors import TableError
    from tests.table_helpers import H200

    monkeypatch.setattr(bundled, "reads_frames", lambda: False)
    (tmp_path / "sm_90-h200.parquet").write_bytes(b"x")
    with pytest.raises(TableError, match=r"no table for arch sm_90 in this directory that "
                                         r"this install reads \(Parquet and CSV tables need "
                                         r"pandas and pyarrow"):
        Dispatcher.load(tmp_path, device=H200)
    shipped = Path(__file__).parents[1] / "tables" / "sm_90-h200.json.gz"
    with pytest.raises(TableError, match=r"takes no overlay of .*mine.parquet \(and a user "
                                         r"table needs pandas and pyarrow"):
        Dispatcher.load(shipped, device=H200, overlay=tmp_path / "mine.parquet")


def test_a_winners_only_map_says_where_the_policy_left_a_problem_bare(fp8_table, tmp_path,
                                                                      caplog):
    """A winners-only map holds one option a problem: where the policy holds it back nothing
    measured is left there, and loading says so once, naming the export that would keep it."""
    bare = tmp_path / "winners.json"
    table.write_json(table.winners_json(table.read(fp8_table), winners_only=True), bare)
    with caplog.at_level("WARNING", logger="mlatune"):
        d = Dispatcher.load(bare, device=H200, allow_arch="sm_90", accuracy="strict")
    assert d.select(BASE).source != "table"
    warned = [r.getMessage() for r in caplog.records if "keeps only" in r.getMessage()]
    assert len(warned) == 1 and "at 2 measured problems accuracy policy strict" in warned[0]
    assert "export with --accuracy strict" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="mlatune"):
        Dispatcher.load(bare, device=H200, allow_arch="sm_90", accuracy="fast")
    assert not [r for r in caplog.records if "keeps only" in r.getMessage()]
