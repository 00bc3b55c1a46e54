"""The Gluon fp8 prefill (mlatune/kernels/gluon_prefill_fp8.py) on the CPU: what it refuses,
its plan and transposed v (the interpreter runs the transpose kernel), where the route offers
it, and, under triton 3.6.x, its compile for sm_90a. Compiling says nothing about the numbers
it computes: tests/test_prefill_gpu.py checks those on the GPU (every fp8-ps param set)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from mlatune import routes
from mlatune.arch import DeviceInfo
from mlatune.kernels import gluon_common
from mlatune.kernels import gluon_prefill_fp8 as g
from mlatune.problem import MLAProblem
from mlatune.routes.prefill_triton import (
    GLUON_FORM_DEFAULTS,
    GLUON_LEADING,
    GLUON_PARAM_SETS,
    GLUON_PARAMS,
)
from tests import sass_hazards
from tests.prefill_aot import resources
from tests.test_gluon_compile import _needs_gluon_triton

H200 = DeviceInfo("sm_90", "NVIDIA H200", "nvidia", 132)
A100 = DeviceInfo("sm_80", "NVIDIA A100", "nvidia", 108)
FP8 = torch.float8_e4m3fn


def _tensors(lens_q, lens_k, heads=4, d_qk=192, d_v=128, dtype=FP8):
    torch.manual_seed(0)
    q = torch.randn(sum(lens_q), heads, d_qk).to(dtype)
    k = torch.randn(sum(lens_k), heads, d_qk).to(dtype)
    v = torch.randn(sum(lens_k), heads, d_v).to(dtype)
    out = torch.empty(sum(lens_q), heads, d_v, dtype=torch.bfloat16)
    lse = torch.empty(sum(lens_q), heads)
    return q, k, v, out, lse


def test_tensors_it_cannot_take_are_refused_with_the_reason():
    q, k, v, *_ = _tensors([100], [100])
    cases = [
        ((q.float().to(torch.bfloat16), k, v), "must all be"),
        ((q, k, v.to(torch.bfloat16)), "must all be"),
        ((q, k, v.to(torch.float8_e5m2)), "must all be"),
        ((q[..., :128], k[..., :128], v), "d_qk must be 192"),
        ((q, k, v[..., :64]), "d_v 128"),
        ((q.transpose(0, 1).contiguous().transpose(0, 1), k, v), "q needs contiguous heads"),
        ((q, k.transpose(0, 1).contiguous().transpose(0, 1), v), "k needs contiguous heads"),
    ]
    shifted = torch.empty(q.numel() + 1, dtype=torch.uint8)[1:].view(FP8).view(q.shape)
    cases.append(((shifted, k, v), "16-byte aligned"))
    for args, message in cases:
        why = g.check_supported(*args)
        assert why is not None and message in why, (message, why)
    assert g.check_supported(q, k, v) is None


@pytest.mark.parametrize("stages", [1, 5])
def test_ring_depths_that_deadlock_or_do_not_fit_are_refused(monkeypatch, stages):
    monkeypatch.setattr(g, "gluon_available", lambda: (True, "ok"))
    q, k, v, out, lse = _tensors([100], [100])
    with pytest.raises(ValueError, match="stages must be 2, 3 or 4"):
        g.GluonPrefill(q, k, v, out, lse, [100], [100], causal=True, sm_scale=0.1,
                       scales=None, num_programs=4, stages=stages)


def test_paired_and_pingpong_together_are_refused(monkeypatch):
    monkeypatch.setattr(g, "gluon_available", lambda: (True, "ok"))
    q, k, v, out, lse = _tensors([100], [100])
    with pytest.raises(ValueError, match="paired and pingpong"):
        g.GluonPrefill(q, k, v, out, lse, [100], [100], causal=True, sm_scale=0.1,
                       scales=None, num_programs=4, paired=True, pingpong=True)


def test_the_launcher_names_the_triton_it_needs():
    if gluon_common.gluon_available()[0]:
        pytest.skip("this machine's triton is the one the kernel is written for")
    q, k, v, out, lse = _tensors([100], [100])
    with pytest.raises(ValueError, match=r"triton 3\.6"):
        g.GluonPrefill(q, k, v, out, lse, [100], [100], causal=True, sm_scale=0.1,
                       scales=None, num_programs=4)


def test_plan_and_transposed_v(monkeypatch):
    """Each request's keys start at a multiple of 128 in the transposed v (no key tile
    crosses into another request's), the padding stays zeros, and the plan splits tiles.
    The host side is built with any triton (the check for 3.6 is set aside here); the
    interpreter runs the transpose kernel."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the transpose kernel on CPU tensors: needs TRITON_INTERPRET=1")
    from mlatune.kernels.prefill import _transpose_v_kernel

    monkeypatch.setattr(g, "gluon_available", lambda: (True, "ok"))

    lens_q, lens_k = [300, 5, 129], [400, 5, 200]
    q, k, v, out, lse = _tensors(lens_q, lens_k)
    launch = g.GluonPrefill(q, k, v, out, lse, lens_q, lens_k, causal=True, sm_scale=0.1,
                            scales=None, num_programs=8, min_split=128)
    items = [item for program in launch.plan.programs for item in program]
    assert {item.v_row0 for item in items} == {0, 512, 640}
    assert launch.plan.merges and all(item.kv_lo % g.BLOCK_N == 0 for item in items)
    grid, args, meta = launch._transpose
    _transpose_v_kernel[grid](*args, **meta)
    assert args[1] is launch._buffers[0]  # the buffer the kernel's descriptor reads
    vt = args[1].view(torch.uint8)
    assert vt.shape == (4, 128, 896)
    k_row0 = 0
    for col0, k_len in zip((0, 512, 640), lens_k, strict=True):
        expect = v[k_row0:k_row0 + k_len].view(torch.uint8).permute(1, 2, 0)
        assert torch.equal(vt[:, :, col0:col0 + k_len], expect)
        k_row0 += k_len
    for pad in (slice(400, 512), slice(517, 640), slice(840, 896)):
        assert int(vt[:, :, pad].sum()) == 0


def test_permuted_v_holds_each_key_where_the_accumulator_holds_it(monkeypatch):
    """With ``permuted_v`` the transposed v's column j (within 32) holds key (j4, j1, j3, j2,
    j0): for quad q of a warp, the wgmma accumulator's keys {8i + 2q, 8i + 2q + 1} and the
    fp8 A operand's columns {4q..4q+3, 16+4q..16+4q+3} then name the same keys, and
    ``_keys_as_operand`` reorders P's columns the same way."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the transpose kernel on CPU tensors: needs TRITON_INTERPRET=1")
    from mlatune.kernels.prefill import _transpose_v_kernel

    monkeypatch.setattr(g, "gluon_available", lambda: (True, "ok"))
    lens = [200, 70]
    q, k, v, out, lse = _tensors(lens, lens)
    launch = g.GluonPrefill(q, k, v, out, lse, lens, lens, causal=True, sm_scale=0.1,
                            scales=None, num_programs=4, permuted_v=True)
    grid, args, meta = launch._transpose
    _transpose_v_kernel[grid](*args, **meta)
    vt = args[1].view(torch.uint8)

    def key(j: int) -> int:  # the key at column j
        bit = [(j >> b) & 1 for b in range(5)]
        return (j & ~31) | bit[4] << 4 | bit[1] << 3 | bit[3] << 2 | bit[2] << 1 | bit[0]

    for col0, k_row0, k_len in ((0, 0, 200), (256, 200, 70)):
        for j in range(-(-k_len // 32) * 32):
            col = vt[:, :, col0 + j]
            if key(j) < k_len:
                assert torch.equal(col, v[k_row0 + key(j)].view(torch.uint8)), j
            else:
                assert int(col.sum()) == 0, j  # past the request: zeros, and P is 0 there
    for quad in range(4):
        acc_keys = {8 * i + 2 * quad + b for i in range(4) for b in (0, 1)}
        operand_cols = {16 * h + 4 * quad + e for h in (0, 1) for e in range(4)}
        assert {key(j) for j in operand_cols} == acc_keys


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("form", [
    dict(stages=2), dict(stages=3), dict(paired=True), dict(paired=True, permuted_v=True),
    dict(pingpong=True), dict(pingpong=True, permuted_v=True, stages=4)],
    ids=["2stages", "3stages", "paired", "paired-permuted", "pingpong", "pingpong-permuted-4"])
def test_compiles_for_sm90_with_fp8_wgmmas(causal, form):
    _needs_gluon_triton()
    compiled = g.aot_compile(causal=causal, **form)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    # Each MMA warpgroup: S (4 + 2 k-steps) before the loop, then S and P.V (4) a tile: 16
    # each, 36 paired (a loop step of two tiles and the odd one after it), pingpong 20 (the
    # last tile's P.V after the loop).
    per_warpgroup = 36 if form.get("paired") else 20 if form.get("pingpong") else 16
    assert re.findall(r"wgmma\.mma_async\.[\w.]+", ptx) == [
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"] * (2 * per_warpgroup)
    assert ptx.count("setmaxnreg.inc.sync.aligned.u32 \t240") == 2
    assert compiled.metadata.shared <= 227 * 1024
    # A few registers spilled, outside the key loops (read in the SASS, 2026-12-01): at most
    # 8 bytes (the plain and pingpong forms), paired 24 and 32 (the loader's 24 registers
    # and the epilogues).
    assert resources(compiled)["stack"] <= (32 if form.get("paired") else 8)


@pytest.mark.parametrize(("form", "counts"), [
    (dict(), (32, 8)), (dict(causal=False), (32, 8)), (dict(paired=True), (64, 24)),
    (dict(paired=True, permuted_v=True), (64, 24)), (dict(pingpong=True), (40, 16)),
    (dict(pingpong=True, permuted_v=True), (40, 16)),
    (dict(pingpong=True, permuted_v=True, stages=4, causal=False), (40, 16))],
    ids=["plain", "plain-full", "paired", "paired-permuted", "pingpong", "pingpong-permuted",
         "pingpong-permuted-4-full"])
def test_no_register_of_an_inflight_wgmma_is_touched(form, counts):
    """P.V takes P from registers asynchronously, and triton 3.6 cannot list 8-bit registers
    among warpgroup_mma_wait's deps: on no path of the SASS may an instruction write them, or
    read or write any wgmma's accumulator, before the wait that retires it (counts: wgmmas,
    and those with P from registers, in the SASS: paired, ptxas drops 8 of the PTX's 72, the
    S issued after a block's last tile and never read; the pingpong form waits for S with
    P.V in flight)."""
    _needs_gluon_triton()
    assert sass_hazards.hazards(sass_hazards.listing(g.aot_compile(**form))) == (*counts, [])


def test_the_hazard_check_sees_a_write_to_p_and_a_read_of_an_accumulator():
    _needs_gluon_triton()
    listing = sass_hazards.listing(g.aot_compile(pingpong=True, permuted_v=True))
    lines = listing.splitlines()
    first = next(i for i, x in enumerate(lines) if re.search(r"QGMMA\S* R\d+, R\d+", x))
    acc, a_reg = re.findall(r"\bR(\d+)\b", lines[first])[:2]
    address = int(re.search(r"/\*([0-9a-f]{4,})\*/", lines[first]).group(1), 16)

    def after_first(text: str) -> str:  # an instruction at the same address, just after it
        return "\n".join([*lines[:first + 1], f"        /*{address:04x}*/  {text} ;",
                          *lines[first + 1:]])

    assert len(sass_hazards.hazards(after_first(f"IMAD.MOV.U32 R{a_reg}, RZ, RZ, R1"))[2]) == 1
    assert len(sass_hazards.hazards(after_first(f"FADD R1, R{acc}, R2"))[2]) == 1
    assert sass_hazards.hazards(after_first("FADD R1, R2, R3"))[2] == []


def _prefill(dtype="fp8_e4m3fn", **kw) -> MLAProblem:
    return MLAProblem(phase="prefill", num_heads=kw.pop("heads", 128), batch=1, qlen=4096,
                      kv_len=4096, q_dtype=dtype, kv_dtype=dtype, **kw)


def test_the_route_leads_with_it_where_it_runs(monkeypatch):
    """Where the kernel runs (sm_90, triton 3.6, e4m3fn, 192/128 dims; the triton check set
    aside here), its fastest forms lead the route's space (the first is the route's default)
    and the rest follow the Triton sets, so a sweep keeping 3 sets a route runs two Gluon
    sets and a Triton one; elsewhere none is offered."""
    from mlatune.kernels import gluon_hopper_plan

    space = routes.get("fp8-ps/triton").param_space(_prefill(), H200)
    assert (GLUON_PARAMS in space) == gluon_common.gluon_available()[0]
    monkeypatch.setattr(gluon_hopper_plan, "triton_refusal", lambda version: None)
    space = routes.get("fp8-ps/triton").param_space(_prefill(), H200)
    assert space[0] == GLUON_PARAMS
    assert space[:GLUON_LEADING] == list(GLUON_PARAM_SETS[:GLUON_LEADING])
    assert space[GLUON_LEADING].get("kernel") != "gluon"
    assert space[len(space) - len(GLUON_PARAM_SETS) + GLUON_LEADING:] == \
        list(GLUON_PARAM_SETS[GLUON_LEADING:])
    for problem, device in [(_prefill(), A100), (_prefill("fp8_e4m3fnuz"), H200),
                            (_prefill(qk_head_dim=128), H200)]:
        assert GLUON_PARAMS not in routes.get("fp8-ps/triton").param_space(problem, device)


_STORED_BEFORE_PINGPONG = {"kernel": "gluon", "num_stages": 3, "grouped": True}


@pytest.mark.parametrize(("params", "runs"), [
    *((p, p) for p in GLUON_PARAM_SETS),
    (_STORED_BEFORE_PINGPONG, _STORED_BEFORE_PINGPONG),  # a set keeps running what it ran
    (None, GLUON_PARAMS),  # no params: the route's first set
], ids=lambda p: "none" if p is None else "-".join(
    f"{k}={v}" for k, v in p.items() if k != "kernel"))
def test_the_route_prepares_the_kernel_with_its_params(monkeypatch, params, runs):
    """fp8-ps/triton's prepare builds the Gluon launcher from a Gluon param set (padded heads,
    the inputs' scales, its ring depth and forms; a form a set leaves out is off) and reports
    what it runs; on the CPU only the host side is built (the check for triton 3.6 and the
    arch are set aside, nothing is launched)."""
    from mlatune.check.inputs import make_prefill_inputs
    from mlatune.routes import prefill_triton

    monkeypatch.setattr(g, "gluon_available", lambda: (True, "ok"))
    monkeypatch.setattr(prefill_triton, "_gluon_serves", lambda problem, device: True)
    problem = MLAProblem(phase="prefill", num_heads=12, batch=2, qlen=150, kv_len=300,
                         q_dtype="fp8_e4m3fn", kv_dtype="fp8_e4m3fn")
    inputs = make_prefill_inputs(problem, 0, "cpu", ragged=True)
    built = []
    real = g.GluonPrefill.__init__

    def spy(self, q, k, v, *args, **kwargs):
        built.append((q.shape, kwargs))
        real(self, q, k, v, *args, **kwargs)

    monkeypatch.setattr(g.GluonPrefill, "__init__", spy)
    prepared = routes.get("fp8-ps/triton").prepare(problem, inputs, params=params)
    (q_shape, kwargs), = built
    assert q_shape[1] == 16  # 12 heads padded to 16, as the route's other kernels run
    assert kwargs["stages"] == runs["num_stages"]
    for form in ("grouped", "paired", "permuted_v", "pingpong"):
        assert kwargs[form] == bool(runs.get(form)), form
    assert all(a is b for a, b in zip(kwargs["scales"], (inputs.q_scale, inputs.k_scale,
                                                         inputs.v_scale), strict=True))
    assert {**runs, "kernel_heads": 16}.items() <= prepared.params.items()
    assert prepared.out.shape == (inputs.q.shape[0], 12, 128) and prepared.graph_safe


def test_a_stored_set_is_read_as_its_kernel_runs_it(monkeypatch):
    """The report reads a stored set as prepare runs it (``routes.with_defaults``, the
    route's ``fill_defaults``): a Gluon set of the kernel's first form keeps its forms off
    (not the first set's pingpong), a Triton set is filled from the first Triton set (no
    Gluon option), none is the first set; so ``time_with`` finds the run that was timed."""
    from mlatune.kernels import gluon_hopper_plan
    from mlatune.report.metrics import time_with

    monkeypatch.setattr(gluon_hopper_plan, "triton_refusal", lambda version: None)
    route, problem = routes.get("fp8-ps/triton"), _prefill()
    space = route.param_space(problem, H200)
    first_triton = space[GLUON_LEADING]
    assert routes.with_defaults(route, None, space) == {**GLUON_FORM_DEFAULTS, **GLUON_PARAMS}
    old = routes.with_defaults(route, _STORED_BEFORE_PINGPONG, space)
    assert old["num_stages"] == 3 and not (old["pingpong"] or old["permuted_v"] or old["paired"])
    stored_triton = {"block_m": first_triton["block_m"], "num_stages": 1}
    triton = routes.with_defaults(route, stored_triton, space)
    assert triton == {**first_triton, "num_stages": 1} and "kernel" not in triton
    timed = {(problem.key, route.id): [(_STORED_BEFORE_PINGPONG, 7.0), (GLUON_PARAMS, 5.0),
                                       ({**first_triton, "num_stages": 1}, 9.0)]}
    assert time_with(timed, problem, route.id, _STORED_BEFORE_PINGPONG, H200) == 7.0
    assert time_with(timed, problem, route.id, {}, H200) == 5.0
    assert time_with(timed, problem, route.id, stored_triton, H200) == 9.0

