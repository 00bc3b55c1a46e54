"""The ``wgmma/gluon`` route (the Hopper Gluon decode) on the CPU: its rules, its refusal
where triton is not 3.6.x, its parameters, and what ``prepare`` hands the kernel's launcher
(a recording fake: the kernel itself runs on an sm_90 GPU only, tests/test_gluon_gpu.py)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlatune import capability, routes
from mlatune.arch import cpu_device
from mlatune.check.accuracy import Rounding
from mlatune.check.inputs import make_decode_inputs
from mlatune.kernels import (
    gluon_common,
    gluon_hopper,
    gluon_hopper_plan,
    gluon_seesaw,
    gluon_transposed,
)
from mlatune.problem import MLAProblem
from mlatune.routes import gluon_hopper as route_module

ROUTE = "wgmma/gluon"
KERNELS = {"wgmma/gluon": gluon_hopper, "seesaw/gluon": gluon_seesaw,
           "transposed/gluon": gluon_transposed}  # route -> its kernel
MMA8 = "transposed-mma8/gluon"  # transposed/gluon's fp8-MMA form, a route of its own
H200 = capability.device_for_arch("sm_90")
FP8 = "fp8_e4m3fn"


def _p(**kw) -> MLAProblem:
    return MLAProblem(**{"num_heads": 16, "batch": 4, "kv_len": 4096, **kw})


@pytest.fixture
def triton_36(monkeypatch):
    monkeypatch.setattr(route_module, "triton_version", lambda: "3.6.0")


# (arch, problem, refusing rule or None)
RULINGS = [
    ("sm_90", _p(), None),
    ("sm_90", _p(q_dtype="fp16", kv_dtype="fp16"), None),
    ("sm_90", _p(num_heads=128, qlen=4), None),
    ("sm_90", _p(num_heads=1, qlen=8), None),
    ("sm_90", _p(num_heads=8, qlen=2, causal=False), None),
    ("sm_90", _p(num_heads=64, dcp_size=2), None),  # single-token decode over a shard
    ("sm_90", _p(qlen=3, dcp_size=4, causal=False), None),
    ("sm_90", _p(qlen=2, dcp_size=2), "wgmma.dcp"),
    ("sm_90", _p(kv_dtype=FP8), "wgmma.dtypes"),
    ("sm_90", _p(q_dtype=FP8, kv_dtype=FP8), "wgmma.dtypes"),
    ("sm_90", _p(page_size=16), None),  # a tile spans 4 pages, a TMA box each
    ("sm_90", _p(page_size=32, qlen=2), None),
    ("sm_90", _p(page_size=128), None),  # a tile lies in a page
    ("sm_90", _p(page_size=1, qlen=3), None),  # each key its own page: gathered
    ("sm_90", _p(page_size=8), "wgmma.page"),
    ("sm_90", _p(page_size=4, kv_dtype=FP8), "wgmma.page"),
    ("sm_90", _p(kv_lora_rank=256), "wgmma.dims"),
    ("sm_90", _p(rope_dim=32), "wgmma.dims"),
    ("sm_90", MLAProblem(phase="prefill", qlen=64, kv_len=64, page_size=1), "wgmma.decode"),
    ("sm_100", _p(), "wgmma.arch"),
    ("sm_80", _p(), "wgmma.arch"),
    ("gfx950", _p(), "wgmma.arch"),
    ("cpu", _p(), "wgmma.arch"),
]


@pytest.mark.parametrize(("arch", "problem", "rule"), RULINGS,
                         ids=[f"{a}-{p.key}" for a, p, _ in RULINGS])
def test_rules(arch, problem, rule):
    ruling = capability.check(ROUTE, problem, arch)
    assert ruling.ok is (rule is None), ruling
    assert ruling.rule == (rule or "")
    if rule:
        assert ruling.reason and capability.tables.SOURCES[
            next(r for r in capability.rules_for(ROUTE) if r.id == rule).source_key]


def test_refusals_say_why():
    dcp = capability.check(ROUTE, _p(qlen=2, dcp_size=2), "sm_90")
    assert "local positions" in dcp.reason
    fp8 = capability.check(ROUTE, _p(kv_dtype=FP8), "sm_90")
    assert "gluon_seesaw and gluon_transposed also read fp8_e4m3fn" in fp8.reason
    assert "pages of a power of two from 16" in capability.check(
        ROUTE, _p(page_size=8), "sm_90").reason
    assert "sm_90 only; this is sm_100" in capability.check(ROUTE, _p(), "sm_100").reason


def test_the_rules_read_the_kernels_sizes():
    assert (gluon_hopper.D_NOPE, gluon_hopper.D_ROPE) == (512, 64)
    assert gluon_hopper.pick_splits is gluon_hopper_plan.pick_splits
    assert gluon_hopper.page_refusal is gluon_hopper_plan.page_refusal


@pytest.mark.parametrize(("route_id", "kv"), [(ROUTE, "bf16"), ("seesaw/gluon", "fp16"),
                                               ("seesaw/gluon", FP8),
                                               ("transposed/gluon", "bf16"),
                                               ("transposed/gluon", FP8), (MMA8, FP8)])
@pytest.mark.parametrize("page", [1, 8, 16, 32, 64, 128, 256, 48])
def test_every_gluon_route_reads_the_pages_of_the_plan(route_id, kv, page):
    """One owner for the pages: each route's rule and its kernels' ``check_supported`` read
    ``gluon_hopper_plan.page_refusal`` (powers of two from 16: a TMA box a page; 1: gathered
    by cp.async, a 16-bit or an fp8 cache, but not under the fp8-MMA form nor by the seesaw
    kernel over an fp8 cache)."""
    fp8_mma = route_id == MMA8
    gathers = not fp8_mma and not (route_id == "seesaw/gluon" and kv == FP8)
    why = gluon_hopper_plan.page_refusal(page, gathers=gathers)
    tma = page >= 16 and page & (page - 1) == 0
    assert (why is None) == (tma or (page == 1 and gathers))
    if page & (page - 1) == 0:  # (a problem's page is a power of two)
        ruling = capability.check(route_id, _p(page_size=page, q_dtype=kv if kv != FP8
                                               else "bf16", kv_dtype=kv), "sm_90")
        assert ruling.ok is (why is None), ruling
        if why:
            assert ruling.rule == "wgmma.page" and ruling.reason == why
    q_dtype = torch.float16 if kv == "fp16" else torch.bfloat16
    cache = torch.zeros(4, page, 576, dtype=q_dtype)
    q = torch.zeros(4, 16, 576, dtype=q_dtype)
    table, lens = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    if kv != FP8:
        check = gluon_hopper.check_supported(q, cache, table, lens)
    elif route_id == "seesaw/gluon":
        check = _launcher_refusal(q, cache.to(torch.float8_e4m3fn), table, lens)
    else:
        check = gluon_transposed.check_supported(q, cache.to(torch.float8_e4m3fn), table, lens,
                                                 torch.ones(1), fp8_mma=fp8_mma)
    assert (why is not None and why in check) or (why is None and "page_size" not in
                                                  (check or ""))


def _launcher_refusal(q, cache, table, lens) -> str | None:
    """The seesaw launcher's refusal of these tensors (an fp8 cache), or None where it gets as
    far as sizing its outputs (it launches nothing on the CPU)."""
    try:
        gluon_seesaw.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=0.1,
                                     kv_scale=torch.ones(1), num_splits=1)
    except ValueError as e:
        return str(e)
    except Exception:  # past the checks: building descriptors needs a GPU
        return None
    return None


def test_refused_where_triton_is_not_3_6(monkeypatch):
    route = routes.get(ROUTE)
    installed = route_module.triton_version()
    if installed is not None and installed.startswith("3.6."):
        pytest.skip("this machine has triton 3.6")
    verdict = route.supports(_p(), H200)
    assert not verdict
    assert "triton 3.6.x" in verdict.reason and f"triton {installed}" in verdict.reason
    monkeypatch.setattr(route_module, "triton_version", lambda: None)
    assert "triton is not installed" in route.supports(_p(), H200).reason
    monkeypatch.setattr(route_module, "triton_version", lambda: "3.9.0")
    assert "this is triton 3.9.0" in route.supports(_p(), H200).reason
    # The rules come first: an fp8 cache is refused by its rule whatever triton is here.
    assert route.supports(_p(kv_dtype=FP8), H200).reason.startswith("rule wgmma.dtypes")


def test_supported_with_triton_3_6(triton_36):
    verdict = routes.get(ROUTE).supports(_p(), H200)
    assert verdict and "3.6.0" in verdict.reason
    assert not routes.get(ROUTE).supports(_p(), cpu_device())


def test_asking_the_route_imports_no_triton():
    """supports() and param_space() may be asked by a dispatcher, which never imports
    triton (tests/test_light_import.py): the version comes from the package metadata."""
    code = ("import sys\nfrom mlatune import routes\nfrom mlatune.capability import "
            "device_for_arch\nfrom mlatune.problem import MLAProblem\n"
            "r, d = routes.get('wgmma/gluon'), device_for_arch('sm_90')\n"
            "r.supports(MLAProblem(), d); r.param_space(MLAProblem(), d)\n"
            "print('triton' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split()[-1] == "False"


@pytest.mark.parametrize(("problem", "first"), [
    (_p(batch=1), 32),  # one request: many splits (each program's partial adds to the merge)
    (_p(batch=64), 2),
    (_p(batch=128, num_heads=128), 1),  # 256 programs already fill 132 SMs
    (_p(batch=8, num_heads=128, kv_len=32768), 8),
    (_p(batch=1, kv_len=64), 1),  # one tile: nothing to split
])
def test_param_space_is_the_kernels_pick_then_half_and_twice(problem, first):
    space = routes.get(ROUTE).param_space(problem, H200)
    assert space[0] == {"num_splits": first}
    assert 1 <= len(space) <= 3
    tiles = -(-problem.shard_len // 64)
    assert all(set(p) == {"num_splits"} and 1 <= p["num_splits"] <= min(64, tiles)
               for p in space)
    assert len({p["num_splits"] for p in space}) == len(space)
    assert {p["num_splits"] for p in space} <= {first, first // 2, first * 2}


def test_param_space_follows_the_shard_and_the_gathered_heads():
    route = routes.get(ROUTE)
    dcp = _p(batch=2, num_heads=16, kv_len=8192, dcp_size=4)  # 64 kernel heads, 2048 keys
    want = gluon_hopper_plan.pick_splits(2, 1, 2048, 132)
    assert route.param_space(dcp, H200)[0] == {"num_splits": want}
    # Off a GPU (a CPU description, no SM count that means anything) the H200's is used.
    assert route.param_space(_p(batch=1), cpu_device()) == route.param_space(_p(batch=1), H200)
    assert routes.step_kind_of(route, {"num_splits": 2}) == routes.LAUNCH_ONLY
    assert route.sized_params == ("num_splits",)


def test_params_at_redoes_the_split_at_a_neighbour():
    route = routes.get(ROUTE)
    measured, asked = _p(batch=64), _p(batch=1)
    picked = route.param_space(measured, H200)[0]
    assert routes.params_at(route, picked, measured, asked, H200) == \
        route.param_space(asked, H200)[0]


class _Recorder:
    """Stands in for ``gluon_seesaw.decode_launcher``: records its arguments, allocates what
    the real one would, and counts launches."""

    def __init__(self):
        self.calls: list[dict] = []
        self.launches = 0

    calls_made = 0  # over every recorder: the order of calls across kernels

    def __call__(self, q, kv_cache, block_table, seq_lens, **kw):
        _Recorder.calls_made += 1
        self.calls.append(dict(q=q, kv_cache=kv_cache, block_table=block_table,
                               seq_lens=seq_lens, order=_Recorder.calls_made, **kw))
        out = kw["out"] if kw["out"] is not None else torch.empty(
            q.shape[0], q.shape[1], 512, dtype=q.dtype)
        lse = kw["lse"] if kw["lse"] is not None else torch.empty(q.shape[0], q.shape[1])

        def launch() -> None:
            self.launches += 1

        return launch, out, lse


@pytest.fixture(params=list(KERNELS))
def recorder(request, monkeypatch):
    """Each Gluon route with its own kernel's launcher recorded (the other's raises)."""
    fake = _Recorder()
    fake.route_id = request.param
    for route_id, kernel in KERNELS.items():
        if route_id == request.param:
            monkeypatch.setattr(kernel, "decode_launcher", fake)
        else:
            monkeypatch.setattr(kernel, "decode_launcher", _not_this_kernel)
    return fake


def _not_this_kernel(*args, **kwargs):
    raise AssertionError("the route ran another route's kernel")


def test_both_gluon_routes_serve_the_same_problems_with_their_split_picks():
    """The same rules but the dtypes (the seesaw kernel also reads an fp8 cache); the same
    split pick but the seesaw's tiles taken in pairs (``plan.seesaw_tile_step``)."""
    assert [r.id for r in capability.rules_for("seesaw/gluon")] == \
        [("seesaw.dtypes" if r.id == "wgmma.dtypes" else r.id) for r in
         capability.rules_for(ROUTE)]
    wgmma, seesaw = routes.get(ROUTE), routes.get("seesaw/gluon")
    for problem in (_p(batch=1), _p(batch=64, num_heads=128, qlen=2, kv_len=8192),
                    _p(batch=8, dcp_size=2)):
        pairs = [p["num_splits"] for p in seesaw.param_space(problem, H200)
                 if p["form"] == "pairs"]
        picks = {step: gluon_hopper_plan.pick_splits(
            problem.batch, wgmma.row_blocks(problem), problem.shard_len, 132, tile_step=step,
            by_reduce=True) for step in (1, 2)}
        assert pairs[0] == picks[2]
        assert set(pairs) <= {picks[2], picks[2] // 2, picks[2] * 2}
        assert wgmma.param_space(problem, H200)[0]["num_splits"] == picks[1]
        assert all((set(p) == {"num_splits", "form"} and p["form"] in seesaw.forms)
                   or p == {"form": "balanced"} for p in seesaw.param_space(problem, H200))
    assert seesaw.sized_params == wgmma.sized_params


def test_the_seesaw_pick_gives_its_splits_whole_pairs_of_tiles_over_a_16_bit_cache():
    """Batch 1, 128 heads, 16,384 keys (256 tiles): the one-tile pick (wgmma/gluon's) leaves 5
    tiles a split, the seesaw's an even count; over an fp8 cache the seesaw picks as a
    one-tile walk."""
    seesaw, wgmma = routes.get("seesaw/gluon"), routes.get(ROUTE)
    bf16 = _p(batch=1, num_heads=128, kv_len=16384)
    fp8 = dataclasses.replace(bf16, kv_dtype="fp8_e4m3fn")
    tiles = 16384 // gluon_hopper_plan.BLOCK_N
    one = wgmma.param_space(bf16, H200)[0]["num_splits"]
    pair = seesaw.param_space(bf16, H200)[0]["num_splits"]
    assert -(-tiles // one) % 2 == 1  # the one-tile pick: a lone last tile
    assert -(-tiles // pair) % 2 == 0
    assert seesaw.param_space(fp8, H200)[0]["num_splits"] == one
    assert gluon_hopper_plan.seesaw_tile_step(True) == 1


def test_the_seesaw_offers_two_requests_a_program_only_past_one_wave():
    """(128, 128, 4096, 1): 2 row blocks x 128 requests at one split, 256 programs on 132
    SMs, so the first set again with two requests a program; (64, 64, 4096, 1) and (128,
    16, 4096, 4) fit one wave (64 and 128 programs at one split): no such set."""
    seesaw = routes.get("seesaw/gluon")
    big = seesaw.param_space(_p(batch=128, num_heads=128, kv_len=4096), H200)
    assert big[0] == {"num_splits": 1, "form": "pairs"}
    assert [p for p in big if p["form"] == "two-requests"] == [{**big[0], "form": "two-requests"}]
    for problem in (_p(batch=64, num_heads=64, kv_len=4096),
                    _p(batch=128, num_heads=16, kv_len=4096, qlen=4)):
        space = seesaw.param_space(problem, H200)
        programs = seesaw.row_blocks(problem) * space[0]["num_splits"] * problem.batch
        assert programs <= 132 and all(p["form"] != "two-requests" for p in space)


def test_the_transposed_route_serves_fp8_caches_and_its_own_row_blocks():
    route = routes.get("transposed/gluon")
    fp8 = _p(batch=4, kv_dtype="fp8_e4m3fn")
    assert capability.check("transposed/gluon", fp8, "sm_90")
    assert not capability.check(ROUTE, fp8, "sm_90")
    refused = capability.check("transposed/gluon", _p(q_dtype="fp8_e4m3fn", kv_dtype="fp8_e4m3fn"),
                               "sm_90")
    assert not refused and refused.rule == "transposed.dtypes"
    # 16 heads x 1 token: one 16-row program a request; 16 x 4 = 64 rows: two of 32;
    # 128 heads: four. The 64-row kernels: one, one and two.
    for heads, qlen, blocks in ((16, 1, 1), (16, 4, 2), (128, 1, 4), (8, 3, 1)):
        problem = _p(batch=1, num_heads=heads, qlen=qlen)
        assert route.row_blocks(problem) == blocks
    # Fewer programs a request: the split pick goes up at batch 64 x 128 heads.
    wide = _p(batch=8, num_heads=128, kv_len=16384)
    assert route.param_space(wide, H200)[0]["num_splits"] <= \
        routes.get(ROUTE).param_space(wide, H200)[0]["num_splits"]


@pytest.mark.parametrize("route_id", list(KERNELS))
@pytest.mark.parametrize(("q", "kv"), [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", FP8),
                                       ("fp16", FP8), (FP8, FP8)])
def test_one_owner_says_which_kernels_read_an_fp8_cache(route_id, q, kv):
    """``gluon_hopper_plan.dtype_refusal`` (over ``FP8_CACHE_KERNELS``) is the dtypes rule of
    each Gluon route (transposed-mma8/gluon: transposed/gluon's, then its own) and says
    whether its prepare hands the kernel the cache's scale."""
    route = routes.get(route_id)
    why = gluon_hopper_plan.dtype_refusal(route.kernel, q, kv)
    ruling = capability.check(route_id, _p(q_dtype=q, kv_dtype=kv), "sm_90")
    assert ruling.ok is (why is None)
    if why:
        assert ruling.reason == why and ruling.rule.endswith(".dtypes")
    assert route.reads_fp8 is (route.kernel in gluon_hopper_plan.FP8_CACHE_KERNELS)
    assert (why is None) is (q in ("bf16", "fp16") and (kv == q or (kv == FP8 and
                                                                    route.reads_fp8)))


def test_the_seesaw_route_serves_fp8_caches_exactly_and_two_requests_from_page_64():
    """seesaw/gluon over an fp8 cache under a 16-bit q: its rule admits it from page 16 (page
    1 refused: its loader copies by TMA), every set exact (the tile widened to fp16, q's rows
    scaled by powers of two); the two-requests form offered past one wave at pages of 64 and
    more only (under them its fp8 build spills registers: ``SEESAW_FP8_TWO_REQUESTS_MIN_PAGE``)."""
    seesaw = routes.get("seesaw/gluon")
    assert seesaw.reads_fp8 and not routes.get(ROUTE).reads_fp8
    for page in (16, 32, 64, 128):
        problem = _p(batch=128, num_heads=128, kv_dtype=FP8, page_size=page)
        assert capability.check("seesaw/gluon", problem, "sm_90")
        space = seesaw.param_space(problem, H200)
        forms = {p["form"] for p in space}  # 256 programs: 1.94 waves, balanced too
        assert forms == ({"pairs", "two-requests", "balanced"} if page >= 64
                         else {"pairs", "balanced"})
        assert {routes.rounding(seesaw, problem, p) for p in space} == {Rounding.NONE}
        bf16 = seesaw.param_space(problem.with_(kv_dtype="bf16"), H200)
        assert [p for p in space if p["form"] == "pairs"] == \
            [p for p in bf16 if p["form"] == "pairs"]
    one = capability.check("seesaw/gluon", _p(kv_dtype=FP8, page_size=1), "sm_90")
    assert not one and one.rule == "wgmma.page"
    quantized = capability.check("seesaw/gluon", _p(q_dtype=FP8, kv_dtype=FP8), "sm_90")
    assert not quantized and quantized.rule == "seesaw.dtypes"
    assert gluon_hopper_plan.seesaw_form_refusal("two-requests", True, 16)
    assert gluon_hopper_plan.seesaw_form_refusal("two-requests", False, 16) is None
    assert gluon_hopper_plan.seesaw_form_refusal("pairs", True, 16) is None


def test_prepare_hands_an_fp8_cache_and_its_scale_to_the_seesaw_kernel(monkeypatch):
    """Over an fp8 cache the seesaw route's every set runs its one kernel, handed the cache
    and its scale; over a 16-bit cache no scale (None)."""
    fake = _Recorder()
    monkeypatch.setattr(gluon_seesaw, "decode_launcher", fake)
    route = routes.get("seesaw/gluon")
    problem = _p(batch=300, num_heads=128, kv_len=300, kv_dtype=FP8)
    inputs = make_decode_inputs(problem, seed=9, ragged=True)
    space = route.param_space(problem, H200)
    assert {p["form"] for p in space} == {"pairs", "two-requests", "balanced"}
    for params in space:
        route.prepare(problem, inputs, params=params)
    assert len(fake.calls) == len(space)
    for call, params in zip(fake.calls, space, strict=True):
        assert call["kv_cache"].dtype == torch.float8_e4m3fn and call["form"] == params["form"]
        assert call["kv_scale"] is inputs.kv_scale and call["q"].dtype == torch.bfloat16
    sixteen = _p(batch=2, kv_len=300)
    route.prepare(sixteen, make_decode_inputs(sixteen, seed=9))
    assert fake.calls[-1]["kv_scale"] is None


TRANSPOSED_KERNELS = ("gluon_transposed", "gluon_transposed_ws", "gluon_transposed_fp8")


def _transposed_recorders(monkeypatch) -> dict[str, _Recorder]:
    """transposed/gluon's three kernels, each launcher recorded."""
    fakes = {}
    for name in TRANSPOSED_KERNELS:
        fakes[name] = _Recorder()
        monkeypatch.setattr(importlib.import_module(f"mlatune.kernels.{name}"),
                            "decode_launcher", fakes[name])
    return fakes


def _ran(fakes: dict[str, _Recorder]) -> list[tuple[str, dict]]:
    """(kernel, its call's options) of each recorded call, in order (one prepare each)."""
    calls = [(name, call) for name, fake in fakes.items() for call in fake.calls]
    return sorted(calls, key=lambda item: item[1]["order"])


def test_prepare_hands_an_fp8_cache_and_its_scale_to_the_transposed_kernels(monkeypatch):
    """Over an fp8 cache transposed/gluon's first set runs the widening, transposed-mma8's the
    fp8-MMA kernel; each is handed the cache and its scale."""
    fakes = _transposed_recorders(monkeypatch)
    problem = _p(batch=2, kv_len=300, kv_dtype="fp8_e4m3fn")
    inputs = make_decode_inputs(problem, seed=8, ragged=True)
    for route_id in ("transposed/gluon", MMA8):
        routes.get(route_id).prepare(problem, inputs)
    ran = _ran(fakes)
    assert [name for name, _ in ran] == ["gluon_transposed_ws", "gluon_transposed_fp8"]
    for _, call in ran:
        assert call["kv_cache"].dtype == torch.float8_e4m3fn
        assert call["kv_scale"] is inputs.kv_scale and call["q"].dtype == torch.bfloat16


@pytest.mark.parametrize("problem", [
    _p(batch=3, kv_len=300),
    _p(batch=2, num_heads=128, qlen=4, kv_len=700, causal=True),
    _p(batch=2, num_heads=8, qlen=2, kv_len=200, causal=False, q_dtype="fp16", kv_dtype="fp16"),
], ids=lambda p: p.key)
def test_prepare_hands_the_launcher_the_inputs(problem, recorder):
    route = routes.get(recorder.route_id)
    inputs = make_decode_inputs(problem, seed=3, ragged=True)
    prepared = route.prepare(problem, inputs, params={"num_splits": 3})
    (call,) = recorder.calls
    shard = inputs.shards[0]
    assert call["q"] is inputs.q and call["q"].shape == (problem.batch * problem.qlen,
                                                        problem.num_heads, 576)
    assert call["kv_cache"] is shard.kv_cache and call["kv_cache"].shape[1:] == (64, 576)
    assert call["kv_cache"].stride() == (64 * 576, 576, 1)
    assert call["block_table"] is shard.block_table and call["seq_lens"] is shard.seq_lens
    assert call["qlen"] == problem.qlen and call["causal"] is problem.causal
    assert call["sm_scale"] == pytest.approx(problem.softmax_scale)
    # Both given, so the launcher never reads the lengths on the host.
    assert call["num_splits"] == 3 and call["max_seq_len"] == problem.kv_len
    # Only the kernels that read an fp8 cache are handed the cache's scale (here None).
    assert ("kv_scale" in call) == (recorder.route_id in ("seesaw/gluon", "transposed/gluon"))
    assert call.get("kv_scale") is None
    assert prepared.params == {"num_splits": 3, **route.kernel_options}
    assert prepared.graph_safe and not prepared.plan_reads_lengths and prepared.plan is None
    assert prepared.step_kind == routes.LAUNCH_ONLY
    assert prepared.out.shape == (problem.batch * problem.qlen, problem.num_heads, 512)
    assert prepared.lse.shape == (problem.batch * problem.qlen, problem.num_heads)
    prepared.step()
    prepared.run()
    assert recorder.launches == 2


def test_a_seesaw_set_hands_its_form_to_the_launcher(monkeypatch):
    """seesaw/gluon's sets name their form; a set without one runs the first form, "pairs";
    a form the kernel no longer has is refused by the launcher."""
    fake = _Recorder()
    monkeypatch.setattr(gluon_seesaw, "decode_launcher", fake)
    route = routes.get("seesaw/gluon")
    problem = _p(batch=2, kv_len=300)
    inputs = make_decode_inputs(problem, seed=9)
    assert route.prepare(problem, inputs).params["form"] == "pairs"
    assert route.prepare(problem, inputs, params={"num_splits": 2}).params["form"] == "pairs"
    two = route.prepare(problem, inputs, params={"num_splits": 2, "form": "two-requests"})
    assert two.params == {"num_splits": 2, "form": "two-requests"}
    assert [call["form"] for call in fake.calls] == ["pairs", "pairs", "two-requests"]
    monkeypatch.undo()
    assert tuple(inspect.signature(gluon_seesaw.decode_launcher).parameters)[-1] == "form"
    assert route.forms == gluon_seesaw.FORMS
    with pytest.raises(ValueError, match="forms are"):
        gluon_seesaw.decode_launcher(*[None] * 4, qlen=1, sm_scale=0.1, form="lone")


def test_transposed_sets_name_their_form_and_each_form_its_kernel(monkeypatch):
    """transposed/gluon's sets name "mma16", transposed-mma8/gluon's "mma8"; mma8 runs the
    fp8-MMA kernel, mma16 the transposed kernel or over an fp8 cache the warp-specialized
    widening; a set without a form runs its route's form. No kernel is handed options beyond
    the call's tensors and sizes."""
    fakes = _transposed_recorders(monkeypatch)
    route, mma8 = routes.get("transposed/gluon"), routes.get(MMA8)
    fp8, bf16 = _p(batch=2, kv_len=300, kv_dtype="fp8_e4m3fn"), _p(batch=2, kv_len=300)
    assert all(p["form"] == "mma16" for p in route.param_space(fp8, H200))
    assert all(p["form"] == "mma16" for p in route.param_space(bf16, H200))
    assert all(p["form"] == "mma8" for p in mma8.param_space(fp8, H200))
    widen = route.param_space(fp8, H200)[0]
    for problem, params in ((fp8, widen), (fp8, {"num_splits": 2}), (bf16, None),
                            (bf16, {"num_splits": 2})):
        route.prepare(problem, make_decode_inputs(problem, seed=10), params=params)
    mma8.prepare(fp8, make_decode_inputs(fp8, seed=10), params={"num_splits": 2})
    ran = [name for name, _ in _ran(fakes)]
    assert ran == ["gluon_transposed_ws", "gluon_transposed_ws", "gluon_transposed",
                   "gluon_transposed", "gluon_transposed_fp8"]
    standard = {"q", "kv_cache", "block_table", "seq_lens", "qlen", "sm_scale", "causal", "out",
                "lse", "num_splits", "max_seq_len", "kv_scale", "order"}
    assert all(set(call) == standard for _, call in _ran(fakes))
    with pytest.raises(ValueError, match="not one of"):
        route.prepare(bf16, make_decode_inputs(bf16, seed=10), params={"form": "ws"})


def test_an_mma16_set_over_fp8_runs_the_warp_specialized_widening(monkeypatch):
    """mma16 over an fp8 cache: the route hands the cache, its scale and the call's buffers
    to ``gluon_transposed_ws``; an mma8 set is not transposed/gluon's; transposed-mma8/gluon
    over a 16-bit cache goes to the fp8-MMA kernel, which refuses it."""
    fakes = _transposed_recorders(monkeypatch)
    route = routes.get("transposed/gluon")
    problem = _p(batch=2, kv_len=300, kv_dtype="fp8_e4m3fn")
    inputs = make_decode_inputs(problem, seed=11)
    shard = inputs.shards[0]
    out = torch.empty(2, 16, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 16)
    route.prepare(problem, inputs, params={"num_splits": 4, "form": "mma16"}, out=out, lse=lse)
    (call, ) = fakes["gluon_transposed_ws"].calls
    call.pop("order")
    assert call == dict(q=inputs.q, kv_cache=shard.kv_cache, block_table=shard.block_table,
                        seq_lens=shard.seq_lens, qlen=1, sm_scale=inputs.softmax_scale,
                        causal=problem.causal, out=out, lse=lse, num_splits=4,
                        max_seq_len=300, kv_scale=inputs.kv_scale)
    monkeypatch.undo()
    bf16 = _p(batch=2, kv_len=300)
    with pytest.raises(ValueError, match="not one of"):
        route.prepare(problem, inputs, params={"form": "mma8"})
    with pytest.raises(ValueError, match="fp8 cache only"):
        routes.get(MMA8).prepare(bf16, make_decode_inputs(bf16, seed=12))


def test_a_stored_seesaw_row_keeps_its_form_and_rescales_its_split_at_a_neighbour():
    """A stored seesaw set carried from batch 1 to batch 64: its split is redone (the pick
    there for the pick here), its form kept (the form is matched apart from the split); an
    empty set (a rule's fallback) is the route's first set."""
    seesaw, wgmma = routes.get("seesaw/gluon"), routes.get(ROUTE)
    measured, asked = _p(batch=1), _p(batch=64)
    stored = {"num_splits": seesaw.param_space(measured, H200)[0]["num_splits"],
              "form": "two-requests"}
    moved = routes.params_at(seesaw, stored, measured, asked, H200)
    assert moved == {"num_splits": seesaw.param_space(asked, H200)[0]["num_splits"],
                     "form": "two-requests"}
    assert moved["num_splits"] != stored["num_splits"]
    split = {"num_splits": stored["num_splits"]}
    new = routes.params_at(seesaw, seesaw.param_space(measured, H200)[0], measured, asked, H200)
    assert new == seesaw.param_space(asked, H200)[0] == {"num_splits": new["num_splits"],
                                                          "form": "pairs"}
    space = seesaw.param_space(asked, H200)
    first = space[0]
    assert routes.with_defaults(seesaw, {}, space) == first
    assert routes.with_defaults(seesaw, None, space) == first
    assert routes.with_defaults(seesaw, stored, space) == stored
    wgmma_space = wgmma.param_space(asked, H200)
    assert routes.with_defaults(wgmma, split, wgmma_space) == {**wgmma_space[0], **split}


def test_the_report_times_a_stored_seesaw_choice_as_it_ran():
    from mlatune.report.metrics import time_with

    problem = _p(batch=2)
    splits = routes.get("seesaw/gluon").param_space(problem, H200)[0]["num_splits"]
    timed = {(problem.key, "seesaw/gluon"): [
        ({"num_splits": splits, "form": "two-requests"}, 10.0),
        ({"num_splits": splits, "form": "pairs"}, 9.0)]}
    assert time_with(timed, problem, "seesaw/gluon",
                     {"num_splits": splits, "form": "two-requests"}, H200) == 10.0
    assert time_with(timed, problem, "seesaw/gluon", {}, H200) == 9.0
    assert time_with(timed, problem, "seesaw/gluon", {"num_splits": splits}, H200) == 9.0


SHIPPED = Path(__file__).resolve().parents[1] / "tables" / "sm_90-h200.parquet"
GLUON_ROUTES = ("wgmma/gluon", "seesaw/gluon", "transposed/gluon", MMA8)


def _shipped_params() -> dict[str, list[dict]]:
    """Each Gluon route's distinct param sets in the shipped H200 table, as read (each row
    under the route its set belongs to, spelled as stored)."""
    import pandas as pd

    rows = pd.read_parquet(SHIPPED, columns=["route", "route_params"])
    rows["route"] = [routes.FACTS.route_of(r, json.loads(t))
                     for r, t in zip(rows["route"], rows["route_params"], strict=True)]
    return {route_id: [json.loads(text) for text in sorted(set(
        rows.loc[rows["route"] == route_id, "route_params"]))] for route_id in GLUON_ROUTES}


def test_every_shipped_gluon_param_set_upgrades_to_a_live_form():
    """Every distinct param set the shipped table stores for the Gluon routes reads as a live
    form of its route with its split kept: no shipped row is stale or under another route."""
    seen = set()
    for route_id, stored in _shipped_params().items():
        route = routes.get(route_id)
        for params in stored:
            assert route.route_of(params) == route_id, params
            new = route.upgrade_params(params)
            assert new is not None, (route_id, params)
            assert new.get("num_splits") == params.get("num_splits")
            assert set(new) <= {"num_splits", "form"}
            # {}: a refusal row's (the route's first set); else the form, where it has forms
            assert new == {} or new.get("form") in (route.forms or (None, ))
            assert route.upgrade_params(new) == new  # the current spelling reads as itself
            seen.add((route_id, new.get("form")))
    assert seen == {("wgmma/gluon", None), ("seesaw/gluon", None), ("seesaw/gluon", "pairs"),
                    ("seesaw/gluon", "two-requests"), ("seesaw/gluon", "balanced"),
                    ("transposed/gluon", None), ("transposed/gluon", "mma16"), (MMA8, None),
                    (MMA8, "mma8")}


def test_the_shipped_boolean_forms_map_to_these_ids():
    seesaw, transposed = routes.get("seesaw/gluon"), routes.get("transposed/gluon")
    on = dict.fromkeys(("chunked", "pdl", "slim", "lone_bars", "afresh_q", "rope_regs"), True)
    assert seesaw.upgrade_params({"num_splits": 2, **on, "two_requests": False}) == \
        {"num_splits": 2, "form": "pairs"}
    assert seesaw.upgrade_params({"num_splits": 1, **on, "two_requests": True}) == \
        {"num_splits": 1, "form": "two-requests"}
    mma8 = dict.fromkeys(("pdl", "ws", "fp8_mma", "defer_sums", "stacked", "wide_vt",
                          "warp_max", "slim"), True)
    assert transposed.route_of({"num_splits": 8, **mma8}) == MMA8
    assert transposed.upgrade_params({"num_splits": 8, **mma8}) is None  # not its form
    assert routes.get(MMA8).upgrade_params({"num_splits": 8, **mma8}) == \
        {"num_splits": 8, "form": "mma8"}
    for widen in (True, False):
        assert transposed.upgrade_params({"num_splits": 8, "pdl": True, "ws": widen,
                                          "fp8_mma": False, "defer_sums": False}) == \
            {"num_splits": 8, "form": "mma16"}
        assert transposed.route_of({"num_splits": 8, "pdl": True, "ws": widen}) == \
            "transposed/gluon"
    assert routes.get(ROUTE).upgrade_params({"num_splits": 16}) == {"num_splits": 16}


SEESAW_ON = dict.fromkeys(("chunked", "pdl", "slim", "lone_bars", "afresh_q", "rope_regs"), True)


@pytest.mark.parametrize(("route_id", "params"), [
    ("seesaw/gluon", {"num_splits": 4}),  # stored before any option: the unchunked kernel
    ("seesaw/gluon", {"num_splits": 4, "chunked": True}),
    ("seesaw/gluon", {"num_splits": 4, "chunked": True, "pdl": True, "slim": True}),
    ("seesaw/gluon", {**SEESAW_ON, "rope_regs": False, "num_splits": 2}),  # afresh, no rope
    ("seesaw/gluon", {**SEESAW_ON, "lone_bars": False, "two_requests": True}),
    ("seesaw/gluon", {"num_splits": 2, "form": "lone"}),
    ("transposed/gluon", {"num_splits": 4}),  # no pdl: the first sets
    ("transposed/gluon", {"num_splits": 4, "ws": True}),
    ("transposed/gluon", {"num_splits": 4, "pdl": True, "fp8_mma": True, "defer_sums": True}),
    ("transposed/gluon", {"num_splits": 4, "pdl": True, "ws": True, "fp8_mma": True,
                          "defer_sums": True, "stacked": True, "wide_vt": True,
                          "warp_max": True}),  # all but slim
    ("transposed/gluon", {"num_splits": 4, "form": "fp8-mma"}),
    ("transposed/gluon", {"num_splits": 4, "form": "mma8"}),  # transposed-mma8/gluon's
    (MMA8, {"num_splits": 4, "form": "mma16"}),
])
def test_a_deleted_form_upgrades_to_none(route_id, params):
    assert routes.get(route_id).upgrade_params(params) is None


@pytest.mark.parametrize("route_id", GLUON_ROUTES)
def test_every_offered_set_is_in_the_current_spelling(route_id):
    route = routes.get(route_id)
    for problem in (_p(batch=1), _p(batch=128, num_heads=128), _p(batch=2, kv_dtype=FP8),
                    _p(batch=64, num_heads=32, kv_dtype=FP8, qlen=2)):
        if not capability.check(route_id, problem, "sm_90"):
            continue
        for params in route.param_space(problem, H200):
            assert route.upgrade_params(params) == params
            assert params.get("form") in (route.forms or (None, ))
    assert route.upgrade_params({}) == {}


def test_prepare_defaults_to_the_first_params_and_takes_the_callers_buffers(recorder):
    route = routes.get(recorder.route_id)
    problem = _p(batch=2, kv_len=256)
    inputs = make_decode_inputs(problem, seed=4)
    scaled = dataclasses.replace(inputs, sm_scale=0.05)
    out = torch.empty(2, 16, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 16)
    prepared = route.prepare(problem, scaled, out=out, lse=lse)
    call = recorder.calls[-1]
    assert call["sm_scale"] == 0.05
    assert call["out"] is out and call["lse"] is lse
    assert prepared.out is out and prepared.lse is lse
    assert call["num_splits"] == route.param_space(problem, cpu_device())[0]["num_splits"]
    assert route.prepare(problem, inputs, want_lse=False).lse is None


@pytest.mark.parametrize(("qlen", "causal"), [(1, True), (3, False)])
def test_a_dcp_rank_runs_over_its_own_shard(qlen, causal, recorder):
    route = routes.get(recorder.route_id)
    problem = _p(batch=3, num_heads=8, qlen=qlen, kv_len=500, dcp_size=2, causal=causal)
    inputs = make_decode_inputs(problem, seed=5, ragged=True)
    for rank in (1, 0):
        prepared = route.prepare(problem, inputs, rank=rank, params={"num_splits": 2})
        call = recorder.calls[-1]
        shard = inputs.shards[rank]
        assert call["kv_cache"] is shard.kv_cache and call["block_table"] is shard.block_table
        assert call["seq_lens"] is shard.seq_lens  # local lengths: the kernel masks on them
        assert call["q"].shape[1] == problem.kernel_heads == 16
        assert call["max_seq_len"] == problem.shard_len == 250
        assert prepared.lse is not None  # the ranks merge by it


def test_prepare_refuses_causal_verify_over_a_shard(recorder):
    problem = _p(batch=2, qlen=2, kv_len=300, dcp_size=2)
    inputs = make_decode_inputs(problem, seed=6)
    with pytest.raises(ValueError, match="local positions"):
        routes.get(recorder.route_id).prepare(problem, inputs, rank=0)
    assert not recorder.calls


@pytest.mark.parametrize("route_id", list(KERNELS))
def test_prepare_without_triton_3_6_raises_naming_it(route_id):
    if gluon_common.gluon_available()[0]:
        pytest.skip("this machine has triton 3.6")
    problem = _p(batch=2, kv_len=256)
    inputs = make_decode_inputs(problem, seed=7)
    with pytest.raises(ValueError, match=r"triton 3\.6\.x"):
        routes.get(route_id).prepare(problem, inputs)


@pytest.mark.parametrize("kw", [
    dict(num_heads=16, batch=3, kv_len=300), dict(num_heads=16, batch=2, kv_len=700, qlen=4),
    dict(num_heads=16, batch=3, kv_len=300, kv_dtype="fp8_e4m3fn"),
    dict(num_heads=8, batch=3, kv_len=500, dcp_size=2), dict(num_heads=128, batch=2, kv_len=5000),
    dict(num_heads=16, batch=2, kv_len=300, qlen=2, q_dtype="fp16", kv_dtype="fp8_e4m3fn"),
], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
@pytest.mark.parametrize("route_id", [*KERNELS, MMA8])
@pytest.mark.parametrize("page", [64, 16, 1])
def test_each_route_reaches_its_launch_at_every_param_set_and_rank(route_id, page, kw):
    """Every parameter set and DCP rank, with and without the caller's buffers, gets past
    the launcher's checks and builds its TMA descriptors (no launch: no GPU here). Needs
    triton 3.6.x, whose Gluon descriptors the launchers build."""
    from tests.test_gluon_compile import _needs_gluon_triton

    _needs_gluon_triton()
    route = routes.get(route_id)
    problem = _p(page_size=page, **kw)
    if not capability.check(route_id, problem, "sm_90"):
        pytest.skip(f"{route_id} does not serve {problem.key}")
    inputs = make_decode_inputs(problem, seed=1, ragged=True)
    tokens, heads = problem.batch * problem.qlen, problem.kernel_heads
    for params in route.param_space(problem, cpu_device()):
        for rank in range(problem.dcp_size):
            own = route.prepare(problem, inputs, rank=rank, params=params)
            assert own.out.shape == (tokens, heads, 512)
            assert own.params == {**route.kernel_options, **params}
            out = torch.empty(tokens, heads, 512, dtype=inputs.q.dtype)
            lse = torch.empty(tokens, heads)
            given = route.prepare(problem, inputs, rank=rank, params=params, out=out, lse=lse)
            assert given.out is out and given.lse is lse


def test_the_fp8_mma_route_serves_fp8_caches_up_to_16_rows_and_rounds_p(monkeypatch):
    """transposed-mma8/gluon serves an fp8 cache at up to 16 query rows a program (refused
    elsewhere by its own rule, after transposed/gluon's), its sets from the fp8-MMA kernel's
    split pick (with ``FP8_MMA_PROGRAM_COST``: 16 splits at batch 4 of 4096 keys, where the
    widening's is 22), then half and twice it, every one P rounded (q's two e4m3 terms keep it
    near 16 bits); transposed/gluon's sets are the widening's, exact."""
    from mlatune.kernels import gluon_hopper_plan as plan

    route, mma8 = routes.get("transposed/gluon"), routes.get(MMA8)
    fp8 = _p(batch=4, kv_len=4096, kv_dtype="fp8_e4m3fn")  # 16 heads x 1 token: 16 rows
    assert capability.check(MMA8, fp8, "sm_90")
    fp8_pick = plan.pick_splits(4, 1, 4096, per_program=plan.FP8_MMA_PROGRAM_COST)
    assert (fp8_pick, plan.pick_splits(4, 1, 4096)) == (16, 22)
    assert mma8.param_space(fp8, H200) == [{"num_splits": s, "form": "mma8"} for s in (16, 8, 32)]
    assert route.param_space(fp8, H200) == [{"num_splits": s, "form": "mma16"}
                                            for s in (22, 11, 44)]
    rounded, none = Rounding.P_FP8, Rounding.NONE
    assert {routes.rounding(mma8, fp8, p) for p in mma8.param_space(fp8, H200)} == {rounded}
    assert routes.rounding(mma8, fp8) == rounded
    assert {routes.rounding(route, fp8, p) for p in route.param_space(fp8, H200)} == {none}
    assert routes.rounding(route, fp8) == none
    for wide in (_p(num_heads=32, batch=2, kv_dtype="fp8_e4m3fn"),  # 32 rows a program
                 _p(batch=2, qlen=2, kv_dtype="fp8_e4m3fn"), _p(batch=2)):
        ruling = capability.check(MMA8, wide, "sm_90")
        assert not ruling and ruling.rule == "transposed.fp8_mma"
        assert "transposed/gluon serves the rest" in mma8.supports(wide, H200).reason
        assert capability.check("transposed/gluon", wide, "sm_90")
    refused = capability.check(MMA8, _p(q_dtype=FP8, kv_dtype=FP8), "sm_90")
    assert not refused and refused.rule == "transposed.dtypes"


def test_the_two_transposed_routes_share_launch_geometry_limits_step_and_plan():
    route, mma8 = routes.get("transposed/gluon"), routes.get(MMA8)
    fp8 = _p(batch=2, kv_len=4096, kv_dtype=FP8)
    assert mma8.block_rows(fp8) == route.block_rows(fp8) == 16
    assert mma8.param_limits == route.param_limits and mma8.sized_params == route.sized_params
    assert mma8.step_kind({"form": "mma8"}) == route.step_kind({}) == routes.LAUNCH_ONLY
    assert not mma8.shares_plan and mma8.writes_into and mma8.reads_fp8
    geometry = mma8.launch_geometry(fp8, {"form": "mma8"}, 132)
    assert geometry is not None and geometry.owner is mma8
    assert geometry.listed(fp8, H200) == [22, 11, 44]  # its own sets' splits
    assert MMA8 in [r.id for r in routes.all_routes()]


def test_the_seesaw_offers_the_balanced_form_where_the_waves_are_ragged():
    """From 64 query rows a request, where the first set's programs leave more than
    ``BALANCED_MIN_IDLE`` of their waves' SM slots idle: (40, 128, 1500, 1) at one split is
    80 programs (0.6 of a wave), (128, 128, 4096, 1) 256 (1.94 waves); 132 requests of 64
    rows fill a wave at one split, and 16 rows a request never get it. A balanced set names
    no split, and is planned on the device (``DEVICE_PLANNED``); it comes third, so a sweep
    keeping three sets a route times it."""
    seesaw = routes.get("seesaw/gluon")
    for problem in (_p(batch=40, num_heads=128, kv_len=1500), _p(batch=128, num_heads=128),
                    _p(batch=40, num_heads=64, kv_len=1500, qlen=2)):
        space = seesaw.param_space(problem, H200)
        assert space[2] == {"form": "balanced"} and space[0]["form"] == "pairs"
        assert [p for p in space if p.get("form") == "balanced"] == [space[2]]
        assert routes.step_kind_of(seesaw, space[2]) == routes.DEVICE_PLANNED
        assert all(routes.step_kind_of(seesaw, p) == routes.LAUNCH_ONLY
                   for p in space[:2] + space[3:])
    full = _p(batch=132, num_heads=64, kv_len=256)
    assert seesaw.param_space(full, H200)[0]["num_splits"] == 1
    for problem in (full, _p(batch=40, num_heads=16, kv_len=1500)):
        assert all(p["form"] != "balanced" for p in seesaw.param_space(problem, H200))
    assert gluon_hopper_plan.wave_idle(132, 132) == 0.0
    geometry = seesaw.launch_geometry(_p(batch=40, num_heads=128), {"form": "balanced"}, 132)
    assert geometry.key is None and geometry.balanced  # the same work spread evenly


def test_a_balanced_set_plans_on_the_device_and_shares_its_plan(monkeypatch):
    """prepare of a balanced set makes the device plan of the shard's lengths (run once
    there), hands its buffers to the launcher, and returns it as the step's plan; another
    layer's prepare with ``plan_from`` reads the same buffers without planning, and one made
    for other length tensors is refused."""
    fake = _Recorder()
    monkeypatch.setattr(gluon_seesaw, "decode_launcher", fake)
    made = []
    real = gluon_seesaw.balanced_plan

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(gluon_seesaw, "balanced_plan", counting)
    route = routes.get("seesaw/gluon")
    problem = _p(batch=5, num_heads=128, kv_len=700)
    inputs = make_decode_inputs(problem, seed=4, ragged=True)
    first = route.prepare(problem, inputs, params={"form": "balanced"})
    assert len(made) == 1 and first.step_kind == routes.DEVICE_PLANNED
    (call,) = fake.calls
    work, work_indptr, split_indptr = call["plan"]
    assert call["form"] == "balanced" and work_indptr.shape == (67,)  # 132 SMs / 2 blocks
    # Planned for the lengths at hand: every request's keys in the work list.
    lens = inputs.shards[0].seq_lens.tolist()
    items = work[:int(work_indptr[-1])].tolist()
    assert sum(e - s for _, s, e, _ in items) == sum(lens)
    assert split_indptr.tolist()[-1] == len(items)
    second = route.prepare(problem, inputs, params={"form": "balanced"}, plan_from=first)
    assert len(made) == 1 and fake.calls[-1]["plan"] is call["plan"]
    assert second.plan is first.plan and second.plan_reads_lengths
    other = make_decode_inputs(problem, seed=5, ragged=True)
    with pytest.raises(ValueError, match="plan_from"):
        route.prepare(problem, other, params={"form": "balanced"}, plan_from=first)
    pairs = route.prepare(problem, inputs, plan_from=first)  # a split set plans nothing
    assert pairs.plan is None and pairs.step_kind == routes.LAUNCH_ONLY


def test_pick_splits_fills_the_gpu():
    assert gluon_hopper_plan.pick_splits(1, 1, 4096) > 16  # batch 1: many splits
    assert gluon_hopper_plan.pick_splits(64, 1, 4096) == 2
    assert gluon_hopper_plan.pick_splits(128, 2, 4096) == 1  # 256 programs already fill 132 SMs
    assert gluon_hopper_plan.pick_splits(8, 2, 32768) == 8
    assert gluon_hopper_plan.pick_splits(4, 1, 0) == 1


# seesaw/gluon's times (us) at its listed split sets over a bf16 cache, H100 80GB HBM3,
# 2026-12-06 (bench.py --routine decode, CUDA-graph replay), one run a line:
# (batch, row blocks, kv) -> {splits: us}.
MEASURED_SPLITS = [
    ((40, 2, 1500), {1: 64.2, 3: 68.8, 6: 98.0}), ((80, 2, 1500), {1: 119.6, 3: 133.4, 6: 176.5}),
    ((160, 2, 1500), {1: 178.5, 2: 214.7, 4: 269.6}), ((128, 2, 4096), {1: 274.4, 2: 319.9}),
    ((32, 2, 4096), {1: 139.8, 2: 92.0}), ((32, 1, 4096), {2: 84.7, 4: 75.3}),
    ((24, 2, 700), {1: 38.6, 2: 31.1}),
    ((80, 2, 1500), {1: 117.9, 2: 122.8}), ((1, 1, 4096), {11: 21.0, 22: 18.0, 44: 17.9}),
    ((4, 1, 4096), {11: 25.4, 22: 26.6, 44: 33.2})]


def test_the_split_cost_ranks_the_measured_sets_as_they_ran():
    """Among the sets timed at each point, the seesaw's ``split_cost`` (tiles in pairs, the
    reduce merging) is least for the fastest (many heads: one split once the programs fill
    most of a wave; few: more)."""
    for at, times in MEASURED_SPLITS:
        def cost(s, at=at):
            return gluon_hopper_plan.split_cost(*at, s, 132, tile_step=2, by_reduce=True)
        assert min(times, key=cost) == min(times, key=times.get), at


def test_a_per_program_cost_splits_less_where_programs_would_be_short():
    """The fp8-MMA kernel's rule (``FP8_MMA_PROGRAM_COST`` a program): at batch 2-16 where
    the bf16 rule's programs walk 2-3 tiles it takes fewer, longer ones (why: its times at
    forced splits, docs/kernels/gluon_transposed.md); where programs are long or the SMs
    full it picks as the bf16 rule."""
    from mlatune.kernels.gluon_hopper_plan import FP8_MMA_PROGRAM_COST as cost

    for batch, kv, bf16, fp8 in [(2, 8192, 32, 32), (4, 4096, 22, 16), (16, 1024, 8, 4),
                                 (8, 8192, 16, 16), (64, 4096, 2, 2), (128, 8192, 1, 1)]:
        assert gluon_hopper_plan.pick_splits(batch, 1, kv) == bf16
        assert gluon_hopper_plan.pick_splits(batch, 1, kv, per_program=cost) == fp8
