"""One device plan per engine step, read by every attention layer (``reuse_plan``).

An engine's layers share the step's lengths and block table; only their q and cache
differ. The first layer's call plans; the others pass ``reuse_plan=True`` and launch
against that plan. Checked on the CPU (Triton interpreter, fp16/fp8) with the routes
that plan on the device: padded/triton's persistent schedule (DCP ranks too) and
segmented/triton's windows; and with FlashMLA's scheduler through its recording fake.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mlatune import attention, table
from mlatune.arch import DeviceInfo, cpu_device
from mlatune.check.accuracy import check
from mlatune.check.inputs import DecodeInputs, make_decode_inputs
from mlatune.dispatch import Dispatcher
from mlatune.errors import DecodeArgumentError
from mlatune.kernels import plan as plan_kernels
from mlatune.problem import MLAProblem
from mlatune.routes import flashmla
from tests.fake_vendors import FakeFlashMLA
from tests.helpers import expected_now
from tests.table_helpers import make_table, result_row
from tests.test_attention import _counting_makes, run_ranks

TILES = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
CASES = [
    ("padded/triton", {**TILES, "persistent": True},
     MLAProblem(num_heads=4, batch=3, kv_len=40, page_size=8, q_dtype="fp16",
                kv_dtype="fp16", dcp_size=2)),
    ("segmented/triton", {**TILES, "num_segments": 2},
     MLAProblem(num_heads=2, qlen=3, batch=2, kv_len=37, page_size=4,
                q_dtype="fp8_e4m3fn", kv_dtype="fp8_e4m3fn", dcp_size=2)),
]


def _dispatcher(problem, route_id, params, tmp_path, device=None) -> Dispatcher:
    device = device or cpu_device()
    rows = [result_row(problem, route_id, 1.0, device=device, params=params),
            result_row(problem, "reference/torch", 9.0, device=device)]
    return Dispatcher.load(table.write(make_table(rows), tmp_path / "t.parquet"), device=device)


def _write_lengths(inputs: DecodeInputs, lens: torch.Tensor) -> None:
    """New lengths in place, as an engine's next step writes them (every rank's share)."""
    p = inputs.problem
    inputs.seq_lens.copy_(lens)
    for shard in inputs.shards:
        shard.seq_lens.copy_(((lens - shard.rank + p.dcp_size - 1) // p.dcp_size).clamp(min=0))


def _layers(problem: MLAProblem, n: int) -> list[DecodeInputs]:
    """``n`` layers' inputs over one step's lengths and block tables (layer 0's): caches
    with pages for kv_len tokens per request, ragged lengths written in."""
    first = make_decode_inputs(problem, seed=3)
    layers = [first]
    for i in range(1, n):
        other = make_decode_inputs(problem, seed=3 + 17 * i)
        shards = tuple(replace(mine, block_table=theirs.block_table, seq_lens=theirs.seq_lens)
                       for mine, theirs in zip(other.shards, first.shards, strict=True))
        layers.append(replace(other, seq_lens=first.seq_lens, shards=shards))
    gen = torch.Generator().manual_seed(8)
    _write_lengths(first, torch.randint(problem.qlen, problem.kv_len + 1, (problem.batch,),
                                        generator=gen).to(torch.int32))
    return layers


def _step(layers: list[DecodeInputs], dispatcher) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One engine step: every layer on every rank, the first layer planning."""
    return [run_ranks(inputs, dispatcher, max_kv_len=inputs.problem.kv_len,
                      reuse_plan=i > 0) for i, inputs in enumerate(layers)]


def _assert_right(layers, results) -> None:
    for n, (inputs, (out, lse)) in enumerate(zip(layers, results, strict=True)):
        want_out, want_lse = expected_now(inputs)
        accuracy = check(inputs.problem, out, want_out, lse, want_lse)
        assert accuracy.ok, f"layer {n}: {accuracy.reason}"


@pytest.mark.parametrize(("route_id", "params", "problem"), CASES,
                         ids=[c[0] for c in CASES])
def test_layers_read_the_first_layers_plan_as_lengths_change(route_id, params, problem,
                                                              tmp_path):
    dispatcher = _dispatcher(problem, route_id, params, tmp_path)
    layers = _layers(problem, 3)
    _assert_right(layers, _step(layers, dispatcher))
    steps = list(attention.plans_of(dispatcher).values())
    assert {s.choice.route_id for s in steps} == {route_id}
    planners = [s for s in steps if s.planner is None]
    assert len(planners) == problem.dcp_size  # one per rank: layer 0's
    assert all(s.planner in planners for s in steps if s.planner is not None)
    assert all(s.prepared.plan_state is not None for s in steps)
    # The next step: shorter lengths written in place; layer 0 plans them for all.
    _write_lengths(layers[0], (layers[0].seq_lens // 2).clamp(min=problem.qlen))
    _assert_right(layers, _step(layers, dispatcher))


def _counting_plans(monkeypatch) -> list:
    """Record each launch of the persistent schedule's device plan."""
    calls = []
    made = plan_kernels.persistent_plan_launcher

    def counting(*args, **kwargs):
        launch = made(*args, **kwargs)

        def counted() -> None:
            calls.append(1)
            launch()
        return counted

    monkeypatch.setattr(plan_kernels, "persistent_plan_launcher", counting)
    return calls


def _with_fresh_q(layers: list[DecodeInputs]) -> list[DecodeInputs]:
    """The layers with q a new tensor each, as an eager model's activations are."""
    return [replace(inputs, q=inputs.q.clone()) for inputs in layers]


@pytest.mark.parametrize("fresh_q", [False, True], ids=["kept-q", "fresh-q"])
def test_the_plan_runs_once_per_step(fresh_q, monkeypatch, tmp_path):
    calls = _counting_plans(monkeypatch)
    route_id, params, problem = CASES[0]
    problem = replace(problem, dcp_size=1)
    dispatcher = _dispatcher(problem, route_id, params, tmp_path)
    layers = _layers(problem, 4)
    _step(_with_fresh_q(layers) if fresh_q else layers, dispatcher)
    for _ in range(2):
        first = len(calls)
        now = _with_fresh_q(layers) if fresh_q else layers
        _assert_right(now, _step(now, dispatcher))
        assert len(calls) - first == 1  # four layers, one plan


@pytest.mark.parametrize(("route_id", "params", "problem"), CASES,
                         ids=[c[0] for c in CASES])
def test_layers_with_a_fresh_q_each_step_are_made_once(route_id, params, problem,
                                                       monkeypatch, tmp_path):
    """An eager model's layers pass a new q every step: each step right, the later layers
    reading layer 0's plan; the steps are made (route chosen, tensors checked) in the first
    engine step only, and no more are kept after it."""
    dispatcher = _dispatcher(problem, route_id, params, tmp_path)
    made = _counting_makes(monkeypatch)
    layers = _layers(problem, 3)
    for _ in range(3):
        now = _with_fresh_q(layers)
        _assert_right(now, _step(now, dispatcher))
        _write_lengths(layers[0], (layers[0].seq_lens // 2).clamp(min=problem.qlen))
    assert len(made) == len(layers) * problem.dcp_size
    assert len(attention.plans_of(dispatcher)) == len(layers) * problem.dcp_size


def test_reuse_before_any_plan_says_what_to_do(tmp_path):
    route_id, params, problem = CASES[0]
    dispatcher = _dispatcher(problem, route_id, params, tmp_path)
    inputs = make_decode_inputs(problem, seed=1)
    shard = inputs.shards[0]
    with pytest.raises(DecodeArgumentError, match=r"^reuse_plan: .*reuse_plan=False in the "
                                                  r"step's first call"):
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=problem.num_heads, dcp_size=problem.dcp_size,
                         reuse_plan=True, dispatcher=dispatcher)


def test_flashmla_layers_share_its_scheduler(monkeypatch, tmp_path):
    fake = FakeFlashMLA().install(monkeypatch)
    flashmla.library.cache_clear()
    try:
        problem = MLAProblem(num_heads=4, batch=3, kv_len=150, page_size=64)
        h200 = DeviceInfo("sm_90", "NVIDIA H200", "nvidia", 132)
        dispatcher = _dispatcher(problem, "dense/flashmla", {}, tmp_path, device=h200)
        # On the CPU the fake runs; the dispatcher is told it is on an H200.
        layers = _layers(problem, 3)
        _assert_right(layers, _step(layers, dispatcher))
        before = fake.plans
        _assert_right(layers, _step(layers, dispatcher))
        assert fake.plans - before == 1
    finally:
        flashmla.library.cache_clear()


def test_the_dispatcher_charges_each_call_its_share_of_the_plan(tmp_path):
    problem = MLAProblem(num_heads=16, batch=64, kv_len=4096, page_size=64)
    rows = [result_row(problem, "dense/flashmla", 96.0), result_row(problem, "padded/triton",
                                                                     107.0)]
    rows[0].update(plan_on="device", plan_us=31.5, capturable=True)
    path = table.write(make_table(rows), tmp_path / "sm_90-h200.parquet")
    cpu = cpu_device()
    one = Dispatcher.load(path, device=cpu, allow_arch="sm_90", plan_calls=1)
    shared = Dispatcher.load(path, device=cpu, allow_arch="sm_90")  # the default: 61
    assert one.select(problem).route_id == "padded/triton"  # 96 + 31.5 > 107
    assert shared.select(problem).route_id == "dense/flashmla"  # 96 + 31.5 / 61 < 107


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInfer's recording fake installed (its calls in ``.calls``), the library cache
    cleared around the test."""
    from mlatune.routes import flashinfer
    from tests.fake_vendors import FakeFlashInfer

    fake = FakeFlashInfer().install(monkeypatch)
    flashinfer.library.cache_clear()
    yield fake
    flashinfer.library.cache_clear()


def _fa3_dispatcher(problem: MLAProblem, tmp_path) -> Dispatcher:
    h200 = DeviceInfo("sm_90", "NVIDIA H200", "nvidia", 132)
    return _dispatcher(problem, "fa3/flashinfer", {}, tmp_path, device=h200)


def _plans(fake) -> int:
    return sum(name == "plan" for name, _ in fake.calls)


def test_flashinfer_layers_share_the_planners_host_plan(fake_flashinfer, tmp_path):
    problem = MLAProblem(num_heads=4, qlen=2, batch=3, kv_len=40, page_size=16)
    dispatcher = _fa3_dispatcher(problem, tmp_path)
    layers = _layers(problem, 3)
    _assert_right(layers, _step(layers, dispatcher))
    plans = _plans(fake_flashinfer)
    _write_lengths(layers[0], (layers[0].seq_lens // 2).clamp(min=problem.qlen))
    _assert_right(layers, _step(layers, dispatcher))  # planned again by layer 0 alone
    assert _plans(fake_flashinfer) - plans == 1


@pytest.mark.parametrize("fresh_q", [False, True], ids=["kept-q", "fresh-q"])
def test_a_host_plan_follows_lengths_that_grow(fresh_q, fake_flashinfer, tmp_path):
    """FlashInfer's host plan, step after step as the lengths grow past page boundaries:
    made from each step's lengths by layer 0 (also where every layer's q is new each step and
    its step is prepared again from the last one), read by the other layers."""
    problem = MLAProblem(num_heads=4, qlen=1, batch=2, kv_len=64, page_size=16)
    dispatcher = _fa3_dispatcher(problem, tmp_path)
    layers = _layers(problem, 3)
    _write_lengths(layers[0], torch.tensor([5, 12], dtype=torch.int32))
    for _ in range(4):
        plans = _plans(fake_flashinfer)
        now = _with_fresh_q(layers) if fresh_q else layers
        _assert_right(now, _step(now, dispatcher))
        assert _plans(fake_flashinfer) - plans == 1
        _write_lengths(layers[0], layers[0].seq_lens + 13)


def test_a_shared_host_plan_is_charged_in_shares(tmp_path):
    problem = MLAProblem(num_heads=16, batch=64, kv_len=4096, page_size=64)
    rows = [result_row(problem, "fa3/flashinfer", 90.0)]
    rows[0].update(plan_on="host", plan_us=0.0, plan_host_us=1525.0, capturable=False)
    path = table.write(make_table(rows), tmp_path / "sm_90-h200.parquet")
    cpu = cpu_device()
    for calls in (1, 61):
        dispatcher = Dispatcher.load(path, device=cpu, allow_arch="sm_90", plan_calls=calls)
        assert dispatcher.select(problem).time_us == pytest.approx(90.0 + 1525.0 / calls)


def test_compiled_layers_share_the_plan_too(monkeypatch, tmp_path):
    """torch.compile(fullgraph=True) over two layers: the op carries reuse_plan."""
    calls = []
    made = plan_kernels.persistent_plan_launcher

    def counting(*args, **kwargs):
        launch = made(*args, **kwargs)

        def counted() -> None:
            calls.append(1)
            launch()
        return counted

    monkeypatch.setattr(plan_kernels, "persistent_plan_launcher", counting)
    route_id, params, problem = CASES[0]
    problem = replace(problem, dcp_size=1)
    dispatcher = _dispatcher(problem, route_id, params, tmp_path)
    layers = _layers(problem, 2)
    shard = layers[0].shards[0]

    bufs = [torch.empty(inputs.q.shape[0], problem.num_heads, problem.d_v,
                        dtype=inputs.q.dtype) for inputs in layers]  # the engine's own

    def model(q0, q1, kv0, kv1, block_table, seq_lens, out0, out1):
        for i, (q, kv, out) in enumerate(((q0, kv0, out0), (q1, kv1, out1))):
            attention.decode(q, kv, block_table, seq_lens, num_heads=problem.num_heads,
                             max_kv_len=problem.kv_len, out=out, reuse_plan=i > 0,
                             dispatcher=dispatcher)
        return out0 * 1.0, out1 * 1.0

    compiled = torch.compile(model, fullgraph=True)
    args = (layers[0].q, layers[1].q, shard.kv_cache, layers[1].shards[0].kv_cache,
            shard.block_table, shard.seq_lens, *bufs)
    compiled(*args)  # compiles, and prepares each layer's step (a prepare plans as well)
    for _ in range(2):  # then each step, shorter lengths each time, planned by layer 0 alone
        before = len(calls)
        outs = compiled(*args)
        assert len(calls) - before == 1
        for inputs, out in zip(layers, outs, strict=True):
            assert check(problem, out, expected_now(inputs)[0]).ok
        _write_lengths(layers[0], (layers[0].seq_lens // 2).clamp(min=problem.qlen))


def test_a_step_whose_plan_later_layers_read_outlives_the_cache_bound(monkeypatch, tmp_path):
    """The kept steps' bound (PLAN_LIMIT, PLAN_BYTES) drops the least recently used, never
    the step that planned for lengths later layers read (``reuse_plan``): with room for two
    steps, six layers still read layer 0's plan, step after step."""
    route_id, params, problem = CASES[0]
    problem = replace(problem, dcp_size=1)
    dispatcher = _dispatcher(problem, route_id, params, tmp_path)
    monkeypatch.setattr(attention, "PLAN_LIMIT", 2)
    layers = _layers(problem, 6)
    for _ in range(2):
        _assert_right(layers, _step(layers, dispatcher))
        _write_lengths(layers[0], (layers[0].seq_lens // 2).clamp(min=problem.qlen))
    assert len(attention.plans_of(dispatcher)) <= 2
