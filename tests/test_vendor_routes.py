"""The vendor routes (FlashMLA, FlashInfer) against recording fakes of their libraries."""

from __future__ import annotations

import sys

import pytest
import torch

from mlatune import routes
from mlatune.arch import DeviceInfo
from mlatune.check import reference
from mlatune.check.accuracy import Rounding, check, tolerance_for
from mlatune.check.inputs import make_inputs, poison_, shard_lengths
from mlatune.dcp import merge_ranks_into
from mlatune.problem import MLAProblem
from mlatune.routes import flashinfer, flashmla
from tests.fake_vendors import FakeFlashInfer, FakeFlashMLA

H200 = DeviceInfo("sm_90", "fake H200", "nvidia", 132)
FP8 = "fp8_e4m3fn"


@pytest.fixture(autouse=True)
def fresh_libraries():
    flashmla.library.cache_clear()
    flashinfer.library.cache_clear()
    yield
    flashmla.library.cache_clear()
    flashinfer.library.cache_clear()


def decode(**kw) -> MLAProblem:
    return MLAProblem(**{"batch": 3, "kv_len": 150, "page_size": 64, "num_heads": 4, **kw})


def run_route(route_id: str, problem: MLAProblem, seed: int = 3):
    """Support, then prepare / poison / step every rank and merge, as a sweep worker does;
    returns the inputs, the prepared ranks and the accuracy against the reference."""
    route = routes.get(route_id)
    verdict = route.supports(problem, H200)
    assert verdict, verdict.reason
    inputs = make_inputs(problem, seed=seed, ragged=True)
    prepared = [route.prepare(problem, inputs, rank=r, want_lse=True)
                for r in range(problem.dcp_size)]
    for p in prepared:
        poison_(p.out, p.lse)
    for p in prepared:
        p.step()
    out, lse = prepared[0].out, prepared[0].lse
    if problem.dcp_size > 1:
        out, lse = torch.empty_like(out), torch.empty_like(lse)
        merge_ranks_into(torch.stack([p.out for p in prepared]),
                         torch.stack([p.lse for p in prepared]), out, lse)
    want_out, want_lse = reference.run(inputs)
    acc = check(problem, out, want_out, lse, want_lse, rounding=routes.rounding(route, problem))
    return inputs, prepared, acc


PROBLEMS = [decode(), decode(qlen=2), decode(qlen=3, causal=False), decode(num_heads=16, qlen=4),
            decode(dcp_size=2), decode(qlen=2, causal=False, dcp_size=2)]
IDS = ["decode", "verify2", "noncausal3", "16h-verify4", "dcp2", "dcp2-noncausal"]


# --- FlashMLA ---------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", ["legacy", "classic"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=IDS)
def test_flashmla_matches_reference(monkeypatch, flavour, problem):
    fake = FakeFlashMLA(flavour).install(monkeypatch)
    _, prepared, acc = run_route("dense/flashmla", problem)
    assert acc.ok, acc.reason
    assert prepared[0].params["interface"] == flavour
    decode_calls = [c for name, c in fake.calls if name == "decode"]
    assert all(c["causal"] == (problem.causal and problem.qlen > 1) for c in decode_calls)


def test_flashmla_fp8_cache_quantizes_a_bf16_q_and_says_so(monkeypatch):
    FakeFlashMLA().install(monkeypatch)
    problem = decode(kv_dtype=FP8, qlen=2)
    _, prepared, acc = run_route("dense/flashmla", problem)
    assert acc.ok, acc.reason
    assert prepared[0].params["q"] == "fp8 per-tensor"
    assert routes.rounding(routes.get("dense/flashmla"), problem) == Rounding.Q_FP8
    # Held to the bf16 tolerance it would fail: the quantized q is what costs accuracy.
    assert acc.rel_l2 > tolerance_for("bf16", FP8).rel_l2


def test_flashmla_fp8_q_passes_its_own_scale(monkeypatch):
    FakeFlashMLA().install(monkeypatch)
    problem = decode(q_dtype=FP8, kv_dtype=FP8)
    _, prepared, acc = run_route("dense/flashmla", problem)
    assert acc.ok, acc.reason
    assert "q" not in prepared[0].params
    assert routes.rounding(routes.get("dense/flashmla"), problem) == Rounding.NONE


def test_flashmla_plans_again_from_lengths_rewritten_in_place(monkeypatch):
    fake = FakeFlashMLA().install(monkeypatch)
    problem = decode()
    inputs, prepared, acc = run_route("dense/flashmla", problem)
    assert acc.ok, acc.reason
    inputs.seq_lens.copy_((inputs.seq_lens // 2).clamp(min=1))  # within each row's pages
    inputs.shards[0].seq_lens.copy_(inputs.seq_lens)  # one shard: the same lengths
    want_out, _ = reference.run(inputs)
    prepared[0].run()  # the launch alone keeps the schedule of the old lengths
    assert not check(problem, prepared[0].out, want_out).ok
    plans = fake.plans
    prepared[0].step()  # the device plan, then the launch
    assert fake.plans == plans + 1
    assert check(problem, prepared[0].out, want_out).ok
    assert prepared[0].step_kind == routes.StepKind("device", True)


@pytest.mark.parametrize("problem, rule", [
    (decode(page_size=16), "flashmla.page"),
    (decode(qlen=2, dcp_size=2), "vendor.dcp"),
    (decode(q_dtype="fp16", kv_dtype="fp16"), "flashmla.dtypes"),
    (decode(phase="prefill", qlen=150), "vendor.decode"),
])
def test_flashmla_rules_refuse_before_the_library(monkeypatch, problem, rule):
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    verdict = routes.get("dense/flashmla").supports(problem, H200)
    assert not verdict and f"rule {rule}:" in verdict.reason


def test_flashmla_refuses_off_hopper(monkeypatch):
    FakeFlashMLA().install(monkeypatch)
    verdict = routes.get("dense/flashmla").supports(decode(), DeviceInfo("sm_100", "B200",
                                                                        "nvidia", 148))
    assert not verdict and "sm_90 only" in verdict.reason


def test_flashmla_missing_names_what_to_install(monkeypatch):
    for name in ("flash_mla", "vllm", "vllm.attention.ops.flashmla",
                 "vllm.v1.attention.ops.flashmla"):
        monkeypatch.setitem(sys.modules, name, None)
    verdict = routes.get("dense/flashmla").supports(decode(), H200)
    assert not verdict and "pip install sgl-flash-mla --no-deps" in verdict.reason
    assert routes.get("dense/flashmla").unusable(H200) == verdict.reason  # ranks compare it
    with pytest.raises(RuntimeError, match="sgl-flash-mla"):
        routes.get("dense/flashmla").prepare(decode(), make_inputs(decode(), seed=1))


# --- FlashInfer -------------------------------------------------------------------------
@pytest.mark.parametrize("route_id", ["fa3/flashinfer", "fa2/flashinfer"])
@pytest.mark.parametrize("problem", [*PROBLEMS, decode(page_size=1, qlen=2),
                                     decode(page_size=16, kv_dtype=FP8)],
                         ids=[*IDS, "page1-verify2", "page16-fp8"])
def test_flashinfer_matches_reference(monkeypatch, route_id, problem):
    fake = FakeFlashInfer().install(monkeypatch)
    _, prepared, acc = run_route(route_id, problem)
    assert acc.ok, acc.reason
    backend = route_id.split("/")[0]
    assert ("init", {"backend": backend}) in fake.calls
    runs = [c for name, c in fake.calls if name == "run"]
    assert runs and all(c["lse_e"] for c in runs), "the table's LSE is natural log"
    plans = [c for name, c in fake.calls if name == "plan"]
    assert all(c["causal"] == (problem.causal and problem.qlen > 1) for c in plans)
    assert prepared[0].step_kind == routes.StepKind("host", False)


def test_flashinfer_writes_into_the_callers_buffers(monkeypatch):
    FakeFlashInfer().install(monkeypatch)
    problem = decode(qlen=2)
    inputs = make_inputs(problem, seed=5, ragged=True)
    out = torch.full((6, 4, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((6, 4), float("nan"))
    prepared = routes.get("fa3/flashinfer").prepare(problem, inputs, out=out, lse=lse)
    prepared.step()
    assert prepared.out is out and prepared.lse is lse
    want_out, want_lse = reference.run(inputs)
    assert check(problem, out, want_out, lse, want_lse).ok


@pytest.mark.parametrize("problem, rule", [
    (decode(qlen=3, dcp_size=2), "vendor.dcp"),
    (decode(q_dtype=FP8, kv_dtype=FP8), "flashinfer.dtypes"),
    (decode(q_dtype="fp16", kv_dtype=FP8), "flashinfer.dtypes"),
])
def test_flashinfer_rules_refuse_before_the_library(monkeypatch, problem, rule):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    verdict = routes.get("fa3/flashinfer").supports(problem, H200)
    assert not verdict and f"rule {rule}:" in verdict.reason


def test_flashinfer_fa3_is_hopper_only_and_fa2_is_not(monkeypatch):
    FakeFlashInfer().install(monkeypatch)
    b200 = DeviceInfo("sm_100", "B200", "nvidia", 148)
    assert not routes.get("fa3/flashinfer").supports(decode(), b200)
    assert routes.get("fa2/flashinfer").supports(decode(), b200)
    assert not routes.get("fa2/flashinfer").supports(decode(kv_dtype=FP8), b200)


def test_flashinfer_missing_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    verdict = routes.get("fa2/flashinfer").supports(decode(), H200)
    assert not verdict and "pip install flashinfer-python apache-tvm-ffi" in verdict.reason
    assert routes.get("fa3/flashinfer").unusable(H200) == verdict.reason  # ranks compare it


def test_installed_vendor_libraries_are_usable(monkeypatch):
    FakeFlashMLA().install(monkeypatch)
    FakeFlashInfer().install(monkeypatch)
    assert [routes.get(r).unusable(H200) for r in
            ("dense/flashmla", "fa3/flashinfer", "fa2/flashinfer")] == [None, None, None]


def test_flashmla_shard_rows_without_keys_merge_as_empty(monkeypatch):
    """A request shorter than the DCP size has no keys on some rank: FlashMLA's row there
    (NaN, +inf in the fake, as seen on the H200) becomes the merge's empty partial: output 0
    and LSE -inf, rewritten after the launch from the step's lengths."""
    FakeFlashMLA().install(monkeypatch)
    problem = decode(dcp_size=2)
    route = routes.get("dense/flashmla")
    inputs = make_inputs(problem, seed=4, ragged=True)
    inputs.seq_lens[0] = 1  # rank 1 holds none of request 0's keys
    for shard in inputs.shards:
        shard.seq_lens.copy_(shard_lengths(inputs.seq_lens, shard.rank, 2))
    assert int(inputs.shards[1].seq_lens[0]) == 0
    prepared = [route.prepare(problem, inputs, rank=r) for r in range(2)]
    for p in prepared:
        p.step()
    assert torch.isneginf(prepared[1].lse[0]).all() and (prepared[1].out[0] == 0).all()
    out, lse = torch.empty_like(prepared[0].out), torch.empty_like(prepared[0].lse)
    merge_ranks_into(torch.stack([p.out for p in prepared]),
                     torch.stack([p.lse for p in prepared]), out, lse)
    want_out, want_lse = reference.run(inputs)
    assert check(problem, out, want_out, lse, want_lse).ok


def test_the_dispatcher_skips_a_missing_library_here_but_not_when_planning(monkeypatch,
                                                                           tmp_path):
    from mlatune import table
    from mlatune.dispatch import Dispatcher
    from tests.table_helpers import make_table, result_row

    monkeypatch.setitem(sys.modules, "flash_mla", None)
    for name in ("vllm", "vllm.attention.ops.flashmla", "vllm.v1.attention.ops.flashmla"):
        monkeypatch.setitem(sys.modules, name, None)
    problem = decode(num_heads=16, batch=64, kv_len=4096)
    rows = [result_row(problem, "dense/flashmla", 50.0), result_row(problem, "padded/triton", 80.0)]
    path = table.write(make_table(rows), tmp_path / "sm_90-h200.parquet")
    here = Dispatcher.load(path, device=H200)  # this machine: FlashMLA does not import
    assert here.select(problem).route_id == "padded/triton"
    cpu = DeviceInfo("cpu", "cpu", "cpu", 2)
    planning = Dispatcher.load(path, device=cpu, allow_arch="sm_90")  # for the H200
    assert planning.select(problem).route_id == "dense/flashmla"
