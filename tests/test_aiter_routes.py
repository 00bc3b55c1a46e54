"""The aiter adapters against a recording fake AITER (tests/fake_aiter.py), on the CPU.

The fake checks each call's names, shapes and dtypes and computes exact
attention from what it is handed, so matching mlatune's reference here proves
the plumbing: indices, padding and unpadding of heads, scales, flags, merges.
It proves nothing about AITER's kernels, which have not run on AMD hardware.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mlatune import routes
from mlatune.arch import DeviceInfo
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_inputs, poison_
from mlatune.dcp import merge_ranks_into
from mlatune.problem import MLAProblem
from mlatune.routes.aiter_probe import probe
from tests.fake_aiter import MANIFEST_ROWS, FakeAiter

FP8 = "fp8_e4m3fn"


@pytest.fixture
def make_fake(monkeypatch, tmp_path):
    """Install a fake AITER (keyword arguments configure it); the probe cache starts empty."""
    probe.cache_clear()

    def make(**config) -> FakeAiter:
        return FakeAiter(tmp_path, **config).install(monkeypatch)

    yield make
    probe.cache_clear()


@pytest.fixture
def fake(make_fake) -> FakeAiter:
    return make_fake()


def amd(arch: str = "gfx950") -> DeviceInfo:
    return DeviceInfo(arch, "fake", "amd", 8)


def run_route(route_id: str, problem: MLAProblem, arch: str = "gfx950", seed: int = 1):
    """Check support, then prepare/poison/run every rank and merge, as a sweep worker does."""
    route = routes.get(route_id)
    verdict = route.supports(problem, amd(arch))
    assert verdict, verdict.reason
    inputs = make_inputs(problem, seed=seed, ragged=True)
    ranks = range(problem.dcp_size) if problem.phase == "decode" else range(1)
    prepared = [route.prepare(problem, inputs, rank=r, want_lse=True) for r in ranks]
    for p in prepared:
        poison_(p.out, p.lse)
    for p in prepared:
        p.run()
    if problem.dcp_size > 1:
        out = torch.empty_like(prepared[0].out)
        lse = torch.empty_like(prepared[0].lse)
        merge_ranks_into(torch.stack([p.out for p in prepared]),
                         torch.stack([p.lse for p in prepared]), out, lse)
    else:
        out, lse = prepared[0].out, prepared[0].lse
    want_out, want_lse = reference.run(inputs)
    acc = check(problem, out, want_out, lse, want_lse if lse is not None else None)
    assert acc.ok, acc.reason
    return inputs, prepared


def decode(**kw) -> MLAProblem:
    return MLAProblem(**{"batch": 3, "kv_len": 45, "page_size": 16, **kw})


# --- padded ASM decode ------------------------------------------------------------------
@pytest.mark.parametrize("problem, kernel_heads, padding, mode", [
    (decode(num_heads=4), 16, "repeat", "persistent"),
    (decode(num_heads=12, qlen=2, page_size=1), 16, "tile", "persistent"),
    (decode(num_heads=16, q_dtype=FP8, kv_dtype=FP8, page_size=64), 16, "none", "persistent"),
    (decode(num_heads=3, qlen=5), 16, "tile", "non-persistent"),
    (decode(num_heads=3, qlen=5, q_dtype=FP8, kv_dtype=FP8), 16, "tile", "persistent"),
    (decode(num_heads=32, qlen=2, q_dtype=FP8, kv_dtype=FP8, causal=False), 32, "none",
     "persistent"),
    (decode(num_heads=2, dcp_size=4), 16, "repeat", "persistent"),
    (decode(num_heads=24, qlen=3, q_dtype="fp16", kv_dtype="fp16"), 32, "tile", "persistent"),
], ids=["4h-repeat", "12h-tile", "16h-fp8", "3h-qlen5-nonpersistent", "3h-qlen5-fp8",
        "32h-noncausal-fp8", "dcp4-lse", "24h-fp16"])
def test_padded_matches_reference(fake, problem, kernel_heads, padding, mode):
    _, prepared = run_route("padded/aiter", problem)
    assert prepared[0].params == {"kernel_heads": kernel_heads, "padding": padding, "mode": mode}
    call = fake.last("mla_decode_fwd")
    assert call["q"].shape[1] == kernel_heads
    assert (call["work_meta_data"] is not None) == (mode == "persistent")
    assert call["return_lse"] is True and call["sm_scale"] == problem.softmax_scale
    if mode == "persistent":
        info = fake.last("get_mla_metadata_info_v1")
        assert (info["batch_size"], info["max_seqlen_qo"], info["num_head_qo"]) == (
            problem.batch, problem.qlen, kernel_heads)


@pytest.mark.parametrize("heads, expected", [
    (4, lambda q: q.repeat_interleave(4, dim=1)),
    (12, lambda q: q.repeat(1, 2, 1)[:, :16]),
    (16, lambda q: q),
])
def test_padded_hands_the_kernel_the_seeds_head_layout(fake, heads, expected):
    problem = decode(num_heads=heads)
    inputs, _ = run_route("padded/aiter", problem)
    assert torch.equal(fake.last("mla_decode_fwd")["q"], expected(inputs.q))


def test_native_h24_build_runs_24_heads_unpadded(make_fake):
    fake = make_fake(native_h24=True)
    _, prepared = run_route("padded/aiter", decode(num_heads=24))
    assert prepared[0].params["kernel_heads"] == 24
    assert fake.last("get_mla_metadata_info_v1")["num_head_qo"] == 24


def test_gfx1250_takes_ps1_or_stage1_by_the_rules(make_fake):
    fake = make_fake(arch="gfx1250")
    _, prepared = run_route("padded/aiter", decode(num_heads=32, qlen=2, page_size=1),
                            arch="gfx1250")
    assert prepared[0].params["mode"] == "persistent"
    _, prepared = run_route("padded/aiter", decode(num_heads=64, qlen=3, page_size=128),
                            arch="gfx1250")
    assert prepared[0].params["mode"] == "stage1"
    call = fake.last("mla_decode_fwd")
    assert call["page_size"] == 64 and call["kv_buffer"].shape[1] == 64
    assert call["return_lse"] is False and call["work_meta_data"] is None


# --- cprr -------------------------------------------------------------------------------
@pytest.mark.parametrize("problem, kernel_heads", [
    (decode(num_heads=4, dcp_size=2, qlen=3), 16),  # 8 gathered heads: repeat-padded
    (decode(num_heads=12, dcp_size=2, qlen=4), 32),  # 24: tile-padded
    (decode(num_heads=16, dcp_size=2, qlen=3, q_dtype=FP8, kv_dtype=FP8), 32),
], ids=["8h-repeat", "24h-tile", "32h-fp8"])
def test_cprr_matches_reference(fake, problem, kernel_heads):
    run_route("cprr/aiter", problem)
    call = fake.last("mla_decode_fwd")
    assert call["q"].shape[1] == kernel_heads and call["causal"] is True
    assert (call["cp_world_size"], call["num_kv_splits"]) == (problem.dcp_size, fake.cu_num)
    schedule = fake.last("get_mla_metadata_v1")
    assert schedule["is_cp_round_robin"] is True and schedule["is_causal"] is False
    assert fake.last("get_mla_metadata_info_v1")["max_split_per_batch"] == fake.cu_num


def test_cprr_unpads_repeated_heads_by_stride_not_prefix(fake):
    """8 gathered heads run at 16 as h0,h0,h1,h1,...: the first 8 are not the real heads."""
    run_route("cprr/aiter", decode(num_heads=4, dcp_size=2, qlen=3))  # passes the reference
    o = fake.last("mla_decode_fwd")["o"]
    assert not torch.equal(o[:, :8], o[:, ::2])


# --- segmented --------------------------------------------------------------------------
@pytest.mark.parametrize("problem", [
    decode(num_heads=4, dcp_size=2, qlen=2, page_size=16),
    decode(num_heads=8, dcp_size=4, qlen=3, page_size=32, q_dtype=FP8, kv_dtype=FP8),
    decode(num_heads=2, dcp_size=2, qlen=4, page_size=256, kv_len=300),
    decode(num_heads=3, dcp_size=2, qlen=2, page_size=16, kv_dtype=FP8),
], ids=["4h-dcp2", "fp8-dcp4", "page256-tile128", "bf16q-fp8kv"])
def test_segmented_matches_reference(fake, problem):
    inputs, _ = run_route("segmented/aiter", problem)
    # Row lengths, by counting: rank r holds global positions p with p % dcp == r.
    call = fake.last("segmented_decode_fwd")
    last_rank = problem.dcp_size - 1
    lens = [sum(1 for p in range(int(n) - problem.qlen + t + 1)
                if p % problem.dcp_size == last_rank)
            for n in inputs.seq_lens for t in range(problem.qlen)]
    assert call["seqused_k"].tolist() == lens
    assert call["kv_buffer"].shape[1] == min(128, problem.page_size)


def test_segment_merge_ignores_unwritten_segments(fake):
    """The fake leaves NaN in segments past a row's end; they must not reach the output."""
    problem = decode(num_heads=4, dcp_size=4, qlen=4, kv_len=20, page_size=16, batch=2)
    run_route("segmented/aiter", problem)
    partials = fake.last("segmented_decode_fwd")
    assert partials["seqused_k"].min() < partials["max_seqlen_kv"]  # some rows end early


# --- Gluon ------------------------------------------------------------------------------
@pytest.mark.parametrize("problem", [
    decode(num_heads=4, page_size=1),
    decode(num_heads=8, qlen=3, page_size=16),
    decode(num_heads=12, qlen=2, page_size=64),
], ids=["4h-decode", "8h-verify", "12h-verify"])
def test_gluon_matches_reference(fake, problem):
    _, prepared = run_route("gluon/aiter", problem)
    call = fake.last("mla_gluon")
    assert call["q_nope"].dim() == (3 if problem.qlen == 1 else 4)
    assert prepared[0].lse is None


def test_gluon_falls_back_to_its_older_module_name(make_fake):
    fake = make_fake(legacy_gluon=True)
    run_route("gluon/aiter", decode(num_heads=2))
    assert fake.names() == ["mla_gluon"]


def test_gluon_non_divisor_decode_only_when_forced(fake, monkeypatch):
    problem = decode(num_heads=12)
    verdict = routes.get("gluon/aiter").supports(problem, amd())
    assert not verdict and "gluon.divisor" in verdict.reason
    monkeypatch.setenv("MLATUNE_AITER_GLUON", "force")
    run_route("gluon/aiter", problem)


# --- FP8 PS prefill ---------------------------------------------------------------------
@pytest.mark.parametrize("heads, kernel_heads", [(16, 16), (12, 16), (8, 16), (40, 48)])
def test_fp8_prefill_matches_reference(fake, heads, kernel_heads):
    problem = MLAProblem(phase="prefill", num_heads=heads, qlen=40, kv_len=40, batch=3,
                         q_dtype=FP8, kv_dtype=FP8, page_size=1)
    _, prepared = run_route("fp8-ps/aiter", problem)
    assert prepared[0].params["kernel_heads"] == kernel_heads
    assert fake.names() == ["get_ps_metadata_info_v1", "get_ps_metadata_v1",
                            "mla_prefill_ps_asm_fwd", "mla_reduce_v1"]
    assert fake.last("mla_prefill_ps_asm_fwd")["splitData"].shape[0] == 256 * fake.partial_tiles


# --- the probe --------------------------------------------------------------------------
def test_without_aiter_the_routes_say_so(monkeypatch):
    probe.cache_clear()
    monkeypatch.setitem(sys.modules, "aiter", None)  # `import aiter` raises ImportError
    try:
        verdict = routes.get("padded/aiter").supports(decode(num_heads=16), amd())
        assert not verdict and verdict.reason.startswith("installed AITER: aiter does not import")
        verdict = routes.get("padded/aiter").supports(decode(num_heads=16), amd("gfx942"))
        assert not verdict and "installed AITER" in verdict.reason
        nvidia = DeviceInfo("sm_90", "fake", "nvidia", 132)
        verdict = routes.get("padded/aiter").supports(decode(num_heads=16), nvidia)
        assert verdict.reason.startswith("rule aiter.amd:")
        # What ranks compare: unusable on an AMD GPU here, by rule alone on an NVIDIA one.
        assert routes.get("padded/aiter").unusable(amd()).startswith(
            "installed AITER: aiter does not import")
        assert routes.get("padded/aiter").unusable(nvidia) is None
    finally:
        probe.cache_clear()


def test_capability_refusal_comes_before_the_probe(fake):
    verdict = routes.get("cprr/aiter").supports(decode(num_heads=16, qlen=3), amd())
    assert verdict.reason.startswith("rule cprr.dcp:")


@pytest.mark.parametrize("config, route_id, problem, words", [
    ({"omit": ("aiter.ops.triton.gluon.mla_gluon",)}, "gluon/aiter", decode(num_heads=4),
     "mla_gluon"),
    ({"omit": ("aiter.ops.triton.attention.mla",)}, "segmented/aiter",
     decode(num_heads=4, dcp_size=2, qlen=2), "aiter.ops.triton.attention.mla"),
    ({"omit": ("aiter.mla_prefill_ps_asm_fwd",)}, "fp8-ps/aiter",
     MLAProblem(phase="prefill", num_heads=16, qlen=64, kv_len=64, q_dtype=FP8, kv_dtype=FP8),
     "mla_prefill_ps_asm_fwd"),
    ({"manifest": MANIFEST_ROWS[:1]}, "cprr/aiter", decode(num_heads=16, dcp_size=2, qlen=3),
     "lists no round-robin"),
    ({"manifest": MANIFEST_ROWS[1:]}, "padded/aiter", decode(num_heads=16), "no ASM decode"),
], ids=["no-gluon", "no-segmented", "no-prefill", "no-cprr-kernels", "no-decode-kernels"])
def test_probe_offers_a_route_only_where_the_build_has_it(make_fake, config, route_id, problem,
                                                           words):
    make_fake(**config)
    verdict = routes.get(route_id).supports(problem, amd())
    assert not verdict and verdict.reason.startswith("installed AITER:") and words in \
        verdict.reason


def test_an_installed_aiter_is_usable_family_by_family(make_fake):
    make_fake(omit=("aiter.ops.triton.gluon.mla_gluon",))
    assert routes.get("padded/aiter").unusable(amd()) is None
    assert "mla_gluon" in routes.get("gluon/aiter").unusable(amd())


def test_probe_without_a_manifest_leaves_kernel_tables_unchecked(make_fake):
    make_fake(manifest=None)
    assert routes.get("cprr/aiter").supports(decode(num_heads=16, dcp_size=2, qlen=3), amd())


def test_probe_refuses_an_aiter_too_old_for_cprr(make_fake, monkeypatch):
    make_fake()

    def old_plan(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k,
                 num_heads_k, is_causal, work_metadata_ptrs, work_info_set, work_indptr,
                 reduce_indptr, reduce_final_map, reduce_partial_map, page_size=1,
                 kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1, fast_mode=True,
                 dtype_q=None, dtype_kv=None):
        raise AssertionError("not called")

    monkeypatch.setattr(sys.modules["aiter"], "get_mla_metadata_v1", old_plan)
    verdict = routes.get("cprr/aiter").supports(decode(num_heads=16, dcp_size=2, qlen=3), amd())
    assert not verdict and "is_cp_round_robin" in verdict.reason
    assert routes.get("padded/aiter").supports(decode(num_heads=16), amd())


def test_probe_runs_once_per_process_and_arch(fake):
    assert probe("gfx950") is probe("gfx950")
    assert probe("gfx950").version == "0.0.fake"


def test_mlatune_imports_and_plans_without_aiter():
    code = ("import sys; import mlatune.cli, mlatune.routes as r; "
            "from mlatune.arch import cpu_device; from mlatune.problem import MLAProblem; "
            "[x.supports(MLAProblem(), cpu_device()) for x in r.all_routes()]; "
            "assert 'aiter' not in sys.modules, 'aiter was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
