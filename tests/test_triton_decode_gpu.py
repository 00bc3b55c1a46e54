"""The Triton decode routes on a real GPU, at real sizes (``python -m pytest -m gpu``).

The same checks as the CPU tests (every rank's partial against the fp32 torch
reference, the ranks merged by the Triton merge kernel against the full
reference, NaN-poisoned outputs, ragged lengths), over batch up to 256, KV up
to 32k, bf16 and fp8 (e4m3fn) KV, and every parameter set of each route's
param_space on this device: a configuration that fails to compile or computes
wrongly fails here before a sweep or the benchmark meets it. Also: CUDA-graph
capture and replay of prepared routes.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from mlatune import routes
from mlatune.arch import current_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs, poison_
from mlatune.lse import combine
from mlatune.problem import MLAProblem

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    # Fail, not skip: `pytest -m gpu` without a GPU must not look like a pass.
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need a GPU: run them on the device machine")

FP8 = "fp8_e4m3fnuz" if torch.version.hip and "gfx94" in (
    torch.cuda.get_device_properties(0).gcnArchName if torch.cuda.is_available() else "") \
    else "fp8_e4m3fn"


def _p(heads: int, batch: int, kv_len: int, qlen: int = 1, dcp: int = 1, kv: str = "bf16",
       q: str | None = None, page: int = 64, causal: bool = True) -> MLAProblem:
    q = q or ("bf16" if kv == FP8 else kv)
    return MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen, dcp_size=dcp,
                      q_dtype=q, kv_dtype=kv, page_size=page, causal=causal)


# (route, problem): between them, every family at small and large heads, qlen 1..4,
# dcp 1/2/4, pages 1/16/64/256, bf16 and fp8, batch up to 256 and KV up to 32k; segmented's
# spaces hold the folded sets (``fold``), over bf16 and fp8 caches.
PROBLEMS = [
    ("padded/triton", _p(16, 1, 4096)),
    ("padded/triton", _p(16, 256, 2048, kv=FP8)),
    ("padded/triton", _p(128, 128, 4096)),
    ("padded/triton", _p(128, 8, 32768, kv=FP8, q=FP8)),
    ("padded/triton", _p(24, 64, 4096, qlen=4, page=16)),
    ("padded/triton", _p(8, 32, 8192, qlen=2, dcp=4, page=1)),
    ("padded/triton", _p(64, 16, 4096, qlen=2, causal=False)),
    ("gluon/triton", _p(8, 64, 4096)),
    ("gluon/triton", _p(4, 128, 8192, qlen=4, kv=FP8, page=16)),
    ("gluon/triton", _p(1, 3, 32768, qlen=2, page=1)),
    ("cprr/triton", _p(16, 64, 16384, qlen=3, dcp=4)),
    ("cprr/triton", _p(8, 256, 4096, dcp=2, kv=FP8, page=16)),
    ("cprr/triton", _p(12, 16, 32768, qlen=4, dcp=2)),
    ("segmented/triton", _p(16, 64, 8192, qlen=3, dcp=4)),
    ("segmented/triton", _p(4, 128, 4096, qlen=2, dcp=2, kv=FP8, page=1)),
    ("segmented/triton", _p(32, 8, 32768, qlen=4, dcp=4, page=256)),
    ("padded/triton", _p(16, 128, 8192, kv=FP8)),  # the benchmark's fp8 point, every set
    ("segmented/triton", _p(8, 64, 4096, qlen=2, dcp=2, kv=FP8, page=16)),
]


def _label(item) -> str:
    route_id, p = item
    return (f"{route_id}-h{p.kernel_heads}-b{p.batch}-kv{p.kv_len}-q{p.qlen}-dcp{p.dcp_size}-"
            f"p{p.page_size}-{p.kv_dtype}-{p.q_dtype}{'' if p.causal else '-noncausal'}")


@pytest.mark.parametrize("item", PROBLEMS, ids=_label)
def test_route_at_real_size(item):
    route_id, problem = item
    device = current_device()
    route = routes.get(route_id)
    verdict = route.supports(problem, device)
    assert verdict, verdict.reason
    seed = zlib.crc32(_label(item).encode()) % 10_000
    inputs = make_decode_inputs(problem, seed=seed, device="cuda", ragged=True)
    wants = [reference.decode_shard(inputs, shard) for shard in inputs.shards]
    space = route.param_space(problem, device)
    assert space
    failures = []
    for i, params in enumerate(space):
        # Every parameter set on rank 0 (the busiest); the first on every rank, merged.
        ranks = range(problem.dcp_size) if i == 0 else [0]
        outs, lses = [], []
        for rank in ranks:
            prepared = route.prepare(problem, inputs, rank=rank, params=params)
            poison_(prepared.out, prepared.lse)
            prepared.run()
            torch.cuda.synchronize()
            acc = check(problem, prepared.out, wants[rank][0], prepared.lse, wants[rank][1],
                        rounding=routes.rounding(route, problem, params))
            if not acc.ok:
                failures.append(f"rank {rank} {params}: {acc.reason} ({acc.summary})")
            outs.append(prepared.out)
            lses.append(prepared.lse)
        if len(outs) > 1:
            from mlatune.kernels.merge import merge_partials_into

            out, lse = torch.empty_like(outs[0]), torch.empty_like(lses[0])
            poison_(out, lse)
            merge_partials_into(torch.stack(outs), torch.stack(lses), out, lse)
            want = reference.decode(inputs)
            acc = check(problem, out, want[0], lse, want[1],
                        rounding=routes.rounding(route, problem, params))
            if not acc.ok:
                failures.append(f"merged {params}: {acc.reason} ({acc.summary})")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("item", [PROBLEMS[1], PROBLEMS[3], PROBLEMS[9], PROBLEMS[11],
                                  PROBLEMS[13], PROBLEMS[16]], ids=_label)
def test_cuda_graph_replay(item):
    """Prepared routes capture into a CUDA graph; each replay rewrites every output element."""
    route_id, problem = item
    device = current_device()
    route = routes.get(route_id)
    inputs = make_decode_inputs(problem, seed=7, device="cuda", ragged=True)
    want_out, want_lse = reference.decode_shard(inputs, inputs.shards[0])
    space = route.param_space(problem, device)
    new_paths = [p for p in space[2:-1] if p.get("fold")][:1]
    for params in space[:2] + new_paths + space[-1:]:
        prepared = route.prepare(problem, inputs, rank=0, params=params)
        assert prepared.graph_safe
        prepared.run()  # compile outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            prepared.run()
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(2):
            poison_(prepared.out, prepared.lse)
            graph.replay()
            torch.cuda.synchronize()
            acc = check(problem, prepared.out, want_out, prepared.lse, want_lse,
                        rounding=routes.rounding(route, problem, params))
            assert acc.ok, f"{params}: {acc.reason} ({acc.summary})"


def test_merge_kernel_at_real_size():
    from mlatune.kernels.merge import merge_partials_into

    gen = torch.Generator(device="cuda").manual_seed(3)
    ranks, tokens, heads, dim = 4, 512, 64, 512
    outs = torch.randn(ranks, tokens, heads, dim, device="cuda", generator=gen).bfloat16()
    lses = torch.randn(ranks, tokens, heads, device="cuda", generator=gen) * 4
    lses[2, :7] = float("-inf")
    outs[2, :7] = 0
    lses[:, 9, 5] = float("-inf")
    outs[:, 9, 5] = 0
    want_out, want_lse = combine(list(outs.float()), list(lses))
    out = torch.empty(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(tokens, heads, device="cuda")
    poison_(out, lse)
    merge_partials_into(outs, lses, out, lse)
    torch.testing.assert_close(out.float(), want_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[9, 5])


# -- the split reduce alone, on the GPU (the CPU tests run it in the interpreter) ---------
@pytest.mark.parametrize(("blocks", "counts", "rows", "pdl", "uniform"), [
    (None, [64], (1, 16, 1), True, False),  # one request's 16 heads over 64 splits
    (None, [2] * 64, (1, 16, 1), True, False),  # 64 requests of 2 splits: 1,024 rows
    (None, [2, 1, 0, 3] * 40, (1, 128, 1), False, False),  # (1, 512), empty groups
    (None, [5, 0, 8, 1], (3, 8, 2), False, False),  # padded heads
    ((2, 64), [33, 2, 0, 16], (2, 3, 2), True, False),
    # uniform slots (the split decodes' reduce): one pass up to 16, two beyond
    (None, [8] * 8, (1, 128, 1), True, True),
    (None, [2] * 64, (1, 64, 1), True, True),
    (None, [4] * 5, (3, 8, 2), False, True),
    (None, [64], (1, 16, 1), True, True),
])
def test_reduce_kernel_matches_torch_on_the_gpu(blocks, counts, rows, pdl, uniform):
    """The reduce at the block shapes its GPU rule picks (and one forced), as a
    programmatic dependent launch too, over uniform slot counts too: each group against a
    torch merge."""
    from tests.test_triton_decode import check_reduce

    tokens, q_heads, rep = rows
    check_reduce(blocks, counts, None, len(counts) * 31 + tokens, "cuda",
                 tokens=tokens, q_heads=q_heads, rep=rep, d_v=512, pdl=pdl, uniform=uniform)


@pytest.mark.parametrize("pdl", [False, True])
def test_reduce_leaves_groups_of_one_slot_in_place_on_the_gpu(pdl):
    """``one_in_place`` (the seesaw decode's balanced form) at its GPU block rule: groups of
    one slot keep their rows, the others merged, an empty one written as empty."""
    from tests.test_triton_decode import check_reduce

    check_reduce(None, [1, 3, 0, 1, 2, 5] * 8, None, 57, "cuda", tokens=1, q_heads=128,
                 rep=1, d_v=512, pdl=pdl, one_in_place=True)
    # From BALANCED_ROWS_4 rows (64 groups of 2 x 128 rows): 4 rows a program, the slot
    # hint (2) below some groups' counts (two passes there).
    from mlatune.kernels.reduce import BALANCED_ROWS_4

    assert BALANCED_ROWS_4 <= 64 * 2 * 128
    check_reduce(None, [1, 2, 0, 3] * 16, 2, 58, "cuda", tokens=2, q_heads=128, rep=1,
                 d_v=512, pdl=pdl, one_in_place=True)
