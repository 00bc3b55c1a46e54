import pytest
import torch

from mlatune import reference, routes
from mlatune.accuracy import check
from mlatune.arch import cpu_device
from mlatune.inputs import make_inputs, poison_
from mlatune.problem import MLAProblem
from mlatune.routes import YES, Route, no


class _Picky:
    id = "test-picky/torch"

    def supports(self, problem, device):
        return YES if problem.num_heads == 16 else no("only 16 heads")

    def param_space(self, problem, device):
        return [{}]

    def prepare(self, problem, inputs, *, rank=0, params=None, want_lse=True):
        raise NotImplementedError


def test_registry_filters_and_explains():
    picky = routes.register(_Picky())
    try:
        assert isinstance(picky, Route)
        dev = cpu_device()
        ids = [r.id for r in routes.viable(MLAProblem(num_heads=16), dev)]
        assert "test-picky/torch" in ids and "reference/torch" in ids
        verdicts = dict((r.id, v) for r, v in routes.verdicts(MLAProblem(num_heads=8), dev))
        assert not verdicts["test-picky/torch"] and verdicts["test-picky/torch"].reason
        assert [r.id for r in routes.viable(MLAProblem(num_heads=8), dev,
                                            only=["test-picky/torch"])] == []
    finally:
        routes.unregister("test-picky/torch")


def test_registry_refuses_bad_and_duplicate_ids():
    bad = _Picky()
    bad.id = "NoSlash"
    with pytest.raises(ValueError, match="family"):
        routes.register(bad)
    dup = _Picky()
    dup.id = "reference/torch"
    with pytest.raises(ValueError, match="already"):
        routes.register(dup)
    with pytest.raises(KeyError, match="reference/torch"):
        routes.get("nope/none")


@pytest.mark.parametrize(
    "problem",
    [
        MLAProblem(num_heads=4, qlen=1, batch=3, kv_len=33, page_size=8, q_dtype="fp16",
                   kv_dtype="fp16"),
        MLAProblem(num_heads=2, qlen=3, batch=2, kv_len=40, page_size=4,
                   kv_dtype="fp8_e4m3fn", dcp_size=4),
        MLAProblem(num_heads=2, qlen=3, batch=2, kv_len=30, page_size=1, causal=False,
                   q_dtype="fp8_e4m3fnuz", kv_dtype="fp8_e4m3fnuz"),
        MLAProblem(phase="prefill", num_heads=3, qlen=12, kv_len=12, batch=2, page_size=1),
    ],
    ids=["decode-fp16", "verify-fp8kv-dcp4", "noncausal-fp8", "prefill"],
)
def test_reference_route_through_registry(problem):
    route = routes.get("reference/torch")
    assert route.supports(problem, cpu_device())
    inputs = make_inputs(problem, seed=3, ragged=True)
    want = reference.run(inputs, torch.float64)
    outs, lses = [], []
    for rank in range(problem.dcp_size):
        prepared = route.prepare(problem, inputs, rank=rank)
        poison_(prepared.out, prepared.lse)
        prepared.run()
        outs.append(prepared.out.float())
        lses.append(prepared.lse)
    out, lse = reference.merge_partials(outs, lses) if len(outs) > 1 else (outs[0], lses[0])
    acc = check(problem, out, want[0], lse, want[1])
    assert acc.ok, acc.reason
