"""A CUDA-graph batch bucket padded with empty requests, on a real GPU (``pytest -m gpu``).

An engine captures one graph per batch bucket and pads the slots it does not use with
requests of length 0. Here: a bucket of 8 with 3 live requests (one of them shorter than
qlen when qlen is 2) and 5 empty ones (their block-table rows zero, as an engine's
zero-filled buffers leave them), captured through ``attention.decode`` with the caller's
buffers, then replayed with the lengths rewritten in place: the live ones' lengths changed
and one of them emptied, another live request emptied and an empty one filled, and every
request empty. Every replay: outputs poisoned first, NaN in each cache slot past a
request's length; live rows match the reference, rows that attend no key are exactly 0
with LSE -inf.

Routes: every one the dispatcher may serve a capturable step from at the bucket's shapes
(heads 16 and 8, qlen 1 and 2, bf16 and fp8 caches; and seesaw/gluon at 64 and 128 heads,
where its balanced form is offered), in each of its kernel forms, forced
through a one-problem table (``test_every_capturable_route_is_covered`` fails if a route
that serves one of the shapes here is missing); FlashMLA where its library imports (else
skipped, naming what to install). FlashInfer, host-planned and so never captured, eagerly
through ``decode`` as the lengths change. Then ``decode`` with the bundled dispatcher (no
``dispatcher=``), captured the same way.
"""

from __future__ import annotations

import pytest
import torch

from mlatune import attention, routes
from mlatune.arch import current_device
from mlatune.check.accuracy import check
from mlatune.check.inputs import DecodeInputs, make_decode_inputs, poison_
from mlatune.problem import MLAProblem
from tests.helpers import expected_now
from tests.test_empty_requests import rows_without_keys
from tests.test_engine_gpu import _forced

pytestmark = pytest.mark.gpu
FP8 = "fp8_e4m3fn"
BUCKET, CAP = 8, 1024  # batch bucket, and the bucket's max_kv_len (each request's pages)
LIVE = (0, 3, 5)
# Capture; the live ones' lengths changed and request 3 emptied; request 0 emptied and
# request 6 (padding until now) filled; every request empty.
STEPS = [
    [1000, 0, 0, 65, 0, 1, 0, 0],
    [513, 0, 0, 0, 0, 64, 0, 0],
    [0, 0, 0, 2, 0, 1024, 3, 0],
    [0] * BUCKET,
]


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not torch.cuda.is_available():  # fail, not skip: -m gpu without a GPU is no pass
        pytest.fail("GPU tests need a GPU: run them on the device machine")


def _p(heads: int, qlen: int, kv: str) -> MLAProblem:
    return MLAProblem(num_heads=heads, qlen=qlen, q_dtype="bf16", kv_dtype=kv, batch=BUCKET,
                      kv_len=CAP, page_size=64)


SHAPES = [_p(16, 1, "bf16"), _p(16, 2, "bf16"), _p(16, 1, FP8), _p(16, 2, FP8),
          _p(8, 1, "bf16"), _p(8, 2, FP8)]
# Every decode route that can serve a capturable step at one of the shapes on sm_90.
CAPTURABLE = ("padded/triton", "gluon/triton", "wgmma/gluon", "seesaw/gluon",
              "transposed/gluon", "transposed-mma8/gluon", "dense/flashmla")
# And seesaw/gluon from 64 query rows a request, where it offers its balanced form too (a
# device plan of the bucket's lengths, captured with the step).
CASES = [(r, p) for p in SHAPES for r in CAPTURABLE] + [
    ("seesaw/gluon", _p(128, 1, "bf16")), ("seesaw/gluon", _p(64, 2, "bf16"))]


def _label(case) -> str:
    route_id, p = case
    return f"{route_id}-h{p.num_heads}-q{p.qlen}-{p.kv_dtype}"


def _forms(route, problem: MLAProblem) -> list[dict]:
    """The first capturable set of each kernel form in the route's space (persistent or
    split, seesaw's and transposed's forms, segmented's folding), and of a split form its
    single-split (direct-write) set too."""
    firsts: dict[tuple, dict] = {}
    for params in route.param_space(problem, current_device()):
        if route.step_kind(params).capturable:
            form = (bool(params.get("persistent")), params.get("form"), params.get("fold"))
            firsts.setdefault(form, params)
    forms = list(firsts.values())
    split = next((p for p in forms if p.get("num_splits", 1) > 1), None)
    return forms if split is None else [*forms, {**split, "num_splits": 1}]


class Bucket:
    """The bucket's tensors: pages for CAP keys per live request, zero block-table rows for
    the padding, lengths written in place with NaN past each in the cache."""

    def __init__(self, problem: MLAProblem, seed: int):
        self.inputs = make_decode_inputs(problem, seed=seed, device="cuda")
        self.shard = self.inputs.shards[0]
        self.clean = self.shard.kv_cache.clone()
        padding = [b for b in range(BUCKET) if b not in LIVE and b != 6]
        self.shard.block_table[padding] = 0

    def write(self, lens: list[int]) -> None:
        shard, page = self.shard, self.shard.kv_cache.shape[1]
        self.inputs.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        shard.seq_lens.copy_(self.inputs.seq_lens)
        shard.kv_cache.copy_(self.clean)
        fp8 = shard.kv_cache.dtype.itemsize == 1
        slots = shard.kv_cache.view(torch.uint8) if fp8 else shard.kv_cache
        nan = 0x7F if fp8 else float("nan")  # e4m3fn's NaN bit pattern
        for b, n in enumerate(lens):
            if b in LIVE or b == 6:  # the padding's page 0 is another request's page
                for j, page_id in enumerate(shard.block_table[b].tolist()):
                    if n < (j + 1) * page:
                        slots[page_id, max(0, n - j * page):] = nan


def _served(problem: MLAProblem, route, params: dict, out, lse, inputs: DecodeInputs,
            lens: list[int], what: str) -> None:
    want_out, want_lse = expected_now(inputs)
    empty = rows_without_keys(lens, problem.qlen, problem.causal, 0).to(out.device)
    live = ~empty
    acc = check(problem, out[live], want_out[live], lse[live], want_lse[live],
                rounding=routes.rounding(route, problem, params))
    assert acc.ok, f"{what}: live rows: {acc.reason} ({acc.summary})"
    assert (out[empty] == 0).all(), f"{what}: rows without keys: output not 0"
    assert torch.isneginf(lse[empty]).all(), f"{what}: rows without keys: LSE not -inf"


def _replayed(bucket: Bucket, graph: torch.cuda.CUDAGraph, out: torch.Tensor,
              lse: torch.Tensor):
    """``graph`` replayed over STEPS, each step's lengths written in and the outputs poisoned
    first; yields (lens, out, lse, inputs) after each replay."""
    for lens in STEPS:
        bucket.write(lens)
        poison_(out, lse)
        graph.replay()
        torch.cuda.synchronize()
        yield lens, out, lse, bucket.inputs


def _captured_bucket(problem: MLAProblem, dispatcher, seed: int):
    """decode() once eagerly and once under capture; yields (lens, out, lse) after each
    replay of STEPS (the capture's own lengths first)."""
    bucket = Bucket(problem, seed)
    inputs, shard = bucket.inputs, bucket.shard
    rows, heads = inputs.q.shape[0], problem.kernel_heads
    out = torch.empty(rows, heads, problem.d_v, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(rows, heads, dtype=torch.float32, device="cuda")

    def step() -> None:
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=problem.num_heads, qlen=problem.qlen,
                         kv_scale=inputs.kv_scale, out=out, lse_out=lse, max_kv_len=CAP,
                         capturable=True, dispatcher=dispatcher)

    bucket.write(STEPS[0])
    step()  # eager: makes the step (compiles, allocates) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    yield from _replayed(bucket, graph, out, lse)


@pytest.mark.parametrize("case", CASES, ids=_label)
def test_a_captured_bucket_with_empty_requests(case, tmp_path):
    route_id, problem = case
    route = routes.get(route_id)
    verdict = route.supports(problem, current_device())
    if not verdict:
        pytest.skip(f"{route_id} does not serve {problem.key}: {verdict.reason}")
    assert route.serves_empty(problem, {})
    for n, params in enumerate(_forms(route, problem)):
        dispatcher = _forced(problem, route_id, params, tmp_path / str(n))
        for lens, out, lse, inputs in _captured_bucket(problem, dispatcher, seed=31 + n):
            _served(problem, route, params, out, lse, inputs, lens, f"{params}, lengths {lens}")
        steps = list(attention.plans_of(dispatcher).values())
        assert {(s.choice.route_id, s.prepared.step_kind.capturable) for s in steps} == \
            {(route_id, True)}


def test_every_capturable_route_is_covered():
    """Each registered route that serves a shape here with a capturable set is in CASES."""
    device = current_device()
    for problem in SHAPES:
        for route in routes.all_routes():
            if not route.supports(problem, device) or route.id == "reference/torch":
                continue
            space = route.param_space(problem, device)
            if any(route.step_kind(p).capturable for p in space):
                assert (route.id, problem) in CASES, (route.id, problem.key)


@pytest.mark.parametrize("fresh_q", [False, True], ids=["kept-q", "fresh-q"])
@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("problem", [_p(16, 1, "bf16"), _p(16, 2, "bf16"), _p(16, 1, FP8)],
                         ids=["q1-bf16", "q2-bf16", "q1-fp8"])
def test_flashinfer_serves_the_bucket_eagerly(backend, problem, fresh_q, tmp_path):
    """Host-planned (never captured): decode() prepares it again from each step's lengths,
    also where q is a new tensor each call (its plan made anew, not the last call's)."""
    route = routes.get(f"{backend}/flashinfer")
    verdict = route.supports(problem, current_device())
    if not verdict:
        pytest.skip(verdict.reason)
    dispatcher = _forced(problem, route.id, {}, tmp_path)
    bucket = Bucket(problem, seed=41)
    inputs, shard = bucket.inputs, bucket.shard
    for lens in STEPS:
        bucket.write(lens)
        q = inputs.q.clone() if fresh_q else inputs.q
        out, lse = attention.decode(q, shard.kv_cache, shard.block_table,
                                    inputs.seq_lens, num_heads=problem.num_heads,
                                    qlen=problem.qlen, kv_scale=inputs.kv_scale,
                                    max_kv_len=CAP, return_lse=True, dispatcher=dispatcher)
        torch.cuda.synchronize()
        _served(problem, route, {}, out, lse, inputs, lens, f"lengths {lens}")
    assert {s.choice.route_id for s in attention.plans_of(dispatcher).values()} == {route.id}


@pytest.mark.parametrize("problem", SHAPES[:4], ids=["q1-bf16", "q2-bf16", "q1-fp8", "q2-fp8"])
def test_decode_with_the_bundled_dispatcher_captures_the_bucket(problem):
    """decode() as an engine calls it, no dispatcher given: the bundled table's capturable
    pick for the bucket, captured and replayed as the lengths change and empty."""
    dispatcher = attention.default_dispatcher(capturable=True)
    before = set(attention.plans_of(dispatcher))
    for lens, out, lse, inputs in _captured_bucket(problem, None, seed=51):
        made = [s for k, s in attention.plans_of(dispatcher).items() if k not in before]
        assert len(made) == 1, "one step for the bucket"
        choice = made[0].choice
        route = routes.get(choice.route_id)
        _served(problem, route, dict(choice.params), out, lse, inputs, lens,
                f"{choice.route_id} {dict(choice.params)}, lengths {lens}")


def test_a_captured_step_outlives_the_plan_limit(monkeypatch):
    """Steps made after a capture past ``PLAN_LIMIT`` drop the older steps from the cache,
    never a captured step: its graph goes on replaying its own buffers (garbage written over
    freed memory would show)."""
    monkeypatch.setattr(attention, "PLAN_LIMIT", 1)
    problem = SHAPES[0]
    replays = _captured_bucket(problem, None, seed=61)
    lens, out, lse, inputs = next(replays)
    shard = inputs.shards[0]
    for _ in range(3):  # each a new key (its own q and out), kept at its second call: the
        q, mine = inputs.q.clone(), torch.empty_like(out)  # older step is dropped
        for _ in range(2):
            attention.decode(q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                             num_heads=problem.num_heads, qlen=problem.qlen, max_kv_len=CAP,
                             out=mine, capturable=True)
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(32)]
    dispatcher = attention.default_dispatcher(capturable=True)
    for lens, out, lse, inputs in replays:
        step = next(s for s in attention._captured[dispatcher].values()
                    if s.out.data_ptr() == out.data_ptr())
        route = routes.get(step.choice.route_id)
        _served(problem, route, dict(step.choice.params), out, lse, inputs, lens,
                f"after the plan limit, lengths {lens}")
    del junk


@pytest.mark.parametrize("problem", [SHAPES[0], SHAPES[3], _p(128, 1, "bf16")],
                         ids=["h16-q1-bf16", "h16-q2-fp8", "h128-q1-bf16"])
def test_fresh_q_each_eager_call_then_a_capture(problem, monkeypatch):
    """An eager model's calls (a new q each, as activations are) with the bundled
    dispatcher as the lengths change and empty, then the bucket captured over the engine's
    static q and replayed: every call right, the route chosen once (later calls prepare it
    again over their q)."""
    made, make = [], attention._make_plan
    monkeypatch.setattr(attention, "_make_plan",
                        lambda *a, **k: made.append(1) or make(*a, **k))
    bucket = Bucket(problem, seed=81)
    inputs, shard = bucket.inputs, bucket.shard
    dispatcher = attention.default_dispatcher(capturable=True)
    rows, heads = inputs.q.shape[0], problem.kernel_heads
    out = torch.empty(rows, heads, problem.d_v, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(rows, heads, dtype=torch.float32, device="cuda")

    def step(q) -> None:
        attention.decode(q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=problem.num_heads, qlen=problem.qlen,
                         kv_scale=inputs.kv_scale, out=out, lse_out=lse, max_kv_len=CAP,
                         capturable=True, dispatcher=dispatcher)

    for lens in STEPS:
        bucket.write(lens)
        poison_(out, lse)
        step(inputs.q.clone())
        torch.cuda.synchronize()
        ran = attention.last_step(dispatcher)
        _served(problem, ran.route, dict(ran.choice.params), out, lse, inputs, lens,
                f"eager {ran.route.id}, lengths {lens}")
    bucket.write(STEPS[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(inputs.q)
    captured = attention.last_step(dispatcher)
    for lens, got, got_lse, now in _replayed(bucket, graph, out, lse):
        _served(problem, captured.route, dict(captured.choice.params), got, got_lse, now,
                lens, f"replayed {captured.route.id}, lengths {lens}")
    assert len(made) == 1


SEESAW_MANY = [_p(128, 1, "bf16"), _p(64, 2, "bf16"), _p(128, 1, FP8)]


def _compiled_replays(problem: MLAProblem, dispatcher, seed: int, counter):
    """A model's step with ``decode`` inside ``torch.compile(fullgraph=True)`` (Inductor,
    through ``counter``: a ``CompileCounterWithBackend``), called once, then captured and
    replayed over STEPS; yields (lens, out, lse, inputs) after each replay, and at the end
    calls the compiled step once more with the last lengths (a retrace would count)."""
    bucket = Bucket(problem, seed)
    inputs, shard = bucket.inputs, bucket.shard

    def model_step(q, kv_cache, block_table, seq_lens, kv_scale):
        out, lse = attention.decode(q * 1.0, kv_cache, block_table, seq_lens,
                                    num_heads=problem.num_heads, qlen=problem.qlen,
                                    kv_scale=kv_scale, max_kv_len=CAP, return_lse=True,
                                    capturable=True, dispatcher=dispatcher)
        return out + 0, lse

    torch._dynamo.reset()
    compiled = torch.compile(model_step, fullgraph=True, backend=counter)
    args = (inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens, inputs.kv_scale)
    bucket.write(STEPS[0])
    # Compiles (model and kernels) outside the capture; the capture then prepares the step
    # again for the graph's q and out (a step is keyed on its tensors).
    compiled(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = compiled(*args)
    yield from _replayed(bucket, graph, out, lse)
    compiled(*args)


@pytest.mark.parametrize("problem", SEESAW_MANY, ids=["h128-q1-bf16", "h64-q2-bf16", "h128-q1-fp8"])
def test_compiled_fullgraph_step_captures_every_seesaw_form(problem, tmp_path):
    """A model's step as an engine builds it: ``decode`` inside ``torch.compile(fullgraph=True)``
    (Inductor; one trace: the op boundary holds), that compiled step captured in a CUDA graph
    and replayed as the lengths change and empty, for each of seesaw/gluon's forms (the
    balanced one plans on the device inside the graph). Only the first call compiles: the
    capture and a call after the lengths changed reuse it."""
    route = routes.get("seesaw/gluon")
    verdict = route.supports(problem, current_device())
    if not verdict:
        pytest.skip(f"seesaw/gluon does not serve {problem.key}: {verdict.reason}")
    # Imported here, not at the top: dynamo's import costs each process that collects this
    # module (every test run's, GPU or not) about 2 s.
    from torch._dynamo.testing import CompileCounterWithBackend

    forms = _forms(route, problem)
    if problem.kv_dtype == "bf16":
        assert "balanced" in {p.get("form") for p in forms}, forms
    for n, params in enumerate(forms):
        dispatcher = _forced(problem, "seesaw/gluon", params, tmp_path / str(n))
        counter = CompileCounterWithBackend("inductor")
        for lens, out, lse, inputs in _compiled_replays(problem, dispatcher, 71 + n, counter):
            _served(problem, route, params, out, lse, inputs, lens, f"{params}, lengths {lens}")
        assert counter.frame_count == 1, f"{params}: compiled {counter.frame_count} times"
        steps = attention.plans_of(dispatcher).values()
        assert {s.choice.route_id for s in steps} == {"seesaw/gluon"}


@pytest.mark.parametrize("problem", [SHAPES[0], SHAPES[3], _p(128, 1, "bf16")],
                         ids=["h16-q1-bf16", "h16-q2-fp8", "h128-q1-bf16"])
def test_reduce_overhead_mode_captures_the_op(problem):
    """``torch.compile(mode="reduce-overhead")``: Inductor's CUDA graphs capture ``decode``
    (``capturable`` left to the op, which sees the capture) after their warm-up call; the
    steps made in their pool keep nothing there (Inductor checks it, ``graph_pools``).
    Called over STEPS twice, the lengths rewritten in place (empty requests too): every call
    right (a second layer's ``reuse_plan`` call too), and a capturable step made under the
    capture."""
    bucket = Bucket(problem, seed=91)
    inputs, shard = bucket.inputs, bucket.shard

    def model_step(q, kv_cache, block_table, seq_lens, kv_scale):
        out, lse = attention.decode(q * 1.0, kv_cache, block_table, seq_lens,
                                    num_heads=problem.num_heads, qlen=problem.qlen,
                                    kv_scale=kv_scale, max_kv_len=CAP, return_lse=True)
        again, _ = attention.decode(q * 1.0, kv_cache, block_table, seq_lens,  # a next layer
                                    num_heads=problem.num_heads, qlen=problem.qlen,
                                    kv_scale=kv_scale, max_kv_len=CAP, return_lse=True,
                                    reuse_plan=True)
        return out + 0, lse, again + 0

    torch._dynamo.reset()
    compiled = torch.compile(model_step, mode="reduce-overhead", fullgraph=True)
    args = (inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens, inputs.kv_scale)
    captured = attention.default_dispatcher(capturable=True)
    for lens in STEPS * 2:
        bucket.write(lens)
        out, lse, again = (t.clone() for t in compiled(*args))
        torch.cuda.synchronize()
        torch.testing.assert_close(again, out, atol=0, rtol=0)
        ran = attention.last_step(captured) or attention.last_step()
        _served(problem, ran.route, dict(ran.choice.params), out, lse, inputs, lens,
                f"{ran.route.id}, lengths {lens}")
    step = attention.last_step(captured)
    assert step is not None and step.prepared.step_kind.capturable, "no step made under capture"


def test_a_split_steps_workspace_is_measured(tmp_path):
    """The kept steps' byte bound (``attention.PLAN_BYTES``) sees a split route's partials:
    the step's measured workspace is at least their bytes (fp32, a slot per request and
    split)."""
    problem = _p(16, 1, "bf16")
    route = routes.get("padded/triton")
    params = next(p for p in route.param_space(problem, current_device())
                  if p.get("num_splits", 1) > 1 and not p.get("persistent"))
    dispatcher = _forced(problem, route.id, params, tmp_path)
    bucket = Bucket(problem, seed=95)
    bucket.write(STEPS[0])
    inputs, shard = bucket.inputs, bucket.shard
    attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                     num_heads=problem.num_heads, max_kv_len=CAP, dispatcher=dispatcher)
    step = attention.last_step(dispatcher)
    partials = BUCKET * params["num_splits"] * problem.num_heads * (problem.d_v + 1) * 4
    assert step.prepared.workspace_bytes >= partials, (step.prepared.workspace_bytes, params)
