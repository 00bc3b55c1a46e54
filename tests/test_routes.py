import dataclasses

import pytest
import torch

from mlatune import routes
from mlatune.arch import cpu_device
from mlatune.check import reference
from mlatune.check.accuracy import Rounding, check
from mlatune.check.inputs import make_inputs, poison_
from mlatune.lse import combine
from mlatune.problem import MLAProblem
from mlatune.routes import YES, Route, no


class _Picky(Route):
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
    out, lse = combine(outs, lses) if len(outs) > 1 else (outs[0], lses[0])
    acc = check(problem, out, want[0], lse, want[1])
    assert acc.ok, acc.reason


def test_params_at_keeps_the_recipe_and_redoes_sized_params():
    from mlatune.routes import params_at
    from tests.table_helpers import H200

    there = MLAProblem(num_heads=16, qlen=2, batch=1, kv_len=4096, dcp_size=2)
    here = there.with_(batch=64, kv_len=65536)
    for route_id in ("padded/triton", "cprr/triton", "segmented/triton"):
        route = routes.get(route_id)
        space_there, space_here = route.param_space(there, H200), route.param_space(here, H200)
        sized = route.sized_params
        for won in space_there:
            got = params_at(route, won, there, here, H200)
            assert got in space_here
            assert {k: v for k, v in got.items() if k not in sized} == \
                {k: v for k, v in won.items() if k not in sized}
        # The device-filling split (each recipe's first set) maps to the one here.
        assert params_at(route, space_there[0], there, here, H200) == space_here[0]
        assert space_there[0] != space_here[0]  # sizes differ enough to change it
        # Parameters not in the neighbour's list, and routes without sized
        # parameters, keep what was measured.
        odd = {**space_there[0], sized[0]: 3}
        assert params_at(route, odd, there, here, H200) == odd
    # As the route ran it (recorded in tables): a persistent set with the first set's
    # split filled in, which it does not use.
    padded = routes.get("padded/triton")
    space_there, space_here = padded.param_space(there, H200), padded.param_space(here, H200)
    persistent = next(p for p in space_there if p.get("persistent"))
    ran = {**space_there[0], **persistent}
    assert params_at(padded, ran, there, here, H200) == next(
        p for p in space_here if p.get("persistent"))  # the route fills in its own split

    # A split above the rule's at the neighbour stays above it here, though the lists
    # differ in length and order (the rule's split is first, the others around it).
    big, small = MLAProblem(num_heads=16, batch=256, kv_len=8192), MLAProblem(
        num_heads=16, batch=128, kv_len=8192)
    tile = padded.param_space(big, H200)[0]
    splits = {p["num_splits"]: p for p in padded.param_space(big, H200)
              if {**p, "num_splits": 0} == {**tile, "num_splits": 0}}
    here_splits = [p["num_splits"] for p in padded.param_space(small, H200)
                   if {**p, "num_splits": 0} == {**tile, "num_splits": 0}]
    assert sorted(splits) == [1, 2] and here_splits == [2, 1, 4]  # else no test
    assert params_at(padded, splits[1], big, small, H200)["num_splits"] == 2
    assert params_at(padded, splits[2], big, small, H200)["num_splits"] == 4
    sdpa = routes.get("sdpa/torch")
    assert params_at(sdpa, {"x": 1}, there, here, H200) == {"x": 1}


NONE, Q_FP8 = Rounding.NONE, Rounding.Q_FP8


def test_quantized_q_per_route_and_params():
    """The quantized-q class only where q is quantized: FlashMLA over an fp8 cache,
    whatever its params; no Triton or Gluon set (transposed/gluon's fp8-MMA sets keep q near
    16 bits and declare P rounded instead: tests/test_gluon_route.py); none over an fp8 q."""
    fp8 = MLAProblem(num_heads=16, batch=2, kv_len=256, q_dtype="bf16", kv_dtype="fp8_e4m3fn")
    for route_id in ("padded/triton", "segmented/triton", "wgmma/gluon"):
        assert routes.rounding(routes.get(route_id), fp8, {"num_splits": 2}) == NONE, route_id
        assert routes.rounding(routes.get(route_id), fp8) == NONE, route_id
    flashmla = routes.get("dense/flashmla")
    assert routes.rounding(flashmla, fp8) == routes.rounding(flashmla, fp8, {"x": 1}) == Q_FP8
    both_fp8 = dataclasses.replace(fp8, q_dtype="fp8_e4m3fn")
    assert routes.rounding(flashmla, both_fp8) == NONE  # q is fp8 already
    assert routes.rounding(flashmla, dataclasses.replace(fp8, kv_dtype="bf16")) == NONE
