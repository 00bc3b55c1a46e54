"""The transposed Gluon decode's host side (mlatune/kernels/gluon_transposed.py) on the CPU:
what its launcher refuses, with a ValueError that says why, before any GPU work."""

from __future__ import annotations

import pytest
import torch

from mlatune.kernels import gluon_transposed as t


def _tensors(batch=2, heads=16, qlen=1, kv=torch.bfloat16, pages=8):
    q = torch.randn(batch * qlen, heads, 576, dtype=torch.bfloat16)
    cache = torch.randn(pages, 64, 576).to(kv)
    table = torch.arange(batch * 4, dtype=torch.int32).reshape(batch, 4) % pages
    lens = torch.full((batch, ), 200, dtype=torch.int32)
    return q, cache, table, lens


def _launch(q, cache, table, lens, **kw):
    return t.decode_launcher(q, cache, table, lens, qlen=kw.pop("qlen", 1), sm_scale=0.1, **kw)


@pytest.mark.parametrize(("change", "message"), [
    (dict(merge="fused"), "merge must be"),
    (dict(widen_cols=1024), "widen_cols must be one of"),
    (dict(widen_cols=0), "widen_cols must be one of"),
    (dict(num_splits=0), "num_splits must be at least 1"),
    (dict(qlen=3), "expected 6 .batch x qlen."),
    (dict(out=torch.empty(2, 16, 256, dtype=torch.bfloat16)), "out must be"),
    (dict(out=torch.empty(2, 16, 512, dtype=torch.float16)), "out must be"),
    (dict(lse=torch.empty(16, 2).t()), "lse must be"),
])
def test_bad_options_and_buffers_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        _launch(*_tensors(), **change)


def test_bad_tensors_are_refused_with_the_reason():
    q, cache, table, lens = _tensors()
    fp8 = cache.to(torch.float8_e4m3fn)
    scale = torch.ones(1)
    cases = [
        ((q, fp8, table, lens, None), "needs its per-tensor scale"),
        ((q, fp8, table, lens, torch.ones(1, dtype=torch.float64)), "one fp32 value"),
        ((q, fp8, table, lens, torch.ones(2)), "one fp32 value"),
        ((q, cache.half(), table, lens, None), "cache dtype"),
        ((q.float(), cache, table, lens, None), "q dtype"),
        ((q, cache, table[:1], lens, None), "a row of contiguous page ids per request"),
        ((q, cache, table.t().contiguous().t(), lens, None), "contiguous page ids"),
        ((q, cache, table.long(), lens, None), "int32"),
        ((q[0], cache, table, lens, None), "expected"),
        ((q, cache[:, :32], table, lens, None), "page_size 32"),
    ]
    for args, message in cases:
        why = t.check_supported(*args)
        assert why is not None and message in why, (message, why)
    # A well-formed fp8 call gets as far as the triton check (none on this machine's 3.9,
    # or None where triton 3.6 is installed).
    why = t.check_supported(q, fp8, table, lens, scale)
    assert why is None or "triton" in why


@pytest.mark.parametrize("kw", [
    dict(num_heads=16, batch=3, kv_len=300), dict(num_heads=16, batch=2, kv_len=700, qlen=4),
    dict(num_heads=16, batch=3, kv_len=300, kv_dtype="fp8_e4m3fn"),
    dict(num_heads=8, batch=3, kv_len=500, dcp_size=2), dict(num_heads=128, batch=2, kv_len=5000),
    dict(num_heads=16, batch=2, kv_len=300, qlen=2, q_dtype="fp16", kv_dtype="fp8_e4m3fn"),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_the_route_reaches_the_launch_at_every_param_set_and_rank(kw):
    """Every parameter set and DCP rank, with and without the caller's buffers, gets past
    the launcher's checks and builds its TMA descriptors (no launch: no GPU here). Needs
    triton 3.6.x, whose Gluon descriptors the launcher builds."""
    from mlatune import routes
    from mlatune.arch import cpu_device
    from mlatune.check.inputs import make_decode_inputs
    from mlatune.problem import MLAProblem
    from tests.test_gluon_compile import _needs_gluon_triton

    _needs_gluon_triton()
    route = routes.get("transposed/gluon")
    problem = MLAProblem(page_size=64, **kw)
    inputs = make_decode_inputs(problem, seed=1, ragged=True)
    tokens, heads = problem.batch * problem.qlen, problem.kernel_heads
    for params in route.param_space(problem, cpu_device()):
        for rank in range(problem.dcp_size):
            own = route.prepare(problem, inputs, rank=rank, params=params)
            assert own.out.shape == (tokens, heads, 512) and own.params == params
            out = torch.empty(tokens, heads, 512, dtype=inputs.q.dtype)
            lse = torch.empty(tokens, heads)
            given = route.prepare(problem, inputs, rank=rank, params=params, out=out, lse=lse)
            assert given.out is out and given.lse is lse
