"""The Gluon routes (``wgmma/gluon``, ``seesaw/gluon``, ``transposed/gluon``: mlatune's
Hopper Gluon decodes) on an sm_90 GPU (``pytest -m gpu``).

The Triton routes' checks, imported: every parameter set against the fp32 reference
on ragged lengths with NaN-poisoned outputs, DCP ranks' partials merged by their LSEs,
CUDA-graph capture (same lengths, every replay rewriting every element), and an
engine's captured step through ``attention.decode`` replayed as the lengths and page
ids change in place. Over bf16 and fp16, qlen 1-4 and 8, causal and not, 1-128 heads
(heads x qlen below, at and across the kernel's 64-row blocks), DCP 2 and 4, batch
1-128, KV up to 32k; and stale cache slots (past a request's length in its last
page) set to NaN, which the kernel must not let through. Skipped, with the reason,
off sm_90 or without triton 3.6.x (the kernel's Gluon API).
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch
import triton

from mlatune import routes
from mlatune.arch import current_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs, poison_
from tests.helpers import poison_stale_slots
from tests.test_engine_gpu import _p as _engine_p
from tests.test_engine_gpu import test_a_captured_step_replays_with_new_lengths as _captured
from tests.test_triton_decode_gpu import (
    _label,
    _needs_a_gpu,  # noqa: F401  (autouse: fail without a GPU)
    _p,
)
from tests.test_triton_decode_gpu import test_cuda_graph_replay as _replayed
from tests.test_triton_decode_gpu import test_route_at_real_size as _at_real_size

pytestmark = pytest.mark.gpu
GLUON = "wgmma/gluon"


@pytest.fixture(autouse=True)
def _needs_hopper_and_triton_36(_needs_a_gpu):  # noqa: F811  (the imported fixture, first)
    verdict = routes.get(GLUON).supports(_p(16, 1, 4096), current_device())
    if not verdict:
        pytest.skip(verdict.reason)


SEESAW = "seesaw/gluon"  # the warp-specialized kernel: the same problems, every case
PROBLEMS = [
    (GLUON, _p(16, 1, 4096)),  # one request: the most splits
    (GLUON, _p(16, 64, 4096)),
    (GLUON, _p(128, 32, 4096)),  # two row blocks per request
    (GLUON, _p(128, 8, 32768)),
    (GLUON, _p(16, 64, 8192, qlen=2)),
    (GLUON, _p(32, 16, 4096, qlen=3, kv="fp16")),
    (GLUON, _p(16, 128, 4096, qlen=4)),
    (GLUON, _p(24, 12, 3000, qlen=3)),  # 72 rows: a block holds parts of two tokens
    (GLUON, _p(8, 16, 4096, qlen=4, causal=False)),  # 32 rows; non-causal verify
    (GLUON, _p(1, 5, 2000, qlen=8)),
    (GLUON, _p(16, 32, 4096, dcp=2)),  # 32 gathered heads, ranks merged
    (GLUON, _p(64, 16, 8192, dcp=4, kv="fp16")),
    (GLUON, _p(8, 16, 4096, qlen=2, dcp=2, causal=False)),
    (GLUON, _p(128, 128, 4096)),  # 256 programs: one split
    (GLUON, _p(16, 160, 3000)),  # 160 programs: the seesaw's two-requests set too
]
TRANSPOSED = "transposed/gluon"  # keys as the MMA's M: every case, and fp8 caches
MMA8 = "transposed-mma8/gluon"  # its fp8-MMA form: fp8 caches at up to 16 rows a program
FP8 = [  # transposed/gluon over fp8 (e4m3) caches: one split and several, verify, DCP
    (TRANSPOSED, _p(16, 1, 4096, kv="fp8_e4m3fn")),
    (TRANSPOSED, _p(16, 128, 8192, kv="fp8_e4m3fn")),
    (TRANSPOSED, _p(32, 16, 4096, qlen=3, kv="fp8_e4m3fn")),
    (TRANSPOSED, _p(16, 128, 4096, qlen=2, kv="fp8_e4m3fn")),
    (TRANSPOSED, _p(16, 32, 4096, dcp=2, kv="fp8_e4m3fn")),
    (TRANSPOSED, _p(16, 24, 3000, qlen=2, kv="fp8_e4m3fn", q="fp16")),  # fp16 MMAs over fp8
    # 16 rows a program: the widening, and the fp8-MMA route (an fp16 q's two e4m3 terms;
    # causal verify)
    (TRANSPOSED, _p(16, 24, 3000, kv="fp8_e4m3fn", q="fp16")),
    (TRANSPOSED, _p(8, 16, 4096, qlen=2, kv="fp8_e4m3fn")),
    (MMA8, _p(16, 24, 3000, kv="fp8_e4m3fn", q="fp16")),
    (MMA8, _p(8, 16, 4096, qlen=2, kv="fp8_e4m3fn")),
    (MMA8, _p(16, 1, 4000, kv="fp8_e4m3fn")),  # a last page partly filled: stale slots
]
# seesaw/gluon over fp8 caches (the tiles widened to fp16 by the loader, q's rows to fp16 by
# powers of two): 128, 64 and 16 heads, qlen 1 and 2, one split and several, two row blocks a
# request, past one wave (the two-requests set too), an fp16 q, pages 16 and 32; the bf16
# bound against the reference over the dequantized cache.
SEESAW_FP8 = [
    (SEESAW, _p(128, 16, 4096, kv="fp8_e4m3fn")),
    (SEESAW, _p(128, 160, 1500, kv="fp8_e4m3fn")),  # 320 programs at one split
    (SEESAW, _p(64, 24, 4096, qlen=2, kv="fp8_e4m3fn")),  # 128 rows: causal verify
    (SEESAW, _p(16, 64, 8192, kv="fp8_e4m3fn")),
    (SEESAW, _p(16, 1, 4000, kv="fp8_e4m3fn")),  # one request: many splits
    (SEESAW, _p(128, 3, 3000, qlen=2, kv="fp8_e4m3fn", q="fp16")),
    (SEESAW, _p(128, 8, 2000, qlen=2, kv="fp8_e4m3fn", page=16)),
    (SEESAW, _p(64, 16, 3000, kv="fp8_e4m3fn", page=32)),
]
CASES = PROBLEMS + [(SEESAW, problem) for _, problem in PROBLEMS] \
    + [(TRANSPOSED, problem) for _, problem in PROBLEMS] + FP8 + SEESAW_FP8


@pytest.mark.parametrize("item", CASES, ids=_label)
def test_gluon_route_at_real_size(item):
    _at_real_size(item)


GRAPHED = [5, 10, 13]


@pytest.mark.parametrize("item", [CASES[k * len(PROBLEMS) + i] for k in range(3)
                                  for i in GRAPHED] + FP8[:3:2], ids=_label)
def test_gluon_cuda_graph_replay(item):
    _replayed(item)


ENGINE_CASES = [_engine_p(16, 32, 4096), _engine_p(64, 16, 4096, qlen=2),
                _engine_p(16, 8, 4096, dcp=2), _engine_p(128, 4, 8192)]


@pytest.mark.parametrize("route_id", [GLUON, SEESAW, TRANSPOSED])
@pytest.mark.parametrize("problem", ENGINE_CASES, ids=lambda p: p.key)
def test_gluon_captured_step_replays_with_new_lengths(problem, route_id, tmp_path):
    _captured(route_id, False, problem, tmp_path)


@pytest.mark.parametrize("problem", [_engine_p(128, 32, 4096, kv="fp8_e4m3fn"),
                                     _engine_p(64, 16, 4096, qlen=2, kv="fp8_e4m3fn"),
                                     _engine_p(16, 4, 8192, kv="fp8_e4m3fn")],
                         ids=lambda p: p.key)
def test_seesaw_fp8_captured_step_replays_with_new_lengths(problem, tmp_path):
    """seesaw/gluon's first set over an fp8 cache as an engine runs it: captured once,
    replayed as lengths and pages change, within the bf16 bound at every replay."""
    _captured(SEESAW, False, problem, tmp_path)


@pytest.mark.parametrize("problem", [_engine_p(16, 32, 4096, kv="fp8_e4m3fn"),
                                     _engine_p(16, 2, 8192, kv="fp8_e4m3fn")],
                         ids=lambda p: p.key)
@pytest.mark.parametrize("route_id", [TRANSPOSED, MMA8])
def test_transposed_fp8_captured_step_replays_with_new_lengths(problem, route_id, tmp_path):
    """Each transposed route's first fp8 param set (at 16 query rows a program: the widening,
    and fp8 MMAs with the reduce as a dependent launch) as an engine runs it: captured once,
    replayed as lengths and pages change."""
    _captured(route_id, False, problem, tmp_path)


def _every_set_matches(route, problem, inputs, want_out, want_lse) -> None:
    """Each of the route's param sets on ``inputs``, outputs poisoned first, against the
    reference's ``want_out`` and ``want_lse``."""
    for params in route.param_space(problem, current_device()):
        prepared = route.prepare(problem, inputs, params=params)
        poison_(prepared.out, prepared.lse)
        prepared.run()
        torch.cuda.synchronize()
        acc = check(problem, prepared.out, want_out, prepared.lse, want_lse,
                    rounding=routes.rounding(route, problem, params))
        assert acc.ok, f"{params}: {acc.reason} ({acc.summary})"


@pytest.mark.parametrize("item", [CASES[k * len(PROBLEMS) + i] for k in range(3)
                                  for i in (1, 5, 7, 14)] + FP8[1:4] + FP8[5:] + SEESAW_FP8,
                         ids=_label)
def test_stale_cache_slots_hold_nan(item):
    route_id, problem = item
    route = routes.get(route_id)
    inputs = make_decode_inputs(problem, seed=zlib.crc32(_label(item).encode()) % 10_000,
                                device="cuda", ragged=True)
    want_out, want_lse = reference.decode_shard(inputs, inputs.shards[0])
    assert poison_stale_slots(inputs) > 0
    _every_set_matches(route, problem, inputs, want_out, want_lse)


@pytest.mark.parametrize("q_gain", [2.0 ** 17, 2.0 ** -20, "heads"])
@pytest.mark.parametrize(("route_id", "problem"),
                         [(SEESAW, _p(128, 4, 3000, qlen=2, kv="fp8_e4m3fn")),
                          (TRANSPOSED, _p(16, 4, 3000, kv="fp8_e4m3fn"))],
                         ids=["seesaw-h128-q2", "transposed-h16"])
def test_fp8_caches_keep_a_bf16_q_beyond_fp16s_range(q_gain, route_id, problem):
    """A bf16 q past fp16's range (|q| up to 2^17 x 4: fp16 ends at 65504) or under its
    normal numbers (2^-20 x: fp16 subnormals keep a few bits), the softmax scale divided by
    the gain (the same scores), and q's heads 2^-6 to 2^6 times (the scores as they come):
    every set stays within the bf16 bound over an fp8 cache. The seesaw scales each row to
    fp16 by its own power of two (128 heads, qlen 2); transposed/gluon widens the cache to
    q's dtype (16 heads)."""
    route = routes.get(route_id)
    inputs = make_decode_inputs(problem, seed=41, device="cuda", ragged=True)
    if q_gain == "heads":
        gains = 2.0 ** torch.arange(-6, 7, device="cuda").repeat(10)[:problem.num_heads]
        q = (inputs.q.float() * gains[None, :, None]).to(inputs.q.dtype)
        inputs = dataclasses.replace(inputs, q=q)
    else:
        inputs = dataclasses.replace(inputs, q=inputs.q * q_gain,
                                     sm_scale=problem.softmax_scale / q_gain)
    assert torch.isfinite(inputs.q).all()
    want_out, want_lse = reference.decode_shard(inputs, inputs.shards[0])
    _every_set_matches(route, problem, inputs, want_out, want_lse)


# The seesaw kernel's splits, each walk checked alone (before the reduce): 64 walks of one
# tile that end on a page boundary (no stale rows to zero), ragged odd walks, two row
# blocks a request, causal verify.
SPLIT_WALKS = [(16, 1, 4096, 1, 64), (16, 6, 700, 1, 3), (128, 4, 1000, 1, 2),
               (16, 4, 900, 4, 5)]
SEESAW_FORMS = ("pairs", "two-requests")  # gluon_seesaw.FORMS (imported there: triton)


@pytest.mark.parametrize("form", SEESAW_FORMS)
@pytest.mark.parametrize("case", SPLIT_WALKS, ids=lambda c: "h{}-b{}-kv{}-q{}-s{}".format(*c))
def test_seesaw_split_partials_match_their_own_keys(case, form, monkeypatch):
    """Each (request, split) partial the kernel writes, before the reduce merges them,
    against attention over that split's keys alone: a wrong walk shows here, apart from
    the reduce's part (``key_range``'s rule: BN-aligned chunks of cdiv(L, splits))."""
    from mlatune.check.accuracy import tolerance_for
    from mlatune.kernels import gluon_seesaw

    heads, batch, kv_len, qlen, splits = case
    problem = _p(heads, batch, kv_len, qlen=qlen)
    inputs = make_decode_inputs(problem, seed=sum(case), device="cuda", ragged=True)
    kept = {}
    real = gluon_seesaw.partials_and_merge

    def no_merge(*args, **kwargs):
        part_out, part_lse, _ = real(*args, **kwargs)
        kept.update(out=part_out, lse=part_lse)
        return part_out, part_lse, lambda: None

    monkeypatch.setattr(gluon_seesaw, "partials_and_merge", no_merge)
    shard = inputs.shards[0]
    launch, _, _ = gluon_seesaw.decode_launcher(
        inputs.q, shard.kv_cache, shard.block_table, shard.seq_lens, qlen=qlen,
        sm_scale=inputs.softmax_scale, causal=problem.causal, num_splits=splits, form=form)
    poison_(kept["out"], kept["lse"])
    launch()
    torch.cuda.synchronize()
    tol = tolerance_for("bf16", "bf16")
    for b, length in enumerate(shard.seq_lens.tolist()):
        chunk = triton.cdiv(triton.cdiv(length, splits), 64) * 64
        for k in range(splits):
            start, end = min(k * chunk, length), min(k * chunk + chunk, length)
            slot = b * splits + k
            _check_piece(problem, inputs, b, (start, end), kept["out"][slot].view(qlen, heads, -1),
                         kept["lse"][slot].view(qlen, heads) * math.log(2), tol,
                         f"request {b} ({length} keys), split {k} [{start}, {end})")


def _check_piece(problem, inputs, b, keys_range, got, got_lse, tol, where) -> None:
    """One piece of request b's output (its keys ``keys_range``: natural-log LSE, -inf where
    no key) against the reference over those keys."""
    qlen, (start, stop) = problem.qlen, keys_range
    shard = inputs.shards[0]
    length = int(shard.seq_lens[b])
    keys = reference.dequantize(reference._gather_pages(
        shard.kv_cache, shard.block_table[b:b + 1], length)[0], inputs.kv_scale,
        torch.float32)[:, None, :]
    tokens = torch.arange(qlen, device="cuda")
    last = length - qlen + tokens if problem.causal else torch.full_like(tokens, length - 1)
    q = inputs.q.float().view(problem.batch, qlen, problem.num_heads, -1)[b]
    want, want_lse = reference.attend(q, keys[start:stop], keys[start:stop, :, :512],
                                      torch.arange(start, stop, device="cuda"), last,
                                      inputs.softmax_scale)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), seen), where
    if seen.any():
        err = (got[seen] - want[seen]).norm() / want[seen].norm()
        assert err < tol.rel_l2, f"{where}: rel_l2 {err:.3g}"
        assert (got_lse[seen] - want_lse[seen]).abs().max() < tol.lse_abs, where


# Small pages: a 64-key tile spans 64 / page pages (16, 32: a TMA box a page; seesaw/gluon over
# a 16-bit cache gathers them by cp.async) or lies in one (128); pages of one key are gathered
# by cp.async. Each Gluon route at every param set (pages shuffled in the block table):
# ragged lengths with a last page partly filled (its slots past the length NaN), block-table
# entries past each request's pages (and four more columns) set to a page id the cache does
# not have (a gather that read one would fault).
SMALL_PAGES = [
    _p(128, 6, 700, page=16),  # two row blocks a request
    _p(8, 16, 3000, qlen=3, page=16),  # causal verify, 24 rows
    _p(16, 4, 2000, page=32),
    _p(16, 3, 1000, qlen=2, page=128),  # a tile inside a page
    _p(8, 24, 700, qlen=3, page=1),  # the page-1 shape, fewer requests
    _p(128, 4, 1500, page=1),
    _p(16, 3, 3000, qlen=2, page=1, kv="fp16"),
]
SMALL_PAGE_CASES = [(route_id, p) for route_id in (GLUON, SEESAW, TRANSPOSED)
                    for p in SMALL_PAGES] + [
    (TRANSPOSED, _p(16, 8, 3000, page=16, kv="fp8_e4m3fn")),  # the widening
    (TRANSPOSED, _p(32, 4, 2000, qlen=2, page=16, kv="fp8_e4m3fn")),
    (MMA8, _p(16, 8, 3000, page=16, kv="fp8_e4m3fn")),
    (TRANSPOSED, _p(16, 8, 3000, page=1, kv="fp8_e4m3fn")),  # fp8 halves gathered by cp.async
    (TRANSPOSED, _p(8, 24, 700, qlen=3, page=1, kv="fp8_e4m3fn")),  # causal, 24 rows: 32
    (SEESAW, _p(128, 6, 700, page=16, kv="fp8_e4m3fn")),  # the loader's widening
    (SEESAW, _p(64, 4, 2000, qlen=2, page=32, kv="fp8_e4m3fn")),
    # seesaw/gluon's gather at pages 16 and 32: an fp16 verify, and 160 programs (past one
    # wave: the two-requests set too; replayed in a graph)
    (SEESAW, _p(64, 12, 2500, qlen=2, page=32, kv="fp16")),
    (SEESAW, _p(16, 160, 3000, page=16)),
]
GARBAGE_PAGE = 1 << 30  # a page id past every cache here


def _garbage_past_the_pages(shard, extra: int = 0):
    """``shard`` with each block-table entry past its request's last page set to
    ``GARBAGE_PAGE``, in place; ``extra`` > 0: on a copy of the table with that many more
    columns (past the longest request's pages too)."""
    table = shard.block_table
    if extra:
        table = torch.cat([table, table.new_full((table.shape[0], extra), GARBAGE_PAGE)], 1)
    page = shard.kv_cache.shape[1]
    used = (shard.seq_lens.long() + page - 1) // page
    cols = torch.arange(table.shape[1], device=table.device)
    table[cols[None, :] >= used[:, None]] = GARBAGE_PAGE
    return dataclasses.replace(shard, block_table=table)


@pytest.mark.parametrize("item", SMALL_PAGE_CASES, ids=_label)
def test_small_pages_match_the_reference(item):
    route_id, problem = item
    route = routes.get(route_id)
    device = current_device()
    verdict = route.supports(problem, device)
    assert verdict, verdict.reason
    inputs = make_decode_inputs(problem, seed=zlib.crc32(_label(item).encode()) % 10_000,
                                device="cuda", ragged=True)
    assert poison_stale_slots(inputs) > 0 or problem.page_size == 1
    want_out, want_lse = reference.decode_shard(inputs, inputs.shards[0])
    inputs = dataclasses.replace(inputs, shards=(_garbage_past_the_pages(inputs.shards[0], 4),))
    _every_set_matches(route, problem, inputs, want_out, want_lse)


@pytest.mark.parametrize("item", SMALL_PAGE_CASES[1::2], ids=_label)
def test_small_pages_replay_in_a_graph_as_lengths_change(item):
    """Each param set's step (a device-planned set: its plan too) captured once over pages
    for every request's full length, then replayed as an engine runs it: new ragged lengths
    written in place, the table past them garbage, the last pages' stale slots NaN."""
    route_id, problem = item
    route = routes.get(route_id)
    inputs = make_decode_inputs(problem, seed=31, device="cuda")
    shard = inputs.shards[0]
    cache, table = shard.kv_cache.clone(), shard.block_table.clone()
    gen = torch.Generator().manual_seed(13)
    for params in route.param_space(problem, current_device()):
        prepared = route.prepare(problem, inputs, params=params)
        prepared.step()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prepared.step()  # a device-planned set's plan, then its launch
        for _ in range(2):
            lens = torch.randint(problem.qlen, problem.kv_len + 1, (problem.batch,),
                                 generator=gen, dtype=torch.int32)
            shard.kv_cache.copy_(cache)
            shard.block_table.copy_(table)
            inputs.seq_lens.copy_(lens)
            shard.seq_lens.copy_(lens)
            poison_stale_slots(inputs)
            want_out, want_lse = reference.decode_shard(inputs, shard)
            _garbage_past_the_pages(shard)
            poison_(prepared.out, prepared.lse)
            graph.replay()
            torch.cuda.synchronize()
            acc = check(problem, prepared.out, want_out, prepared.lse, want_lse,
                        rounding=routes.rounding(route, problem, params))
            assert acc.ok, f"{params}, lengths {lens.tolist()}: {acc.reason} ({acc.summary})"


# The seesaw kernel's balanced form ({"form": "balanced"}): a program a (row block, worker),
# each worker's share of a device plan's key tiles, requests cut into pieces merged by the
# reduce, a request of one piece written in place. Issue 43's shapes (40 and 160 requests of
# 128 heads), a causal verify whose row blocks' bounds differ, a few long requests cut over
# every worker, four tokens a block, a last row block half filled (96 heads, not causal),
# pages of 16 and 1, an fp8 cache, a verify at page 32. Forced where the route would not
# offer it.
BALANCED = [
    _p(128, 40, 1500),
    _p(128, 160, 1500),
    _p(64, 40, 1500, qlen=2),
    _p(128, 3, 11000),
    _p(32, 20, 3000, qlen=4),
    _p(96, 17, 3000, causal=False),
    _p(128, 24, 700, page=16),
    _p(128, 6, 1500, page=1),
    _p(128, 33, 2000, kv="fp8_e4m3fn"),
    _p(64, 24, 1500, qlen=2, page=32),
]
BALANCED_SET = {"form": "balanced"}


def _short(p) -> str:
    return (f"h{p.num_heads}-b{p.batch}-kv{p.kv_len}-q{p.qlen}-p{p.page_size}-{p.kv_dtype}"
            + ("" if p.causal else "-noncausal"))


def _write_lengths(inputs, lens: torch.Tensor) -> None:
    """New lengths in place (the problem's and the shard's), NaN past each in its last page."""
    inputs.seq_lens.copy_(lens)
    inputs.shards[0].seq_lens.copy_(lens)
    poison_stale_slots(inputs)


def _with_empties(problem, gen: torch.Generator) -> torch.Tensor:
    """Ragged lengths with empty requests (a quarter, at least one where there are two or
    more requests), and from 8 requests one of one key and one shorter than qlen."""
    lens = torch.randint(problem.qlen, problem.kv_len + 1, (problem.batch,), generator=gen)
    picks = torch.randperm(problem.batch, generator=gen)
    if problem.batch > 1:
        lens[picks[:max(1, problem.batch // 4)]] = 0
    if problem.batch >= 8:
        lens[picks[-1]] = 1
        lens[picks[-2]] = problem.qlen - 1
    return lens.to(torch.int32)


def _balanced_served(route, problem, prepared, inputs, what: str) -> None:
    """``prepared``'s out and lse against the reference of the lengths ``inputs`` hold now:
    rows that attend no key exactly 0 and -inf, the others within the bound."""
    from tests.test_empty_requests import assert_served, rows_without_keys

    want = reference.decode_shard(inputs, inputs.shards[0])
    empty = rows_without_keys(inputs.seq_lens.tolist(), problem.qlen, problem.causal, 0)
    assert_served(problem, route, prepared.out, prepared.lse, want, empty.to("cuda"), what)


@pytest.mark.parametrize("problem", BALANCED, ids=_short)
def test_seesaw_balanced_matches_the_reference(problem):
    """The balanced set on random inputs, outputs poisoned: ragged lengths with empty and
    short requests (stale slots NaN), then the route's every set where it offers the form."""
    route = routes.get(SEESAW)
    # Pages for kv_len keys a request (the capacity), the lengths written after.
    inputs = make_decode_inputs(problem, seed=zlib.crc32(problem.key.encode()) % 10_000,
                                device="cuda")
    _write_lengths(inputs, _with_empties(problem, torch.Generator().manual_seed(3)).cuda())
    prepared = route.prepare(problem, inputs, params=BALANCED_SET)
    assert prepared.step_kind == routes.DEVICE_PLANNED
    poison_(prepared.out, prepared.lse)
    prepared.run()
    torch.cuda.synchronize()
    _balanced_served(route, problem, prepared, inputs, f"lengths {inputs.seq_lens.tolist()}")
    if BALANCED_SET in route.param_space(problem, current_device()):
        want_out, want_lse = reference.decode_shard(inputs, inputs.shards[0])
        _every_set_matches(route, problem, inputs, want_out, want_lse)


@pytest.mark.parametrize("problem", BALANCED[::2], ids=_short)
def test_seesaw_balanced_replays_in_a_graph_as_lengths_change(problem):
    """The balanced step (its device plan, then the kernel and the reduce) captured once,
    replayed as an engine runs it: new ragged lengths with empty requests written in place,
    the table past them garbage, stale slots NaN; then every request empty, then full."""
    route = routes.get(SEESAW)
    inputs = make_decode_inputs(problem, seed=31, device="cuda")
    shard = inputs.shards[0]
    cache, table = shard.kv_cache.clone(), shard.block_table.clone()
    gen = torch.Generator().manual_seed(17)
    prepared = route.prepare(problem, inputs, params=BALANCED_SET)
    prepared.step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared.step()
    full = torch.full((problem.batch,), problem.kv_len, dtype=torch.int32)
    for lens in (_with_empties(problem, gen), _with_empties(problem, gen),
                 torch.zeros_like(full), full):
        shard.kv_cache.copy_(cache)
        shard.block_table.copy_(table)
        _write_lengths(inputs, lens.cuda())
        want = reference.decode_shard(inputs, shard)
        _garbage_past_the_pages(shard)
        poison_(prepared.out, prepared.lse)
        graph.replay()
        torch.cuda.synchronize()
        from tests.test_empty_requests import assert_served, rows_without_keys

        empty = rows_without_keys(lens.tolist(), problem.qlen, problem.causal, 0)
        assert_served(problem, route, prepared.out, prepared.lse, want, empty.to("cuda"),
                      f"lengths {lens.tolist()}")


@pytest.mark.parametrize("problem", [BALANCED[0], BALANCED[2], BALANCED[3], BALANCED[5]],
                         ids=_short)
def test_seesaw_balanced_pieces_match_their_own_keys(problem, monkeypatch):
    """Each piece the kernel writes, before the reduce: a request's only item in place (out
    and its natural-log LSE), every other item's partial slot against attention over that
    item's keys alone (the row block's causal bound cutting its end): a wrong walk, slot or
    bound shows here, apart from the reduce's part."""
    from mlatune.check.accuracy import tolerance_for
    from mlatune.kernels import gluon_seesaw

    inputs = make_decode_inputs(problem, seed=5, device="cuda")  # pages for kv_len keys
    _write_lengths(inputs, _with_empties(problem, torch.Generator().manual_seed(8)).cuda())
    kept = {}

    def no_merge(part_out, part_lse, *args, **kwargs):
        kept.update(out=part_out, lse=part_lse)
        return lambda: None

    monkeypatch.setattr(gluon_seesaw, "reduce_launcher", no_merge)
    shard = inputs.shards[0]
    planner, plan = gluon_seesaw.balanced_plan(shard.seq_lens, heads=problem.num_heads,
                                               qlen=problem.qlen)
    launch, out, lse = gluon_seesaw.decode_launcher(
        inputs.q, shard.kv_cache, shard.block_table, shard.seq_lens, qlen=problem.qlen,
        sm_scale=inputs.softmax_scale, causal=problem.causal, form="balanced", plan=plan)
    poison_(kept["out"], kept["lse"], out, lse)
    planner()
    launch()  # the kernel alone: no reduce
    torch.cuda.synchronize()
    work, work_indptr, split_indptr = plan
    _check_pieces(problem, inputs, kept, out, lse, work[:int(work_indptr[-1])].tolist(),
                  split_indptr.tolist(), tolerance_for("bf16", "bf16"))


def _check_pieces(problem, inputs, kept, out, lse, items, split_indptr, tol) -> None:
    heads, qlen = problem.num_heads, problem.qlen
    for b, start, stop, slot in items:
        if split_indptr[b + 1] - split_indptr[b] == 1:  # the request's only item: in place
            got = out[b * qlen:(b + 1) * qlen].float()
            got_lse = lse[b * qlen:(b + 1) * qlen]
        else:
            got = kept["out"][slot].view(qlen, heads, -1)
            got_lse = kept["lse"][slot].view(qlen, heads) * math.log(2)
        length = int(inputs.shards[0].seq_lens[b])
        _check_piece(problem, inputs, b, (start, stop), got, got_lse, tol,
                     f"request {b} ({length} keys), item [{start}, {stop}) slot {slot}")


@pytest.mark.parametrize("problem", [_engine_p(128, 40, 1500), _engine_p(64, 24, 3000, qlen=2)],
                         ids=_short)
def test_seesaw_balanced_captured_step_replays_with_new_lengths(problem, tmp_path,
                                                                monkeypatch):
    """The balanced set as an engine runs it (``attention.decode``, its device plan in the
    captured step): replayed as lengths and pages change."""
    from tests import test_engine_gpu

    monkeypatch.setattr(test_engine_gpu, "_params", lambda *args: dict(BALANCED_SET))
    _captured(SEESAW, False, problem, tmp_path)
