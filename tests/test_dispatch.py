import builtins
import io
import logging
import math
import os
import random
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mlatune import routes, table
from mlatune.arch import DeviceInfo
from mlatune.dispatch import Choice, Dispatcher, TableError, bundled, find_table
from mlatune.dispatch import dispatcher as dispatch_module
from mlatune.dispatch.laws import Laws
from mlatune.problem import MLAProblem
from mlatune.table.schema import KEY_COLUMNS, NEITHER_STATUSES, STATUSES
from tests.table_helpers import (
    H200,
    MI355,
    FakeRoute,
    grid_rows,
    large_batch_fast,
    make_table,
    reference_slow,
    result_row,
    small_batch_fast,
)


@pytest.fixture(autouse=True)
def _nearest_for_unmeasured(monkeypatch):
    """These tests pin down how ``nearest`` answers an unmeasured shape; the default,
    ``predict``, has its own tests (tests/test_predict.py)."""
    monkeypatch.setattr(dispatch_module, "DEFAULT_UNMEASURED", "nearest")

BUCKETS = [MLAProblem(num_heads=16, qlen=1), MLAProblem(num_heads=8, qlen=2, causal=False),
           MLAProblem(num_heads=128, qlen=1, kv_dtype="fp8_e4m3fn", dcp_size=4)]
BATCHES = [1, 8, 64, 256]
KV_LENS = [1024, 8192, 65536]
PICKY_MAX_BATCH = 8


def picky_fast(p: MLAProblem) -> float | None:
    """The fastest route of all, but only measured (and supported) up to batch 8."""
    return 1.0 + p.kv_len / 1e5 if p.batch <= PICKY_MAX_BATCH else None


@pytest.fixture
def fakes():
    made = {r.id: r for r in (FakeRoute("fast-small/fake"), FakeRoute("fast-large/fake"),
                              FakeRoute("picky/fake", lambda p: p.batch <= PICKY_MAX_BATCH))}
    for route in made.values():
        routes.register(route)
    yield made
    for route_id in made:
        routes.unregister(route_id)


def grid_frame(device=H200, extra_rows=()):
    rows = grid_rows(BUCKETS, BATCHES, KV_LENS,
                     {"fast-small/fake": small_batch_fast, "fast-large/fake": large_batch_fast,
                      "picky/fake": picky_fast, "reference/torch": reference_slow},
                     device=device)
    return make_table([*rows, *extra_rows])


@pytest.fixture
def table_path(tmp_path, fakes):
    return table.write(grid_frame(), tmp_path / "sm_90.parquet")


def usable_ranked(frame, problem, supported):
    """Independent answer: the key's ok rows by time, keeping routes that serve the problem."""
    rows = frame[(frame["arch"] == "sm_90") & (frame["status"] == "ok")]
    for name, value in problem.key_dict().items():
        rows = rows[rows[name] == value]
    return [r for r in rows.sort_values("time_us")["route"] if supported(r, problem)]


def supported_by(registry):
    def check(route_id, problem):
        return route_id in registry and registry[route_id].supports(problem, H200).ok
    return check


def brute_force_nearest(frame, problem, supported):
    """The nearest measured point whose winner serves the problem, by the squared
    difference in log2 total tokens plus half that in log2 batch, ties to the smaller
    batch then kv_len; None when there is none."""
    best = None
    rows = frame[(frame["arch"] == "sm_90") & (frame["status"] == "ok")]
    bucket = {k: v for k, v in problem.key_dict().items() if k not in ("batch", "kv_len")}
    for name, value in bucket.items():
        rows = rows[rows[name] == value]
    for (batch, kv_len), group in rows.groupby(["batch", "kv_len"]):
        point = problem.with_(batch=int(batch), kv_len=int(kv_len))
        if point.key == problem.key:
            continue
        winners = [r for r in group.sort_values("time_us")["route"] if supported(r, point)]
        if not winners or not supported(winners[0], problem):
            continue
        d = (math.log2(batch * kv_len) - math.log2(problem.batch * problem.kv_len)) ** 2 + \
            0.5 * (math.log2(batch) - math.log2(problem.batch)) ** 2
        candidate = (d, math.log2(batch), math.log2(kv_len))
        if best is None or candidate < best[0]:
            best = (candidate, winners[0], point.key)
    return best


# Exact hits ------------------------------------------------------------------------

def test_exact_hits_return_the_fastest_route_that_serves_the_problem(table_path, fakes):
    frame = table.read(table_path)
    dispatcher = Dispatcher.load(table_path, device=H200)
    registry = dispatcher.routes
    for _, row in frame.drop_duplicates(list(KEY_COLUMNS)).iterrows():
        problem = MLAProblem.from_key_dict(row)
        choice = dispatcher.select(problem)
        expected = usable_ranked(frame, problem, supported_by(registry))[0]
        assert (choice.source, choice.route_id, choice.key) == ("table", expected, problem.key)
        assert dispatcher.select(problem) is choice  # remembered: the same object


def test_exact_winner_that_now_refuses_yields_the_runner_up(tmp_path, fakes):
    # A stale table: picky measured ok (and fastest) at batch 64, which it now refuses.
    big = BUCKETS[0].with_(batch=64, kv_len=8192)
    frame = make_table([result_row(big, "picky/fake", 1.0),
                        result_row(big, "fast-large/fake", 5.0),
                        result_row(big, "reference/torch", 50.0)])
    dispatcher = Dispatcher.load(table.write(frame, tmp_path / "t.parquet"), device=H200)
    choice = dispatcher.select(big)
    assert (choice.source, choice.route_id) == ("table", "fast-large/fake")
    chosen, notes = dispatcher.explain(big)
    assert chosen == choice and any("picky/fake refuses" in n for n in notes)


def test_unregistered_routes_are_skipped_and_counted(tmp_path, fakes):
    p = BUCKETS[0].with_(batch=8, kv_len=1024)
    frame = make_table([result_row(p, "ghost/fake", 0.5), result_row(p, "ghost/fake2", 0.7),
                        result_row(p, "fast-small/fake", 3.0),
                        result_row(p.with_(batch=1), "ghost/fake", 0.5)])
    dispatcher = Dispatcher.load(table.write(frame, tmp_path / "t.parquet"), device=H200)
    assert dispatcher.skipped_routes == {"ghost/fake": 2, "ghost/fake2": 1}
    assert dispatcher.select(p).route_id == "fast-small/fake"
    # A key measured only by missing routes is answered as if unmeasured.
    alone = dispatcher.select(p.with_(batch=1))
    assert alone.source == "nearest" and alone.route_id == "fast-small/fake"


def test_params_are_parsed_once_and_read_only(tmp_path, fakes):
    p = BUCKETS[0].with_(batch=8, kv_len=1024)
    frame = make_table([result_row(p, "fast-small/fake", 2.0, params={"splits": 4, "tile": 64})])
    choice = Dispatcher.load(table.write(frame, tmp_path / "t.csv"), device=H200).select(p)
    assert dict(choice.params) == {"splits": 4, "tile": 64}
    with pytest.raises(TypeError):
        choice.params["splits"] = 8  # type: ignore[index]


# Nearest and rule ------------------------------------------------------------------

def test_nearest_picks_the_closest_measured_point_in_log_space(table_path, fakes):
    frame = table.read(table_path)
    dispatcher = Dispatcher.load(table_path, device=H200)
    check = supported_by(dispatcher.routes)
    rng = random.Random(0)
    for _ in range(120):
        problem = rng.choice(BUCKETS).with_(batch=rng.randint(1, 400),
                                            kv_len=rng.randint(600, 100_000))
        if problem.batch in BATCHES and problem.kv_len in KV_LENS:
            continue
        expected = brute_force_nearest(frame, problem, check)
        choice = dispatcher.select(problem)
        assert choice.source == "nearest"
        assert (choice.route_id, choice.key) == (expected[1], expected[2]), problem


def test_nearest_prefers_a_point_of_the_same_total_tokens(tmp_path, fakes):
    # Four corners, each won by another route, all one grid step from batch 2 x kv 2048
    # in both log2 batch and log2 kv_len; two of them hold the same 4096 tokens.
    corners = {(1, 1024): "fast-small/fake", (1, 4096): "fast-large/fake",
               (4, 1024): "picky/fake", (4, 4096): "reference/torch"}
    rows = [result_row(BUCKETS[0].with_(batch=b, kv_len=kv), route, 1.0)
            for (b, kv), route in corners.items()]
    dispatcher = Dispatcher.load(table.write(make_table(rows), tmp_path / "t.parquet"),
                                 device=H200)
    # Same tokens: batch 1 x 4096 and batch 4 x 1024 tie; the smaller batch wins the tie.
    assert dispatcher.select(BUCKETS[0].with_(batch=2, kv_len=2048)).route_id == \
        "fast-large/fake"
    # Batch 3 x 1400 holds 4200 tokens, as near the two 4096-token corners; batch 4 is nearer 3.
    assert dispatcher.select(BUCKETS[0].with_(batch=3, kv_len=1400)).route_id == "picky/fake"


def test_nearest_skips_a_neighbour_whose_winner_refuses(table_path, fakes):
    dispatcher = Dispatcher.load(table_path, device=H200)
    # batch 12 sits nearest the batch-8 points, all won by picky, which refuses batch 12.
    problem = BUCKETS[0].with_(batch=12, kv_len=8192)
    choice = dispatcher.select(problem)
    assert choice.source == "nearest" and choice.route_id != "picky/fake"
    assert MLAProblem.from_key_dict(table_key(choice.key)).batch == 64
    # batch 6 may use it.
    assert dispatcher.select(problem.with_(batch=6)).route_id == "picky/fake"


def table_key(key):
    return dict(part.split("=") for part in key.split("|"))


def test_cost_laws_answer_buckets_never_measured(table_path, fakes):
    dispatcher = Dispatcher.load(table_path, device=H200)
    for batch in (4, 100):
        problem = MLAProblem(num_heads=3, qlen=1, batch=batch, kv_len=5000)
        choice = dispatcher.select(problem)
        assert choice.source == "law" and choice.time_us > 0
        assert dispatcher.routes[choice.route_id].supports(problem, H200).ok
        assert choice.key in dispatcher._winner  # the measured row its recipe comes from
        assert any(n.startswith("law: ") for n in dispatcher.explain(problem)[1])


def test_rule_answers_where_no_route_has_a_law(table_path, fakes):
    frame = table.read(table_path)
    dispatcher = Dispatcher.load(table_path, device=H200)
    dispatcher._laws = Laws({}, dispatcher.routes, dispatcher.hardware)  # no law at all
    wins = table.winners(frame)["route"].value_counts()
    order = sorted(wins.index, key=lambda r: (-wins[r], r))
    for batch in (4, 100):
        problem = MLAProblem(num_heads=3, qlen=1, batch=batch, kv_len=5000)
        choice = dispatcher.select(problem)
        serving = [r for r in order if dispatcher.routes[r].supports(problem, H200).ok]
        assert choice.source == "rule" and choice.route_id == serving[0]
        assert choice.key == "" and math.isnan(choice.time_us)


def test_without_a_table_every_answer_is_a_rule_and_reference_is_last(fakes):
    only_picky = Dispatcher(H200, routes={"picky/fake": fakes["picky/fake"]})
    assert only_picky.select(BUCKETS[0].with_(batch=2)) == Choice("picky/fake", {}, "rule")
    fallback = only_picky.select(BUCKETS[0].with_(batch=200))
    assert (fallback.route_id, fallback.source) == ("reference/torch", "rule")


def test_a_route_whose_supports_raises_counts_as_refusing(tmp_path, fakes):
    def broken(problem):
        raise RuntimeError("bug in a capability rule")

    routes.register(FakeRoute("broken/fake", broken))
    try:
        p = BUCKETS[0].with_(batch=8, kv_len=1024)
        frame = make_table([result_row(p, "broken/fake", 0.5),
                            result_row(p, "fast-small/fake", 2.0)])
        dispatcher = Dispatcher.load(table.write(frame, tmp_path / "t.parquet"), device=H200)
        assert dispatcher.select(p).route_id == "fast-small/fake"
        # The only neighbour's winner is the broken route: the rule answers, without it.
        neighbour = dispatcher.select(p.with_(batch=9))
        assert neighbour.source == "rule" and neighbour.route_id != "broken/fake"
        _, notes = dispatcher.explain(p)
        assert any("supports() raised RuntimeError: bug in a capability rule" in n
                   for n in notes)
    finally:
        routes.unregister("broken/fake")


@settings(max_examples=300, deadline=None)
@given(bucket=st.sampled_from([*BUCKETS, MLAProblem(num_heads=3)]),
       batch=st.integers(1, 1024), kv_len=st.integers(8, 1 << 18))
def test_select_never_returns_a_route_that_refuses(bucket, batch, kv_len):
    # Hypothesis runs this many times; the routes are registered for the whole test.
    picky = FakeRoute("picky/fake", lambda p: p.batch <= PICKY_MAX_BATCH)
    made = [FakeRoute("fast-small/fake"), FakeRoute("fast-large/fake"), picky]
    for r in made:
        routes.register(r)
    try:
        dispatcher = _hypothesis_dispatcher()
        problem = bucket.with_(batch=batch, kv_len=kv_len)
        choice = dispatcher.select(problem)
        assert dispatcher.routes[choice.route_id].supports(problem, H200).ok
        assert choice.source in ("table", "nearest", "law", "rule")
    finally:
        for r in made:
            routes.unregister(r.id)


_cached: list[Dispatcher] = []


def _hypothesis_dispatcher() -> Dispatcher:
    if not _cached:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = table.write(grid_frame(), os.path.join(tmp, "sm_90.parquet"))
            _cached.append(Dispatcher.load(path, device=H200))
    return _cached[0]


# Routes that failed where they were measured -----------------------------------------

def test_a_route_that_failed_at_the_exact_problem_is_not_taken_from_a_neighbour(tmp_path,
                                                                               fakes):
    # batch 64: the only measured route failed its accuracy check; batch 32 (the nearest
    # point) is won by that route, batch 256 by another.
    here = BUCKETS[0].with_(batch=64, kv_len=8192)
    frame = make_table([
        result_row(here, "padded/triton", None, status="rejected_accuracy",
                   reason="rel_l2 0.9 > tolerance 0.01"),
        result_row(here.with_(batch=32), "padded/triton", 3.0),
        result_row(here.with_(batch=32), "reference/torch", 90.0),
        result_row(here.with_(batch=256), "fast-small/fake", 20.0)])
    dispatcher = Dispatcher.load(table.write(frame, tmp_path / "t.parquet"), device=H200)
    choice = dispatcher.select(here)
    assert (choice.source, choice.route_id) == ("nearest", "fast-small/fake")
    assert choice.key == here.with_(batch=256).key
    explained, notes = dispatcher.explain(here)
    assert explained == choice
    assert any(n.startswith("measured here: padded/triton rejected_accuracy") for n in notes)
    assert not any("was not measured" in n for n in notes)
    # A neighbour the table never measured still takes the winner of batch 32.
    assert dispatcher.select(here.with_(batch=40)).route_id == "padded/triton"


@pytest.mark.parametrize("reference", [None, "timeout"])
def test_a_problem_where_every_route_failed_falls_to_the_reference(tmp_path, fakes, reference):
    here = BUCKETS[0].with_(batch=64, kv_len=8192)
    registry = dispatch_module.registered_routes()
    failing = [r for r in sorted(registry) if r != "reference/torch"
               and registry[r].supports(here, H200).ok]
    assert "padded/triton" in failing and "fast-large/fake" in failing
    statuses = ["rejected_accuracy", "crashed", "timeout"]
    rows = [result_row(here, r, None, status=statuses[i % 3]) for i, r in enumerate(failing)]
    rows.append(result_row(here, "picky/fake", None, status="unsupported"))
    if reference:
        rows.append(result_row(here, "reference/torch", None, status=reference))
    # Every neighbour is won by a route that failed here.
    rows += [result_row(here.with_(batch=b), r, 2.0 + i) for b in (32, 128)
             for i, r in enumerate(failing)]
    dispatcher = Dispatcher.load(table.write(make_table(rows), tmp_path / "t.csv"),
                                 device=H200)
    choice = dispatcher.select(here)
    assert (choice.source, choice.route_id) == ("rule", "reference/torch")
    assert dispatcher.select(here) is choice
    explained, notes = dispatcher.explain(here)
    assert explained == choice
    assert any(n.startswith("measured here: ") and "padded/triton" in n for n in notes)
    # Elsewhere in the bucket the neighbours' winners still answer.
    assert dispatcher.select(here.with_(batch=40)).source == "nearest"


_FAILING_ROUTES = ("fast-small/fake", "fast-large/fake", "picky/fake", "padded/triton",
                   "reference/torch")
_FAILING_GRID = [BUCKETS[0].with_(batch=b, kv_len=kv) for b in (1, 8, 64) for kv in (1024,
                                                                                     8192)]


@settings(max_examples=20, deadline=None)
@given(statuses=st.lists(st.sampled_from([*STATUSES, "ok", "ok", None]),
                         min_size=len(_FAILING_GRID) * len(_FAILING_ROUTES),
                         max_size=len(_FAILING_GRID) * len(_FAILING_ROUTES)),
       times=st.lists(st.integers(1, 50), min_size=len(_FAILING_ROUTES),
                      max_size=len(_FAILING_ROUTES)))
def test_select_never_returns_a_route_that_failed_at_the_exact_problem(statuses, times):
    import tempfile

    cells = [(p, r) for p in _FAILING_GRID for r in _FAILING_ROUTES]
    rows = [result_row(p, r, float(times[_FAILING_ROUTES.index(r)] * p.batch), status=s)
            for (p, r), s in zip(cells, statuses, strict=True) if s is not None]
    assume(rows)
    made = [FakeRoute("fast-small/fake"), FakeRoute("fast-large/fake"),
            FakeRoute("picky/fake", lambda p: p.batch <= PICKY_MAX_BATCH)]
    for r in made:
        routes.register(r)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            frame = make_table(rows)
            path = table.write(frame, os.path.join(tmp, "sm_90.parquet"))
            dispatcher = Dispatcher.load(path, device=H200)
            json_path = table.write_json(table.winners_json(frame),
                                         os.path.join(tmp, "sm_90.json"))
            from_json = Dispatcher.load(json_path, device=H200)
        for p in _FAILING_GRID:
            assert from_json.select(p) == dispatcher.select(p)  # the map keeps the failures
            failed = {r["route"] for r in rows if r["batch"] == p.batch
                      and r["kv_len"] == p.kv_len and r["status"] not in ("ok", *NEITHER_STATUSES)}
            choice = dispatcher.select(p)
            assert dispatcher.explain(p)[0] == choice
            assert dispatcher.routes[choice.route_id].supports(p, H200).ok
            if choice.route_id in failed:
                # Only the last resort, and only when every other route failed or refuses.
                assert choice.route_id == "reference/torch", (p, choice, failed)
                assert all(r in failed or not dispatcher.routes[r].supports(p, H200).ok
                           for r in dispatcher.routes if r != "reference/torch")
    finally:
        for r in made:
            routes.unregister(r.id)


# Arch, devices, discovery ----------------------------------------------------------

def test_a_table_for_another_arch_is_refused_naming_both(table_path):
    with pytest.raises(TableError) as info:
        Dispatcher.load(table_path, device=MI355)
    message = str(info.value)
    assert "sm_90" in message and "gfx950" in message and "\n" not in message
    planned = Dispatcher.load(table_path, device=MI355, allow_arch="sm_90")
    assert planned.device.arch == "sm_90" and planned.table_device == ("sm_90", "NVIDIA H200", 132)
    with pytest.raises(TableError, match=r"sm_90.*sm_100"):
        Dispatcher.load(table_path, device=MI355, allow_arch="sm_100")


def test_a_table_of_several_devices_answers_with_the_matching_one(tmp_path, fakes):
    p = BUCKETS[0].with_(batch=8, kv_len=1024)
    frame = make_table([result_row(p, "fast-small/fake", 2.0),
                        result_row(p, "fast-large/fake", 3.0),
                        result_row(p, "fast-small/fake", 9.0, device=MI355),
                        result_row(p, "fast-large/fake", 4.0, device=MI355)])
    path = table.write(frame, tmp_path / "both.parquet")
    assert Dispatcher.load(path, device=H200).select(p).route_id == "fast-small/fake"
    assert Dispatcher.load(path, device=MI355).select(p).route_id == "fast-large/fake"


def test_directories_and_bundled_tables_are_found_by_arch(tmp_path, monkeypatch, fakes):
    frame = grid_frame()
    table.write(frame, tmp_path / "sm_90-h200.parquet")
    table.write(make_table(grid_rows([BUCKETS[0]], [1], [1024], {"reference/torch":
                                                                 reference_slow},
                                     device=MI355)), tmp_path / "gfx950.csv")
    (tmp_path / "sm_90.txt").write_text("not a table")
    assert find_table(tmp_path, "sm_90", "NVIDIA H200").name == "sm_90-h200.parquet"
    assert find_table(tmp_path, "gfx950").name == "gfx950.csv"
    assert find_table(tmp_path, "sm_100") is None
    assert Dispatcher.load(tmp_path, device=MI355).table_device[0] == "gfx950"

    monkeypatch.delenv(dispatch_module.TABLE_ENV, raising=False)
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: tmp_path)
    served = Dispatcher.from_bundled(H200)
    assert served.source.endswith("sm_90-h200.parquet")
    assert Dispatcher.from_bundled(MI355).source.endswith("gfx950.csv")
    bare = Dispatcher.from_bundled(replace(H200, arch="sm_100", name="NVIDIA B200"))
    assert bare.source == "" and bare.select(BUCKETS[0]).source == "rule"


def test_the_environment_variable_overrides_and_must_be_usable(tmp_path, monkeypatch, fakes):
    path = table.write(grid_frame(), tmp_path / "mine.parquet")
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: None)
    monkeypatch.setenv(dispatch_module.TABLE_ENV, str(path))
    assert Dispatcher.from_bundled(H200).source == str(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(TableError, match="not a readable Parquet"):
        Dispatcher.from_bundled(H200)


def test_a_damaged_bundled_table_falls_back_to_rules(tmp_path, monkeypatch, caplog, fakes):
    (tmp_path / "sm_90.parquet").write_bytes(b"PAR1 damaged")
    monkeypatch.delenv(dispatch_module.TABLE_ENV, raising=False)
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: tmp_path)
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        dispatcher = Dispatcher.from_bundled(H200)
    assert dispatcher.source == "" and "bundled table unusable" in caplog.text
    assert dispatcher.select(BUCKETS[0]).source == "rule"


def failing_frame():
    """The grid with failures: at some problems some routes crashed, timed out, failed
    their accuracy check or were unsupported (a route not installed here too), and at two
    problems every route failed, their neighbours won by the routes that failed there."""
    rng = random.Random(5)
    statuses = ["crashed", "timeout", "rejected_accuracy", "unsupported"]
    rows = []
    for row in grid_frame().to_dict("records"):
        if row["status"] == "ok" and rng.random() < 0.25:
            row = result_row(_problem_of_row(row), row["route"], None,
                             status=rng.choice(statuses))
        rows.append(row)
    everything_failed = [BUCKETS[0].with_(batch=64, kv_len=8192),
                         BUCKETS[1].with_(batch=3, kv_len=1024)]  # the second never ok
    rows = [r for r in rows if _problem_of_row(r) not in everything_failed]
    for i, p in enumerate(everything_failed):
        rows += [result_row(p, r, None, status=statuses[(i + j) % 4])
                 for j, r in enumerate(FAKE_ROUTES)]
    some = BUCKETS[2].with_(batch=8, kv_len=1024)
    rows += [result_row(some, "padded/triton", None, status="crashed"),
             result_row(some, "gone/plugin", None, status="timeout")]
    return make_table(rows)


def _problem_of_row(row) -> MLAProblem:
    return MLAProblem.from_key_dict({k: row[k] for k in MLAProblem().key_dict()})


@pytest.mark.parametrize("capturable", [False, True])
def test_json_winners_map_answers_like_the_table(tmp_path, fakes, capturable):
    frame = failing_frame()
    table_path = table.write(frame, tmp_path / "sm_90.parquet")
    json_path = table.write_json(table.winners_json(frame), tmp_path / "sm_90.json")
    from_table = Dispatcher.load(table_path, device=H200, capturable=capturable)
    from_json = Dispatcher.load(json_path, device=H200, capturable=capturable)
    grid = [b.with_(batch=batch, kv_len=kv) for b in [*BUCKETS, MLAProblem(num_heads=3)]
            for batch in (*BATCHES, 2, 3, 12, 100, 300) for kv in (*KV_LENS, 3000, 20000)]
    sources = set()
    for p in grid:
        assert from_json.select(p) == from_table.select(p), p
        assert from_json.explain(p) == from_table.explain(p), p
        sources.add(from_table.select(p).source)
    assert sources == {"table", "nearest", "law", "rule"}
    # Every route failed at these two: none is taken from a neighbour or the rule there.
    for p in (BUCKETS[0].with_(batch=64, kv_len=8192), BUCKETS[1].with_(batch=3, kv_len=1024)):
        assert from_json.select(p).route_id not in FAKE_ROUTES
        assert from_json.explain(p)[1][0].startswith("measured here: ")
    # The failures decide answers: a map stripped of them (as written before) differs.
    document = table.winners_json(frame)
    for device in document["devices"]:
        del device["all_failed"]
        for entry in device["winners"].values():
            entry.pop("failed", None)
    stripped = Dispatcher.load(table.write_json(document, tmp_path / "old" / "sm_90.json"),
                               device=H200, capturable=capturable)
    assert [p for p in grid if stripped.select(p) != from_table.select(p)]


FAKE_ROUTES = ("fast-small/fake", "fast-large/fake", "picky/fake", "reference/torch")


@pytest.mark.parametrize("damage", [
    b"{", b"[]", b'{"format": "other"}',
    b'{"format": "mlatune-winners", "schema_version": 99, "key_fields": [], "devices": []}',
])
def test_a_damaged_json_winners_map_is_refused(tmp_path, damage):
    path = tmp_path / "sm_90.json"
    path.write_bytes(damage)
    with pytest.raises(TableError) as info:
        Dispatcher.load(path, device=H200)
    assert "\n" not in str(info.value)


def test_a_winners_map_that_lists_one_device_twice_is_refused(tmp_path, fakes):
    document = table.winners_json(failing_frame())
    document["devices"].append(dict(document["devices"][0]))
    path = table.write_json(document, tmp_path / "sm_90.json")
    with pytest.raises(TableError, match=r"devices\[1\] is devices\[0\]'s device again"):
        Dispatcher.load(path, device=H200)
    document["devices"][1]["device_name"] = ["NVIDIA H200"]  # not text: named, not a crash
    path = table.write_json(document, tmp_path / "sm_90.json")
    with pytest.raises(TableError, match=r"devices\[1\] lacks arch, device_name or cu_count"):
        Dispatcher.load(path, device=H200)


def _respelled(document: dict) -> dict:
    """The first winner's key spelled otherwise ("num_heads=016"): the same problem."""
    winners = document["devices"][0]["winners"]
    key = next(iter(winners))
    heads = MLAProblem.from_key(key).num_heads
    winners[key.replace(f"num_heads={heads}|", f"num_heads=0{heads}|")] = winners.pop(key)
    return document


@pytest.mark.parametrize(("damage", "message"), [
    (_respelled, "invalid winner entries"),
    (lambda d: {**d, "devices": [{**d["devices"][0], "provenance": ["x", 1]}]},
     "lacks its provenance"),
    (lambda d: {**d, "devices": [{**d["devices"][0], "cu_count": True}]},
     "lacks arch, device_name or cu_count"),
], ids=["respelled-key", "provenance-of-text", "cu-count-bool"])
def test_a_winners_map_of_unclear_entries_is_refused(tmp_path, fakes, damage, message):
    path = table.write_json(damage(table.winners_json(failing_frame())), tmp_path / "sm_90.json")
    with pytest.raises(TableError, match=message):
        Dispatcher.load(path, device=H200)


def test_a_winners_map_giving_one_key_twice_is_refused(tmp_path, fakes):
    import json

    document = table.winners_json(failing_frame())
    winners = document["devices"][0]["winners"]
    key = next(iter(winners))
    text = json.dumps(document).replace('"winners": {',
                                        '"winners": {' + json.dumps(key) + ": "
                                        + json.dumps(winners[key]) + ", ", 1)
    path = tmp_path / "sm_90.json"
    path.write_text(text)
    with pytest.raises(TableError, match="given twice in one object"):
        Dispatcher.load(path, device=H200)


@pytest.mark.parametrize(("field", "value"), [("arch", "zzz"), ("cu_count", -2),
                                              ("device_name", " ")])
def test_a_winners_map_checks_its_devices_as_a_table_does(tmp_path, fakes, field, value):
    document = table.winners_json(failing_frame())
    document["devices"][0][field] = value
    path = table.write_json(document, tmp_path / "sm_90.json")
    with pytest.raises(TableError, match=r"devices\[0\]: arch .* is not a device"):
        Dispatcher.load(path, device=H200)


# The hot path ----------------------------------------------------------------------

def test_repeated_selects_allocate_nothing_and_touch_no_files(table_path, fakes):
    dispatcher = Dispatcher.load(table_path, device=H200)
    problems = [b.with_(batch=batch, kv_len=kv) for b in BUCKETS for batch in (1, 8, 12, 300)
                for kv in (1024, 5000)]
    problems.append(MLAProblem(num_heads=3))  # law (a bucket never measured)
    first = [dispatcher.select(p) for p in problems]
    assert {c.source for c in first} == {"table", "nearest", "law"}

    def no_io(*args, **kwargs):
        raise AssertionError("select did I/O")

    # Patched only around the loop (pytest itself stats files when reporting).
    patched = [(builtins, "open"), (io, "open"), (os, "open"), (os, "stat")]
    saved = [getattr(target, name) for target, name in patched]
    def noop(problem):
        return problem

    def traced(call):
        """Bytes still held and the peak above the start, over many calls of ``call``."""
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in range(50):
            for p in problems:
                call(p)
        after, peak = tracemalloc.get_traced_memory()
        return after - before, peak - before

    tracemalloc.start()
    try:
        for target, name in patched:
            setattr(target, name, no_io)
        baseline = traced(noop)  # the loop's own iterators
        measured = traced(dispatcher.select)
    finally:
        for (target, name), original in zip(patched, saved, strict=True):
            setattr(target, name, original)
        tracemalloc.stop()
    assert measured == baseline and measured[0] == 0
    assert [dispatcher.select(p) for p in problems] == first


def test_explain_says_why(table_path, fakes):
    dispatcher = Dispatcher.load(table_path, device=H200)
    choice, notes = dispatcher.explain(BUCKETS[0].with_(batch=8, kv_len=1024))
    assert choice.source == "table" and notes[-1].startswith(f"measured: {choice.route_id}")
    choice, notes = dispatcher.explain(BUCKETS[0].with_(batch=12, kv_len=8192))
    assert choice.source == "nearest"
    assert any("picky/fake refuses" in n for n in notes)
    assert notes[-1].startswith("nearest measured point: batch=64 kv_len=1024")
    choice, notes = dispatcher.explain(MLAProblem(num_heads=3))
    assert choice.source == "law" and notes[-1].startswith("law:")


def test_nearest_redoes_the_neighbours_kv_splits_for_the_asked_problem(tmp_path):
    """A split-KV winner's recipe (tile, warps, variant) is kept from the neighbour, its
    device-filling split count is the asked problem's own."""
    padded = routes.get("padded/triton")
    there = MLAProblem(num_heads=16, batch=1, kv_len=65536)
    here = there.with_(batch=256, kv_len=32768)
    space_there, space_here = padded.param_space(there, H200), padded.param_space(here, H200)
    assert space_there[0]["num_splits"] != space_here[0]["num_splits"]  # else no test
    for won in (space_there[0], space_there[1]):
        frame = make_table([result_row(there, "padded/triton", 10.0, params=won)])
        dispatcher = Dispatcher.load(table.write(frame, tmp_path / "t.parquet"), device=H200)
        choice = dispatcher.select(here)
        assert choice.source == "nearest" and choice.route_id == "padded/triton"
        assert dict(choice.params) == space_here[space_there.index(won)]
        assert dispatcher.select(there).params == won  # measured: as measured
        explained, notes = dispatcher.explain(here)
        assert explained == choice
        assert any("redone" in n for n in notes) == (dict(choice.params) != won)


# Step costs: what the caller pays ---------------------------------------------------
class StepRoute(FakeRoute):
    """A fake route that declares a step kind."""

    def __init__(self, route_id, kind):
        super().__init__(route_id)
        self.kind = kind

    def step_kind(self, params):
        return self.kind


@pytest.fixture
def step_routes():
    made = [StepRoute("host/fake", routes.HOST_PLANNED),
            StepRoute("device/fake", routes.StepKind("device", True)),
            StepRoute("plain/fake", routes.LAUNCH_ONLY)]
    for route in made:
        routes.register(route)
    yield made
    for route in made:
        routes.unregister(route.id)


def _costed(problem, route, launch, plan_on, plan_us, plan_host_us):
    return {**result_row(problem, route, launch), "plan_on": plan_on,
            "capturable": plan_on != "host", "plan_us": plan_us, "plan_host_us": plan_host_us,
            "launch_host_us": 5.0}


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_steps_are_ranked_by_what_the_caller_pays(tmp_path, step_routes, fmt):
    """Eager callers pay a host plan; graph callers cannot run one; everyone pays the
    device plan. Launch times alone would pick host/fake at both problems."""
    cheap_host, dear_host = MLAProblem(batch=1), MLAProblem(batch=2)
    rows = [_costed(cheap_host, "host/fake", 10.0, "host", 0.0, 4.0),
            _costed(cheap_host, "device/fake", 12.0, "device", 9.0, 6.0),
            _costed(cheap_host, "plain/fake", 20.0, "none", 0.0, 0.0),
            _costed(dear_host, "host/fake", 10.0, "host", 0.0, 50.0),
            _costed(dear_host, "device/fake", 12.0, "device", 3.0, 6.0),
            _costed(dear_host, "plain/fake", 20.0, "none", 0.0, 0.0)]
    frame = make_table(rows)
    path = table.write(frame, tmp_path / "sm_90.parquet") if fmt == "parquet" else \
        table.write_json(table.winners_json(frame), tmp_path / "sm_90.json")
    # Each call plans (plan_calls=1): the whole device plan is charged to it.
    eager = Dispatcher.load(path, device=H200, plan_calls=1)
    graphs = Dispatcher.load(path, device=H200, capturable=True, plan_calls=1)
    assert eager.select(cheap_host).route_id == "host/fake"  # 10 + 4 < 12 + 9 < 20
    assert eager.select(dear_host).route_id == "device/fake"  # 12 + 3 < 20 < 10 + 50
    assert eager.select(dear_host).time_us == pytest.approx(15.0)
    assert graphs.select(cheap_host).route_id == "plain/fake"  # 20 < 12 + 9; host: none
    assert graphs.select(dear_host).route_id == "device/fake"
    # Nearest answers come from capturable winners too, and the rule skips host plans.
    assert graphs.select(MLAProblem(batch=1, kv_len=2048)).route_id == "plain/fake"
    assert "host/fake" not in [r.id for r in graphs._rule_order]
    assert "host/fake" in [r.id for r in eager._rule_order]


def test_a_converted_table_ranks_by_launch_time(tmp_path, step_routes):
    """Costs a v1 table never measured count as nothing: its winners stay its winners."""
    problem = MLAProblem(batch=4)
    rows = [_costed(problem, "device/fake", 10.0, "device", math.nan, math.nan),
            _costed(problem, "plain/fake", 11.0, "none", math.nan, math.nan)]
    path = table.write(make_table(rows), tmp_path / "sm_90.parquet")
    assert Dispatcher.load(path, device=H200).select(problem).route_id == "device/fake"


# A user table overlays the bundled one, problem by problem ----------------------------
def test_a_user_table_overlays_the_bundled_one_problem_by_problem(tmp_path, monkeypatch,
                                                                   fakes):
    fast_small, fast_large = "fast-small/fake", "fast-large/fake"
    shared, only_bundled, only_user = (MLAProblem(batch=b, kv_len=1024) for b in (4, 16, 64))
    bundled_dir = tmp_path / "bundled"
    bundled_dir.mkdir()
    table.write(make_table([result_row(shared, fast_small, 10.0),
                            result_row(shared, fast_large, 12.0),
                            result_row(only_bundled, fast_small, 20.0)]),
                bundled_dir / "sm_90-h200.parquet")
    user = table.write(make_table([result_row(shared, fast_large, 11.0),
                                   result_row(only_user, fast_large, 30.0)]),
                       tmp_path / "mine.parquet")
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: bundled_dir)
    monkeypatch.delenv(dispatch_module.TABLE_ENV, raising=False)
    monkeypatch.setenv(dispatch_module.USER_TABLE_ENV, str(user))
    overlaid = Dispatcher.from_bundled(H200)
    assert overlaid.source.endswith("sm_90-h200.parquet + " + str(user))
    # The user's rows replace the bundled ones of the problem they hold (fast_small's
    # 10 us row there is gone), the rest stays, and the user's new problem is measured.
    assert (overlaid.select(shared).route_id, overlaid.select(shared).time_us) == \
        (fast_large, 11.0)
    assert overlaid.select(only_bundled).route_id == fast_small
    assert overlaid.select(only_user).source == "table"
    monkeypatch.setenv(dispatch_module.USER_TABLE_ENV, str(tmp_path / "missing.parquet"))
    assert Dispatcher.from_bundled(H200).select(shared).route_id == fast_small


H100 = DeviceInfo("sm_90", "NVIDIA H100 80GB HBM3", "nvidia", 132, 80 * 2**30, 0)
H800 = DeviceInfo("sm_90", "NVIDIA H800", "nvidia", 132, 80 * 2**30, 0)


def _bundled_h100_and_user(tmp_path, monkeypatch, user_device):
    """A bundled directory holding only an H100 table (two problems) and a user table of
    ``user_device`` holding the first problem and a third; the three problems."""
    fast_small, fast_large = "fast-small/fake", "fast-large/fake"
    shared, only_bundled, only_user = (MLAProblem(batch=b, kv_len=1024) for b in (4, 16, 64))
    bundled_dir = tmp_path / "bundled"
    bundled_dir.mkdir()
    table.write(make_table([result_row(shared, fast_small, 10.0, device=H100),
                            result_row(only_bundled, fast_small, 20.0, device=H100)]),
                bundled_dir / "sm_90-h100.parquet")
    user = table.write(make_table([result_row(shared, fast_large, 11.0, device=user_device),
                                   result_row(only_user, fast_large, 30.0,
                                              device=user_device)]),
                       tmp_path / "mine.parquet")
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: bundled_dir)
    monkeypatch.delenv(dispatch_module.TABLE_ENV, raising=False)
    monkeypatch.setenv(dispatch_module.USER_TABLE_ENV, str(user))
    return shared, only_bundled, only_user


def test_a_user_table_of_this_gpu_overlays_a_table_of_another_model(tmp_path, monkeypatch,
                                                                    fakes):
    """On a GPU no table ships for, the user's own rows overlay the nearest model's table
    problem by problem: they neither hide its other problems nor are hidden by them."""
    shared, only_bundled, only_user = _bundled_h100_and_user(tmp_path, monkeypatch, H800)
    served = Dispatcher.from_bundled(H800)
    assert served.table_device[1] == H100.name
    assert (served.select(shared).route_id, served.select(shared).time_us) == \
        ("fast-large/fake", 11.0)
    assert (served.select(only_bundled).route_id, served.select(only_bundled).source) == \
        ("fast-small/fake", "table")
    assert (served.select(only_user).route_id, served.select(only_user).source) == \
        ("fast-large/fake", "table")


def test_a_user_table_of_another_gpu_is_left_out_with_a_warning(tmp_path, monkeypatch, fakes,
                                                                caplog):
    """Rows the user measured on another GPU model do not time this one: the bundled table
    serves alone and a warning says which rows were left out."""
    shared, _, only_user = _bundled_h100_and_user(tmp_path, monkeypatch, H200)
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        served = Dispatcher.from_bundled(H100)
    assert served.select(shared).route_id == "fast-small/fake"
    assert served.select(only_user).source != "table"
    assert "rows of NVIDIA H200 (132) are not overlaid" in caplog.text


def test_a_refused_bundled_table_leaves_the_user_table_serving(tmp_path, monkeypatch, fakes,
                                                               caplog):
    """MLATUNE_OTHER_GPU=refuse refuses the other model's bundled table; the user's own
    table of this GPU still serves (not the rules)."""
    _, only_bundled, only_user = _bundled_h100_and_user(tmp_path, monkeypatch, H800)
    monkeypatch.setenv("MLATUNE_OTHER_GPU", "refuse")
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        served = Dispatcher.from_bundled(H800)
    assert (served.select(only_user).route_id, served.select(only_user).source) == \
        ("fast-large/fake", "table")
    assert served.select(only_bundled).source != "table"
    assert "the user table serves alone" in caplog.text


def _served_over_a_damaged_user_table(tmp_path, monkeypatch, caplog, bundled_rows):
    """``from_bundled`` with a damaged MLATUNE_USER_TABLE over a bundled directory holding
    an sm_90-h200 table of ``bundled_rows`` (none: no table ships); the dispatcher and
    the warnings logged."""
    bundled_dir = tmp_path / "bundled"
    bundled_dir.mkdir()
    if bundled_rows:
        table.write(make_table(bundled_rows), bundled_dir / "sm_90-h200.parquet")
    damaged = tmp_path / "mine.parquet"
    damaged.write_bytes(b"PAR1 not a table")
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: bundled_dir)
    monkeypatch.delenv(dispatch_module.TABLE_ENV, raising=False)
    monkeypatch.setenv(dispatch_module.USER_TABLE_ENV, str(damaged))
    with caplog.at_level("WARNING", logger="mlatune"):
        served = Dispatcher.from_bundled(H200)
    return served, f"{damaged}", " ".join(r.getMessage() for r in caplog.records)


def test_a_damaged_user_table_leaves_the_bundled_one_serving(tmp_path, monkeypatch, fakes,
                                                              caplog):
    """A user table that cannot be used is left out, the warning naming it; the bundled
    table still answers (not the rules)."""
    problem = MLAProblem(batch=4, kv_len=1024)
    served, damaged, warned = _served_over_a_damaged_user_table(
        tmp_path, monkeypatch, caplog, [result_row(problem, "fast-large/fake", 10.0)])
    assert (served.select(problem).route_id, served.select(problem).source) == \
        ("fast-large/fake", "table")
    assert served.source.endswith("sm_90-h200.parquet")
    assert f"MLATUNE_USER_TABLE={damaged} not overlaid" in warned
    assert "bundled table unusable" not in warned


def test_a_damaged_user_table_where_no_table_ships_is_named_and_the_rules_serve(
        tmp_path, monkeypatch, fakes, caplog):
    """No table ships for the GPU, so the user table would serve alone: damaged, the
    warning names it (not the bundled table), and the rules answer."""
    served, damaged, warned = _served_over_a_damaged_user_table(tmp_path, monkeypatch,
                                                                caplog, [])
    assert served.select(MLAProblem(batch=4)).source == "rule"
    assert f"MLATUNE_USER_TABLE={damaged} unusable, dispatching by rule" in warned
    assert "bundled table" not in warned


def test_a_json_map_takes_no_overlay(tmp_path, fakes):
    problem = MLAProblem(batch=4)
    frame = make_table([result_row(problem, "fast-small/fake", 10.0)])
    path = table.write_json(table.winners_json(frame), tmp_path / "sm_90.json")
    user = table.write(frame, tmp_path / "mine.parquet")
    with pytest.raises(TableError, match="takes no overlay"):
        Dispatcher.load(path, device=H200, overlay=user)


@pytest.mark.parametrize(("options", "message"), [
    ({"unmeasured": "bogus"}, r"^unmeasured must be one of"),
    ({"plan_calls": 0}, r"^plan_calls must be an int >= 1"),
    ({"plan_calls": -1}, r"^plan_calls must be an int >= 1"),
    ({"plan_calls": 2.5}, r"^plan_calls must be an int >= 1"),
])
def test_bad_dispatcher_options_are_named_not_blamed_on_the_table(options, message):
    with pytest.raises(ValueError, match=message) as raised:
        Dispatcher.load(Path(__file__).parents[1] / "tables" / "sm_90-h200.parquet",
                        device=H200, **options)
    assert not isinstance(raised.value, TableError)
    with pytest.raises(ValueError, match=message):
        Dispatcher(H200, **options)


@pytest.mark.parametrize("plan_calls", [0, -5, "61", 2.5, True])
def test_from_bundled_refuses_bad_plan_calls_where_no_table_ships(plan_calls, monkeypatch,
                                                                   tmp_path):
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: tmp_path)  # none ships
    monkeypatch.delenv(dispatch_module.TABLE_ENV, raising=False)
    with pytest.raises(ValueError, match=r"^plan_calls must be an int >= 1"):
        Dispatcher.from_bundled(H200, plan_calls=plan_calls)


def test_from_bundled_keeps_plan_calls_where_the_rules_serve(monkeypatch, tmp_path):
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: tmp_path)
    monkeypatch.delenv(dispatch_module.TABLE_ENV, raising=False)
    served = Dispatcher.from_bundled(H200, plan_calls=7)
    assert (served.source, served.plan_calls) == ("", 7)


@pytest.mark.parametrize("thing", [{"num_heads": 16}, None, "decode", 16])
def test_select_names_what_it_takes(thing):
    with pytest.raises(TypeError, match=r"^select takes an MLAProblem, got "):
        Dispatcher.rules_only(H200).select(thing)
