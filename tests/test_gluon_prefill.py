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
from mlatune.routes.prefill_triton import GLUON_FORM, GLUON_PARAM_SETS, GLUON_PARAMS
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


def test_the_launcher_names_the_triton_it_needs():
    if gluon_common.gluon_available()[0]:
        pytest.skip("this machine's triton is the one the kernel is written for")
    q, k, v, out, lse = _tensors([100], [100])
    with pytest.raises(ValueError, match=r"triton 3\.6"):
        g.GluonPrefill(q, k, v, out, lse, [100], [100], causal=True, sm_scale=0.1,
                       scales=None, num_programs=4)


def key_at(j: int) -> int:
    """The key the transposed v holds at column ``j``: (j4, j1, j3, j2, j0), bits of j."""
    bit = [(j >> b) & 1 for b in range(5)]
    return (j & ~31) | bit[4] << 4 | bit[1] << 3 | bit[3] << 2 | bit[2] << 1 | bit[0]


def test_plan_and_transposed_v(monkeypatch):
    """Each request's keys start at a multiple of 128 in the transposed v (no key tile
    crosses into another request's), the padding stays zeros, and the plan splits tiles.
    The host side is built with any triton (the check for 3.6 is set aside here); the
    interpreter runs the transpose kernel. (Columns put back in key order here:
    test_transposed_v_holds_each_key_where_the_accumulator_holds_it checks their order.)"""
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
    permuted = args[1].view(torch.uint8)
    assert permuted.shape == (4, 128, 896)
    vt = torch.empty_like(permuted)
    vt[:, :, [key_at(j) for j in range(896)]] = permuted
    k_row0 = 0
    for col0, k_len in zip((0, 512, 640), lens_k, strict=True):
        expect = v[k_row0:k_row0 + k_len].view(torch.uint8).permute(1, 2, 0)
        assert torch.equal(vt[:, :, col0:col0 + k_len], expect)
        k_row0 += k_len
    for pad in (slice(400, 512), slice(517, 640), slice(840, 896)):
        assert int(vt[:, :, pad].sum()) == 0


def test_transposed_v_holds_each_key_where_the_accumulator_holds_it(monkeypatch):
    """The transposed v's column j (within 32) holds key (j4, j1, j3, j2, j0): for quad q of
    a warp, the wgmma accumulator's keys {8i + 2q, 8i + 2q + 1} and the fp8 A operand's
    columns {4q..4q+3, 16+4q..16+4q+3} then name the same keys, and ``_keys_as_operand``
    reorders P's columns the same way."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the transpose kernel on CPU tensors: needs TRITON_INTERPRET=1")
    from mlatune.kernels.prefill import _transpose_v_kernel

    monkeypatch.setattr(g, "gluon_available", lambda: (True, "ok"))
    lens = [200, 70]
    q, k, v, out, lse = _tensors(lens, lens)
    launch = g.GluonPrefill(q, k, v, out, lse, lens, lens, causal=True, sm_scale=0.1,
                            scales=None, num_programs=4)
    grid, args, meta = launch._transpose
    _transpose_v_kernel[grid](*args, **meta)
    vt = args[1].view(torch.uint8)
    key = key_at
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
@pytest.mark.parametrize("stages", [3, 4])
def test_compiles_for_sm90_with_fp8_wgmmas(causal, stages):
    _needs_gluon_triton()
    compiled = g.aot_compile(causal=causal, stages=stages)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    # Each MMA warpgroup: S (4 + 2 k-steps) before the loop, then S and P.V (4) a tile, and
    # the last tile's P.V after the loop: 20.
    assert re.findall(r"wgmma\.mma_async\.[\w.]+", ptx) == [
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"] * (2 * 20)
    assert ptx.count("setmaxnreg.inc.sync.aligned.u32 \t240") == 2
    assert compiled.metadata.shared <= 227 * 1024
    # At most 8 bytes of registers spilled, outside the key loops (read in the SASS).
    assert resources(compiled)["stack"] <= 8


@pytest.mark.parametrize("build", [dict(), dict(causal=False), dict(stages=4, causal=False)],
                         ids=["causal", "full", "4-stages-full"])
def test_no_register_of_an_inflight_wgmma_is_touched(build):
    """P.V takes P from registers asynchronously, and triton 3.6 cannot list 8-bit registers
    among warpgroup_mma_wait's deps: on no path of the SASS may an instruction write them, or
    read or write any wgmma's accumulator, before the wait that retires it (40 wgmmas in the
    SASS, 16 with P from registers; S is waited for with P.V in flight)."""
    _needs_gluon_triton()
    assert sass_hazards.hazards(sass_hazards.listing(g.aot_compile(**build))) == (40, 16, [])


def test_the_hazard_check_sees_a_write_to_p_and_a_read_of_an_accumulator():
    _needs_gluon_triton()
    listing = sass_hazards.listing(g.aot_compile())
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
    aside here), its two ring depths lead the route's space (the first is the route's
    default), then the Triton sets, so a sweep keeping 3 sets a route runs both and a Triton
    one; elsewhere none is offered."""
    from mlatune.kernels import gluon_hopper_plan

    space = routes.get("fp8-ps/triton").param_space(_prefill(), H200)
    assert (GLUON_PARAMS in space) == gluon_common.gluon_available()[0]
    monkeypatch.setattr(gluon_hopper_plan, "triton_refusal", lambda version: None)
    space = routes.get("fp8-ps/triton").param_space(_prefill(), H200)
    assert space[0] == GLUON_PARAMS
    assert space[:2] == list(GLUON_PARAM_SETS)
    assert [p["num_stages"] for p in GLUON_PARAM_SETS] == [3, 4]
    assert all(p.get("kernel") != "gluon" for p in space[2:]) and len(space) > 2
    for problem, device in [(_prefill(), A100), (_prefill("fp8_e4m3fnuz"), H200),
                            (_prefill(qk_head_dim=128), H200)]:
        assert GLUON_PARAMS not in routes.get("fp8-ps/triton").param_space(problem, device)


def _gluon_route_on_cpu(monkeypatch):
    """fp8-ps/triton with the Gluon launcher's host side buildable here (the check for
    triton 3.6 and the arch set aside; nothing is launched), and a spy on its arguments."""
    from mlatune.routes import prefill_triton

    monkeypatch.setattr(g, "gluon_available", lambda: (True, "ok"))
    monkeypatch.setattr(prefill_triton, "_gluon_serves", lambda problem, device: True)
    built = []
    real = g.GluonPrefill.__init__

    def spy(self, q, k, v, *args, **kwargs):
        built.append((q.shape, kwargs))
        real(self, q, k, v, *args, **kwargs)

    monkeypatch.setattr(g.GluonPrefill, "__init__", spy)
    return routes.get("fp8-ps/triton"), built


_PROBLEM = MLAProblem(phase="prefill", num_heads=12, batch=2, qlen=150, kv_len=300,
                      q_dtype="fp8_e4m3fn", kv_dtype="fp8_e4m3fn")


@pytest.mark.parametrize(("params", "runs"), [
    *((p, p) for p in GLUON_PARAM_SETS),
    (None, GLUON_PARAMS),  # no params: the route's first set
    ({"kernel": "gluon", "num_stages": 4}, {**GLUON_PARAMS, "num_stages": 4}),
], ids=["stages3", "stages4", "none", "filled"])
def test_the_route_prepares_the_kernel_with_its_params(monkeypatch, params, runs):
    """fp8-ps/triton's prepare builds the Gluon launcher from a Gluon param set (padded heads,
    the inputs' scales, its ring depth and plan; what a set leaves out, from the first Gluon
    set) and reports what it runs."""
    from mlatune.check.inputs import make_prefill_inputs

    route, built = _gluon_route_on_cpu(monkeypatch)
    inputs = make_prefill_inputs(_PROBLEM, 0, "cpu", ragged=True)
    prepared = route.prepare(_PROBLEM, inputs, params=params)
    (q_shape, kwargs), = built
    assert q_shape[1] == 16  # 12 heads padded to 16, as the route's other kernels run
    assert (kwargs["stages"], kwargs["grouped"]) == (runs["num_stages"], runs["grouped"])
    assert all(a is b for a, b in zip(kwargs["scales"], (inputs.q_scale, inputs.k_scale,
                                                         inputs.v_scale), strict=True))
    assert {**runs, "kernel_heads": 16}.items() <= prepared.params.items()
    assert prepared.out.shape == (inputs.q.shape[0], 12, 128) and prepared.graph_safe


def test_the_route_refuses_a_gluon_form_it_does_not_have(monkeypatch):
    from mlatune.check.inputs import make_prefill_inputs

    route, built = _gluon_route_on_cpu(monkeypatch)
    inputs = make_prefill_inputs(_PROBLEM, 0, "cpu", ragged=True)
    with pytest.raises(ValueError, match="form 'paired'"):
        route.prepare(_PROBLEM, inputs, params={**GLUON_PARAMS, "form": "paired"})
    assert not built


# Stored Gluon sets as the route stored them before the form id (extra keys: what prepare
# reported besides the set).
_RAN = {"kernel_heads": 128, "programs": 132, "split_tiles": 0}
_PINGPONG_PERMUTED = {"kernel": "gluon", "num_stages": 4, "grouped": True, "pingpong": True,
                      "permuted_v": True, "paired": False, **_RAN}


@pytest.mark.parametrize(("stored", "current"), [
    (_PINGPONG_PERMUTED, {"kernel": "gluon", "form": GLUON_FORM, "num_stages": 4,
                          "grouped": True, **_RAN}),
    ({"kernel": "gluon", "pingpong": True, "permuted_v": True},  # its defaults then
     {"kernel": "gluon", "form": GLUON_FORM, "num_stages": 3, "grouped": False}),
    ({**_PINGPONG_PERMUTED, "permuted_v": False}, None),  # pingpong alone
    ({**_PINGPONG_PERMUTED, "pingpong": False, "paired": True}, None),  # paired + permuted_v
    ({"kernel": "gluon", "num_stages": 3, "grouped": True}, None),  # the plain walk
    ({"kernel": "gluon", "num_stages": 2, "grouped": True}, None),
    ({**GLUON_PARAMS, **_RAN}, {**GLUON_PARAMS, **_RAN}),  # the current spelling
    ({**GLUON_PARAMS, "form": "paired"}, None),
], ids=["pingpong-permuted", "defaults", "pingpong", "paired-permuted", "plain", "plain-2",
        "current", "unknown-form"])
def test_a_stored_gluon_set_reads_in_the_current_spelling(stored, current):
    """A set of the kept form (pingpong and permuted_v on, paired off) reads with the form id
    in place of the booleans; a set of any other form (a deleted one) is stale (None)."""
    route = routes.get("fp8-ps/triton")
    assert route.upgrade_params(stored) == current
    if current is not None:
        assert route.upgrade_params(current) == current


def test_a_stored_set_is_read_as_its_kernel_runs_it(monkeypatch):
    """The report reads a stored set as prepare runs it (``routes.with_defaults``, the
    route's ``fill_defaults``): a Gluon set over the first Gluon set, a Triton set over the
    first Triton set (no Gluon option), none is the first set; so ``time_with`` finds the
    run that was timed, a journal's set in the boolean spelling too."""
    from mlatune.kernels import gluon_hopper_plan
    from mlatune.report.metrics import time_with

    monkeypatch.setattr(gluon_hopper_plan, "triton_refusal", lambda version: None)
    route, problem = routes.get("fp8-ps/triton"), _prefill()
    space = route.param_space(problem, H200)
    first_triton = space[len(GLUON_PARAM_SETS)]
    assert routes.with_defaults(route, None, space) == GLUON_PARAMS
    assert routes.with_defaults(route, {"kernel": "gluon", "num_stages": 4}, space) == \
        GLUON_PARAM_SETS[1]
    stored_triton = {"block_m": first_triton["block_m"], "num_stages": 1}
    triton = routes.with_defaults(route, stored_triton, space)
    assert triton == {**first_triton, "num_stages": 1} and "kernel" not in triton
    legacy = {k: v for k, v in _PINGPONG_PERMUTED.items() if k not in _RAN}
    timed = {(problem.key, route.id): [(legacy, 7.0), (GLUON_PARAMS, 5.0),
                                       ({**first_triton, "num_stages": 1}, 9.0)]}
    assert time_with(timed, problem, route.id, GLUON_PARAM_SETS[1], H200) == 7.0
    assert time_with(timed, problem, route.id, {}, H200) == 5.0
    assert time_with(timed, problem, route.id, stored_triton, H200) == 9.0
