"""The Triton decode routes against the torch reference (CPU: the Triton interpreter).

A covering design, not the cartesian product: each route gets a short list of
cases that together exercise every value it supports of every axis (kernel
heads {1, 4, 8, 12, 16, 24, 48, 128}, qlen {1..4}, dcp {1, 2, 4}, page size
{1, 16, 64}, KV fp16 / e4m3fn / e4m3fnuz) and of its parameters (splits,
direct write, persistent schedule, row-block sizes); ``test_cases_cover_every_axis``
fails if an edit drops a value. Every case uses ragged lengths, fresh seeds,
NaN-poisoned outputs, and checks every DCP rank's partial out and LSE, then the
ranks merged by the Triton merge kernel against the full reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from mlatune import routes
from mlatune.arch import DeviceInfo, cpu_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs, poison_
from mlatune.lse import combine
from mlatune.problem import MLAProblem
from mlatune.routes.triton_decode import row_padding

HEADS = {1, 4, 8, 12, 16, 24, 48, 128}
QLENS = {1, 2, 3, 4}
DCPS = {1, 2, 4}
PAGES = {1, 16, 64}
KV_DTYPES = {"fp16", "fp8_e4m3fn", "fp8_e4m3fnuz"}

# Small tiles keep the interpreter quick; real sizes are the GPU tests' job.
T16 = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
T32 = {**T16, "block_m": 32}
T64 = {**T16, "block_m": 64}


@dataclass(frozen=True)
class Case:
    kernel_heads: int
    qlen: int
    dcp: int
    page: int
    kv: str
    params: dict = field(hash=False)
    q_fp8: bool = False  # fp8 q of the KV's format (else fp16 q)
    kv_len: int = 72
    batch: int = 3
    causal: bool = True

    def problem(self) -> MLAProblem:
        q = self.kv if self.q_fp8 else "fp16"
        return MLAProblem(num_heads=self.kernel_heads // self.dcp, qlen=self.qlen,
                          q_dtype=q, kv_dtype=self.kv, batch=self.batch, kv_len=self.kv_len,
                          dcp_size=self.dcp, page_size=self.page, causal=self.causal)

    def __str__(self) -> str:
        extra = "-".join(f"{k}{v}" for k, v in self.params.items() if k not in T16)
        return (f"h{self.kernel_heads}-q{self.qlen}-dcp{self.dcp}-p{self.page}-{self.kv}"
                f"{'-qfp8' if self.q_fp8 else ''}{'' if self.causal else '-noncausal'}-"
                f"bm{self.params['block_m']}-{extra}")


FN, FNUZ = "fp8_e4m3fn", "fp8_e4m3fnuz"
CASES: dict[str, list[Case]] = {
    "padded/triton": [
        Case(1, 1, 1, 1, "fp16", {**T16, "num_splits": 2}),
        Case(4, 2, 2, 16, FN, {**T16, "num_splits": 1, "kv_twice": True}),
        Case(8, 3, 4, 64, FNUZ, {**T16, "persistent": True, "num_workers": 3}, q_fp8=True),
        Case(12, 4, 1, 16, "fp16", {**T32, "num_splits": 3}),
        Case(16, 1, 2, 64, "fp16", {**T16, "persistent": True, "kv_twice": True}),
        Case(24, 2, 4, 1, FN, {**T16, "num_splits": 2}, q_fp8=True),
        Case(48, 3, 1, 16, FNUZ, {**T64, "num_splits": 2}),
        Case(128, 1, 4, 64, "fp16", {**T64, "persistent": True, "num_workers": 2}),
        Case(12, 3, 2, 16, "fp16", {**T16, "num_splits": 2}, causal=False),
        # Every window tiny: ranks and tokens with no key at all (out 0, LSE -inf).
        Case(8, 4, 4, 1, "fp16", {**T16, "num_splits": 2}, kv_len=5),
    ],
    "gluon/triton": [
        Case(1, 4, 1, 16, "fp16", {**T16, "num_splits": 2}),
        Case(4, 1, 1, 1, FN, {**T16, "num_splits": 1}),
        Case(8, 2, 1, 64, FNUZ, {**T16, "num_splits": 3, "kv_twice": True}, q_fp8=True),
        Case(12, 3, 1, 16, "fp16", {**T64, "num_splits": 1}),
        Case(4, 1, 1, 16, "fp16", {**T16, "num_splits": 1}, causal=False),
        Case(4, 4, 1, 1, "fp16", {**T16, "num_splits": 2}, kv_len=4),
    ],
    "cprr/triton": [
        Case(4, 3, 2, 1, "fp16", {**T16, "num_splits": 2}),
        Case(8, 1, 4, 16, FN, {**T16, "num_splits": 1}),
        Case(12, 4, 4, 64, FNUZ, {**T16, "num_splits": 3}, q_fp8=True),
        Case(16, 2, 2, 16, "fp16", {**T16, "num_splits": 2, "kv_twice": True}),
        Case(24, 1, 2, 64, "fp16", {**T32, "num_splits": 1}),
        Case(48, 3, 4, 16, FN, {**T64, "num_splits": 2}),
        Case(128, 2, 2, 1, "fp16", {**T64, "num_splits": 2}, batch=2),
        Case(8, 4, 4, 16, "fp16", {**T16, "num_splits": 2}, kv_len=5),
    ],
    "segmented/triton": [
        Case(4, 2, 2, 1, "fp16", {**T16, "num_segments": 2}),
        Case(8, 3, 4, 16, FN, {**T16, "num_segments": 1}),
        Case(12, 4, 4, 64, FNUZ, {**T16, "num_segments": 3}, q_fp8=True),
        Case(16, 2, 2, 64, "fp16", {**T16, "num_segments": 2}),
        Case(24, 3, 2, 16, "fp16", {**T32, "num_segments": 2, "kv_twice": True}),
        Case(48, 4, 4, 1, FN, {**T64, "num_segments": 2}),
        # page 256: the segment tile caps at 128 and the kernel's tile (16) is a part of it.
        Case(128, 2, 4, 256, "fp16", {**T64, "num_segments": 2}, batch=2),
        Case(8, 4, 4, 16, "fp16", {**T16, "num_segments": 2}, kv_len=5),
        # A request's tokens folded into the rows: blocks spanning tokens, tokens spanning
        # blocks, tiny windows, fp8 caches (upcast tiles) under fp16 and fp8 q.
        Case(16, 4, 2, 16, "fp16", {**T64, "num_segments": 2, "fold": True}),
        Case(12, 3, 4, 64, "fp16", {**T16, "num_segments": 3, "fold": True}),
        Case(8, 4, 4, 1, "fp16", {**T32, "num_segments": 2, "fold": True}, kv_len=5),
        Case(24, 2, 2, 16, FN, {**T32, "num_segments": 1, "fold": True, "kv_twice": True}),
        Case(4, 3, 2, 64, FNUZ, {**T16, "num_segments": 2, "fold": True}, q_fp8=True),
    ],
}
# What each route can serve of each axis (its supports() refuses the rest).
SERVABLE = {
    "padded/triton": dict(heads=HEADS, qlen=QLENS, dcp=DCPS),
    "gluon/triton": dict(heads={h for h in HEADS if h < 16}, qlen=QLENS, dcp={1}),
    "cprr/triton": dict(heads=HEADS - {1}, qlen=QLENS, dcp=DCPS - {1}),
    "segmented/triton": dict(heads=HEADS - {1}, qlen=QLENS - {1}, dcp=DCPS - {1}),
}
_SEEDS = iter(range(1000, 100000))  # a fresh seed for every case


def _run_route(route_id: str, problem: MLAProblem, params: dict, seed: int,
               want_lse: bool = True):
    """Every rank's partial checked against the reference; returns the ranks' (out, lse)."""
    route = routes.get(route_id)
    verdict = route.supports(problem, cpu_device())
    assert verdict, verdict.reason
    inputs = make_decode_inputs(problem, seed=seed, ragged=True)
    outs, lses = [], []
    for rank in range(problem.dcp_size):
        want_out, want_lse_ = reference.decode_shard(inputs, inputs.shards[rank], torch.float64)
        prepared = route.prepare(problem, inputs, rank=rank, params=params, want_lse=want_lse)
        poison_(prepared.out, prepared.lse)
        prepared.run()
        assert prepared.out.dtype == getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[
            problem.out_dtype])
        acc = check(problem, prepared.out, want_out, prepared.lse, want_lse_)
        assert acc.ok, f"rank {rank}: {acc.reason} ({acc.summary})"
        outs.append(prepared.out)
        lses.append(prepared.lse)
    return inputs, outs, lses


@pytest.mark.parametrize(("route_id", "case"),
                         [(r, c) for r, cases in CASES.items() for c in cases], ids=str)
def test_route_matches_reference(route_id: str, case: Case):
    problem = case.problem()
    inputs, outs, lses = _run_route(route_id, problem, case.params, next(_SEEDS))
    if problem.dcp_size > 1:
        from mlatune.kernels.merge import merge_partials_into

        out = torch.empty_like(outs[0])
        lse = torch.empty_like(lses[0])
        poison_(out, lse)
        merge_partials_into(torch.stack(outs), torch.stack(lses), out, lse)
        want = reference.decode(inputs, torch.float64)
        acc = check(problem, out, want[0], lse, want[1])
        assert acc.ok, f"merged: {acc.reason} ({acc.summary})"


def test_cases_cover_every_axis():
    for route_id, cases in CASES.items():
        servable = SERVABLE[route_id]
        assert {c.kernel_heads for c in cases} == servable["heads"], route_id
        assert {c.qlen for c in cases} == servable["qlen"], route_id
        assert {c.dcp for c in cases} == servable["dcp"], route_id
        assert {c.page for c in cases} >= PAGES, route_id
        assert {c.kv for c in cases} == KV_DTYPES, route_id
        assert any(c.q_fp8 for c in cases), route_id
        assert any(c.params.get("kv_twice") for c in cases), route_id
        if route_id == "segmented/triton":
            folded = [c for c in cases if c.params.get("fold")]
            assert {c.qlen for c in folded} == servable["qlen"], route_id
            assert {c.kv for c in folded} == KV_DTYPES, route_id
        splits = {c.params.get("num_splits", c.params.get("num_segments")) for c in cases}
        assert 1 in splits and len(splits - {None}) >= 3, route_id
        for case in cases:
            assert routes.get(route_id).supports(case.problem(), cpu_device()), (route_id, case)


def test_without_lse_and_rerun_rewrites_everything():
    """want_lse=False gives no LSE; a second run after re-poisoning writes every element again."""
    problem = MLAProblem(num_heads=4, qlen=2, q_dtype="fp16", kv_dtype="fp16", batch=2,
                         kv_len=40, page_size=16, dcp_size=2)
    inputs = make_decode_inputs(problem, seed=next(_SEEDS), ragged=True)
    for route_id, params in [("padded/triton", {**T16, "persistent": True, "num_workers": 2}),
                             ("cprr/triton", {**T16, "num_splits": 1}),
                             ("segmented/triton", {**T16, "num_segments": 2})]:
        prepared = routes.get(route_id).prepare(problem, inputs, rank=1, params=params,
                                                want_lse=False)
        assert prepared.lse is None and prepared.graph_safe
        want_out, _ = reference.decode_shard(inputs, inputs.shards[1], torch.float64)
        for _ in range(2):
            poison_(prepared.out)
            prepared.run()
            acc = check(problem, prepared.out, want_out)
            assert acc.ok, f"{route_id}: {acc.reason}"


def test_default_params_run_on_the_cpu():
    """prepare() without params takes the first of param_space: it must run."""
    problem = MLAProblem(num_heads=2, qlen=3, q_dtype="fp16", kv_dtype="fp16", batch=2,
                         kv_len=33, page_size=16, dcp_size=2)
    for route_id in ("padded/triton", "cprr/triton", "segmented/triton"):
        _run_route(route_id, problem, None, next(_SEEDS))


# -- padding ------------------------------------------------------------------------
@pytest.mark.parametrize(("heads", "target"),
                         [(1, 16), (4, 16), (8, 16), (16, 16), (12, 16), (24, 32), (48, 48),
                          (6, 32), (12, 64), (48, 64), (128, 128)])
def test_row_padding_is_the_seeds(heads: int, target: int):
    """Layout head h reads the head the seed's padding puts there; kept heads unpad exactly."""
    q = torch.arange(heads)[None, :]
    if target == heads:
        padded = q
        unpadded_idx = torch.arange(heads)
    elif target % heads == 0:
        padded = q.repeat_interleave(target // heads, dim=1)
        unpadded_idx = torch.arange(0, target, target // heads)
    else:
        padded = q.repeat(1, -(-target // heads))[:, :target]
        unpadded_idx = torch.arange(heads)
    row_heads, rep = row_padding(heads, target)
    assert row_heads == target
    layout = torch.tensor([(h // rep) % heads for h in range(row_heads)])
    assert torch.equal(layout, padded[0])
    kept = [h for h in range(row_heads) if h % rep == 0 and h // rep < heads]
    assert kept == unpadded_idx.tolist()
    assert [h // rep for h in kept] == list(range(heads))


# -- the DCP merge kernel -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_kernel_matches_torch(dtype):
    from mlatune.kernels.merge import merge_partials_into

    gen = torch.Generator().manual_seed(next(_SEEDS))
    ranks, tokens, heads, dim = 3, 5, 6, 40  # dim not a power of two: masked lanes
    outs = torch.randn(ranks, tokens, heads, dim, generator=gen).to(dtype)
    lses = torch.randn(ranks, tokens, heads, generator=gen) * 3
    lses[1, 0] = -math.inf  # one rank saw nothing for token 0
    lses[:, 1, 2] = -math.inf  # no rank saw (token 1, head 2)
    # An empty partial's output is garbage (FlashMLA leaves NaN or inf there): unread.
    outs[1, 0] = math.nan
    outs[:, 1, 2] = math.inf
    want_out, want_lse = combine(list(outs.double()), list(lses.double()))
    assert want_out.isfinite().all() and (want_out[1, 2] == 0).all()
    out = torch.empty(tokens, heads, dim, dtype=dtype)
    lse = torch.empty(tokens, heads)
    poison_(out, lse)
    merge_partials_into(outs, lses, out, lse)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    assert torch.isneginf(lse[1, 2]) and torch.isfinite(lse[0]).all()
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


# -- the split reduce kernel ---------------------------------------------------------
@pytest.mark.parametrize(("blocks", "counts", "hint"), [
    ((2, 16), [3, 0, 1, 4], None), ((16, 64), [3, 0, 1, 4], None),
    ((16, 64), [20, 0, 1, 17], None), ((2, 16), [33, 2, 0, 16], None),  # blocks
    ((2, 16), [33, 2, 0, 16], 2),  # a slot hint below the counts (a device plan's)
    ((1, 64), [3, 0, 1, 4], None), ((1, 64), [33, 2, 0, 16], None),  # a row each
])
def test_reduce_kernel_matches_torch(blocks, counts, hint):
    """Slots of varying count per group (none for one), padded rows sliced by head_rep;
    any count is merged whatever ``max_slots`` says."""
    check_reduce(blocks, counts, hint, next(_SEEDS), "cpu")


@pytest.mark.parametrize(("blocks", "slots"), [
    ((2, 16), 1), ((16, 64), 3), ((1, 64), 8),  # one pass: a slot block
    ((2, 16), 16), ((16, 64), 20),  # 20 slots: two passes over 16-slot blocks
])
def test_reduce_kernel_over_uniform_slots_matches_torch(blocks, slots):
    """``uniform``: every group has ``slots`` slots, the indptr not read (a stand-in full of
    wrong offsets is passed), up to a slot block in one pass of the LSEs and outputs."""
    check_reduce(blocks, [slots] * 3, None, next(_SEEDS), "cpu", uniform=True)


@pytest.mark.parametrize(("blocks", "counts", "hint"), [
    ((2, 16), [1, 3, 0, 1, 2], None), ((1, 64), [2, 1], None),
    ((4, 64), [1, 3, 0, 1, 2, 5], 2),  # the balanced form's hint: groups past it, two passes
])
def test_reduce_kernel_leaves_groups_of_one_slot_in_place(blocks, counts, hint):
    """``one_in_place``: a group of exactly one slot was written by the kernel itself (the
    seesaw decode's balanced form): its rows keep what they hold; the others are merged
    (one pass where they fit a slot block, two past it), a group of none written as
    empty."""
    check_reduce(blocks, counts, hint, next(_SEEDS), "cpu", one_in_place=True)


def check_reduce(blocks: tuple[int, int] | None, counts: list[int],
                 hint: int | None, seed: int, device: str, *, tokens: int = 2, q_heads: int = 3,
                 rep: int = 2, d_v: int = 64, pdl: bool = False, uniform: bool = False,
                 one_in_place: bool = False) -> None:
    """``reduce_launcher`` over groups of ``counts`` slots against a torch merge (also the
    GPU tests' body, on ``device``). ``uniform``: the launcher told every group has
    ``max(counts)`` slots, and handed an indptr of wrong offsets it must not read;
    ``one_in_place``: groups of one slot must keep their poisoned rows. Slots that saw no
    key of a row (LSE -inf) weigh nothing; a row none of its group's slots saw gets output 0
    and LSE -inf."""
    from mlatune.kernels.reduce import reduce_launcher

    gen = torch.Generator().manual_seed(seed)
    row_heads = q_heads * rep
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    slots, rows = int(indptr[-1]), tokens * row_heads
    part_out = torch.randn(slots, rows, d_v, generator=gen)
    lse2 = torch.randn(slots, rows, generator=gen) * 4
    lse2[0, :2] = -math.inf  # one slot saw no key for two rows (row 0 is a kept one)
    part_out[0, :2] = 0
    full = next((g for g, n in enumerate(counts) if n >= 2), None)
    if full is not None:  # a kept row no slot of its group saw (a segment's empty window)
        first, row = int(indptr[full]), (tokens - 1) * row_heads + (q_heads - 1) * rep
        lse2[first:first + counts[full], row] = -math.inf
        part_out[first:first + counts[full], row] = 0
    out = torch.empty(len(counts) * tokens, q_heads, d_v, device=device)
    lse = torch.empty(len(counts) * tokens, q_heads, device=device)
    poison_(out, lse)
    given = torch.full_like(indptr, slots + 7) if uniform else indptr
    on = (part_out.to(device), lse2.to(device), given.to(device))
    reduce_launcher(*on, out, lse, tokens_per_group=tokens, q_heads=q_heads,
                    row_heads=row_heads, head_rep=rep, max_slots=hint or max(counts),
                    blocks=blocks, pdl=pdl, uniform=uniform, one_in_place=one_in_place)()
    out, lse = out.cpu(), lse.cpu()
    for g, n in enumerate(counts):
        first = int(indptr[g])
        for t in range(tokens):
            kept = [t * row_heads + h * rep for h in range(q_heads)]
            o, lg = out[g * tokens + t], lse[g * tokens + t]
            if one_in_place and n == 1:
                assert torch.isnan(o).all() and torch.isnan(lg).all()
                continue
            if n == 0:
                assert torch.all(o == 0) and torch.all(torch.isneginf(lg))
                continue
            ln = lse2[first:first + n][:, kept] * math.log(2)  # (n, heads)
            want_lse = torch.logsumexp(ln, 0)
            w = torch.exp(ln - want_lse).nan_to_num(0.0)
            want = (w[..., None] * part_out[first:first + n][:, kept]).sum(0)
            torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lg, want_lse, rtol=1e-5, atol=1e-5)


# -- capability rules ---------------------------------------------------------------
H200 = DeviceInfo("sm_90", "NVIDIA H200", "nvidia", 132, 141 << 30, 0)
MI355 = DeviceInfo("gfx950", "AMD Instinct MI355X", "amd", 256, 288 << 30, 0)
A100 = DeviceInfo("sm_80", "NVIDIA A100", "nvidia", 108, 80 << 30, 0)


@pytest.mark.parametrize(("route_id", "problem", "device", "reason"), [
    ("gluon/triton", MLAProblem(num_heads=16), H200, "< 16"),
    ("gluon/triton", MLAProblem(num_heads=4, dcp_size=2), H200, "DCP"),
    ("gluon/triton", MLAProblem(num_heads=4, qlen=9), H200, "qlen 9"),
    ("gluon/triton", MLAProblem(num_heads=4, qlen=2, causal=False), H200, "non-causal"),
    ("segmented/triton", MLAProblem(num_heads=4, qlen=2), H200, "dcp_size"),
    ("segmented/triton", MLAProblem(num_heads=4, dcp_size=2), H200, "qlen > 1"),
    ("segmented/triton", MLAProblem(num_heads=4, qlen=2, dcp_size=2, causal=False), H200,
     "causal"),
    ("cprr/triton", MLAProblem(num_heads=16), H200, "DCP"),
    ("cprr/triton", MLAProblem(num_heads=80, dcp_size=2), H200, "> 128"),
    ("padded/triton", MLAProblem(num_heads=136), H200, "128"),
    ("padded/triton", MLAProblem(phase="prefill", num_heads=16, qlen=8, kv_len=8), H200,
     "decode"),
    ("padded/triton", MLAProblem(kv_dtype="fp8_e4m3fnuz"), H200, "fnuz"),
    ("padded/triton", MLAProblem(kv_dtype="fp8_e4m3fn"), A100, "sm_89"),
    ("padded/triton", MLAProblem(kv_lora_rank=500), H200, "power of two"),
])
def test_refusals_say_why(route_id, problem, device, reason):
    verdict = routes.get(route_id).supports(problem, device)
    assert not verdict and reason in verdict.reason


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    verdict = routes.get("padded/triton").supports(MLAProblem(), cpu_device())
    assert not verdict and "TRITON_INTERPRET" in verdict.reason


@pytest.mark.parametrize("problem", [
    MLAProblem(num_heads=16, batch=1, kv_len=4096), MLAProblem(num_heads=128, batch=128),
    MLAProblem(num_heads=8, batch=64, kv_dtype="fp8_e4m3fn", qlen=4),
    MLAProblem(num_heads=16, dcp_size=4, qlen=3, batch=32, kv_len=32768),
])
def test_param_spaces_are_small_and_valid(problem):
    for device in (H200, MI355):
        for route in routes.viable(problem, device):
            if not route.id.endswith("/triton"):
                continue
            space = route.param_space(problem, device)
            assert 1 <= len(space) <= 13, (route.id, space)
            for p in space:
                assert p["block_m"] in (16, 32, 64) and p["block_n"] in (16, 32, 64)
                splits = p.get("num_splits", p.get("num_segments"))
                assert p.get("persistent") or splits >= 1
            assert len({tuple(sorted(p.items())) for p in space}) == len(space)
