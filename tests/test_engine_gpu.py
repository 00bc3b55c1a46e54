"""``attention.decode`` the way an engine calls it, on a real GPU (``pytest -m gpu``).

Each route the shipped table picks that claims a capturable step is forced through a
one-problem table, called once eagerly, captured in a CUDA graph with the caller's
buffers, and replayed after the engine's next steps are written in place: ragged
lengths, shorter and longer ones within the block table's capacity, and new page ids.
Every replay is checked against the reference for what the tensors hold then. bf16
(which the CPU interpreter cannot check) and fp8 caches, DCP ranks merged.
"""

from __future__ import annotations

import pytest
import torch

from mlatune import attention, routes, table
from mlatune.arch import current_device
from mlatune.check.accuracy import check
from mlatune.check.inputs import DecodeInputs, make_decode_inputs, poison_
from mlatune.dispatch import Dispatcher
from mlatune.lse import combine
from mlatune.problem import MLAProblem
from tests.helpers import expected_now
from tests.table_helpers import make_table, result_row

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not torch.cuda.is_available():  # fail, not skip: -m gpu without a GPU is no pass
        pytest.fail("GPU tests need a GPU: run them on the device machine")


def _p(heads, batch, kv_len, qlen=1, dcp=1, kv="bf16", page=64):
    return MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen, dcp_size=dcp,
                      q_dtype="bf16", kv_dtype=kv, page_size=page)


# (route, persistent?, problem): the routes of the shipped table, with both plans of padded;
# (128,128,4096,1) and (32,16,8192,3) failed to capture before the device plans. FlashMLA's
# cases skip, naming what to install, where its library is missing (an optional backend).
CASES = [
    ("padded/triton", False, _p(16, 32, 4096)),
    ("padded/triton", True, _p(128, 128, 4096)),
    ("padded/triton", True, _p(16, 32, 8192, qlen=3)),
    ("padded/triton", True, _p(16, 64, 4096, kv="fp8_e4m3fn")),
    ("padded/triton", True, _p(16, 8, 4096, qlen=2, dcp=2, page=16)),
    ("gluon/triton", False, _p(8, 16, 4096, qlen=2)),
    ("cprr/triton", False, _p(16, 16, 4096, dcp=2)),
    ("segmented/triton", False, _p(16, 16, 4096, qlen=3, dcp=2)),
    ("dense/flashmla", False, _p(16, 32, 4096)),
    ("dense/flashmla", False, _p(64, 16, 4096, qlen=2)),
    ("dense/flashmla", False, _p(16, 16, 4096, kv="fp8_e4m3fn")),
    ("dense/flashmla", False, _p(16, 8, 4096, dcp=2)),
]


def _params(route_id: str, persistent: bool, problem: MLAProblem) -> dict:
    space = routes.get(route_id).param_space(problem, current_device())
    return next(p for p in space if bool(p.get("persistent")) == persistent)


def _forced(problem: MLAProblem, route_id: str, params: dict, tmp_path) -> Dispatcher:
    """A dispatcher that serves ``route_id`` with ``params`` at ``problem``, whatever the
    route rounds (accuracy policy "fast"; each test checks at the route's own bound)."""
    device = current_device()
    rows = [result_row(problem, route_id, 1.0, device=device, params=params),
            result_row(problem, "reference/torch", 9.0, device=device)]
    return Dispatcher.load(table.write(make_table(rows), tmp_path / "gpu.parquet"),
                           device=device, accuracy="fast")


def _next_steps(problem: MLAProblem, gen: torch.Generator) -> list[torch.Tensor]:
    """Lengths an engine's later steps bring: ragged, all short, all at capacity."""
    b, lo, cap = problem.batch, problem.qlen, problem.kv_len
    return [torch.randint(lo, cap + 1, (b,), generator=gen),
            torch.randint(lo, max(lo + 1, cap // 8), (b,), generator=gen),
            torch.full((b,), cap)]


@pytest.mark.parametrize(("route_id", "persistent", "problem"), CASES,
                         ids=[f"{r}-{'persistent-' if s else ''}{p.key}" for r, s, p in CASES])
def test_a_captured_step_replays_with_new_lengths(route_id, persistent, problem, tmp_path):
    route = routes.get(route_id)
    verdict = route.supports(problem, current_device())
    if not verdict and "install" in verdict.reason:
        pytest.skip(verdict.reason)
    params = _params(route_id, persistent, problem)
    dispatcher = _forced(problem, route_id, params, tmp_path)
    # Pages for kv_len tokens per request (the capacity); the lengths start ragged.
    inputs = make_decode_inputs(problem, seed=21, device="cuda")
    gen = torch.Generator().manual_seed(5)
    inputs.seq_lens.copy_(_next_steps(problem, gen)[0].to(torch.int32))
    rows, heads = inputs.q.shape[0], problem.kernel_heads
    outs = [torch.empty(rows, heads, problem.d_v, dtype=torch.bfloat16, device="cuda")
            for _ in inputs.shards]
    lses = [torch.empty(rows, heads, dtype=torch.float32, device="cuda") for _ in inputs.shards]
    scale = 0.7 * problem.softmax_scale

    def step() -> None:
        for shard, out, lse in zip(inputs.shards, outs, lses, strict=True):
            attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                             num_heads=problem.num_heads, qlen=problem.qlen,
                             kv_scale=inputs.kv_scale, softmax_scale=scale, out=out,
                             lse_out=lse, dcp_rank=shard.rank, dcp_size=problem.dcp_size,
                             max_kv_len=problem.kv_len, capturable=True,
                             dispatcher=dispatcher)

    step()  # eager: makes the steps (compiles, allocates) outside the capture
    chosen = {(p.choice.route_id, p.prepared.step_kind) for p in
              attention.plans_of(dispatcher).values()}
    assert chosen == {(route_id, routes.step_kind_of(routes.get(route_id), params))}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for n, lens in enumerate(_next_steps(problem, gen)):
        inputs.seq_lens.copy_(lens.to(torch.int32))
        if problem.dcp_size == 1 and n == 1:  # the engine moved pages: new ids in place
            table_ = inputs.shards[0].block_table
            table_.copy_(table_.flip(0))
        for t in (*outs, *lses):
            poison_(t)
        graph.replay()
        torch.cuda.synchronize()
        if problem.dcp_size > 1:
            out, lse = combine([o.float() for o in outs], list(lses))
        else:
            out, lse = outs[0], lses[0]
        scaled = DecodeInputs(problem, inputs.q, inputs.q_scale, inputs.kv_scale,
                              inputs.seq_lens, inputs.shards, sm_scale=scale)
        want_out, want_lse = expected_now(scaled)
        accuracy = check(problem, out, want_out, lse, want_lse,
                         rounding=routes.rounding(route, problem))
        assert accuracy.ok, f"replay {n}: {accuracy.reason}"


@pytest.mark.parametrize(("route_id", "persistent", "problem"), [CASES[1], CASES[7]],
                         ids=["padded-persistent", "segmented-dcp2"])
def test_eager_calls_replay_a_private_graph_with_new_lengths(route_id, persistent, problem,
                                                             tmp_path):
    """From the second eager call on, decode replays its own graph of the step."""
    dispatcher = _forced(problem, route_id, _params(route_id, persistent, problem), tmp_path)
    inputs = make_decode_inputs(problem, seed=22, device="cuda")
    gen = torch.Generator().manual_seed(6)
    for n, lens in enumerate(_next_steps(problem, gen)):
        inputs.seq_lens.copy_(lens.to(torch.int32))
        outs, lses = [], []
        for shard in inputs.shards:
            out, lse = attention.decode(inputs.q, shard.kv_cache, shard.block_table,
                                        inputs.seq_lens, num_heads=problem.num_heads,
                                        qlen=problem.qlen, dcp_rank=shard.rank,
                                        dcp_size=problem.dcp_size, max_kv_len=problem.kv_len,
                                        return_lse=True, dispatcher=dispatcher)
            outs.append(out.float().clone())
            lses.append(lse.clone())
        out, lse = combine(outs, lses) if len(outs) > 1 else (outs[0], lses[0])
        want_out, want_lse = expected_now(inputs)
        accuracy = check(problem, out, want_out, lse, want_lse)
        assert accuracy.ok, f"call {n}: {accuracy.reason}"
        graphs = [p.graph is not None for p in attention.plans_of(dispatcher).values()]
        assert all(graphs) == (n >= 1), f"call {n}: private graphs {graphs}"
