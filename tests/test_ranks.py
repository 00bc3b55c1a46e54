"""One pick on every rank (issue 40 item 4): a dispatcher loaded with a process group refuses
ranks whose tables or GPU models differ, and first sight picks the same route on every rank
however their local timings disagree. Two CPU processes with gloo; without a group nothing
collective runs."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mlatune import attention, routes, table
from mlatune.arch import cpu_device
from mlatune.check.inputs import make_decode_inputs
from mlatune.dispatch import Dispatcher, first_sight, ranks
from mlatune.measure import timers
from mlatune.problem import MLAProblem
from tests import processes
from tests.table_helpers import FakeRoute, make_table, result_row

BASE = MLAProblem(num_heads=2, page_size=8, q_dtype="fp16", kv_dtype="fp16")
FAR = BASE.with_(batch=48, kv_len=256)  # past the table's grid: an unsure prediction
ROUTE_IDS = ("slow/fake", "quick/fake", "third/fake")
# Each rank's own timings (us). Alone, rank 0 picks slow/fake and rank 1 quick/fake; at each
# route's slowest rank (40, 30, 25 us) third/fake is the fastest.
LOCAL_US = ({"slow/fake": 10.0, "quick/fake": 30.0, "third/fake": 20.0},
            {"slow/fake": 40.0, "quick/fake": 15.0, "third/fake": 25.0})
_LAST_RUN = [""]  # the route whose step ran last: what the fake timer times


class MarkedRoute(FakeRoute):
    """Right (the reference's output), and says that it ran."""

    def prepare(self, problem, inputs, *, rank=0, params=None, want_lse=True):
        prepared = super().prepare(problem, inputs, rank=rank, params=params,
                                   want_lse=want_lse)
        inner = prepared.run

        def run() -> None:
            _LAST_RUN[0] = self.id
            inner()

        prepared.run = run
        return prepared


def _register() -> list[str]:
    for route_id in ROUTE_IDS:
        routes.register(MarkedRoute(route_id))
    return list(ROUTE_IDS)


def _time_as(rank: int):
    """A stand-in for timers.measure: the step runs once, and takes this rank's time."""
    def measure(run, device, budget=None, graph_safe=True, best_us=None):
        run()
        return SimpleNamespace(median_us=LOCAL_US[rank][_LAST_RUN[0]])
    return measure


def _write_table(path: Path, slow_us: float = 1.0) -> Path:
    """slow/fake wins every measured (tiny) point by its recorded times."""
    rows = []
    for b in (1, 2, 3, 4):
        for k in (16, 24, 32):
            p = BASE.with_(batch=b, kv_len=k)
            rows += [result_row(p, "slow/fake", slow_us, device=cpu_device()),
                     result_row(p, "third/fake", 1.2, device=cpu_device()),
                     result_row(p, "quick/fake", 1.5, device=cpu_device())]
    return table.write(make_table(rows), path)


def _decode(dispatcher: Dispatcher, problem: MLAProblem = FAR) -> None:
    inputs = make_decode_inputs(problem, seed=2)
    shard = inputs.shards[0]
    attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                     num_heads=problem.num_heads, max_kv_len=problem.kv_len,
                     dispatcher=dispatcher)


def _error_of(call) -> str:
    try:
        call()
    except Exception as exc:  # reported to the test, which checks its type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# --- the ranks (separate processes) ------------------------------------------------
def _rank(rank: int, worker: str, tmp: str, backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    try:
        result = globals()[worker](rank, Path(tmp))
    except Exception as exc:  # reported to the test, which fails with it
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.destroy_process_group()
    Path(tmp, f"rank-{rank}.json").write_text(json.dumps(result))


def _spawn(worker: str, tmp_path: Path, backend: str = "gloo") -> list[dict]:
    processes.spawn("tests.test_ranks:_rank", (worker, str(tmp_path), backend), 2)
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert not [r["error"] for r in results if "error" in r]
    return results


def _disagreeing_timings(rank: int, tmp: Path) -> dict:
    """First sight alone and across the group, then a reload of what it recorded."""
    _register()
    timers.measure = _time_as(rank)
    path = _write_table(tmp / f"table-{rank}.parquet")  # the same bytes, each rank's own file
    alone = Dispatcher.load(path, device=cpu_device(), first_sight=tmp / f"alone-{rank}.parquet")
    _decode(alone)
    user = tmp / f"user-{rank}.parquet"
    together = Dispatcher.load(path, device=cpu_device(), first_sight=user,
                               group=dist.group.WORLD)
    guess = together.select(FAR)
    _decode(together)
    picked = together.select(FAR)
    reloaded = Dispatcher.load(path, device=cpu_device(), overlay=user, group=dist.group.WORLD)
    return {"guess": [guess.route_id, guess.source], "alone": alone.select(FAR).route_id,
            "picked": [picked.route_id, dict(picked.params), picked.source, picked.time_us],
            "user_sha256": hashlib.sha256(user.read_bytes()).hexdigest(),
            "recorded": sorted(zip(*(table.read(user)[c] for c in ("route", "time_us")),
                                   strict=True)),
            "reloaded": [reloaded.select(FAR).route_id, reloaded.select(FAR).source]}


def _mismatches(rank: int, tmp: Path) -> dict:
    """What each rank says when the group's tables, GPU models or problems differ."""
    _register()
    world = dist.group.WORLD
    own = _write_table(tmp / f"own-{rank}.parquet", slow_us=1.0 + rank)
    same = _write_table(tmp / f"same-{rank}.parquet")
    other_gpu = cpu_device() if rank == 0 else replace(cpu_device(), name="another model")
    missing = same if rank == 0 else tmp / "nowhere.parquet"
    os.environ.pop("MLATUNE_TABLE", None)
    if rank == 0:  # rank 1 finds no bundled table for the CPU: rules only
        os.environ["MLATUNE_TABLE"] = str(same)
    errors = {
        "table": _error_of(lambda: Dispatcher.load(own, device=cpu_device(), group=world)),
        "gpu": _error_of(lambda: Dispatcher.load(same, device=other_gpu, group=world)),
        "missing": _error_of(lambda: Dispatcher.load(missing, device=cpu_device(),
                                                     group=world)),
        "bundled": _error_of(lambda: Dispatcher.from_bundled(cpu_device(), group=world)),
    }
    # An engine's backend: its tensor-parallel group (vLLM's and SGLang's coordinator).
    from mlatune.integrations.core import MLADecoder, rank_group
    from tests.test_integration_core import _model

    # A vendor library that imports on rank 0 and is broken on rank 1: its route would
    # refuse there every problem rank 0 serves with it.
    broken = MarkedRoute("vendor/fake")
    broken.unusable = lambda device: "FakeLib is not usable (ImportError: libfake.so)" \
        if rank == 1 else None
    routes.register(broken)
    errors["vendor"] = _error_of(lambda: Dispatcher.load(same, device=cpu_device(),
                                                         group=world))
    routes.unregister(broken.id)
    # A setting that cannot load on one rank: the other raises too, rather than wait for it
    # in the collective until the group's timeout.
    if rank == 1:
        os.environ["MLATUNE_ACCURACY"] = "bogus"
    errors["setting"] = _error_of(lambda: Dispatcher.load(same, device=cpu_device(),
                                                          group=world))
    os.environ.pop("MLATUNE_ACCURACY", None)
    interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = str(1 - rank)  # rank 1 could not run the Triton routes
    errors["settings"] = _error_of(lambda: Dispatcher.load(same, device=cpu_device(),
                                                           group=world))
    os.environ.pop("TRITON_INTERPRET")
    if interpret is not None:
        os.environ["TRITON_INTERPRET"] = interpret
    os.environ["MLATUNE_TABLE"] = str(own)
    coordinator = SimpleNamespace(cpu_group=world, world_size=2)
    errors["engine"] = _error_of(lambda: MLADecoder.load(_model(), device="cpu",
                                                         group=rank_group(coordinator)))
    os.environ.pop("MLATUNE_TABLE", None)
    sighted = Dispatcher.load(same, device=cpu_device(), first_sight=tmp / f"u-{rank}.parquet",
                              group=world)
    problem = FAR if rank == 0 else FAR.with_(batch=40)  # both unsure, not the same
    errors["first_sight"] = _error_of(lambda: _decode(sighted, problem))
    return errors


def _tuning_ranks(rank: int, tmp: Path) -> dict:
    """Both ranks tune into one user table with their group, then load with it: the first
    rank tunes, the other waits, and their loads read the same bytes."""
    from mlatune.sweep.at_load import ServingShapes, TuneOptions, tune_at_load

    user = tmp / "user.parquet"
    os.environ["MLATUNE_USER_TABLE"] = str(user)
    os.environ.pop("MLATUNE_TABLE", None)
    shapes = ServingShapes(batches=(1, 2), num_heads=2, context=(8, 16), kv_points=2,
                           q_dtype="fp16", kv_dtype="fp16", page_size=8)
    report = tune_at_load(shapes, lambda: Dispatcher.from_bundled(cpu_device()), budget_s=60,
                          progress=False, group=dist.group.WORLD,
                          options=TuneOptions(routes=("reference/torch",),
                                              max_params_per_route=1))
    loaded = Dispatcher.from_bundled(cpu_device(), group=dist.group.WORLD)
    return {"tuned": len(report.tuned), "stopped": report.error or None,
            "served": sorted({loaded.select(p).source for p in shapes.problems()})}


def _over_nccl(rank: int, tmp: Path) -> dict:
    """First sight over the bundled table on this rank's GPU, each rank's timings in the
    order its candidates are timed disagreeing as LOCAL_US's do."""
    local = iter(LOCAL_US[rank].values())  # rank 0: 10, 30, 20 us; rank 1: 40, 15, 25 us

    def measure(run, *args, **kwargs):
        run()
        return SimpleNamespace(median_us=next(local))

    timers.measure = measure
    os.environ["MLATUNE_FIRST_SIGHT"] = str(tmp / f"user-{rank}.parquet")
    dispatcher = Dispatcher.from_bundled(group=dist.group.WORLD)
    shapes = [MLAProblem(num_heads=h, batch=b, kv_len=k, q_dtype="bf16", kv_dtype="bf16",
                         page_size=64) for h in (16, 128) for k in (20, 7, 50, 300_000)
              for b in (1, 3)]  # short ones are predicted unsurely from the shipped table
    problem = next(p for p in shapes if first_sight.unsure(dispatcher.select(p))
                   and len(dispatcher.predicted_choices(p, first_sight.CANDIDATES)) > 1)
    inputs = make_decode_inputs(problem, seed=2, device="cuda")
    shard = inputs.shards[0]
    attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                     num_heads=problem.num_heads, max_kv_len=problem.kv_len,
                     dispatcher=dispatcher)
    picked = dispatcher.select(problem)
    rows = table.read(tmp / f"user-{rank}.parquet")
    return {"picked": [picked.route_id, dict(picked.params), picked.source, picked.time_us],
            "recorded": sorted(rows["time_us"].tolist())}


# --- the tests -----------------------------------------------------------------------
def test_ranks_whose_timings_disagree_pick_the_same_route(tmp_path):
    results = _spawn("_disagreeing_timings", tmp_path)
    for result in results:
        assert result["guess"][0] == "slow/fake" and result["guess"][1] == "predicted"
    # Alone, each rank's own timings pick differently ...
    assert [r["alone"] for r in results] == ["slow/fake", "quick/fake"]
    # ... across the group every rank picks the fastest at the slowest rank's times.
    for result in results:
        assert result["picked"] == ["third/fake", {}, "table", 25.0]
        assert result["recorded"] == [["quick/fake", 30.0], ["slow/fake", 40.0],
                                      ["third/fake", 25.0]]
        assert result["reloaded"] == ["third/fake", "table"]
    # Both ranks wrote the same bytes, so the next load with the group accepts them.
    assert results[0]["user_sha256"] == results[1]["user_sha256"]


def test_ranks_that_differ_are_refused_on_every_rank(tmp_path):
    results = _spawn("_mismatches", tmp_path)
    assert results[0] == results[1]  # every rank raises, naming every rank's value
    errors = results[0]
    found = re.fullmatch(r"RankMismatchError: the ranks of the process group differ in their "
                         r"tables \(rank 0: sha256 (\w{16}) \(.*own-0\.parquet\); rank 1: "
                         r"sha256 (\w{16}) \(.*own-1\.parquet\)\): load the same table file "
                         r"on every rank", errors["table"])
    assert found and found[1] != found[2], errors["table"]
    assert re.match(r"RankMismatchError: .* differ in their route settings \(rank 0: .*"
                    r"\"TRITON_INTERPRET\": \"1\".*; rank 1: .*\"TRITON_INTERPRET\": \"0\"",
                    errors["settings"]), errors["settings"]
    assert re.match(r"RankMismatchError: .* differ in their routes \(rank 0: .*vendor/fake.*"
                    r"; rank 1: .*; vendor/fake unusable: FakeLib is not usable "
                    r"\(ImportError: libfake.so\)\): every rank must register the same routes, "
                    r"each usable alike", errors["vendor"]), errors["vendor"]
    assert errors["vendor"].count("vendor/fake unusable") == 1  # rank 0's could run it
    assert re.match(r"RankMismatchError: .* differ in their settings \(rank 0: loaded; rank 1: "
                    r".*bogus.*\): every rank's load settings", errors["setting"]), \
        errors["setting"]
    assert errors["engine"].startswith("RankMismatchError: the ranks of the process group "
                                       "differ in their tables"), errors["engine"]
    assert re.match(r"RankMismatchError: .* differ in their GPU models \(rank 0: cpu .*; "
                    r"rank 1: cpu another model, \d+ cores?\)", errors["gpu"]), errors["gpu"]
    # A rank that cannot read its table, or has none, refuses the group rather than hang it.
    assert re.match(r"RankMismatchError: .* tables \(rank 0: sha256 \w{16} \(.*\); rank 1: "
                    r"unreadable \(FileNotFoundError\)", errors["missing"]), errors["missing"]
    assert re.match(r"RankMismatchError: .* tables \(rank 0: sha256 \w{16} \(.*\); rank 1: "
                    r"no table\)", errors["bundled"]), errors["bundled"]
    assert re.match(r"RankMismatchError: .* first-sight candidates \(rank 0: .*batch=48.*; "
                    r"rank 1: .*batch=40.*\): ranks must meet the same problems in the same "
                    r"order", errors["first_sight"]), errors["first_sight"]


def test_ranks_tuning_at_load_into_one_user_table_then_load_it_together(tmp_path):
    results = _spawn("_tuning_ranks", tmp_path)
    assert results[0] == results[1]
    assert results[0]["tuned"] == 4 and results[0]["served"] == ["table"]


@pytest.fixture
def marked():
    made = _register()
    yield made
    for route_id in made:
        routes.unregister(route_id)


def test_without_a_group_nothing_collective_runs(tmp_path, monkeypatch, marked):
    def collective(*args, **kwargs):
        raise AssertionError("a collective without a group")

    monkeypatch.setattr(dist, "all_gather_object", collective)
    monkeypatch.setattr(timers, "measure", _time_as(1))
    dispatcher = Dispatcher.load(_write_table(tmp_path / "t.parquet"), device=cpu_device(),
                                 first_sight=tmp_path / "mine.parquet")
    assert dispatcher.group is None
    _decode(dispatcher)
    picked = dispatcher.select(FAR)  # this rank's own timings decide
    assert (picked.route_id, picked.source, picked.time_us) == ("quick/fake", "table", 15.0)
    assert Dispatcher.from_bundled(cpu_device()).group is None
    timed = [(1.0, dispatcher.select(FAR), {})]
    assert ranks.agree_on_timings(None, FAR, [], timed, None) == (timed, None)


@pytest.mark.gpu
def test_ranks_on_two_gpus_pick_the_same_route_over_nccl(tmp_path):
    if torch.cuda.device_count() < 2:  # fail, not skip: -m gpu without two GPUs is no pass
        pytest.fail("this test needs two GPUs: run it on a two-GPU device machine")
    results = _spawn("_over_nccl", tmp_path, backend="nccl")
    assert results[0]["picked"] == results[1]["picked"]
    # The candidates timed, each at its slower rank's time: 40, 30 and 25 us (or the first two).
    recorded = results[0]["recorded"]
    assert recorded in ([25.0, 30.0, 40.0], [30.0, 40.0]) and results[1]["recorded"] == recorded
    assert results[0]["picked"][2:] == ["table", recorded[0]]
