"""The peers' decode test grids on a real GPU (``pytest -m gpu``): FlashMLA's
(tests/test_flash_mla_dense_decoding.py) and FlashInfer's (tests/attention/test_deepseek_mla.py)
cases in mlatune's own terms, docs/peers.md listing them and what mlatune does not serve.

Each case goes through ``attention.decode`` as an engine calls it: with the bundled
dispatcher (the strict accuracy policy), and forced through each capturable route that
serves it (a one-problem table; each kernel form). The caller's ``out=`` and ``lse_out=`` are
poisoned with NaN before each call; pages are shuffled over the whole cache (or shared
between requests), every cache slot no request attends holds NaN, table entries past each
request's used pages point past the cache or at -1; the lengths (0, below qlen, ragged, up to
8,736) and table rows are rewritten in place for a second call, which replays the step's
CUDA graph. Every call matches the float64 reference within the route's rounding class, rows
without keys exactly 0 and -inf. bf16 q over bf16 and fp8 (e4m3fn) caches, fp16; heads 1 to
128, odd ones among them; pages of 1, 16, 32 and 64 tokens; qlen 1 to 17; causal and not;
the default and custom softmax scales.
"""

from __future__ import annotations

import pytest
import torch

from mlatune import attention, routes
from mlatune.arch import current_device
from mlatune.check.accuracy import Rounding
from mlatune.problem import MLAProblem
from tests.peer_grid import (
    CAPTURABLE,
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

pytestmark = pytest.mark.gpu
FP8 = "fp8_e4m3fn"
FLASHMLA_SCALE = 576 ** -0.5  # FlashMLA's suite scales by the q/k width


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not torch.cuda.is_available():  # fail, not skip: -m gpu without a GPU is no pass
        pytest.fail("GPU tests need a GPU: run them on the device machine")


def _big_batch(seed: int) -> tuple[int, ...]:
    """FlashMLA's zero-length corner case: 128 lengths around 4,096 (spread 2,048, at least
    qlen 2), about half of them 0."""
    gen = torch.Generator().manual_seed(seed)
    lens = (4096 + 2048 * torch.randn(128, generator=gen)).clamp(min=2).long()
    lens[torch.rand(128, generator=gen) < 0.5] = 0
    return tuple(lens.tolist())


CASES = [
    # FlashMLA: 64-token pages; heads 1, 3, 9, 63, 64, 126, 128; qlen 1, 2, 4; lengths
    # around 20, 140 and 4,096; causal and not; its zero-length batch of 128.
    PeerCase("flashmla", 1, 1, 64, ((20, 0, 140, 64, 65, 4096), (0, 63, 1, 4096, 140, 0)),
             scale=FLASHMLA_SCALE),
    PeerCase("flashmla", 3, 2, 64, ((0, 1, 2, 140, 65, 4096, 20),
                                    (4096, 0, 1, 64, 0, 129, 2))),
    PeerCase("flashmla", 9, 4, 64, ((0, 3, 20, 140, 4096, 64), (1, 0, 4096, 0, 127, 2)),
             causal=False),
    PeerCase("flashmla", 63, 1, 64, ((4096, 20, 0, 140, 1, 65), (20, 4096, 140, 0, 0, 1)),
             scale=FLASHMLA_SCALE),
    PeerCase("flashmla", 64, 2, 64, ((140, 0, 4096, 1, 20, 65), (0, 140, 2, 4096, 0, 1)),
             kv=FP8),
    PeerCase("flashmla", 126, 2, 64, ((0, 140, 20, 4096), (4096, 1, 0, 64)), kv=FP8,
             scale=0.7 * 192 ** -0.5),
    PeerCase("flashmla", 128, 4, 64, ((20, 0, 3, 4096, 140), (4096, 140, 0, 20, 2)),
             shared_pages=True),
    PeerCase("flashmla", 3, 2, 64, (_big_batch(1), _big_batch(2)), kv=FP8),
    # FlashInfer: pages of 1, 16 and 32 tokens; heads 4 to 128; qlen up to 17 (16 over an
    # fp8 cache); lengths 0 to 8,736; non-causal verify over lengths below qlen; fp16; the
    # scale 1; q scaled by 100 over pages drawn with repeats.
    PeerCase("flashinfer", 16, 1, 1, ((0, 1, 3, 11, 17, 33, 79, 114, 514),
                                      (514, 0, 17, 1, 0, 33, 3, 79, 11))),
    PeerCase("flashinfer", 16, 3, 1, ((0, 1, 3, 11, 17, 514), (2, 514, 0, 33, 1, 11)),
             q="fp16", kv="fp16", causal=False),
    PeerCase("flashinfer", 4, 7, 32, ((0, 5, 17, 33, 75, 197), (197, 0, 6, 75, 7, 33))),
    PeerCase("flashinfer", 16, 17, 16, ((0, 16, 17, 33, 96, 97, 114, 1024),
                                        (1024, 0, 97, 5, 0, 17, 114, 33))),
    PeerCase("flashinfer", 32, 16, 16, ((256, 1024, 0, 15, 4096), (4096, 0, 256, 16, 1024)),
             kv=FP8),
    PeerCase("flashinfer", 128, 1, 16, ((2743, 0, 514, 8736, 1), (0, 8736, 1, 514, 2743)),
             kv=FP8, scale=1.0),
    PeerCase("flashinfer", 128, 1, 64, ((1024, 128, 4096, 0), (128, 4096, 0, 1024)),
             shared_pages=True, q_gain=100.0),
    PeerCase("flashinfer", 16, 3, 64, ((0, 1, 3, 11, 17, 514), (514, 2, 0, 1, 33, 3)),
             q="fp16", kv="fp16", causal=False),
]
RUNS = [(case, route_id) for case in CASES for route_id in CAPTURABLE]


@pytest.mark.parametrize("fresh_q", [False, True], ids=["kept-q", "fresh-q"])
@pytest.mark.parametrize(("case", "route_id"), RUNS,
                         ids=[f"{r}-{c.label}" for c, r in RUNS])
def test_a_forced_route_serves_the_peers_case(case, route_id, fresh_q, tmp_path):
    """Each of the route's forms; with q kept, or a new tensor at each call (the step then
    prepared again over it, its device plan shared)."""
    route, problem, device = routes.get(route_id), case.problem(), current_device()
    verdict = route.supports(problem, device)
    if not verdict:
        pytest.skip(f"{route_id} does not serve {case.label}: {verdict.reason}")
    for n, params in enumerate(forms(route, problem, device)):
        dispatcher = forced(problem, route_id, params, tmp_path / f"{n}.parquet", device)
        batch = PeerBatch(case, seed=11 + n, device="cuda")
        for lens, out, lse in run_case(batch, dispatcher, fresh_q=fresh_q):
            assert_served(batch, route, params, out, lse, lens, f"{route_id} {params}")
        steps = attention.plans_of(dispatcher).values()
        assert {(s.choice.route_id, s.prepared.step_kind.capturable) for s in steps} == \
            {(route_id, True)}


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_decode_with_the_bundled_dispatcher_serves_the_peers_case(case):
    """The bundled table's capturable pick, within the bounds of the problem's own dtypes
    (the strict policy); the same answer into the step's own buffers."""
    dispatcher = attention.default_dispatcher(capturable=True)
    before = set(attention.plans_of(dispatcher))
    batch = PeerBatch(case, seed=7, device="cuda")
    for lens, out, lse in run_case(batch, None):
        made = served_routes(dispatcher, before)
        assert len(made) == 1, "one step for the case"
        choice = made[0].choice
        route, params = routes.get(choice.route_id), dict(choice.params)
        assert routes.rounding(route, batch.problem, params) == Rounding.NONE
        assert_served(batch, route, params, out, lse, lens, f"{route.id} {params}")
    own_out, own_lse = decode_into_its_own_buffers(batch)
    assert torch.equal(own_out, out) and torch.equal(own_lse, lse)


ROPE = MLAProblem(num_heads=16, kv_dtype=FP8, batch=2, kv_len=256, page_size=64)


@pytest.mark.parametrize("route_id", CAPTURABLE)
def test_a_key_picked_by_its_rope_dims_wins(route_id, tmp_path):
    """FlashInfer's rope-aliasing case over an fp8 cache (softmax scale 1), each kernel
    form."""
    route, device, problem = routes.get(route_id), current_device(), ROPE
    verdict = route.supports(problem, device)
    if not verdict:
        pytest.skip(f"{route_id} does not serve {problem.key}: {verdict.reason}")
    for n, params in enumerate(forms(route, problem, device)):
        dispatcher = forced(problem, route_id, params, tmp_path / f"{n}.parquet", device)
        assert_rope_key_wins(rope_dominated(problem, seed=n, device="cuda"), route, params,
                             dispatcher)


def test_every_capturable_route_is_covered():
    """Each registered route that serves a case here with a capturable set is forced."""
    device = current_device()
    for case in CASES:
        for route in routes.all_routes():
            if route.id == "reference/torch" or not route.supports(case.problem(), device):
                continue
            space = route.param_space(case.problem(), device)
            if any(route.step_kind(p).capturable for p in space):
                assert route.id in CAPTURABLE, (route.id, case.label)


def test_a_head_count_no_capturable_route_serves_is_refused_when_capturable():
    """130 heads over 16-token pages: padded/triton pads up to 128 heads or multiples of 16,
    the Gluon kernels and FlashMLA read 64-token pages; refused by name."""
    case = PeerCase("flashmla", 130, 1, 16, ((0, 20, 140),))
    assert not any(routes.get(r).supports(case.problem(), current_device()) for r in CAPTURABLE)
    batch = PeerBatch(case, seed=13, device="cuda")
    with pytest.raises(RuntimeError, match=r"no route that serves phase=decode\|num_heads=130\|"
                                           r".* is capturable"):
        next(run_case(batch, None))
