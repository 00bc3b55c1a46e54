"""The vendor routes (FlashMLA, FlashInfer) on a real GPU (``python -m pytest -m gpu``).

Each route against the fp32 reference on ragged lengths with NaN-poisoned buffers:
qlen 1-4, causal and not, DCP ranks merged, bf16 and fp8 caches, pages 1/16/64.
Then FlashInfer (host-planned) the way an engine calls it through ``attention.decode``,
eagerly as the lengths change; FlashMLA's capture in a CUDA graph with new lengths and
page ids written in place is among tests/test_engine_gpu.py's cases. A vendor library that is not
installed skips its tests, saying what to install (they are optional backends).
"""

from __future__ import annotations

import pytest
import torch

from mlatune import attention, routes
from mlatune.arch import current_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs, poison_
from mlatune.kernels.merge import merge_partials_into
from mlatune.problem import MLAProblem
from tests.helpers import expected_now
from tests.test_engine_gpu import _forced, _next_steps

pytestmark = pytest.mark.gpu
FP8 = "fp8_e4m3fn"


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not torch.cuda.is_available():  # fail, not skip: -m gpu without a GPU is no pass
        pytest.fail("GPU tests need a GPU: run them on the device machine")


def _p(heads, batch, kv_len, qlen=1, dcp=1, kv="bf16", q="bf16", page=64, causal=True):
    return MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen, dcp_size=dcp,
                      q_dtype=q, kv_dtype=kv, page_size=page, causal=causal)


def _route(route_id: str, problem: MLAProblem):
    route = routes.get(route_id)
    verdict = route.supports(problem, current_device())
    if not verdict and "install" in verdict.reason:
        pytest.skip(verdict.reason)
    assert verdict, verdict.reason
    return route


CASES = [
    ("dense/flashmla", _p(16, 64, 4096)),
    ("dense/flashmla", _p(128, 32, 4096)),
    ("dense/flashmla", _p(16, 16, 8192, qlen=4)),
    ("dense/flashmla", _p(64, 8, 4096, qlen=2, causal=False)),
    ("dense/flashmla", _p(16, 32, 4096, dcp=2)),
    ("dense/flashmla", _p(16, 64, 4096, kv=FP8)),
    ("dense/flashmla", _p(128, 16, 4096, qlen=2, kv=FP8, q=FP8)),
    ("dense/flashmla", _p(8, 3, 1500, qlen=3)),
    ("fa3/flashinfer", _p(16, 64, 4096)),
    ("fa3/flashinfer", _p(128, 16, 4096, kv=FP8)),
    ("fa3/flashinfer", _p(16, 16, 4096, qlen=3, page=16)),
    ("fa3/flashinfer", _p(16, 8, 2048, qlen=2, page=1)),
    ("fa3/flashinfer", _p(64, 16, 4096, dcp=2)),
    ("fa2/flashinfer", _p(16, 64, 4096)),
    ("fa2/flashinfer", _p(32, 16, 4096, qlen=4, page=16, kv=FP8)),
    ("fa2/flashinfer", _p(16, 8, 4096, qlen=2, causal=False, dcp=2)),
]


def _label(item) -> str:
    route_id, p = item
    return (f"{route_id}-h{p.num_heads}-b{p.batch}-kv{p.kv_len}-q{p.qlen}-dcp{p.dcp_size}-"
            f"p{p.page_size}-{p.kv_dtype}-{p.q_dtype}{'' if p.causal else '-noncausal'}")


@pytest.mark.parametrize("item", CASES, ids=_label)
def test_vendor_route_matches_reference(item):
    route_id, problem = item
    route = _route(route_id, problem)
    rounds = routes.rounding(route, problem)
    inputs = make_decode_inputs(problem, seed=11, device="cuda", ragged=True)
    outs, lses = [], []
    for shard in inputs.shards:
        prepared = route.prepare(problem, inputs, rank=shard.rank, want_lse=True)
        poison_(prepared.out, prepared.lse)
        prepared.step()
        torch.cuda.synchronize()
        outs.append(prepared.out)
        lses.append(prepared.lse)
        want_out, want_lse = reference.decode_shard(inputs, shard)
        acc = check(problem, prepared.out, want_out, prepared.lse, want_lse, rounding=rounds)
        if route_id.endswith("/flashinfer") and problem.kv_dtype == FP8:
            # FlashInfer dequantizes an fp8 cache to bf16 with the scale applied
            # (mla_hopper.cuh repack_fp8_kv_to_bf16); its LSE was seen 0.046-0.051 off at
            # some shapes (H200, 2026-11-30), past the bf16 bound of 0.04 that the sweep
            # holds it to (those candidates are rejected there). The output must be right.
            assert acc.rel_l2 < 1e-2 and acc.lse_max_abs < 0.1, acc.summary
            continue
        assert acc.ok, f"rank {shard.rank}: {acc.reason} ({acc.summary})"
    if len(outs) > 1:
        out, lse = torch.empty_like(outs[0]), torch.empty_like(lses[0])
        poison_(out, lse)
        merge_partials_into(torch.stack(outs), torch.stack(lses), out, lse)
        want_out, want_lse = reference.decode(inputs)
        acc = check(problem, out, want_out, lse, want_lse, rounding=rounds)
        assert acc.ok, f"merged: {acc.reason} ({acc.summary})"


@pytest.mark.parametrize("problem", [_p(16, 32, 4096, page=16), _p(16, 8, 4096, qlen=3)],
                         ids=lambda p: p.key)
def test_flashinfer_eager_steps_follow_new_lengths(problem, tmp_path):
    _route("fa3/flashinfer", problem)
    dispatcher = _forced(problem, "fa3/flashinfer", {}, tmp_path)
    inputs = make_decode_inputs(problem, seed=24, device="cuda")
    gen = torch.Generator().manual_seed(10)
    for n, lens in enumerate(_next_steps(problem, gen)):
        inputs.seq_lens.copy_(lens.to(torch.int32))
        shard = inputs.shards[0]
        out, lse = attention.decode(inputs.q, shard.kv_cache, shard.block_table,
                                    inputs.seq_lens, num_heads=problem.num_heads,
                                    qlen=problem.qlen, max_kv_len=problem.kv_len,
                                    return_lse=True, dispatcher=dispatcher)
        want_out, want_lse = expected_now(inputs)
        accuracy = check(problem, out, want_out, lse, want_lse)
        assert accuracy.ok, f"call {n}: {accuracy.reason}"
    chosen = {p.choice.route_id for p in attention.plans_of(dispatcher).values()}
    assert chosen == {"fa3/flashinfer"}
