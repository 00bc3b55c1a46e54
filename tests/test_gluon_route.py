"""The ``wgmma/gluon`` route (the Hopper Gluon decode) on the CPU: its rules, its refusal
where triton is not 3.6.x, its parameters, and what ``prepare`` hands the kernel's launcher
(a recording fake: the kernel itself runs on an sm_90 GPU only, tests/test_gluon_gpu.py)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import subprocess
import sys

import pytest
import torch

from mlatune import capability, routes
from mlatune.arch import cpu_device
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
    ("sm_90", _p(page_size=16), "wgmma.page"),
    ("sm_90", _p(page_size=1), "wgmma.page"),
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
    assert "transposed/gluon reads an fp8 cache" in fp8.reason
    assert "64-token page" in capability.check(ROUTE, _p(page_size=16), "sm_90").reason
    assert "sm_90 only; this is sm_100" in capability.check(ROUTE, _p(), "sm_100").reason


def test_the_rules_read_the_kernels_sizes():
    assert (gluon_hopper.D_NOPE, gluon_hopper.D_ROPE, gluon_hopper.PAGE_SIZE) == (512, 64, 64)
    assert gluon_hopper.pick_splits is gluon_hopper_plan.pick_splits


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
    (_p(batch=1), 64),  # one request: many splits (capped at 64)
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


def test_both_gluon_routes_serve_the_same_problems_with_the_same_splits():
    assert capability.rules_for("seesaw/gluon") == capability.rules_for(ROUTE)
    wgmma, seesaw = routes.get(ROUTE), routes.get("seesaw/gluon")
    for problem in (_p(batch=1), _p(batch=64, num_heads=128, qlen=2, kv_len=8192),
                    _p(batch=8, dcp_size=2)):
        assert [p["num_splits"] for p in seesaw.param_space(problem, H200)
                if not p["two_requests"]] == \
            [p["num_splits"] for p in wgmma.param_space(problem, H200)]
        assert all(p["chunked"] and p["pdl"] and p["slim"] and p["lone_bars"]
                   for p in seesaw.param_space(problem, H200))
    assert seesaw.sized_params == wgmma.sized_params


def test_the_seesaw_offers_two_requests_a_program_only_past_one_wave():
    """(128, 128, 4096, 1): 2 row blocks x 128 requests at one split, 256 programs on 132
    SMs, so the first set again with two requests a program; (64, 64, 4096, 1) and (128,
    16, 4096, 4) fit one wave (64 and 128 programs at one split): no such set."""
    seesaw = routes.get("seesaw/gluon")
    big = seesaw.param_space(_p(batch=128, num_heads=128, kv_len=4096), H200)
    assert big[0]["num_splits"] == 1 and not big[0]["two_requests"]
    assert [p for p in big if p["two_requests"]] == [{**big[0], "two_requests": True}]
    for problem in (_p(batch=64, num_heads=64, kv_len=4096),
                    _p(batch=128, num_heads=16, kv_len=4096, qlen=4)):
        space = seesaw.param_space(problem, H200)
        programs = seesaw.row_blocks(problem) * space[0]["num_splits"] * problem.batch
        assert programs <= 132 and not any(p["two_requests"] for p in space)


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


def _transposed_recorders(monkeypatch) -> dict[str, _Recorder]:
    """transposed/gluon's three kernels (``TRANSPOSED_KERNELS``), each launcher recorded."""
    fakes = {}
    for name in route_module.TRANSPOSED_KERNELS:
        fakes[name] = _Recorder()
        monkeypatch.setattr(importlib.import_module(f"mlatune.kernels.{name}"),
                            "decode_launcher", fakes[name])
    return fakes


def _ran(fakes: dict[str, _Recorder]) -> list[tuple[str, dict]]:
    """(kernel, its call's options) of each recorded call, in order (one prepare each)."""
    calls = [(name, call) for name, fake in fakes.items() for call in fake.calls]
    return sorted(calls, key=lambda item: item[1]["order"])


def test_prepare_hands_an_fp8_cache_and_its_scale_to_the_transposed_kernel(monkeypatch):
    fakes = _transposed_recorders(monkeypatch)
    problem = _p(batch=2, kv_len=300, kv_dtype="fp8_e4m3fn")
    inputs = make_decode_inputs(problem, seed=8, ragged=True)
    routes.get("transposed/gluon").prepare(problem, inputs)
    (call, ) = fakes["gluon_transposed_fp8"].calls  # the route's first fp8 set: fp8 MMAs
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
    # Only the kernel that reads an fp8 cache is handed the cache's scale (a device tensor).
    assert ("kv_scale" in call) == (recorder.route_id == "transposed/gluon")
    assert prepared.params == {"num_splits": 3, **route.kernel_options}
    assert prepared.graph_safe and not prepared.plan_reads_lengths and prepared.plan is None
    assert prepared.step_kind == routes.LAUNCH_ONLY
    assert prepared.out.shape == (problem.batch * problem.qlen, problem.num_heads, 512)
    assert prepared.lse.shape == (problem.batch * problem.qlen, problem.num_heads)
    prepared.step()
    prepared.run()
    assert recorder.launches == 2


def test_a_stored_param_set_without_an_option_runs_what_it_ran(monkeypatch):
    """seesaw/gluon's param sets run the chunked form; a set stored before the option
    (``{"num_splits": k}``) still runs the unchunked form it was timed with."""
    fake = _Recorder()
    monkeypatch.setattr(gluon_seesaw, "decode_launcher", fake)
    route = routes.get("seesaw/gluon")
    problem = _p(batch=2, kv_len=300)
    inputs = make_decode_inputs(problem, seed=9)
    assert route.prepare(problem, inputs).params["chunked"] is True
    assert route.prepare(problem, inputs, params={"num_splits": 2}).params["chunked"] is False
    assert route.prepare(problem, inputs, params={"num_splits": 2, "chunked": True}) \
        .params["chunked"] is True
    assert [call["chunked"] for call in fake.calls] == [True, False, True]
    # pdl likewise: the route's sets launch the reduce as a dependent, stored sets do not.
    assert [call["pdl"] for call in fake.calls] == [True, False, False]
    # lone_bars likewise: the route's sets only.
    assert [call["lone_bars"] for call in fake.calls] == [True, False, False]
    assert "chunked" not in inspect.signature(gluon_transposed.decode_launcher).parameters


def test_transposed_param_sets_ask_for_pdl_and_the_ws_widening_over_fp8_only(monkeypatch):
    """New sets launch the reduce as a dependent (pdl) and read an fp8 cache with fp8 MMAs
    or the warp-specialized widening (ws); a stored set without them runs the forms it was
    timed with; a 16-bit cache never gets ws. Each set's kernel is handed only the options
    it takes (``TRANSPOSED_KERNELS``)."""
    fakes = _transposed_recorders(monkeypatch)
    route = routes.get("transposed/gluon")
    fp8, bf16 = _p(batch=2, kv_len=300, kv_dtype="fp8_e4m3fn"), _p(batch=2, kv_len=300)
    assert all(p["pdl"] and p["ws"] for p in route.param_space(fp8, H200))
    assert all(p["pdl"] and "ws" not in p for p in route.param_space(bf16, H200))
    widen = route.param_space(fp8, H200)[1]
    assert widen["ws"] and not widen.get("fp8_mma")
    for problem, params in ((fp8, None), (fp8, widen), (fp8, {"num_splits": 2}), (bf16, None),
                            (bf16, {"num_splits": 2})):
        route.prepare(problem, make_decode_inputs(problem, seed=10), params=params)
    ran = [(name, {k: v for k, v in call.items() if k in ("pdl", "defer_sums", "ws")})
           for name, call in _ran(fakes)]
    assert ran == [("gluon_transposed_fp8", {"pdl": True, "defer_sums": True}),
                   ("gluon_transposed_ws", {"pdl": True}), ("gluon_transposed", {"pdl": False}),
                   ("gluon_transposed", {"pdl": True}), ("gluon_transposed", {"pdl": False})]


def test_a_ws_set_runs_the_warp_specialized_kernel_over_fp8_only(monkeypatch):
    """``ws``: the route hands an fp8 cache, its scale and the call's buffers to
    ``gluon_transposed_ws``; a 16-bit cache is refused by that kernel, not widened."""
    fakes = _transposed_recorders(monkeypatch)
    route = routes.get("transposed/gluon")
    problem = _p(batch=2, kv_len=300, kv_dtype="fp8_e4m3fn")
    inputs = make_decode_inputs(problem, seed=11)
    shard = inputs.shards[0]
    out = torch.empty(2, 16, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 16)
    route.prepare(problem, inputs, params={"num_splits": 4, "ws": True, "pdl": True}, out=out,
                  lse=lse)
    (call, ) = fakes["gluon_transposed_ws"].calls
    call.pop("order")
    assert call == dict(q=inputs.q, kv_cache=shard.kv_cache, block_table=shard.block_table,
                        seq_lens=shard.seq_lens, qlen=1, sm_scale=inputs.softmax_scale,
                        causal=problem.causal, out=out, lse=lse, num_splits=4,
                        max_seq_len=300, pdl=True, kv_scale=inputs.kv_scale)
    monkeypatch.undo()
    bf16 = _p(batch=2, kv_len=300)
    with pytest.raises(ValueError, match="fp8 cache only"):
        route.prepare(bf16, make_decode_inputs(bf16, seed=12), params={"ws": True})


def test_a_stored_seesaw_row_keeps_its_form_and_rescales_its_split_at_a_neighbour():
    """A shipped seesaw row (no ``chunked``: the unchunked form was timed) carried from batch
    1 to batch 64: its split is redone as wgmma/gluon's is, its form kept; an empty set
    (a rule's fallback) is the route's first set, chunked (and with pdl)."""
    seesaw, wgmma = routes.get("seesaw/gluon"), routes.get(ROUTE)
    measured, asked = _p(batch=1), _p(batch=64)
    stored = {"num_splits": wgmma.param_space(measured, H200)[0]["num_splits"]}
    moved = routes.params_at(seesaw, stored, measured, asked, H200)
    old_form = {"chunked": False, "pdl": False, "slim": False, "lone_bars": False,
                "afresh_q": False, "two_requests": False, "rope_regs": False}
    assert moved == {**routes.params_at(wgmma, stored, measured, asked, H200), **old_form}
    assert moved["num_splits"] != stored["num_splits"]
    new = routes.params_at(seesaw, seesaw.param_space(measured, H200)[0], measured, asked, H200)
    assert new == seesaw.param_space(asked, H200)[0] and new["chunked"] is True
    space = seesaw.param_space(asked, H200)
    first = space[0]
    assert routes.with_defaults(seesaw, {}, space) == first
    assert routes.with_defaults(seesaw, None, space) == first
    assert routes.with_defaults(seesaw, stored, space) == {**stored, **old_form}
    wgmma_space = wgmma.param_space(asked, H200)
    assert routes.with_defaults(wgmma, stored, wgmma_space) == {**wgmma_space[0], **stored}


def test_the_report_times_a_stored_seesaw_choice_as_it_ran():
    from mlatune.report.metrics import time_with

    problem = _p(batch=2)
    splits = routes.get("seesaw/gluon").param_space(problem, H200)[0]["num_splits"]
    form = routes.get("seesaw/gluon").FORM  # what the route's sets run now
    timed = {(problem.key, "seesaw/gluon"): [({"num_splits": splits, "chunked": False}, 10.0),
                                             ({"num_splits": splits, **form}, 9.0)]}
    assert time_with(timed, problem, "seesaw/gluon", {"num_splits": splits}, H200) == 10.0
    assert time_with(timed, problem, "seesaw/gluon", {}, H200) == 9.0
    # A journal written before the option: its runs' params lack it too.
    old = {(problem.key, "seesaw/gluon"): [({"num_splits": splits}, 11.0)]}
    assert time_with(old, problem, "seesaw/gluon", {"num_splits": splits}, H200) == 11.0
    assert math.isnan(time_with(old, problem, "seesaw/gluon", {}, H200))


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
@pytest.mark.parametrize("route_id", list(KERNELS))
def test_each_route_reaches_its_launch_at_every_param_set_and_rank(route_id, kw):
    """Every parameter set and DCP rank, with and without the caller's buffers, gets past
    the launcher's checks and builds its TMA descriptors (no launch: no GPU here). Needs
    triton 3.6.x, whose Gluon descriptors the launchers build."""
    from tests.test_gluon_compile import _needs_gluon_triton

    _needs_gluon_triton()
    route = routes.get(route_id)
    problem = _p(page_size=64, **kw)
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


def test_transposed_fp8_sets_alternate_fp8_mmas_and_the_widening_up_to_16_rows(monkeypatch):
    """Over an fp8 cache at up to 16 query rows a program the fp8-MMA sets and the
    widening's alternate, fp8 MMAs first, each from its kernel's own split pick (the fp8-MMA
    kernel's with ``FP8_MMA_PROGRAM_COST``: 22 splits at batch 2 of 4096 keys, where the
    widening's is 64), then half and twice it (at most 64); past 16 rows only the widening. Only the
    fp8-MMA sets (and no params where the first set is one) declare P rounded, none a
    quantized q (q's two e4m3 terms keep it near 16 bits)."""
    from mlatune.kernels import gluon_hopper_plan as plan

    route = routes.get("transposed/gluon")
    fp8 = _p(batch=2, kv_len=4096, kv_dtype="fp8_e4m3fn")  # 16 heads x 1 token: 16 rows
    space = route.param_space(fp8, H200)
    assert all(p["ws"] and p["pdl"] for p in space)
    assert [bool(p.get("fp8_mma")) for p in space] == [True, False, True, False, True]
    assert all(bool(p.get("defer_sums")) == bool(p.get("fp8_mma")) for p in space)
    fp8_pick = plan.pick_splits(2, 1, 4096, per_program=plan.FP8_MMA_PROGRAM_COST)
    assert (fp8_pick, plan.pick_splits(2, 1, 4096)) == (22, 64)
    assert [p["num_splits"] for p in space[::2]] == [22, 11, 44]
    assert [p["num_splits"] for p in space[1::2]] == [64, 32]
    rounded = {"q_quantized": False, "p_rounded": True}
    assert [routes.rounding(route, fp8, p) for p in space[:2]] == \
        [rounded, {"q_quantized": False, "p_rounded": False}]
    assert routes.rounding(route, fp8) == rounded
    assert not routes.rounding(route, fp8, {"num_splits": 2})["p_rounded"]
    assert not any(routes.rounding(route, _p(batch=2, kv_len=4096), {"fp8_mma": True}).values())
    for wide in (_p(num_heads=32, batch=2, kv_dtype="fp8_e4m3fn"),  # 32 rows a program
                 _p(batch=2, qlen=2, kv_dtype="fp8_e4m3fn")):
        assert route.block_rows(wide) == 32
        assert all(p["ws"] and "fp8_mma" not in p for p in route.param_space(wide, H200))
        assert not any(routes.rounding(route, wide).values())


def test_an_fp8_mma_set_runs_the_fp8_kernel_over_fp8_only(monkeypatch):
    """``fp8_mma``: an fp8 cache goes to gluon_transposed_fp8 with its options (``ws`` does
    not apply there); a 16-bit cache runs the transposed kernel as without it."""
    fakes = _transposed_recorders(monkeypatch)
    route = routes.get("transposed/gluon")
    params = {"num_splits": 4, "ws": True, "pdl": True, "fp8_mma": True, "defer_sums": True}
    fp8_problem, bf16_problem = _p(batch=2, kv_len=300, kv_dtype="fp8_e4m3fn"), _p(batch=2)
    route.prepare(fp8_problem, make_decode_inputs(fp8_problem, seed=13), params=params)
    route.prepare(bf16_problem, make_decode_inputs(bf16_problem, seed=14),
                  params={**params, "ws": False})
    (fp8, ) = fakes["gluon_transposed_fp8"].calls
    (bf16, ) = fakes["gluon_transposed"].calls
    assert fp8["pdl"] and fp8["defer_sums"] and fp8["num_splits"] == 4 and "ws" not in fp8
    assert fp8["kv_cache"].dtype == torch.float8_e4m3fn
    assert bf16["pdl"] and "defer_sums" not in bf16 and "fp8_mma" not in bf16
    assert not fakes["gluon_transposed_ws"].calls


@pytest.mark.parametrize("option", ["stacked", "wide_vt", "warp_max", "slim"])
def test_the_fp8_mma_sets_run_their_forms_and_a_stored_set_keeps_the_form_it_ran(monkeypatch,
                                                                                option):
    """The route's fp8-MMA sets run q's two terms stacked in one operand (``stacked``), V^T
    moved without bank conflicts (``wide_vt``) and the tile's max across the warps in one
    barrier (``warp_max``), its softmax in fewer instructions (``slim``); a set stored
    before an option (without it) still runs the form it was timed as."""
    fakes = _transposed_recorders(monkeypatch)
    route = routes.get("transposed/gluon")
    problem = _p(batch=2, kv_len=300, kv_dtype="fp8_e4m3fn")
    fp8_sets = [p for p in route.param_space(problem, H200) if p.get("fp8_mma")]
    assert fp8_sets and all(p[option] for p in fp8_sets)
    inputs = make_decode_inputs(problem, seed=15)
    route.prepare(problem, inputs, params=fp8_sets[0])
    stored = {k: v for k, v in fp8_sets[0].items() if k != option}
    route.prepare(problem, inputs, params=stored)
    new, old = fakes["gluon_transposed_fp8"].calls
    assert new[option] is True and old[option] is False
    assert all(new[k] == old[k] for k in ("stacked", "wide_vt", "warp_max", "slim")
               if k != option)