"""Empty requests (length 0: an engine's padding of a CUDA-graph bucket) and requests shorter
than qlen, on every decode route the CPU runs: mlatune's Triton kernels in the interpreter,
the reference, and FlashMLA, FlashInfer and AITER through their recording fakes (made to
leave NaN and +inf in rows without keys, as FlashMLA does on the H200).

A row that attends no key (length 0; a causal verify token before its request's first key;
a DCP rank that holds none of its window) must come out as output 0 and LSE -inf, every
other row as the reference has it, whatever the output buffers held (NaN) and the cache
holds past each length (NaN): at prepare, after the lengths are rewritten in place (live
requests emptied, empty ones filled), for a batch of empty requests only, and through
``attention.decode`` and ``prepare_decode``. The GPU side (bf16, captured graphs, the Gluon
and vendor kernels): tests/test_graph_buckets_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from mlatune import attention, routes, table
from mlatune.arch import DeviceInfo, cpu_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import DecodeInputs, make_decode_inputs, poison_, shard_lengths
from mlatune.dispatch import Dispatcher
from mlatune.errors import DecodeArgumentError
from mlatune.lse import combine
from mlatune.problem import MLAProblem
from mlatune.routes import flashinfer, flashmla
from mlatune.routes.aiter_probe import probe
from tests.fake_aiter import FakeAiter
from tests.fake_vendors import FakeFlashInfer, FakeFlashMLA
from tests.table_helpers import FakeRoute, make_table, result_row

H200 = DeviceInfo("sm_90", "fake H200", "nvidia", 132)
MI355 = DeviceInfo("gfx950", "fake", "amd", 8)
T16 = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
FN = "fp8_e4m3fn"
CAP = 24  # every request's pages hold this many keys (per rank)


def _p(heads=4, qlen=1, q="fp16", kv="fp16", dcp=1, page=8, causal=True, batch=4):
    return MLAProblem(num_heads=heads, qlen=qlen, q_dtype=q, kv_dtype=kv, batch=batch,
                      kv_len=CAP, dcp_size=dcp, page_size=page, causal=causal)


# (route, params, problem, device that supports it): each route the CPU runs, in the forms
# that read the lengths differently (split, direct, persistent plan, segments, folded rows).
CASES = [
    ("reference/torch", {}, _p(qlen=2), "cpu"),
    ("padded/triton", {**T16, "num_splits": 2}, _p(), "cpu"),
    ("padded/triton", {**T16, "persistent": True, "num_workers": 3}, _p(qlen=2, kv=FN), "cpu"),
    ("padded/triton", {**T16, "num_splits": 1}, _p(qlen=3, q=FN, kv=FN, dcp=2), "cpu"),
    ("gluon/triton", {**T16, "num_splits": 2}, _p(qlen=2, page=16), "cpu"),
    ("gluon/triton", {**T16, "num_splits": 1}, _p(kv=FN, page=1), "cpu"),
    ("padded/triton", {**T16, "num_splits": 2}, _p(qlen=2, causal=False), "cpu"),
    ("cprr/triton", {**T16, "num_splits": 2}, _p(heads=2, qlen=2, dcp=2), "cpu"),
    ("segmented/triton", {**T16, "num_segments": 2}, _p(heads=2, qlen=2, dcp=2), "cpu"),
    ("segmented/triton", {**T16, "num_segments": 2, "fold": True},
     _p(heads=2, qlen=3, dcp=2, kv=FN), "cpu"),
    ("dense/flashmla", {}, _p(q="bf16", kv="bf16", page=64), "h200"),
    ("dense/flashmla", {}, _p(qlen=2, q="bf16", kv="bf16", page=64), "h200"),
    ("dense/flashmla", {}, _p(q="bf16", kv="bf16", page=64, dcp=2), "h200"),
    ("fa2/flashinfer", {}, _p(q="bf16", kv="bf16", page=16), "h200"),
    ("fa2/flashinfer", {}, _p(qlen=2, q="bf16", kv="bf16", page=16), "h200"),
    ("padded/aiter", {}, _p(q="bf16", kv="bf16", page=16), "mi355"),
    ("padded/aiter", {}, _p(heads=12, qlen=2, q="bf16", kv="bf16", page=16), "mi355"),
    ("cprr/aiter", {}, _p(qlen=3, q="bf16", kv="bf16", dcp=2, page=16), "mi355"),
    ("gluon/aiter", {}, _p(qlen=2, q="bf16", kv="bf16", page=16), "mi355"),
    ("segmented/aiter", {}, _p(heads=2, qlen=2, q="bf16", kv="bf16", dcp=2, page=16), "mi355"),
]
DEVICES = {"cpu": cpu_device(), "h200": H200, "mi355": MI355}


def _label(case) -> str:
    route_id, params, p, _ = case
    extra = "-".join(f"{k}{v}" for k, v in params.items() if k not in T16)
    return (f"{route_id}-{extra}-q{p.qlen}-dcp{p.dcp_size}-{p.kv_dtype}"
            f"{'' if p.causal else '-noncausal'}")


# --- libraries that leave rows without keys as FlashMLA does -----------------------------
class LeavesEmptyRowsAiter(FakeAiter):
    """The fake AITER, whose ASM decode and Gluon leave NaN (and +inf LSE) in the rows of a
    request without keys, as a kernel may: the route must write them."""

    def mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, kv_indptr, *args, **kwargs):
        o, lse = super().mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, *args, **kwargs)
        for b in torch.nonzero(kv_indptr[1:] == kv_indptr[:-1]).flatten().tolist():
            o[int(qo_indptr[b]):int(qo_indptr[b + 1])] = float("nan")
            if lse is not None:
                lse[int(qo_indptr[b]):int(qo_indptr[b + 1])] = float("inf")
        return o, lse

    def mla_gluon(self, q_nope, q_pe, kv_c, o, page_table, seq_info, *args, **kwargs):
        super().mla_gluon(q_nope, q_pe, kv_c, o, page_table, seq_info, *args, **kwargs)
        empty = (seq_info[1:] == seq_info[:-1]).tolist()
        for b in (b for b, e in enumerate(empty) if e):
            o[b] = float("nan")


@pytest.fixture(autouse=True)
def libraries(monkeypatch, tmp_path):
    """Every vendor fake installed; their caches cleared before and after."""
    for clear in (flashmla.library.cache_clear, flashinfer.library.cache_clear,
                  probe.cache_clear):
        clear()
    FakeFlashMLA().install(monkeypatch)
    FakeFlashInfer().install(monkeypatch)
    LeavesEmptyRowsAiter(tmp_path).install(monkeypatch)
    yield
    for clear in (flashmla.library.cache_clear, flashinfer.library.cache_clear,
                  probe.cache_clear):
        clear()


# --- inputs ------------------------------------------------------------------------------
class Batch:
    """Decode inputs whose every request has pages for CAP keys, its lengths set by
    ``write`` in place, and NaN in each cache slot past a request's length."""

    def __init__(self, problem: MLAProblem, seed: int):
        self.inputs = make_decode_inputs(problem, seed=seed)  # every length CAP
        self.clean = [s.kv_cache.clone() for s in self.inputs.shards]

    def write(self, lens: list[int]) -> None:
        inputs = self.inputs
        inputs.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for shard, clean in zip(inputs.shards, self.clean, strict=True):
            local = shard_lengths(inputs.seq_lens, shard.rank, inputs.dcp_size)
            shard.seq_lens.copy_(local)
            shard.kv_cache.copy_(clean)
            page = shard.kv_cache.shape[1]
            for b, n in enumerate(local.tolist()):
                for j, page_id in enumerate(shard.block_table[b].tolist()):
                    if n < (j + 1) * page:  # stale slots from max(0, n - j * page) on
                        shard.kv_cache[page_id, max(0, n - j * page):] = float("nan")

    def expected(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.decode_shard(self.inputs, self.inputs.shards[rank], torch.float64)


def rows_without_keys(lens: list[int], qlen: int, causal: bool, rank: int) -> torch.Tensor:
    """Which query rows attend no key on ``rank`` (the convention, written out)."""
    last = [n - qlen + t if causal else n - 1 for n in lens for t in range(qlen)]
    return torch.tensor([x < rank for x in last])


def assert_served(problem, route, out, lse, want, empty: torch.Tensor, what: str) -> None:
    """Live rows match the reference; rows without keys are exactly 0 and -inf."""
    want_out, want_lse = want
    assert torch.equal(torch.isneginf(want_lse).all(-1), empty), "the reference's empty rows"
    acc = check(problem, out, want_out, lse, want_lse if lse is not None else None,
                rounding=routes.rounding(route, problem))
    assert acc.ok, f"{what}: {acc.reason} ({acc.summary})"
    assert (out[empty] == 0).all(), f"{what}: output of rows without keys"
    if lse is not None:
        assert torch.isneginf(lse[empty]).all(), f"{what}: LSE of rows without keys"


# --- each route, prepared as a sweep or an engine does ------------------------------------
def _lengths(problem: MLAProblem) -> list[list[int]]:
    """Ragged with an empty and a short request; live ones emptied and an empty one filled
    in place; every request empty."""
    short = max(1, problem.qlen - 1)
    return [[CAP, 0, short, 13], [0, 17, 0, 1], [0] * problem.batch]


@pytest.mark.parametrize("case", CASES, ids=_label)
def test_rows_without_keys_are_zero_and_minus_inf(case):
    route_id, params, problem, device = case
    route = routes.get(route_id)
    assert route.supports(problem, DEVICES[device])
    assert route.serves_empty(problem, params)
    batch = Batch(problem, seed=len(route_id) + problem.qlen)
    steps = _lengths(problem)
    batch.write(steps[0])
    ranks = range(problem.dcp_size)
    prepared = [route.prepare(problem, batch.inputs, rank=r, params=params) for r in ranks]
    for n, lens in enumerate(steps):
        if n:
            batch.write(lens)
            if n == 2:  # an engine's padding rows point at no pages
                for shard in batch.inputs.shards:
                    shard.block_table.fill_(-1)
        for r in ranks:
            p = prepared[r]
            if n and p.step_kind.plan_on == "host":  # planned on the host: prepared again
                p = prepared[r] = route.prepare(problem, batch.inputs, rank=r, params=params)
            poison_(p.out, p.lse)
            if n:
                p.step()  # the device plan (if any) from the lengths now, then the launch
            else:
                p.run()
            empty = rows_without_keys(lens, problem.qlen, problem.causal, r)
            assert_served(problem, route, p.out, p.lse, batch.expected(r), empty,
                          f"lengths {lens}, rank {r}")


def test_the_cases_cover_every_decode_route_the_cpu_runs():
    """Every registered decode route but the Hopper Gluon kernels (GPU only: the GPU test)."""
    mine = [r for r in routes.all_routes() if type(r).__module__.startswith("mlatune.")]
    decode_ids = {r.id for r in mine if r.supports(_p(), cpu_device())
                  or r.supports(_p(q="bf16", kv="bf16", page=64), H200)
                  or r.supports(_p(q="bf16", kv="bf16", page=16), MI355)}
    gpu_only = {"wgmma/gluon", "seesaw/gluon", "transposed/gluon", "transposed-mma8/gluon",
                "fa3/flashinfer"}
    assert decode_ids - gpu_only <= {case[0] for case in CASES}


# --- through attention.decode and prepare_decode -------------------------------------------
def _forced(problem: MLAProblem, route_id: str, params: dict, tmp_path,
            device: DeviceInfo) -> Dispatcher:
    """A dispatcher whose table has ``route_id`` fastest at the problem."""
    rows = [result_row(problem, route_id, 1.0, device=device, params=params),
            result_row(problem, "reference/torch", 9.0, device=device)]
    return Dispatcher.load(table.write(make_table(rows), tmp_path / "t.parquet"), device=device)


def _decode_ranks(inputs: DecodeInputs, dispatcher, outs, lses, **kw):
    """decode() on every rank into the caller's (poisoned) buffers; the ranks merged."""
    p = inputs.problem
    for shard, out, lse in zip(inputs.shards, outs, lses, strict=True):
        poison_(out, lse)
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=p.num_heads, qlen=p.qlen, causal=p.causal,
                         kv_scale=inputs.kv_scale, q_scale=inputs.q_scale, out=out,
                         lse_out=lse, dcp_rank=shard.rank, dcp_size=p.dcp_size,
                         dispatcher=dispatcher, **kw)
    if len(outs) == 1:
        return outs[0], lses[0]
    return combine([o.float() for o in outs], list(lses))


@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[7], CASES[10], CASES[11]],
                         ids=_label)
def test_decode_serves_empty_and_short_requests(case, tmp_path):
    route_id, params, problem, device = case
    dispatcher = _forced(problem, route_id, params, tmp_path, DEVICES[device])
    batch = Batch(problem, seed=7)
    inputs = batch.inputs
    rows, heads = inputs.q.shape[0], problem.kernel_heads
    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[problem.out_dtype])
    outs = [torch.empty(rows, heads, problem.d_v, dtype=dtype) for _ in inputs.shards]
    lses = [torch.empty(rows, heads) for _ in inputs.shards]
    route = routes.get(route_id)
    for lens in _lengths(problem):
        batch.write(lens)
        for max_kv_len in (CAP, None):  # the engine's bound, or read from the lengths
            out, lse = _decode_ranks(inputs, dispatcher, outs, lses, max_kv_len=max_kv_len)
            empty = rows_without_keys(lens, problem.qlen, problem.causal, 0)  # on no rank
            want = reference.decode(inputs, torch.float64)
            assert_served(problem, route, out, lse, want, empty, f"decode {lens}")
    served = {s.choice.route_id for s in attention.plans_of(dispatcher).values()}
    assert served == {route_id}


@pytest.mark.parametrize("qlen", [1, 3])
def test_a_batch_of_empty_requests_is_served_not_refused(qlen):
    """All lengths 0, max_kv_len read from them (0) or given: zeros and -inf, from a step
    made for qlen keys (MLAProblem holds at least qlen), never a ValueError."""
    problem = _p(qlen=qlen)
    batch = Batch(problem, seed=11)
    batch.write([0] * problem.batch)
    inputs, shard = batch.inputs, batch.inputs.shards[0]
    dispatcher = Dispatcher.rules_only(cpu_device())
    for max_kv_len in (None, 0, 1):
        out, lse = attention.decode(inputs.q, shard.kv_cache, shard.block_table,
                                    inputs.seq_lens, num_heads=problem.num_heads, qlen=qlen,
                                    max_kv_len=max_kv_len, return_lse=True,
                                    dispatcher=dispatcher)
        assert (out == 0).all() and torch.isneginf(lse).all()
    kv_lens = {s.problem.kv_len for s in attention.plans_of(dispatcher).values()}
    assert kv_lens == {1 if qlen == 1 else 4}


@pytest.mark.parametrize(("route_id", "params", "problem"), [
    ("padded/triton", {**T16, "persistent": True, "num_workers": 2}, _p(qlen=2)),
    ("segmented/triton", {**T16, "num_segments": 2}, _p(heads=2, qlen=2, dcp=2)),
], ids=["persistent-plan", "segmented-dcp2"])
def test_a_held_step_follows_lengths_emptied_in_place(route_id, params, problem, tmp_path):
    """prepare_decode's step on every rank, then the lengths rewritten in place: live
    requests emptied and shortened below qlen, then every one emptied."""
    dispatcher = _forced(problem, route_id, params, tmp_path, cpu_device())
    batch = Batch(problem, seed=13)
    inputs = batch.inputs
    batch.write([CAP, 9, 0, 5])
    steps = [attention.prepare_decode(
        inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
        num_heads=problem.num_heads, qlen=problem.qlen, kv_scale=inputs.kv_scale,
        dcp_rank=shard.rank, dcp_size=problem.dcp_size, max_kv_len=CAP, return_lse=True,
        dispatcher=dispatcher) for shard in inputs.shards]
    assert {s.choice.route_id for s in steps} == {route_id}
    for lens in ([CAP, 9, 0, 5], [0, 1, 0, CAP], [0, 0, 0, 0]):
        batch.write(lens)
        outs, lses = [], []
        for step in steps:
            poison_(step.out, step.lse)
            out, lse = step()
            outs.append(out.float().clone())
            lses.append(lse.clone())
        out, lse = combine(outs, lses) if len(outs) > 1 else (outs[0], lses[0])
        empty = rows_without_keys(lens, problem.qlen, problem.causal, 0)
        assert_served(problem, routes.get(route_id), out, lse,
                      reference.decode(inputs, torch.float64), empty, f"held step {lens}")


class NoEmptyRoute(FakeRoute):
    """A route that leaves rows without keys undefined, and says so."""

    def serves_empty(self, problem, params):
        return False


def test_a_route_that_does_not_serve_empty_requests_is_not_served(tmp_path):
    problem = _p()
    fake = NoEmptyRoute("noempty/fake")
    routes.register(fake)
    try:
        dispatcher = _forced(problem, "noempty/fake", {}, tmp_path, cpu_device())
        assert dispatcher.select(problem).route_id == "noempty/fake"
        batch = Batch(problem, seed=17)
        batch.write([CAP, 3, 7, 1])  # no empty request now: a held step may meet one later
        inputs, shard = batch.inputs, batch.inputs.shards[0]
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=problem.num_heads, max_kv_len=CAP, dispatcher=dispatcher)
        assert fake.prepared == []
        served = {s.choice.route_id for s in attention.plans_of(dispatcher).values()}
        assert len(served) == 1 and "noempty/fake" not in served  # the next alternative
    finally:
        routes.unregister("noempty/fake")


@pytest.mark.parametrize(("lens", "max_kv_len", "message"), [
    ([CAP, -1, 0, 2], CAP, r"^seq_lens: request 1 has length -1; lengths are >= 0"),
    ([CAP, 0, 0, 2], -1, r"^max_kv_len: must be >= 0"),
    ([CAP, 0, 0, 2], 2.5, r"^max_kv_len: must be an int or None, got 2.5"),
])
def test_negative_lengths_are_refused_by_name(lens, max_kv_len, message):
    problem = _p()
    inputs = make_decode_inputs(problem, seed=19)
    inputs.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    shard = inputs.shards[0]
    with pytest.raises(DecodeArgumentError, match=message):
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=problem.num_heads, max_kv_len=max_kv_len,
                         dispatcher=Dispatcher.rules_only(cpu_device()))


def test_the_reference_defines_empty_and_short_rows():
    """Length 0 and the tokens of a short request before key 0 attend nothing (0, -inf);
    a short request's later tokens see the keys that exist (its causal window)."""
    problem = _p(qlen=3, batch=2)
    batch = Batch(problem, seed=23)
    batch.write([0, 2])  # request 1: token 0 sees nothing, token 1 key 0, token 2 keys 0-1
    out, lse = reference.decode(batch.inputs, torch.float64)
    assert (out[:4] == 0).all() and torch.isneginf(lse[:4]).all()
    shard = batch.inputs.shards[0]
    k = shard.kv_cache[int(shard.block_table[1, 0]), :2].double()
    q = batch.inputs.q[4:6].double()  # tokens 1 and 2 of request 1
    scores = torch.einsum("thd,nd->thn", q, k) * problem.softmax_scale
    scores[0, :, 1] = float("-inf")  # token 1 does not see key 1
    want = torch.softmax(scores, -1) @ k[:, :problem.d_v]
    assert torch.allclose(out[4:6], want, atol=1e-9)
    assert torch.allclose(lse[4:6], torch.logsumexp(scores, -1), atol=1e-9)
