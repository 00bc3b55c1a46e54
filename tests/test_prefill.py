"""Prefill routes on the CPU: the Triton kernel under the interpreter, SDPA, the plan.

bf16 is left to the GPU tests (tests/test_prefill_gpu.py): the Triton
interpreter computes bf16 tl.dot wrongly, so fp16 stands in for the 16-bit path.
"""

import itertools
import json
import os
import subprocess
import sys
import zlib
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest
import torch
import triton

from mlatune import routes
from mlatune.arch import DeviceInfo, cpu_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_prefill_inputs, poison_
from mlatune.kernels.prefill_plan import (
    SUB_BLOCK_OVERHEAD_KEYS,
    plan_work,
    split_head_dim,
    v_key_offsets,
    v_transpose_tiles,
)
from mlatune.problem import DTYPES, MLAProblem
from mlatune.routes.prefill_triton import _GPU_CONFIGS_FP8, TILE_Q
from mlatune.routes.triton_support import interpreter_enabled

H200 = DeviceInfo("sm_90", "NVIDIA H200", "nvidia", 132)
A100 = DeviceInfo("sm_80", "NVIDIA A100", "nvidia", 108)
MI300 = DeviceInfo("gfx942", "AMD Instinct MI300X", "amd", 304)
MI355 = DeviceInfo("gfx950", "AMD Instinct MI355X", "amd", 256)


def prefill(heads=16, qlen=20, kv_len=30, batch=3, dtype="fp16", causal=True, kv_dtype=None,
            **dims):
    return MLAProblem(phase="prefill", num_heads=heads, qlen=qlen, kv_len=kv_len, batch=batch,
                      q_dtype=dtype, kv_dtype=kv_dtype or dtype, causal=causal, page_size=1,
                      **dims)


def seed_of(*parts) -> int:
    """A different seed for every case, the same on every run."""
    return zlib.crc32(repr(parts).encode())


# On a GPU machine conftest leaves the interpreter off, and Triton cannot run on
# CPU tensors: the GPU tests cover the kernels there.
interpreted = pytest.mark.skipif(not interpreter_enabled(),
                                 reason="Triton on CPU tensors needs TRITON_INTERPRET=1")


def run_route(route_id, problem, seed, params=None, want_lse=True):
    """Prepare, poison the outputs, run, and check against the fp64 reference."""
    if route_id.endswith("/triton") and not interpreter_enabled():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    assert routes.get(route_id).supports(problem, cpu_device())
    inputs = make_prefill_inputs(problem, seed=seed, ragged=True)
    ref_out, ref_lse = reference.prefill(inputs, torch.float64)
    prepared = routes.get(route_id).prepare(problem, inputs, params=params, want_lse=want_lse)
    poison_(prepared.out, prepared.lse)
    prepared.run()
    acc = check(problem, prepared.out, ref_out, prepared.lse,
                ref_lse if prepared.lse is not None else None)
    assert acc.ok, f"{route_id} {problem.key}: {acc.reason} ({acc.summary})"
    return prepared, acc


# Route against the reference -------------------------------------------------
# (heads, batch, qlen, kv_len): 12 and 24 take the head-padding path (to 16, 32);
# kv_len > qlen gives every request a prefix of kv_len - qlen keys.
SHAPES = [(12, 3, 20, 30), (16, 2, 40, 40), (24, 3, 24, 56), (128, 2, 8, 8)]


def v_transposed(dtype: str) -> bool:
    """The v layout the route's sets read: transposed for fp8's P.V, as given for 16 bits."""
    return dtype.startswith("fp8")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-b{s[1]}-q{s[2]}-k{s[3]}")
@pytest.mark.parametrize(("route_id", "dtype"), [
    ("fp8-ps/triton", "fp8_e4m3fn"),
    ("bf16-ps/triton", "fp16"),
    ("sdpa/torch", "fp16"),
    ("sdpa/torch", "bf16"),  # torch itself on the CPU, not the interpreter
])
def test_route_matches_reference(route_id, dtype, shape):
    heads, batch, qlen, kv_len = shape
    problem = prefill(heads, qlen, kv_len, batch, dtype)
    prepared, _ = run_route(route_id, problem, seed_of(route_id, dtype, shape))
    if route_id.endswith("/triton"):
        assert prepared.params["kernel_heads"] == -(-heads // 16) * 16
        assert prepared.out.shape == (prepared.out.shape[0], heads, 128)
    else:
        assert prepared.params["sdpa_backend"] in ("cudnn", "flash", "efficient", "math")
        assert prepared.lse is None


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"h{s[0]}-b{s[1]}-q{s[2]}-k{s[3]}")
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3fn", "fp8_e4m3fnuz"])
def test_bf16_ps_over_an_fp8_cache(kv_dtype, shape):
    """A 16-bit q over fp8 k/v: the kernel converts k and v tiles as it loads them
    (fp16 here: the interpreter's bf16 dots are wrong; bf16 runs on the GPU)."""
    heads, batch, qlen, kv_len = shape
    problem = prefill(heads, qlen, kv_len, batch, "fp16", kv_dtype=kv_dtype)
    prepared, _ = run_route("bf16-ps/triton", problem, seed_of("bf16-ps-fp8", kv_dtype, shape))
    assert prepared.out.dtype == torch.float16 and prepared.lse is not None


@pytest.mark.parametrize("q_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3fn", "fp8_e4m3fnuz"])
def test_sdpa_dequantizes_an_fp8_cache_every_call(q_dtype, kv_dtype):
    problem = prefill(12, 20, 30, 3, q_dtype, kv_dtype=kv_dtype)
    run_route("sdpa/torch", problem, seed_of("sdpa-fp8-ragged", q_dtype, kv_dtype))
    inputs = make_prefill_inputs(problem, seed=seed_of("sdpa-fp8", q_dtype, kv_dtype))
    prepared = routes.get("sdpa/torch").prepare(problem, inputs)
    assert prepared.params["kv_dequant"] == q_dtype and prepared.out.dtype == DTYPES[q_dtype]
    # The dequantization is inside the timed call: new cache contents, then a run, and the
    # output follows them.
    other = make_prefill_inputs(problem, seed=seed_of("sdpa-fp8-other"))  # same lengths
    inputs.k.copy_(other.k)
    inputs.v.copy_(other.v)
    poison_(prepared.out)
    prepared.run()
    ref_out, _ = reference.prefill(inputs, torch.float64)
    acc = check(problem, prepared.out, ref_out)
    assert acc.ok, acc.summary


@pytest.mark.parametrize("heads", [12])  # 128 heads: test_route_matches_reference's
def test_fp8_fnuz(heads):
    problem = prefill(heads, 12, 20, 2, "fp8_e4m3fnuz")
    run_route("fp8-ps/triton", problem, seed_of("fnuz", heads))


@pytest.mark.parametrize(("dtype", "causal", "shape"), [
    ("fp8_e4m3fn", True, (12, 3, 20, 30)),
    ("fp8_e4m3fnuz", True, (16, 3, 37, 37)),
    ("fp8_e4m3fn", False, (4, 2, 24, 50)),
    ("fp16", True, (12, 3, 24, 56)),
])
def test_two_key_blocks(dtype, causal, shape):
    """Through the route, ragged with prefixes, at two key blocks: 16 (several blocks a row,
    the diagonal inside the loop) and 64 (one partial block)."""
    heads, batch, qlen, kv_len = shape
    route_id = "fp8-ps/triton" if dtype.startswith("fp8") else "bf16-ps/triton"
    for block_n in (16, 64):
        params = {"block_m": 32, "block_n": block_n, "num_warps": 4, "num_stages": 1,
                  "v_transposed": v_transposed(dtype)}
        prepared, _ = run_route(route_id, prefill(heads, qlen, kv_len, batch, dtype, causal),
                                seed_of("key-blocks", dtype, causal, block_n), params)
        assert prepared.params["v_transposed"] == v_transposed(dtype)


@interpreted
def test_transposed_v_has_aligned_requests_and_zero_padding():
    from mlatune.kernels.prefill import V_ALIGN, KernelConfig, PersistentPrefill

    k_lens = [5, 40, 17]
    v = torch.randn(sum(k_lens), 2, 32).to(torch.float8_e4m3fn)
    q = torch.zeros(sum(k_lens), 2, 48, dtype=torch.float8_e4m3fn)
    launch = PersistentPrefill(
        q, q, v, torch.empty(sum(k_lens), 2, 32, dtype=torch.bfloat16),
        torch.empty(sum(k_lens), 2), k_lens, k_lens, causal=True, sm_scale=1.0,
        scales=(torch.ones(1),) * 3, config=KernelConfig(16, 16, 4, 1, True),
        num_programs=2)
    vt = launch._main_args[2]
    v.copy_(torch.randn(v.shape).to(v.dtype))  # each call copies the v of that call
    launch()
    cols = v_key_offsets(k_lens, V_ALIGN)
    assert vt.shape == (2, 32, cols[-1]) and all(c % V_ALIGN == 0 for c in cols)
    for b, (k0, n) in enumerate(zip([0, 5, 45], k_lens, strict=True)):
        got = vt[:, :, cols[b]:cols[b] + n].view(torch.uint8)
        assert torch.equal(got, v[k0:k0 + n].permute(1, 2, 0).view(torch.uint8))
        assert not vt[:, :, cols[b] + n:cols[b + 1]].view(torch.uint8).any()


def test_v_transpose_tiles_cover_every_key_once():
    k_lens = [5, 130, 64, 1]
    tiles = v_transpose_tiles(k_lens, 16, 64)
    cols = v_key_offsets(k_lens, 16)
    assert cols == [0, 16, 160, 224, 240]
    rows = [r for row0, _, n in tiles for r in range(row0, row0 + n)]
    assert rows == list(range(sum(k_lens)))
    assert all(col0 % 16 == 0 and 1 <= n <= 64 for _, col0, n in tiles)
    plan = plan_work(k_lens, k_lens, 2, 3, tile_q=64, block_m=32, v_align=16)
    assert {(it.k_row0, it.v_row0) for items in plan.programs for it in items} == {
        (0, 0), (5, 16), (135, 160), (199, 224)}


@pytest.mark.parametrize("route_id", ["fp8-ps/triton", "bf16-ps/triton"])
def test_not_causal(route_id):
    dtype = "fp8_e4m3fn" if route_id.startswith("fp8") else "fp16"
    run_route(route_id, prefill(12, 20, 36, 3, dtype, causal=False), seed_of(route_id, "nc"))


def test_other_head_dims():
    """d_qk = 64 + 32 and d_v = 32: the kernel is not tied to DeepSeek's 192/128."""
    problem = prefill(4, 20, 20, 2, "fp16", qk_head_dim=96, v_head_dim=32)
    run_route("bf16-ps/triton", problem, seed_of("dims"))


@interpreted
def test_lse_is_optional_and_runs_repeat():
    problem = prefill(12, 16, 16, 2, "fp16")
    inputs = make_prefill_inputs(problem, seed=seed_of("repeat"), ragged=True)
    prepared = routes.get("bf16-ps/triton").prepare(problem, inputs, want_lse=False)
    assert prepared.lse is None and prepared.graph_safe
    prepared.run()
    first = prepared.out.clone()
    poison_(prepared.out)
    prepared.run()
    assert torch.equal(prepared.out, first)


# The kernel's split-KV path, which the routes reach only at GPU sizes -------
@interpreted
@pytest.mark.parametrize("dtype", ["fp16", "fp8_e4m3fn"])
@pytest.mark.parametrize("causal", [True, False])
def test_split_tiles_are_merged_by_lse(dtype, causal):
    from mlatune.kernels.prefill import KernelConfig, PersistentPrefill

    problem = prefill(3, 70, 100, 3, dtype, causal=causal)
    inputs = make_prefill_inputs(problem, seed=seed_of("split", dtype, causal), ragged=True)
    ref_out, ref_lse = reference.prefill(inputs, torch.float64)
    out = torch.empty(inputs.q.shape[0], 3, 128, dtype=DTYPES[problem.out_dtype])
    lse = torch.empty(inputs.q.shape[0], 3)
    scales = (inputs.q_scale, inputs.k_scale, inputs.v_scale) if dtype != "fp16" else None
    launch = PersistentPrefill(
        inputs.q, inputs.k, inputs.v, out, lse, inputs.cu_seqlens_q.diff().tolist(),
        inputs.cu_seqlens_k.diff().tolist(), causal=causal, sm_scale=problem.softmax_scale,
        scales=scales, config=KernelConfig(16, 16, 4, 1, v_transposed(dtype)), num_programs=24,
        tile_q=32,
        min_split=16)
    assert len(launch.plan.merges) >= 5  # more programs than tiles: many tiles are cut
    poison_(out, lse)
    launch()
    acc = check(problem, out, ref_out, lse, ref_lse)
    assert acc.ok, acc.reason


@interpreted
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_partial_merge_is_the_lse_combine(out_dtype):
    """The merge kernel combines split tiles' partial slots (random outputs and LSEs; some
    rows without keys in a slot, one row in none) as ``mlatune.lse.combine`` does."""
    from mlatune.kernels.prefill import PlanTables, _merge_partials_kernel, run_launch
    from mlatune.lse import combine

    q_lens, heads, tile_q = [70, 100, 45], 3, 32
    plan = plan_work(q_lens, q_lens, heads, 24, tile_q=tile_q, block_m=16, split_align=16,
                     min_split=16)
    assert len(plan.merges) >= 5
    tables = PlanTables.of(plan, tile_q, 128, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed_of("merge", out_dtype))
    tables.part_out.copy_(torch.randn(tables.part_out.shape, generator=gen))
    lses = torch.randn(tables.part_lse.shape, generator=gen) * 4
    lses[torch.rand(lses.shape, generator=gen) < 0.2] = float("-inf")
    first = plan.merges[0]
    lses[first.slot0 * tile_q + torch.arange(first.n_slots) * tile_q] = float("-inf")
    tables.part_lse.copy_(lses)
    out = torch.empty(sum(q_lens), heads, 128, dtype=out_dtype)
    lse = torch.empty(sum(q_lens), heads)
    poison_(out, lse)
    run_launch(_merge_partials_kernel, tables.merge_launch(plan, out, lse, tile_q))
    for m in plan.merges:
        slots = [(m.slot0 + j) * tile_q + torch.arange(m.q_rows) for j in range(m.n_slots)]
        want_out, want_lse = combine([tables.part_out[s] for s in slots],
                                     [tables.part_lse[s] for s in slots])
        rows = slice(m.q_row0, m.q_row0 + m.q_rows)
        torch.testing.assert_close(out[rows, m.head], want_out.to(out_dtype))
        torch.testing.assert_close(lse[rows, m.head], want_lse)
    assert lse[first.q_row0, first.head] == float("-inf")
    assert not out[first.q_row0, first.head].any()


# The host plan -------------------------------------------------------------------
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("programs", [1, 5, 132])
def test_plan_covers_every_key_of_every_row_once(programs, causal, grouped):
    """Every tile's keys once, in pieces of the right request (a request without query
    tokens among them), merged from their own slots; each program's load is its items'."""
    gen = torch.Generator().manual_seed(seed_of("cover", programs, causal))
    q_lens = torch.randint(1, 700, (5,), generator=gen).tolist()
    k_lens = [q + int(torch.randint(0, 300, (), generator=gen)) for q in q_lens]
    q_lens[2:2], k_lens[2:2] = [0], [40]
    plan = plan_work(q_lens, k_lens, 3, programs, tile_q=256, block_m=64, causal=causal,
                     split_align=64, min_split=128, grouped=grouped)
    assert len(plan.programs) == programs and plan.work_indptr[-1] == len(plan.work_info)
    pieces: dict[tuple[int, int], list] = {}
    for items in plan.programs:
        for it in items:
            pieces.setdefault((it.q_row0, it.head), []).append(it)
    q_starts, k_starts = ([0, *itertools.accumulate(lens)][:-1] for lens in (q_lens, k_lens))
    expected_tiles = {(q0 + t, h) for q0, n in zip(q_starts, q_lens, strict=True)
                      for t in range(0, n, 256) for h in range(3)}
    assert set(pieces) == expected_tiles
    merges = set()
    for (q_row0, head), its in pieces.items():
        its.sort(key=lambda it: it.kv_lo)
        b = max(i for i, q0 in enumerate(q_starts) if q0 <= q_row0 and q_lens[i])
        first = its[0]
        assert {(it.q_row0 - it.q_pos0, it.q_rows, it.k_row0, it.prefix, it.v_row0)
                for it in its} == {(q_starts[b], min(256, q_lens[b] - first.q_pos0),
                                    k_starts[b], k_lens[b] - q_lens[b], k_starts[b])}
        kv_end = min(k_lens[b], first.prefix + first.q_pos0 + first.q_rows) if causal else (
            k_lens[b])
        assert first.kv_lo == 0 and its[-1].kv_hi == kv_end
        assert all(a.kv_hi == c.kv_lo for a, c in itertools.pairwise(its))
        assert all(it.kv_lo % 64 == 0 and it.kv_hi - it.kv_lo >= 1 for it in its)
        slots = [it.slot for it in its]
        if len(its) == 1:
            assert slots == [-1]
        else:
            merges.add((q_row0, first.q_rows, head, min(slots), len(slots)))
            assert sorted(slots) == list(range(min(slots), min(slots) + len(slots)))
    assert {astuple(m) for m in plan.merges} == merges and len(plan.merges) == len(merges)
    assert sorted(m.slot0 for m in plan.merges) == [m.slot0 for m in plan.merges]
    assert sum(m.n_slots for m in plan.merges) == plan.num_partials
    k_len_at = {q0: k for q0, q, k in zip(q_starts, q_lens, k_lens, strict=True) if q}
    assert list(plan.loads) == [
        sum(_item_cost(it, 64, k_len_at[it.q_row0 - it.q_pos0] if not causal else None)
            for it in items) for items in plan.programs]


def _item_cost(it, block_m: int, k_len: int | None) -> int:
    """Keys an item's sub-blocks visit (causal where ``k_len`` is None) plus their fixed
    cost: the plan's cost model."""
    ends = [it.prefix + it.q_pos0 + min(s + block_m, it.q_rows) if k_len is None else k_len
            for s in range(0, it.q_rows, block_m)]
    keys = sum(max(0, min(it.kv_hi, end) - it.kv_lo) for end in ends)
    return keys + SUB_BLOCK_OVERHEAD_KEYS * len(ends)


def test_plan_is_the_one_the_quotas_give():
    """Tiles in order (request, head, position), whole while they fit a program's quota,
    the one that straddles a cut split at a key-block multiple, its pieces merged; a
    request without query tokens takes no tile but moves the next one's rows."""
    plan = plan_work([200, 0, 70], [260, 30, 70], 2, 4, tile_q=128, block_m=64,
                     split_align=32, min_split=64, v_align=16)
    assert [[astuple(it) for it in items] for items in plan.programs] == [
        [(0, 0, 128, 0, 60, 0, 188, 0, -1, 0)],
        [(128, 128, 72, 0, 60, 0, 260, 0, -1, 0)],
        [(0, 0, 128, 0, 60, 0, 188, 1, -1, 0), (128, 128, 72, 0, 60, 0, 96, 1, 0, 0)],
        [(128, 128, 72, 0, 60, 96, 260, 1, 1, 0), (200, 0, 70, 290, 0, 0, 70, 0, -1, 304),
         (200, 0, 70, 290, 0, 0, 70, 1, -1, 304)]]
    assert [astuple(m) for m in plan.merges] == [(128, 72, 1, 0, 2)]
    assert plan.num_partials == 2 and list(plan.loads) == [440, 640, 760, 972]
    assert plan.work_info.dtype == plan.merge_info.dtype == plan.work_indptr.dtype == np.int32
    # One request on 3 programs: its second tile cut where program 1's quota ends.
    one = plan_work([245], [245], 1, 3, tile_q=128, block_m=64, split_align=32, min_split=64)
    assert one.work_info.tolist() == [[0, 0, 128, 0, 0, 0, 128, 0, -1, 0],
                                      [128, 128, 117, 0, 0, 0, 64, 0, 0, 0],
                                      [128, 128, 117, 0, 0, 64, 245, 0, 1, 0]]
    assert one.work_indptr.tolist() == [0, 1, 2, 3] and one.merge_info.tolist() == [
        [128, 117, 0, 0, 2]]


@pytest.mark.parametrize(("q_lens", "heads"), [([4096], 16), ([4096], 128), ([2048] * 8, 16),
                                               ([512] * 32, 16)])
def test_plan_balances_the_causal_tail(q_lens, heads):
    """Equal work per program on 132 SMs, with fewer split tiles than programs."""
    plan = plan_work(q_lens, q_lens, heads, 132, tile_q=256, block_m=128, split_align=128)
    mean = sum(plan.loads) / 132
    assert max(plan.loads) <= 1.2 * mean and min(plan.loads) >= 0.8 * mean
    assert len(plan.merges) < 132


def test_grouped_plan_runs_few_heads_at_once_and_stays_balanced():
    """128 heads x 4096 on 132 programs: whole tiles, within a few percent of the mean
    load, and the tiles the programs run at the same time (by planned start) from a
    few heads, where the contiguous plan has each program on a head of its own."""
    plan = plan_work([4096], [4096], 128, 132, grouped=True)
    assert not plan.merges and all(it.slot == -1 for items in plan.programs for it in items)
    mean = sum(plan.loads) / 132
    assert max(plan.loads) <= 1.05 * mean
    assert sum(len(items) for items in plan.programs) == 128 * 16
    for items in plan.programs:  # in head order, a window at a time
        heads = [it.head for it in items]
        assert all(b - a <= 16 for a, b in itertools.pairwise(heads)), heads
    starts = []
    for p, items in enumerate(plan.programs):
        t = 0.0
        for it in items:
            starts.append((t, it.head, p))
            t += (it.kv_hi + 64) * 2  # about its cost: two sub-blocks
    starts.sort()
    for i in range(0, len(starts) - 132, 132):
        assert len({h for _, h, _ in starts[i:i + 132]}) <= 16
    contiguous = plan_work([4096], [4096], 128, 132)
    assert len({items[0].head for items in contiguous.programs}) > 100


@interpreted
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_plan_through_the_kernel(causal):
    """Whole tiles in head-grouped order (many tiles on 2 programs) against the reference."""
    from mlatune.kernels.prefill import KernelConfig, PersistentPrefill

    problem = prefill(6, 70, 90, 3, "fp8_e4m3fn", causal=causal)
    inputs = make_prefill_inputs(problem, seed=seed_of("grouped", causal), ragged=True)
    ref_out, ref_lse = reference.prefill(inputs, torch.float64)
    out = torch.empty(inputs.q.shape[0], 6, 128, dtype=DTYPES[problem.out_dtype])
    lse = torch.empty(inputs.q.shape[0], 6)
    launch = PersistentPrefill(
        inputs.q, inputs.k, inputs.v, out, lse, inputs.cu_seqlens_q.diff().tolist(),
        inputs.cu_seqlens_k.diff().tolist(), causal=causal, sm_scale=problem.softmax_scale,
        scales=(inputs.q_scale, inputs.k_scale, inputs.v_scale),
        config=KernelConfig(16, 16, 4, 1, True, True), num_programs=2, tile_q=32)
    assert not launch.plan.merges and sum(map(len, launch.plan.programs)) >= 12
    poison_(out, lse)
    launch()
    acc = check(problem, out, ref_out, lse, ref_lse)
    assert acc.ok, acc.reason


def test_grouped_plan_falls_back_to_splitting_few_tiles():
    assert plan_work([4096], [4096], 16, 132, grouped=True).merges  # 256 tiles: split


def test_splitting_is_what_balances_few_long_tiles():
    """1 x 4096 tokens, 16 heads: 256 tiles of very unequal cost on 132 programs."""
    split = plan_work([4096], [4096], 16, 132)
    unsplit = plan_work([4096], [4096], 16, 132, min_split=10**9)
    mean = sum(unsplit.loads) / 132
    assert not unsplit.merges and max(unsplit.loads) > 1.5 * mean
    assert max(split.loads) < 1.2 * mean
    one_head = plan_work([4096], [4096], 1, 132)  # 16 tiles: the long ones in many pieces
    assert max(m.n_slots for m in one_head.merges) >= 8


def test_plan_gives_an_empty_program_a_piece_of_an_expensive_short_tile():
    plan = plan_work([100], [100], 1, 4, tile_q=256, block_m=128, split_align=64, min_split=256)
    assert [len(items) for items in plan.programs] == [1, 0, 0, 0] and not plan.merges


def test_split_head_dim():
    assert split_head_dim(192) == (128, 64)
    assert split_head_dim(128) == (64, 64)
    assert split_head_dim(576) == (512, 64)
    assert split_head_dim(176) is None and split_head_dim(16) is None


# Capability rules and the parameter space -------------------------------------------
@pytest.mark.parametrize(("route_id", "problem", "device", "reason"), [
    ("fp8-ps/triton", MLAProblem(), H200, "prefill only"),
    ("sdpa/torch", MLAProblem(), H200, "prefill only"),
    ("fp8-ps/triton", prefill(dtype="bf16"), H200, "needs q and kv both in"),
    ("bf16-ps/triton", prefill(dtype="fp8_e4m3fn"), H200, "needs q and kv both in"),
    ("sdpa/torch", prefill(dtype="fp8_e4m3fn"), H200, "needs q bf16 or fp16"),
    ("fp8-ps/triton", MLAProblem(phase="prefill", q_dtype="bf16", kv_dtype="fp8_e4m3fn",
                                 qlen=8, kv_len=8), H200, "q bf16 with kv fp8_e4m3fn"),
    ("fp8-ps/triton", prefill(dtype="fp8_e4m3fnuz"), H200, "AMD's fp8 format"),
    ("fp8-ps/triton", prefill(dtype="fp8_e4m3fn"), A100, "sm_89 or newer"),
    ("fp8-ps/triton", prefill(dtype="fp8_e4m3fn"), MI300, "gfx942 computes fp8 as fp8_e4m3fnuz"),
    ("fp8-ps/triton", prefill(dtype="fp8_e4m3fnuz"), MI355, "gfx950 computes fp8 as fp8_e4m3fn"),
    ("bf16-ps/triton", prefill(qk_head_dim=176), H200, "d_qk 176"),
    ("bf16-ps/triton", prefill(v_head_dim=96), H200, "d_v 96"),
])
def test_refusals_say_why(route_id, problem, device, reason):
    verdict = routes.get(route_id).supports(problem, device)
    assert not verdict and reason in verdict.reason


def test_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    verdict = routes.get("bf16-ps/triton").supports(prefill(), cpu_device())
    assert not verdict and "TRITON_INTERPRET" in verdict.reason


def test_viable_prefill_routes_on_gpus():
    fp8, bf16 = prefill(dtype="fp8_e4m3fn"), prefill(dtype="bf16")
    ids = lambda p, d: {r.id for r in routes.viable(p, d)}  # noqa: E731
    assert ids(fp8, H200) == {"fp8-ps/triton", "reference/torch"}
    assert ids(bf16, H200) == {"bf16-ps/triton", "sdpa/torch", "reference/torch"}
    mixed = prefill(dtype="bf16", kv_dtype="fp8_e4m3fn")
    assert ids(mixed, H200) == {"bf16-ps/triton", "sdpa/torch", "reference/torch"}
    assert "fp8-ps/triton" in ids(prefill(dtype="fp8_e4m3fnuz"), MI300)
    assert "fp8-ps/triton" in ids(fp8, MI355)


@pytest.mark.parametrize("device", [H200, A100, MI300, cpu_device()], ids=lambda d: d.arch)
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3fn"])
def test_param_space_is_small_and_valid(device, dtype):
    space = routes.get("fp8-ps/triton" if dtype != "bf16" else "bf16-ps/triton").param_space(
        prefill(dtype=dtype), device)
    # The Gluon kernel's set (tests/test_gluon_prefill.py) comes last where it runs.
    space = [p for p in space if p.get("kernel") != "gluon"]
    assert 1 <= len(space) <= 3
    for params in space:
        assert TILE_Q % params["block_m"] == 0
        assert {"block_m", "block_n", "num_warps", "num_stages"} <= set(params) <= {
            "block_m", "block_n", "num_warps", "num_stages", "v_transposed", "grouped"}
    if dtype != "bf16" and device in (H200, cpu_device()):
        assert all(p["v_transposed"] for p in space)  # Hopper's fp8 P.V reads v transposed
    if device is MI300 and dtype == "bf16":  # 64 KB of LDS: only the smallest config fits
        assert space == [{"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 1}]


@pytest.mark.parametrize("route_id", ["fp8-ps/triton", "bf16-ps/triton"])
def test_a_stored_triton_set_reads_without_the_deleted_qk_ahead(route_id):
    """A set stored with ``qk_ahead`` off reads as the same set without it (the same kernel);
    on, it named a deleted form: stale (None)."""
    route = routes.get(route_id)
    stored = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3,
              "v_transposed": True, "grouped": True, "kernel_heads": 16, "split_tiles": 3}
    assert route.upgrade_params({**stored, "qk_ahead": False}) == stored
    assert route.upgrade_params(stored) == stored
    assert route.upgrade_params({**stored, "qk_ahead": True}) is None
    assert route.upgrade_params({}) == {}


# The GPU kernels, compiled here (`pytest -m kernels`, as the other kernels' builds) ------
@pytest.mark.kernels
def test_kernels_compile_for_hopper():
    """Every GPU config compiles for sm_90 with the ptxas in Triton's wheel and uses wgmma."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton wheel carries no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.prefill_aot"], env=env, text=True,
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = {r["kernel"]: r for r in map(json.loads, done.stdout.splitlines())}
    # 16-bit, fp8, 16-bit over fp8; merge; transpose
    assert len(reports) == 3 + 3 + 3 + 1 + 1
    assert all(r["wgmma"] for name, r in reports.items() if name.startswith(("bf16", "fp8")))
    # No key loop spills; outside it, deep fp8 pipelines spill some.
    assert all(r["loop_spill_accesses"] == 0 for r in reports.values()), reports
    assert all(r["stack"] <= 512 for r in reports.values()), reports
    for config in _GPU_CONFIGS_FP8:
        r = reports[f"fp8 {config}"]
        # v transposed: every k/v tile an async copy (q's two tiles are not), P.V in
        # flight into the next step, the q.k halves waited for each.
        assert r["wgmma_shapes"] == ["m64n128k32"], r
        assert (r["loop_wgmma_waits"], r["dots_in_flight"], r["sync_tile_loads"]) == (
            2, 2, 2), r
