"""Truth tables for the capability rules, with the expected answers written from the seeds.

Each ``expect_*`` states a route's rules the way the issue and the seeds do
(seeds/vllm-rocm-aiter-mla-backend.txt, seeds/aiter-pr-6563-gfx1250-mla-decode.txt),
independently of mlatune.capability's code; the tests compare the two over
heads 1..144, qlen 1..8, dtypes, causal and DCP sizes on every AMD arch.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mlatune import capability
from mlatune.capability import HeadPlan
from mlatune.problem import MLAProblem

AMD = ("gfx942", "gfx950", "gfx1250")
FP8_OF = {"gfx942": "fp8_e4m3fnuz", "gfx950": "fp8_e4m3fn", "gfx1250": "fp8_e4m3fn"}
HEADS = range(1, 145)
QLENS = range(1, 9)
DCPS = (1, 2, 4)


def ceil16(n: int) -> int:
    return -(-n // 16) * 16


def valid(n: int) -> bool:
    """AiterMLAHelper.is_valid_num_heads: at most 128, or a multiple of 16 (no arch condition)."""
    return n > 0 and (n <= 128 or n % 16 == 0)


def backend_heads(h: int, dcp: int) -> bool:
    """AiterMLAImpl.__init__ checks the heads per rank and the DCP-gathered count alike."""
    return valid(h) and valid(h * dcp)


# --- the rules as the sources state them ------------------------------------------------
def expect_gluon(arch, h, qlen, q, kv, causal, dcp, force=False):
    """gfx950; < 16 heads; a 16-bit KV (the fp8 regime cannot take a batch; the backend's
    supported_dtypes are bf16 and fp16); divisor of 16 at qlen 1 unless forced; causal verify;
    no DCP."""
    if arch != "gfx950" or kv not in ("bf16", "fp16") or h * dcp >= 16 or dcp > 1:
        return False
    return (16 % h == 0 or force) if qlen == 1 else causal


def ps1(kernel_heads, qlen, dtype):
    """gfx1250 FlyDSL PS1: 16 heads at qlen <= 4; 32/64 at qlen <= 4 with heads x qlen <= 128;
    96 and 128 heads through the fp8 PS1 ASM (128: the single-token code objects)."""
    small = kernel_heads == 16 or (kernel_heads in (32, 64) and kernel_heads * qlen <= 128)
    if dtype in ("bf16", "fp8") and qlen <= 4 and small:
        return True
    return dtype == "fp8" and (kernel_heads == 96 or (kernel_heads == 128 and qlen == 1))


def expect_padded(arch, h, qlen, q, kv, causal, dcp, page=64, h24=False):
    """Heads padded to a multiple of 16 up to 128 (24 native where built), aligned above (any
    arch: is_valid_num_heads), per rank and gathered; q and KV alike; no causal verify over a
    DCP shard; non-causal verify on gfx950 only, never fp16, and fp8 2-token blocks only at
    32/64/96/128; gfx1250 off PS1: 64-token pages, no DCP."""
    k = h * dcp
    fp8 = kv.startswith("fp8")
    if q != kv or qlen > 8 or not backend_heads(h, dcp):
        return False
    kernel = 24 if k == 24 and h24 and arch != "gfx1250" else ceil16(k)
    if dcp > 1 and causal and qlen > 1:
        return False
    if not causal and qlen > 1:
        if arch != "gfx950" or q == "fp16":
            return False
        if fp8 and qlen == 2 and kernel not in (32, 64, 96, 128):
            return False
    if arch == "gfx1250" and not ps1(kernel, qlen, "fp8" if fp8 else q):
        return page % 64 == 0 and dcp == 1
    return True


def expect_cprr(arch, h, qlen, q, kv, causal, dcp):
    """gfx950; DCP > 1 (interleave 1); causal verify with qlen >= 3; <= 128 gathered heads;
    bf16 or fp8 (AITER's gfx950 mla_asm.csv has no fp16 cprr kernel)."""
    return (arch == "gfx950" and q == kv and q in ("bf16", FP8_OF[arch]) and dcp > 1 and causal
            and 3 <= qlen <= 8 and h * dcp <= 128)


def expect_segmented(arch, h, qlen, q, kv, causal, dcp, page=64):
    """DCP > 1 (interleave 1), causal qlen > 1; a 16-bit cache with q in its dtype, or fp8 (the
    arch's format); heads per rank and gathered valid; the page is the tile (>= 16)."""
    f = FP8_OF[arch]
    dtypes_ok = (q == kv and q in ("bf16", "fp16")) or (kv == f and q in ("bf16", "fp16", f))
    return (dtypes_ok and backend_heads(h, dcp) and dcp > 1 and causal and qlen > 1
            and page >= 16)


def expect_fp8_prefill(arch, h, q, kv, causal, qlen, kv_len):
    """gfx950; fp8 KV and q (bf16 out); heads to a multiple of 16; causal; KV = the new tokens."""
    return (arch == "gfx950" and q == kv == FP8_OF[arch] and (h <= 128 or h % 16 == 0)
            and causal and kv_len == qlen)


EXPECT = {"gluon/aiter": expect_gluon, "padded/aiter": expect_padded,
          "cprr/aiter": expect_cprr, "segmented/aiter": expect_segmented}


def dtype_pairs(arch):
    f = FP8_OF[arch]
    return (("bf16", "bf16"), ("fp16", "fp16"), (f, f), ("bf16", f))


def decode_grid(arch):
    for h, qlen, (q, kv), causal, dcp in itertools.product(HEADS, QLENS, dtype_pairs(arch),
                                                           (True, False), DCPS):
        yield (h, qlen, q, kv, causal, dcp), MLAProblem(
            num_heads=h, qlen=qlen, q_dtype=q, kv_dtype=kv, causal=causal, dcp_size=dcp,
            batch=2, kv_len=512, page_size=64)


@pytest.fixture(scope="module")
def grids():
    return {arch: list(decode_grid(arch)) for arch in AMD}


def mismatches(route_id, arch, cases, expect, **options):
    wrong = []
    for args, problem in cases:
        ruling = capability.check(route_id, problem, arch, **options)
        assert ruling.ok or (ruling.reason and ruling.rule), f"refusal without a reason: {args}"
        if ruling.ok != expect(arch, *args, **options_for_expect(options)):
            wrong.append((args, ruling))
    return wrong


def options_for_expect(options):
    return {{"native_h24": "h24", "force_gluon": "force"}[k]: v for k, v in options.items()}


@pytest.mark.parametrize("arch", AMD)
@pytest.mark.parametrize("route_id", sorted(EXPECT))
def test_decode_truth_table(grids, route_id, arch):
    wrong = mismatches(route_id, arch, grids[arch], EXPECT[route_id])
    assert not wrong, f"{len(wrong)} disagree, e.g. {wrong[:3]}"


@pytest.mark.parametrize("route_id, options", [
    ("gluon/aiter", {"force_gluon": True}),
    ("padded/aiter", {"native_h24": True}),
])
def test_decode_truth_table_with_options(grids, route_id, options):
    for arch in AMD:
        wrong = mismatches(route_id, arch, grids[arch], EXPECT[route_id], **options)
        assert not wrong, f"{arch}: {len(wrong)} disagree, e.g. {wrong[:3]}"


@pytest.mark.parametrize("arch", AMD)
def test_fp8_prefill_truth_table(arch):
    f = FP8_OF[arch]
    shapes = ((256, 256), (256, 512))  # (qlen, kv_len): without and with a prefix
    for h, (q, kv), causal, (qlen, kv_len) in itertools.product(
            HEADS, (("bf16", "bf16"), ("fp16", "fp16"), (f, f), ("bf16", f)), (True, False),
            shapes):
        problem = MLAProblem(phase="prefill", num_heads=h, q_dtype=q, kv_dtype=kv,
                             causal=causal, qlen=qlen, kv_len=kv_len, page_size=1)
        ruling = capability.check("fp8-ps/aiter", problem, arch)
        assert ruling.ok == expect_fp8_prefill(arch, h, q, kv, causal, qlen, kv_len), (
            h, q, kv, causal, qlen, kv_len, ruling)


@pytest.mark.parametrize("route_id", ["segmented/aiter", "padded/aiter"])
@pytest.mark.parametrize("page", [1, 8, 16, 32, 64, 128, 256])
def test_page_size_rules(route_id, page):
    """Segmented: the page is the tile, >= 16. gfx1250 stage 1 (64 heads x 3 tokens): 64-pages."""
    if route_id == "segmented/aiter":
        problem = MLAProblem(num_heads=4, qlen=2, dcp_size=2, page_size=page, kv_len=512)
        assert capability.check(route_id, problem, "gfx950").ok == expect_segmented(
            "gfx950", 4, 2, "bf16", "bf16", True, 2, page=page)
    else:
        problem = MLAProblem(num_heads=64, qlen=3, page_size=page, kv_len=512)
        assert capability.check(route_id, problem, "gfx1250").ok == expect_padded(
            "gfx1250", 64, 3, "bf16", "bf16", True, 1, page=page)


def test_gluon_cache_bound_is_two_gib():
    tokens = (1 << 31) // (576 * 2) // 64 * 64  # whole 64-token pages of a bf16 576-wide cache
    fits = MLAProblem(num_heads=4, batch=1, kv_len=tokens, page_size=64)
    over = fits.with_(kv_len=tokens + 64)
    assert capability.kv_cache_bytes(fits) <= 1 << 31 < capability.kv_cache_bytes(over)
    assert capability.check("gluon/aiter", fits, "gfx950")
    ruling = capability.check("gluon/aiter", over, "gfx950")
    assert not ruling and ruling.rule == "gluon.cache"


@pytest.mark.parametrize("route_id, arch, wrong", [
    ("padded/aiter", "gfx950", "fp8_e4m3fnuz"), ("cprr/aiter", "gfx950", "fp8_e4m3fnuz"),
    ("segmented/aiter", "gfx950", "fp8_e4m3fnuz"), ("padded/aiter", "gfx942", "fp8_e4m3fn"),
    ("segmented/aiter", "gfx942", "fp8_e4m3fn"), ("padded/aiter", "gfx1250", "fp8_e4m3fnuz"),
])
def test_fp8_must_be_the_archs_format(route_id, arch, wrong):
    problem = MLAProblem(num_heads=16, qlen=3, q_dtype=wrong, kv_dtype=wrong, dcp_size=2)
    ruling = capability.check(route_id, problem, arch)
    assert not ruling and ruling.rule == "aiter.fp8"


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_portable_archs_refuse_aiter_and_admit_triton(arch):
    problem = MLAProblem(num_heads=16)
    for route_id in EXPECT:
        ruling = capability.check(route_id, problem, arch)
        assert not ruling and ruling.rule == "aiter.amd"
    assert capability.check("padded/triton", problem, arch)
    assert not capability.check("padded/triton", problem.with_(phase="prefill", qlen=8,
                                                               kv_len=8), arch)
    prefill = MLAProblem(phase="prefill", qlen=8, kv_len=8, q_dtype="fp8_e4m3fn",
                         kv_dtype="fp8_e4m3fn")
    assert capability.check("fp8-ps/triton", prefill, arch)
    assert capability.check("bf16-ps/triton", prefill.with_(q_dtype="bf16"), arch)
    assert not capability.check("bf16-ps/triton", problem, arch)


def test_unknown_arch_and_route():
    ruling = capability.check("padded/aiter", MLAProblem(), "tpu_v5")
    assert not ruling and ruling.rule == "arch.unknown" and "gfx950" in ruling.reason
    with pytest.raises(KeyError, match="no capability rules"):
        capability.check("nope/torch", MLAProblem(), "gfx950")
    with pytest.raises(KeyError, match="no capability rules"):
        capability.check("anything/triton", MLAProblem(), "gfx950")
    assert capability.known("padded/aiter") and capability.known("reference/torch")
    assert not capability.known("anything/triton")


@pytest.mark.parametrize("arch, rule", [("cpu", "aiter.amd"), ("sm_80", "aiter.amd"),
                                        ("gfx90a", "aiter.amd")])
def test_archs_met_on_a_machine_refuse_aiter(arch, rule):
    """A route meets the CPU, or a GPU no plan names (an A100, an MI250): AITER refuses them
    by rule, the portable routes judge them by what their dots take."""
    ruling = capability.check("segmented/aiter", MLAProblem(num_heads=4, qlen=2, dcp_size=2),
                              arch)
    assert not ruling and ruling.rule == rule
    assert capability.check("reference/torch", MLAProblem(), arch)


@pytest.mark.parametrize("arch, dtype, rule, words", [
    ("cpu", "bf16", "triton.interpreter", "interpreter"),
    ("cpu", "fp8_e4m3fnuz", None, ""),
    ("sm_75", "fp16", "triton.dots", "sm_80"),
    ("sm_80", "fp8_e4m3fn", "triton.fp8", "sm_89"),
    ("sm_90", "fp8_e4m3fnuz", "triton.fp8", "AMD's fp8 format"),
    ("gfx942", "fp8_e4m3fn", "triton.fp8", "gfx942 computes fp8 as fp8_e4m3fnuz"),
    ("gfx950", "fp8_e4m3fnuz", "triton.fp8", "gfx950 computes fp8 as fp8_e4m3fn"),
    ("gfx1250", "fp8_e4m3fn", "triton.fp8", "no fp8 matrix support known"),
    ("gfx90a", "bf16", None, ""),
])
def test_what_triton_dots_take_per_arch(arch, dtype, rule, words):
    for route_id in ("padded/triton", "bf16-ps/triton" if dtype in ("bf16", "fp16")
                     else "fp8-ps/triton"):
        phase = "decode" if route_id == "padded/triton" else "prefill"
        problem = MLAProblem(phase=phase, q_dtype=dtype, kv_dtype=dtype, qlen=8, kv_len=8)
        ruling = capability.check(route_id, problem, arch)
        assert ruling.ok == (rule is None), (route_id, ruling)
        assert ruling.rule == (rule or "") and words in ruling.reason


@pytest.mark.parametrize("route_id, problem, rule", [
    ("gluon/triton", MLAProblem(num_heads=128), "triton.gluon"),
    ("gluon/triton", MLAProblem(num_heads=4, dcp_size=2), "triton.gluon"),
    ("gluon/triton", MLAProblem(num_heads=4, qlen=9, kv_len=512), "triton.gluon"),
    ("gluon/triton", MLAProblem(num_heads=4, qlen=2, causal=False), "triton.gluon"),
    ("gluon/triton", MLAProblem(num_heads=4, qlen=2), None),
    ("cprr/triton", MLAProblem(num_heads=16, qlen=3), "triton.cprr"),
    ("cprr/triton", MLAProblem(num_heads=80, dcp_size=2), "triton.cprr"),
    ("cprr/triton", MLAProblem(num_heads=48, dcp_size=2), None),
    ("segmented/triton", MLAProblem(num_heads=4, qlen=2), "triton.segmented"),
    ("segmented/triton", MLAProblem(num_heads=4, dcp_size=2), "triton.segmented"),
    ("segmented/triton", MLAProblem(num_heads=4, qlen=2, dcp_size=2, causal=False),
     "triton.segmented"),
    ("segmented/triton", MLAProblem(num_heads=4, qlen=2, dcp_size=2), None),
    ("padded/triton", MLAProblem(num_heads=136), "triton.padded.heads"),
    ("padded/triton", MLAProblem(num_heads=144), None),
    ("padded/triton", MLAProblem(kv_lora_rank=500), "triton.decode.dims"),
    ("padded/triton", MLAProblem(phase="prefill", qlen=8, kv_len=8), "triton.decode"),
    ("bf16-ps/triton", MLAProblem(num_heads=16), "triton.prefill"),
    ("bf16-ps/triton", MLAProblem(phase="prefill", qlen=8, kv_len=8, qk_head_dim=176),
     "triton.prefill.dims"),
    ("bf16-ps/triton", MLAProblem(phase="prefill", qlen=8, kv_len=8, kv_dtype="fp8_e4m3fn"),
     None),
    ("fp8-ps/triton", MLAProblem(phase="prefill", qlen=8, kv_len=8, kv_dtype="fp8_e4m3fn"),
     "triton.prefill.dtypes"),
    ("sdpa/torch", MLAProblem(), "sdpa.prefill"),
    ("sdpa/torch", MLAProblem(phase="prefill", qlen=8, kv_len=8, q_dtype="fp8_e4m3fn",
                              kv_dtype="fp8_e4m3fn"), "sdpa.dtypes"),
    ("reference/torch", MLAProblem(num_heads=1000, dcp_size=8), None),
])
def test_portable_route_rules(route_id, problem, rule):
    for arch in ("sm_90", "sm_100", "gfx950"):
        ruling = capability.check(route_id, problem, arch)
        assert ruling.ok == (rule is None) and ruling.rule == (rule or ""), (arch, ruling)


def test_heads_per_rank_and_gathered_are_both_checked():
    """136 heads per rank are refused even where the gathered 272 are aligned; segmented checks
    the gathered count (100 x 2 = 200 is neither <= 128 nor aligned)."""
    for route_id, problem in (
            ("padded/aiter", MLAProblem(num_heads=136, dcp_size=2)),
            ("segmented/aiter", MLAProblem(num_heads=100, qlen=2, dcp_size=2)),
            ("segmented/aiter", MLAProblem(num_heads=136, qlen=2, dcp_size=2))):
        ruling = capability.check(route_id, problem, "gfx950")
        assert not ruling and ruling.rule == "aiter.heads", (route_id, ruling)
    for arch in AMD:  # aligned counts above 128 on every arch, as is_valid_num_heads says
        assert capability.check("padded/aiter", MLAProblem(num_heads=144), arch), arch


def test_every_rule_cites_a_source():
    for route_id in capability.rules.ROUTE_RULES:
        rules = capability.rules_for(route_id)
        assert len({r.id for r in rules}) == len(rules)
        for rule in rules:
            assert rule.source.where and rule.source.says
            assert any(s in rule.source.where for s in (
                "seeds/", "AITER", "mlatune/", "Triton", "torch", "flash", "FlashMLA")), rule


def test_known_arch_devices():
    counts = {a: capability.device_for_arch(a).cu_count for a in capability.ARCHS}
    assert counts == {"gfx942": 304, "gfx950": 256, "gfx1250": 0, "sm_90": 132, "sm_100": 148}
    assert capability.device_for_arch("gfx950").vendor == "amd"
    with pytest.raises(KeyError, match="known"):
        capability.device_for_arch("gfx90a")


# --- head plans ------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", HEADS)
def test_kernel_head_counts(heads):
    assert capability.asm_decode_heads(heads) == (
        ceil16(heads) if heads <= 128 else (heads if heads % 16 == 0 else None))
    assert capability.asm_decode_heads(heads, native_h24=True) == (
        24 if heads == 24 else capability.asm_decode_heads(heads))
    assert capability.cprr_heads(heads) == next((n for n in (16, 32, 64, 128) if n >= heads),
                                                None)
    assert capability.fp8_prefill_heads(heads) == capability.asm_decode_heads(heads)


@pytest.mark.parametrize("heads", range(1, 129))
def test_head_padding_round_trips(heads):
    """Each kernel head is a copy of one real head, and unpadding finds every real head."""
    q = torch.arange(3 * heads, dtype=torch.float32).view(3, heads, 1).expand(3, heads, 2)
    for kernel in {ceil16(heads), capability.cprr_heads(heads)}:
        plan = HeadPlan(heads, kernel)
        padded = plan.padded(q.contiguous())
        assert padded.shape == (3, kernel, 2)
        assert set(padded[0, :, 0].tolist()) == set(q[0, :, 0].tolist())
        assert torch.equal(plan.real_heads(padded), q)


def test_padding_matches_the_seed():
    """Divisors of the target: repeat_interleave; others: tile and cut (get_mla_padded_q)."""
    q = torch.randn(5, 4, 3)
    assert torch.equal(HeadPlan(4, 16).padded(q), q.repeat_interleave(4, dim=1))
    q = torch.randn(5, 12, 3)
    assert torch.equal(HeadPlan(12, 16).padded(q), q.repeat(1, 2, 1)[:, :16])
    assert HeadPlan(16, 16).padded(q[:, :4].repeat(1, 4, 1)) is not None
    assert HeadPlan(8, 16).stride == 2 and HeadPlan(12, 16).stride == 1


def test_asm_modes():
    """bf16 padded heads: persistent up to qlen 4, then non-persistent; fp8 keeps the schedule."""
    for qlen in QLENS:
        for kv in ("bf16", "fp8_e4m3fn"):
            problem = MLAProblem(num_heads=4, qlen=qlen, kv_dtype=kv, q_dtype=kv)
            plan = capability.padded_asm_plan(problem, "gfx950")
            persistent = kv != "bf16" or qlen <= 4  # the seed: _ASM_PADDED_MAX_PS_QLEN
            assert plan.mode == ("persistent" if persistent else "non-persistent")
    assert capability.padded_asm_plan(MLAProblem(num_heads=16, qlen=8), "gfx950").mode == \
        "persistent"
