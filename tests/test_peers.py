"""The peers' decode test grids (FlashMLA's and FlashInfer's; docs/peers.md) at tiny sizes on
the CPU: mlatune's Triton routes in the interpreter, fp16 and an fp8 cache under an fp16 q
(the interpreter computes bf16 dots wrongly), through ``attention.decode`` with each route
forced and with the bundled dispatcher; and the peers' cases mlatune does not serve, refused
by name. The GPU grid (bf16, the Gluon and FlashMLA routes, graphs): tests/test_peers_gpu.py.

Every case: odd and large head counts, pages of 1 to 16 tokens shuffled over the cache (or
shared between requests), lengths of 0, below qlen and ragged, NaN in every cache slot no
request attends, table entries past each request's used pages pointing past the cache or
at -1, the caller's out= and lse_out= poisoned before each call, the lengths and table rows
rewritten in place for a second call.
"""

from __future__ import annotations

import pytest
import torch

from mlatune import attention, routes
from mlatune.arch import cpu_device
from mlatune.check.inputs import make_decode_inputs
from mlatune.dispatch import Dispatcher
from mlatune.errors import DecodeArgumentError
from mlatune.problem import MLAProblem
from tests.peer_grid import (
    PeerBatch,
    PeerCase,
    assert_rope_key_wins,
    assert_served,
    decode_into_its_own_buffers,
    forced,
    forms,
    rope_dominated,
    run_case,
    served_routes,
)

FP8 = "fp8_e4m3fn"
CPU = cpu_device()


def _case(peer: str, heads: int, qlen: int, page: int, lens, **kw) -> PeerCase:
    return PeerCase(peer, heads, qlen, page, lens, q="fp16", kv=kw.pop("kv", "fp16"), pad=16,
                    **kw)


CASES = [
    _case("flashmla", 1, 1, 1, ((0, 1, 5, 13), (13, 0, 2, 0)), scale=576 ** -0.5),
    _case("flashmla", 3, 2, 16, ((0, 1, 17, 40), (2, 40, 0, 16))),
    _case("flashmla", 63, 1, 16, ((21, 0, 1), (0, 16, 33))),
    _case("flashinfer", 4, 3, 8, ((0, 2, 9, 30), (30, 1, 0, 8)), kv=FP8, causal=False),
    _case("flashinfer", 16, 3, 4, ((0, 2, 7, 26), (26, 0, 3, 1)), shared_pages=True,
          scale=0.3),
    _case("flashinfer", 2, 5, 2, ((0, 4, 5, 19), (1, 19, 0, 6)), kv=FP8),
]
ROUTES = ("padded/triton", "gluon/triton")
RUNS = [(case, route_id) for case in CASES for route_id in ROUTES
        if routes.get(route_id).supports(case.problem(), CPU)]


@pytest.mark.parametrize("fresh_q", [False, True], ids=["kept-q", "fresh-q"])
@pytest.mark.parametrize(("case", "route_id"), RUNS,
                         ids=[f"{r}-{c.label}" for c, r in RUNS])
def test_a_forced_route_serves_the_peers_case(case, route_id, fresh_q, tmp_path):
    """Each of the route's forms; with q kept, or a new tensor at each call (the step then
    prepared again over it, its device plan shared)."""
    route = routes.get(route_id)
    problem = case.problem()
    for n, params in enumerate(forms(route, problem, CPU)):
        dispatcher = forced(problem, route_id, params, tmp_path / f"{n}.parquet", CPU)
        batch = PeerBatch(case, seed=3 + n, device="cpu")
        for lens, out, lse in run_case(batch, dispatcher, fresh_q=fresh_q):
            assert_served(batch, route, params, out, lse, lens, f"{route_id} {params}")
        assert {s.choice.route_id for s in attention.plans_of(dispatcher).values()} \
            == {route_id}


@pytest.mark.parametrize("fresh_q", [False, True], ids=["kept-q", "fresh-q"])
@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_decode_with_the_bundled_dispatcher_serves_the_peers_case(case, fresh_q):
    """The bundled dispatcher's capturable pick (one step made, also where q is a new tensor
    at each call); the same answer into the step's own buffers."""
    dispatcher = attention.default_dispatcher(capturable=True)
    before = set(attention.plans_of(dispatcher))
    batch = PeerBatch(case, seed=5, device="cpu")
    for lens, out, lse in run_case(batch, None, fresh_q=fresh_q):
        made = served_routes(dispatcher, before)
        assert len(made) == 1, "one step for the case"
        choice = made[0].choice
        assert_served(batch, routes.get(choice.route_id), dict(choice.params), out, lse, lens,
                      f"{choice.route_id} {dict(choice.params)}")
    own_out, own_lse = decode_into_its_own_buffers(batch)
    assert torch.equal(own_out, out) and torch.equal(own_lse, lse)


ROPE = MLAProblem(num_heads=4, q_dtype="fp16", kv_dtype=FP8, batch=2, kv_len=40, page_size=16)


@pytest.mark.parametrize("route_id", ROUTES)
def test_a_key_picked_by_its_rope_dims_wins(route_id, tmp_path):
    """FlashInfer's rope-aliasing case over an fp8 cache at softmax scale 1."""
    route = routes.get(route_id)
    for n, params in enumerate(forms(route, ROPE, CPU)):
        dispatcher = forced(ROPE, route_id, params, tmp_path / f"{n}.parquet", CPU)
        assert_rope_key_wins(rope_dominated(ROPE, seed=n, device="cpu"), route, params,
                             dispatcher)


def test_every_route_the_cpu_runs_is_in_the_grid():
    """Each decode route that serves one of the cases on the CPU with a capturable set is
    among the forced ones."""
    for case in CASES:
        for route in routes.all_routes():
            if route.id == "reference/torch" or not route.supports(case.problem(), CPU):
                continue
            space = route.param_space(case.problem(), CPU)
            if any(route.step_kind(p).capturable for p in space):
                assert (case, route.id) in RUNS, (route.id, case.label)


# --- the peers' cases mlatune does not serve: refused by name -----------------------------
def _inputs(heads: int = 4, kv: str = "fp16"):
    problem = MLAProblem(num_heads=heads, q_dtype="fp16" if kv != "bf16" else "bf16",
                         kv_dtype=kv, batch=2, kv_len=16, page_size=8)
    inputs = make_decode_inputs(problem, seed=9)
    return problem, inputs, inputs.shards[0]


def _decode(inputs, kv_cache, **kw):
    shard = inputs.shards[0]
    kw = {"num_heads": inputs.problem.num_heads, "kv_scale": inputs.kv_scale,
          "max_kv_len": 16, "dispatcher": Dispatcher.rules_only(CPU), **kw}
    return attention.decode(inputs.q, kv_cache, shard.block_table, inputs.seq_lens, **kw)


def test_several_kv_heads_are_refused():
    """FlashMLA's grid has 2, 3 and 8 KV heads (GQA); MLA's cache holds one latent head."""
    _, inputs, shard = _inputs()
    two_heads = shard.kv_cache[:, :, None].expand(-1, -1, 2, -1).contiguous()
    with pytest.raises(DecodeArgumentError, match=r"^kv_cache: must be \(pages, page_size, "
                                                  r"d_qk\) or \(pages, page_size, 1, d_qk\)"):
        _decode(inputs, two_heads)


def test_a_cache_without_rope_dims_is_refused():
    """FlashInfer's test without kpe (head_dim_kpe 0): the latent alone, d_qk 512."""
    problem, inputs, shard = _inputs()
    latent = shard.kv_cache[..., :problem.kv_lora_rank].contiguous()
    with pytest.raises(DecodeArgumentError, match=r"^kv_cache: d_qk \(last dim\) 512 must "
                                                  r"exceed kv_lora_rank 512"):
        _decode(inputs, latent)


def test_an_fp8_cache_takes_one_per_tensor_scale():
    """FlashInfer's fp8 cache takes a scale for the latent and one for the rope dims, or a
    scale per 128-channel group; mlatune one per-tensor scale, and none is refused."""
    _, inputs, shard = _inputs(kv=FP8)
    groups = inputs.kv_scale.repeat(4)
    with pytest.raises(DecodeArgumentError, match=r"^kv_scale: must hold one per-tensor "
                                                  r"scale, got shape \(4,\)"):
        _decode(inputs, shard.kv_cache, kv_scale=groups)
    with pytest.raises(DecodeArgumentError, match=r"^kv_scale: an fp8 kv_cache "
                                                  r"\(float8_e4m3fn\) needs its per-tensor "
                                                  r"scale"):
        _decode(inputs, shard.kv_cache, kv_scale=None)


def test_a_q_of_another_16_bit_dtype_than_the_cache_is_refused():
    _, inputs, shard = _inputs()
    with pytest.raises(DecodeArgumentError, match=r"^q: q_dtype must equal kv_dtype"):
        _decode(inputs, shard.kv_cache.to(torch.bfloat16))


def test_a_head_count_no_capturable_route_serves_is_refused_when_capturable():
    """Past 128 heads, a count that is not a multiple of 16 has no capturable route on the
    CPU (padded/triton pads up to 128 heads or multiples of 16): refused by name."""
    _, inputs, shard = _inputs(heads=130)
    with pytest.raises(RuntimeError, match=r"no route that serves phase=decode\|num_heads=130\|.* "
                                           r"is capturable \(.*reference/torch: its step is "
                                           r"not capturable"):
        _decode(inputs, shard.kv_cache, capturable=True)


def test_the_reference_route_serves_a_head_count_the_kernels_do_not_eagerly():
    """Uncaptured, the same count is served by reference/torch, with the peers' table layout
    (entries past the used pages pointing past the cache)."""
    case = _case("flashmla", 130, 2, 8, ((0, 1, 9, 30), (30, 0, 2, 5)))
    assert not any(routes.get(r).supports(case.problem(), CPU) for r in ROUTES)
    batch = PeerBatch(case, seed=7, device="cpu")
    route = routes.get("reference/torch")
    for lens, out, lse in run_case(batch, Dispatcher.rules_only(CPU), capturable=False):
        assert_served(batch, route, {}, out, lse, lens, route.id)
