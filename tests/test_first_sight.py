"""On first sight (issue 16 item 4): an unsure answer is timed at run time among the
predicted routes, remembered, and written to the user table that overlays the bundled."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from mlatune import attention, routes, table
from mlatune.arch import cpu_device
from mlatune.check import reference
from mlatune.check.accuracy import Rounding, check
from mlatune.check.inputs import make_decode_inputs
from mlatune.dispatch import Dispatcher, first_sight
from mlatune.problem import MLAProblem
from tests.table_helpers import FakeRoute, make_table, result_row

BASE = MLAProblem(num_heads=2, page_size=8, q_dtype="fp16", kv_dtype="fp16")
FAR = BASE.with_(batch=48, kv_len=256)  # 3-4 doublings past the grid: an unsure prediction


class SlowRoute(FakeRoute):
    """Right, and slower than it says: every call sleeps first."""

    def prepare(self, problem, inputs, *, rank=0, params=None, want_lse=True):
        prepared = super().prepare(problem, inputs, rank=rank, params=params,
                                   want_lse=want_lse)
        inner = prepared.run

        def run() -> None:
            time.sleep(0.2)  # far beyond the noise of timing the reference on a busy CPU
            inner()

        prepared.run = run
        return prepared


class ScaledRoute(FakeRoute):
    """Fast, its output scaled by ``factor`` after the run."""

    factor = 2.0  # wrong

    def prepare(self, problem, inputs, *, rank=0, params=None, want_lse=True):
        prepared = super().prepare(problem, inputs, rank=rank, params=params,
                                   want_lse=want_lse)
        inner = prepared.run

        def run() -> None:
            inner()
            prepared.out.mul_(self.factor)

        prepared.run = run
        return prepared


class RoundingRoute(ScaledRoute):
    """Off by what rounding P to fp8 costs (2%), which it declares."""

    factor = 1.02

    def rounding(self, problem, params) -> Rounding:
        return Rounding.P_FP8


@pytest.fixture
def made():
    made = [SlowRoute("slow/fake"), FakeRoute("quick/fake"), ScaledRoute("wrong/fake"),
            RoundingRoute("rounding/fake")]
    for route in made:
        routes.register(route)
    yield made
    for route in made:
        routes.unregister(route.id)


def _table(tmp_path, with_wrong: bool = False, third: str = "wrong/fake"):
    """The slow route wins every measured (tiny) point by its recorded times (``third``,
    with ``with_wrong``, comes second)."""
    rows = []
    for b in (1, 2, 3, 4):
        for k in (16, 24, 32):
            p = BASE.with_(batch=b, kv_len=k)
            rows += [result_row(p, "slow/fake", 1.0, device=cpu_device()),
                     result_row(p, "quick/fake", 1.5, device=cpu_device())]
            if with_wrong:
                rows.append(result_row(p, third, 1.2, device=cpu_device()))
    return table.write(make_table(rows), tmp_path / "cpu.parquet")


def _decode(dispatcher, seed: int = 2):
    inputs = make_decode_inputs(FAR, seed=seed)
    shard = inputs.shards[0]
    out = attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                           num_heads=FAR.num_heads, max_kv_len=FAR.kv_len,
                           dispatcher=dispatcher)
    return inputs, out


def test_an_unsure_answer_is_timed_remembered_and_written_to_the_user_table(tmp_path,
                                                                            made):
    user = tmp_path / "mine.parquet"
    dispatcher = Dispatcher.load(_table(tmp_path), device=cpu_device(), first_sight=user)
    guess = dispatcher.select(FAR)
    assert guess.route_id == "slow/fake" and first_sight.unsure(guess)
    inputs, out = _decode(dispatcher)
    assert check(FAR, out, reference.run(inputs, torch.float64)[0]).ok
    measured = dispatcher.select(FAR)  # timed here: the quick route, remembered
    assert (measured.route_id, measured.source) == ("quick/fake", "table")
    rows = table.read(user)
    assert set(rows["route"]) == {"slow/fake", "quick/fake"}
    assert (rows["status"] == "ok").all() and set(rows["batch"]) == {FAR.batch}
    # The next load, with the user table overlaid, answers from the measurement.
    later = Dispatcher.load(_table(tmp_path), device=cpu_device(), overlay=user)
    assert (later.select(FAR).route_id, later.select(FAR).source) == ("quick/fake", "table")


@pytest.mark.parametrize("where", ["under a file", "damaged", "no pandas"])
def test_a_user_table_it_cannot_write_leaves_the_step_served(tmp_path, made, where, caplog,
                                                            monkeypatch):
    """Recording the pick is first sight's bookkeeping: a path it cannot write, or a damaged
    file there, is one warning naming MLATUNE_FIRST_SIGHT; decode serves and the pick is
    remembered for this process."""
    (tmp_path / "afile").write_text("")
    user = tmp_path / "afile" / "mine.parquet"
    if where == "damaged":
        user = tmp_path / "mine.parquet"
        user.write_bytes(b"PAR1 not a table")
    dispatcher = Dispatcher.load(_table(tmp_path), device=cpu_device(), first_sight=user)
    if where == "no pandas":  # the runtime install: building the rows imports pandas
        user = tmp_path / "mine.parquet"
        dispatcher.first_sight = user

        def no_pandas(*args, **kwargs):
            raise ModuleNotFoundError("No module named 'pandas'")

        monkeypatch.setattr(first_sight.table, "build", no_pandas)
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        inputs, out = _decode(dispatcher)
    assert check(FAR, out, reference.run(inputs, torch.float64)[0]).ok
    assert dispatcher.select(FAR).route_id == "quick/fake"
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"MLATUNE_FIRST_SIGHT={user}: cannot record the pick" in warning


def test_a_candidate_that_disagrees_with_the_answer_is_dropped(tmp_path, made):
    user = tmp_path / "mine.parquet"
    dispatcher = Dispatcher.load(_table(tmp_path, with_wrong=True), device=cpu_device(),
                                 first_sight=user)
    _decode(dispatcher)
    assert dispatcher.select(FAR).route_id == "quick/fake"
    assert "wrong/fake" not in set(table.read(user)["route"])


def test_a_candidate_off_by_its_declared_rounding_is_kept(tmp_path, made):
    """Beside a 16-bit answer, a route that declares P rounded to fp8 is held to that
    rounding's tolerance (2% off passes it, not fp16's), so it can win where the accuracy
    policy admits its class; the strict policy never times it."""
    for accuracy, timed in (("fp8-mma", True), ("strict", False)):
        user = tmp_path / f"mine-{accuracy}.parquet"
        dispatcher = Dispatcher.load(_table(tmp_path, with_wrong=True, third="rounding/fake"),
                                     device=cpu_device(), first_sight=user, accuracy=accuracy)
        _decode(dispatcher)
        assert ("rounding/fake" in set(table.read(user)["route"])) is timed, accuracy


def test_without_first_sight_nothing_is_timed(tmp_path, made):
    dispatcher = Dispatcher.load(_table(tmp_path), device=cpu_device())
    _decode(dispatcher)
    assert dispatcher.select(FAR).source == "predicted"
    assert not list(tmp_path.glob("mine*"))


def test_a_sure_answer_is_not_timed(tmp_path, made):
    user = tmp_path / "mine.parquet"
    dispatcher = Dispatcher.load(_table(tmp_path), device=cpu_device(), first_sight=user)
    near = BASE.with_(batch=3, kv_len=20)  # between grid points: a sure prediction
    assert not first_sight.unsure(dispatcher.select(near))
    inputs = make_decode_inputs(near, seed=1)
    shard = inputs.shards[0]
    attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                     num_heads=near.num_heads, max_kv_len=near.kv_len, dispatcher=dispatcher)
    assert not user.exists()


def test_first_sight_is_on_where_no_table_answers_the_device(tmp_path, monkeypatch):
    """Without a table for the device every answer is a rule's, which first sight would
    time: MLATUNE_FIRST_SIGHT is kept by the rules-only dispatcher, not dropped."""
    monkeypatch.delenv("MLATUNE_TABLE", raising=False)
    monkeypatch.delenv("MLATUNE_USER_TABLE", raising=False)
    monkeypatch.setenv("MLATUNE_FIRST_SIGHT", str(tmp_path / "mine.parquet"))
    dispatcher = Dispatcher.from_bundled(cpu_device())
    assert dispatcher.source == "" and dispatcher.first_sight == str(tmp_path / "mine.parquet")
    assert first_sight.enabled(dispatcher) and first_sight.unsure(dispatcher.select(FAR))
