"""The accuracy contract on a real GPU (``pytest -m gpu``): ``decode()`` with the bundled
table, a bf16 q over an fp8 cache, under each policy; strict's output within the bf16 bound.
Each case prints the route, its error and its eager time (a benchmark line, not a check)."""

from __future__ import annotations

import pytest
import torch

from mlatune import attention, routes
from mlatune.check.accuracy import Rounding, check, tolerance_for
from mlatune.check.inputs import make_decode_inputs, poison_
from mlatune.check.policy import POLICIES
from mlatune.dispatch import Dispatcher
from mlatune.problem import MLAProblem
from tests.helpers import expected_now

pytestmark = pytest.mark.gpu

FP8 = "fp8_e4m3fn"
# The shape (where the fastest row quantizes q) and a small-head one (where the
# fastest rounds P to fp8).
PROBLEMS = [MLAProblem(num_heads=128, batch=200, kv_len=6000, q_dtype="bf16", kv_dtype=FP8),
            MLAProblem(num_heads=16, batch=64, kv_len=4096, q_dtype="bf16", kv_dtype=FP8)]


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not torch.cuda.is_available():  # fail, not skip: -m gpu without a GPU is no pass
        pytest.fail("GPU tests need a GPU: run them on the device machine")


@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.label for p in PROBLEMS])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_each_policy_serves_within_its_bound(problem, policy):
    inputs = make_decode_inputs(problem, seed=40, device="cuda", ragged=True)
    shard = inputs.shards[0]
    dispatcher = Dispatcher.from_bundled(accuracy=policy)
    out = torch.empty(inputs.q.shape[0], problem.num_heads, problem.d_v, dtype=torch.bfloat16,
                      device="cuda")
    lse = torch.empty(inputs.q.shape[0], problem.num_heads, dtype=torch.float32, device="cuda")
    poison_(out)
    poison_(lse)

    def call() -> None:
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=problem.num_heads, kv_scale=inputs.kv_scale, out=out,
                         lse_out=lse, max_kv_len=problem.kv_len, dispatcher=dispatcher,
                         accuracy=policy)

    call()
    torch.cuda.synchronize()
    want_out, want_lse = expected_now(inputs)
    served = next(iter(attention.plans_of(dispatcher).values())).choice
    cls = routes.rounding(dispatcher.route(served.route_id), problem, dict(served.params))
    assert dispatcher.accuracy.admits_class(problem.q_dtype, cls)
    accuracy = check(problem, out, want_out, lse, want_lse, rounding=cls)
    assert accuracy.ok, accuracy.reason
    if policy == "strict":
        assert cls == Rounding.NONE
        assert accuracy.rel_l2 <= tolerance_for("bf16", "bf16").rel_l2
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        call()
    end.record()
    torch.cuda.synchronize()
    print(f"\nBENCH accuracy={policy} {problem.label}: {served.route_id} "
          f"{dict(served.params)} ({served.source}, {cls}) rel_l2={accuracy.rel_l2:.3g} "
          f"lse_err={accuracy.lse_max_abs:.3g} eager {start.elapsed_time(end) * 100:.1f} us")
