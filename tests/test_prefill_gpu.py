"""Prefill routes on a real GPU at serving sizes: ``python -m pytest -m gpu``.

Every case runs a route on poisoned outputs, checks it against the fp32
reference (computed on the GPU), and, for routes that claim to be graph-safe,
captures one run in a CUDA graph and checks the replay too. Without a GPU these
tests fail rather than skip: asking for them means asking for a GPU.
"""

import zlib

import pytest
import torch

from mlatune import routes
from mlatune.arch import DeviceInfo, current_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_prefill_inputs, poison_
from mlatune.problem import MLAProblem
from mlatune.routes.base import Prepared
from mlatune.routes.prefill_triton import GLUON_PARAM_SETS

pytestmark = pytest.mark.gpu

SIZES = [(1, 4096), (8, 2048), (32, 512)]  # (batch, tokens per request)
ROUTES = [("fp8-ps/triton", "fp8_e4m3fn"), ("bf16-ps/triton", "bf16"), ("sdpa/torch", "bf16")]


@pytest.fixture(scope="module")
def device() -> DeviceInfo:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA or ROCm GPU")
    return current_device()


def fp8_for(device: DeviceInfo) -> str:
    """The fp8 format the device computes in (gfx942 is the one e4m3fnuz GPU)."""
    return "fp8_e4m3fnuz" if device.arch.startswith("gfx94") else "fp8_e4m3fn"


def prefill(heads, batch, qlen, kv_len, dtype, causal=True) -> MLAProblem:
    return MLAProblem(phase="prefill", num_heads=heads, batch=batch, qlen=qlen, kv_len=kv_len,
                      q_dtype=dtype, kv_dtype=dtype, causal=causal)


def run_and_check(route_id: str, problem: MLAProblem, device: DeviceInfo, *,
                  ragged: bool = False, params=None) -> Prepared:
    route = routes.get(route_id)
    verdict = route.supports(problem, device)
    assert verdict, verdict.reason
    seed = zlib.crc32(f"{route_id}|{problem.key}|{ragged}|{params}".encode())
    inputs = make_prefill_inputs(problem, seed, device.torch_device, ragged)
    ref_out, ref_lse = reference.prefill(inputs)
    prepared = route.prepare(problem, inputs, params=params)

    def assert_accurate(what: str) -> None:
        torch.cuda.synchronize()
        acc = check(problem, prepared.out, ref_out, prepared.lse,
                    ref_lse if prepared.lse is not None else None)
        assert acc.ok, f"{route_id} {what} {prepared.params}: {acc.reason} ({acc.summary})"

    poison_(prepared.out, prepared.lse)
    prepared.run()
    assert_accurate("eager")
    if prepared.graph_safe:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prepared.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prepared.run()
        poison_(prepared.out, prepared.lse)
        graph.replay()
        assert_accurate("graph replay")
    return prepared


@pytest.mark.parametrize(("route_id", "dtype"), ROUTES, ids=[r.split("/")[0] for r, _ in ROUTES])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("size", SIZES, ids=[f"{b}x{t}" for b, t in SIZES])
def test_serving_sizes(device, size, heads, route_id, dtype):
    batch, tokens = size
    dtype = fp8_for(device) if dtype.startswith("fp8") else dtype
    prepared = run_and_check(route_id, prefill(heads, batch, tokens, tokens, dtype), device)
    if route_id.endswith("/triton") and size == (1, 4096) and heads == 16:
        # 256 tiles of very unequal causal cost on ~100+ SMs: the plan must split some.
        assert prepared.params["split_tiles"] > 0


@pytest.mark.parametrize(("route_id", "dtype"), ROUTES, ids=[r.split("/")[0] for r, _ in ROUTES])
@pytest.mark.parametrize("heads", [12, 24])
def test_padded_heads_ragged_with_prefix(device, heads, route_id, dtype):
    dtype = fp8_for(device) if dtype.startswith("fp8") else dtype
    prepared = run_and_check(route_id, prefill(heads, 5, 1000, 1700, dtype), device, ragged=True)
    if route_id.endswith("/triton"):
        assert prepared.params["kernel_heads"] == {12: 16, 24: 32}[heads]


@pytest.mark.parametrize("route_id", ["fp8-ps/triton", "bf16-ps/triton"])
def test_every_parameter_set(device, route_id):
    dtype = fp8_for(device) if route_id.startswith("fp8") else "bf16"
    problem = prefill(16, 3, 700, 900, dtype)
    space = routes.get(route_id).param_space(problem, device)
    assert space
    for params in space:
        if params.get("kernel") == "gluon":
            continue  # test_gluon_fp8_kernel's
        run_and_check(route_id, problem, device, ragged=True, params=params)


def fp8_triton_sets(device: DeviceInfo) -> list[dict]:
    """fp8-ps's Triton param sets (not the Gluon kernel's: test_gluon_fp8_kernel runs those,
    so a hang there stays there)."""
    problem = prefill(128, 1, 4096, 4096, fp8_for(device))
    return [p for p in routes.get("fp8-ps/triton").param_space(problem, device)
            if p.get("kernel") != "gluon"]


@pytest.mark.parametrize("causal", [True, False])
def test_every_fp8_triton_set_at_128_heads(device, causal):
    """Issue 19's point (128 heads x 4096 tokens) and a ragged batch with prefixes, for
    every fp8 Triton set of the route (its ring depths)."""
    for params in fp8_triton_sets(device):
        run_and_check("fp8-ps/triton", prefill(128, 1, 4096, 4096, fp8_for(device), causal),
                      device, params=params)
        run_and_check("fp8-ps/triton", prefill(24, 5, 1000, 1700, fp8_for(device), causal),
                      device, ragged=True, params=params)


@pytest.mark.parametrize("route_id", ["bf16-ps/triton", "sdpa/torch"])
def test_fp16(device, route_id):
    run_and_check(route_id, prefill(16, 4, 900, 1200, "fp16"), device, ragged=True)


@pytest.mark.parametrize("route_id", ["fp8-ps/triton", "bf16-ps/triton", "sdpa/torch"])
def test_not_causal(device, route_id):
    dtype = fp8_for(device) if route_id.startswith("fp8") else "bf16"
    run_and_check(route_id, prefill(16, 3, 600, 1000, dtype, causal=False), device, ragged=True)


@pytest.mark.parametrize("route_id", ["bf16-ps/triton", "sdpa/torch"])
@pytest.mark.parametrize("heads", [16, 128])
def test_bf16_query_over_an_fp8_cache(device, route_id, heads):
    problem = MLAProblem(phase="prefill", num_heads=heads, batch=5, qlen=1000, kv_len=1700,
                         q_dtype="bf16", kv_dtype=fp8_for(device))
    prepared = run_and_check(route_id, problem, device, ragged=True)
    if route_id == "sdpa/torch":
        assert prepared.params["kv_dequant"] == "bf16"


GLUON_CASES = [  # (heads, batch, qlen, kv_len, causal, ragged)
    (16, 1, 4096, 4096, True, False),  # causal tiles of unequal cost: the plan splits some
    (128, 1, 4096, 4096, True, False),  # issue 19's point
    (16, 3, 700, 900, True, True),  # ragged, with prefixes
    (24, 5, 1000, 1700, False, True),  # padded heads, not causal
    (16, 4, 1, 130, True, True),  # one query row a request: the second warpgroup's rows unused
]


@pytest.mark.parametrize("params", GLUON_PARAM_SETS, ids=lambda p: f"stages{p['num_stages']}")
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: "x".join(map(str, c[:4]))
                         + ("-causal" if c[4] else "-full") + ("-ragged" if c[5] else ""))
def test_gluon_fp8_kernel(device, case, params):
    """fp8-ps/triton's Gluon sets (kernels/gluon_prefill_fp8: warp-specialized, fp8 wgmmas,
    P in registers) on poisoned outputs, eager and replayed from a CUDA graph."""
    heads, batch, qlen, kv_len, causal, ragged = case
    problem = prefill(heads, batch, qlen, kv_len, fp8_for(device), causal)
    if GLUON_PARAM_SETS[0] not in routes.get("fp8-ps/triton").param_space(problem, device):
        pytest.skip(f"the Gluon fp8 prefill is not offered on {device.arch} with this triton")
    prepared = run_and_check("fp8-ps/triton", problem, device, ragged=ragged, params=params)
    assert prepared.params["kernel"] == "gluon"
    if (heads, qlen) == (16, 4096):
        assert prepared.params["split_tiles"] > 0
