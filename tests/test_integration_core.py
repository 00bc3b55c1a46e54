"""The engine adapter (``mlatune.integrations.core``) on the CPU: Triton's interpreter, fp16
q over fp16 and fp8 caches at tiny sizes.

An engine's step through ``MLADecoder``: ``begin_step`` with the step's block table and
lengths (ragged, padded with empty slots, rewritten in place between steps), then one
``forward`` per layer; every layer's output and LSE against the torch reference, outputs
poisoned first. DCP 2 simulated: the two ranks' partials merged by their LSEs equal the
whole computed by one rank. The plan made once per step, counted; ``refusal`` case by case;
the load's log line; the counters.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy
import pytest
import torch

from mlatune import attention, table
from mlatune.arch import cpu_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import DecodeInputs, poison_
from mlatune.errors import DecodeArgumentError
from mlatune.integrations.core import MLADecoder, ServedModel, refusal, uniform_qlen
from mlatune.kernels import plan as plan_kernels
from mlatune.lse import combine
from mlatune.problem import DTYPES, MLAProblem
from tests.helpers import expected_now, unsharded
from tests.table_helpers import make_table, result_row
from tests.test_light_import import _modules_after
from tests.test_shared_plan import TILES, _dispatcher, _layers, _write_lengths

FP8 = "fp8_e4m3fn"
SCALE = 0.1147  # a model's own softmax scale (not the problem's default 192 ** -0.5)
LAYERS = 3


def _served(problem: MLAProblem, **changes) -> ServedModel:
    model = ServedModel(num_heads=problem.num_heads, softmax_scale=SCALE,
                        q_dtype=DTYPES[problem.q_dtype], kv_cache_dtype=DTYPES[problem.kv_dtype],
                        page_size=problem.page_size, num_layers=LAYERS,
                        dcp_size=problem.dcp_size, max_qlen=problem.qlen)
    return replace(model, **changes)


def _run_step(decoder: MLADecoder, layers: list[DecodeInputs], rank: int,
              given: dict[int, tuple[torch.Tensor, torch.Tensor]]
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One engine step on ``rank``: begin_step, then forward per layer. Layers in ``given``
    write into those (poisoned) buffers; the others return the step's own buffers, which
    a previous step left and which are poisoned here too."""
    first, p = layers[0], layers[0].problem
    shard = first.shards[rank]
    decoder.begin_step(shard.block_table, first.seq_lens, qlen=p.qlen, max_kv_len=p.kv_len)
    results = []
    for i, inputs in enumerate(layers):
        out, lse = given.get(i, (None, None))
        poison_(out, lse)
        results.append(decoder.forward(inputs.q, inputs.shards[rank].kv_cache, out=out,
                                       lse_out=lse, kv_scale=inputs.kv_scale,
                                       q_scale=inputs.q_scale))
    return results


def _buffers(problem: MLAProblem, layers: list[int]) -> dict[int, tuple[torch.Tensor, ...]]:
    rows, heads = problem.batch * problem.qlen, problem.kernel_heads
    return {i: (torch.empty(rows, heads, problem.d_v, dtype=torch.float16),
                torch.empty(rows, heads)) for i in layers}


def _assert_right(layers: list[DecodeInputs], results, what: str) -> None:
    for n, (inputs, (out, lse)) in enumerate(zip(layers, results, strict=True)):
        want_out, want_lse = expected_now(replace(inputs, sm_scale=SCALE))
        accuracy = check(inputs.problem, out, want_out, lse, want_lse)
        assert accuracy.ok, f"{what}, layer {n}: {accuracy.reason} ({accuracy.summary})"
        empty = torch.isneginf(want_lse)
        assert (out[empty.all(-1)] == 0).all(), f"{what}, layer {n}: rows without keys"


# Two steps of a bucket of 5: empty slots (0), a request shorter than qlen 2 (1); then the
# lengths rewritten in place: a live request emptied, an empty one filled.
STEPS = ([24, 0, 9, 1, 0], [0, 17, 24, 0, 2])


@pytest.mark.parametrize(("qlen", "kv_dtype"), [(1, "fp16"), (2, "fp16"), (1, FP8)],
                         ids=["decode", "verify", "fp8-cache"])
def test_the_layers_of_each_step_match_the_reference(qlen, kv_dtype):
    problem = MLAProblem(num_heads=4, qlen=qlen, batch=5, kv_len=24, page_size=8,
                         q_dtype="fp16", kv_dtype=kv_dtype)
    layers = _layers(problem, LAYERS)
    decoder = MLADecoder.load(_served(problem), device="cpu")
    given = _buffers(problem, [0, 2])
    results: list = []
    for lens in STEPS:
        for out, lse in results:  # the step's own buffers of layer 1, from the last step
            poison_(out, lse)
        _write_lengths(layers[0], torch.tensor(lens, dtype=torch.int32))
        results = _run_step(decoder, layers, 0, given)
        _assert_right(layers, results, f"lengths {lens}")
        assert results[0][0] is given[0][0] and results[2][1] is given[2][1]
    assert sum(decoder.routes_served.values()) == LAYERS * len(STEPS)
    assert decoder.captured == {}  # nothing captured on the CPU


def test_dcp_ranks_partials_merge_to_the_whole():
    """Two DCP ranks, one decoder each (as two processes would hold them) over their
    round-robin shards; the partials, merged by their LSEs, equal the whole problem
    computed by one rank holding every token."""
    problem = MLAProblem(num_heads=2, qlen=2, batch=4, kv_len=21, page_size=4,
                         q_dtype="fp16", kv_dtype="fp16", dcp_size=2)
    layers = _layers(problem, 2)
    _write_lengths(layers[0], torch.tensor([21, 0, 1, 6], dtype=torch.int32))
    ranks = [MLADecoder.load(_served(problem, num_layers=2, dcp_rank=r), device="cpu")
             for r in range(2)]
    parts = [_run_step(decoder, layers, r, {}) for r, decoder in enumerate(ranks)]
    for n, inputs in enumerate(layers):
        out, lse = combine([parts[r][n][0].float() for r in range(2)],
                           [parts[r][n][1] for r in range(2)])
        whole = replace(unsharded(inputs), sm_scale=SCALE)
        want_out, want_lse = reference.run(whole, torch.float64)
        accuracy = check(problem, out, want_out, lse, want_lse)
        assert accuracy.ok, f"layer {n}: {accuracy.reason} ({accuracy.summary})"
    assert all(sum(d.routes_served.values()) == 2 for d in ranks)


def test_the_plan_is_made_once_per_step(monkeypatch, tmp_path):
    """padded/triton's persistent schedule (a device plan), forced through the engine's own
    dispatcher: three layers, one plan launch a step, every layer right."""
    launches = []
    made = plan_kernels.persistent_plan_launcher

    def counting(*args, **kwargs):  # each plan launch noted as it runs
        launch = made(*args, **kwargs)
        return lambda: (launches.append(launch), launch())

    monkeypatch.setattr(plan_kernels, "persistent_plan_launcher", counting)
    problem = MLAProblem(num_heads=4, batch=3, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    dispatcher = _dispatcher(problem, "padded/triton", {**TILES, "persistent": True}, tmp_path)
    decoder = MLADecoder.load(_served(problem), device="cpu", dispatcher=dispatcher)
    layers = _layers(problem, LAYERS)
    made_at = 0  # the first step's plans: the steps are made (and planned) then
    for n, lens in enumerate(([40, 0, 13], [7, 40, 0], [0, 0, 39])):
        _write_lengths(layers[0], torch.tensor(lens, dtype=torch.int32))
        _assert_right(layers, _run_step(decoder, layers, 0, {}), f"lengths {lens}")
        if n == 0:
            made_at = len(launches)
        assert len(launches) - made_at == n, "one plan a step"
    steps = list(attention.plans_of(dispatcher).values())
    assert sum(s.planner is None for s in steps) == 1  # layer 0's; the others read it
    assert decoder.routes_served == {"padded/triton": 3 * LAYERS}
    assert decoder.summary() == ("mlatune (engine): forward calls by route: padded/triton 9 "
                                 "(graph replays are not counted)")


def test_forward_needs_a_step_and_a_qlen_the_model_declared():
    problem = MLAProblem(num_heads=4, batch=2, kv_len=8, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    decoder = MLADecoder.load(_served(problem), device="cpu")
    layer = _layers(problem, 1)[0]
    with pytest.raises(RuntimeError, match="before begin_step"):
        decoder.forward(layer.q, layer.shards[0].kv_cache)
    with pytest.raises(DecodeArgumentError, match=r"qlen: 2 is not one of 1\.\.1"):
        decoder.begin_step(layer.shards[0].block_table, layer.seq_lens, qlen=2, max_kv_len=8)


# --- refusal ------------------------------------------------------------------------------
def _model(**changes) -> ServedModel:
    base = ServedModel(num_heads=16, softmax_scale=SCALE, q_dtype=torch.float16,
                       kv_cache_dtype=torch.float16, page_size=64, num_layers=61)
    return replace(base, **changes)


SERVED = {
    "fp16": {},
    "fp8-cache": {"kv_cache_dtype": torch.float8_e4m3fn},
    "fp8-q-and-cache": {"q_dtype": torch.float8_e4m3fn, "kv_cache_dtype": torch.float8_e4m3fn},
    "few-heads-verify": {"num_heads": 4, "max_qlen": 4},
    "dcp2-verify": {"dcp_size": 2, "dcp_rank": 1, "max_qlen": 2},
    "page-1": {"page_size": 1},
    "numpy-scale": {"softmax_scale": numpy.float32(0.1)},  # as decode takes it
}
REFUSED = {
    "latent-256": ({"kv_lora_rank": 256}, "head dim 320 = 256 latent + 64 rope: mlatune "
                                          "serves MLA decode at 576 = 512 + 64 only"),
    "rope-32": ({"rope_dim": 32}, "head dim 544 = 512 latent + 32 rope"),
    "fp32-q": ({"q_dtype": torch.float32}, "q dtype torch.float32: mlatune serves bfloat16"),
    "uint8-cache": ({"kv_cache_dtype": torch.uint8}, "kv cache dtype torch.uint8"),
    "page-48": ({"page_size": 48}, "page_size must be a power of two, got 48"),
    "fp16-q-bf16-cache": ({"kv_cache_dtype": torch.bfloat16},
                          "q_dtype must equal kv_dtype for a 16-bit cache"),
    "fp8-q-16-bit-cache": ({"q_dtype": torch.float8_e4m3fn},
                           "q_dtype must equal kv_dtype for a 16-bit cache"),
    "fp8-formats-mixed": ({"q_dtype": torch.float8_e4m3fn,
                           "kv_cache_dtype": torch.float8_e4m3fnuz}, "mix fp8 formats"),
    "130-heads": ({"num_heads": 130}, "padded/triton: rule triton.padded.heads: 130 kernel "
                                      "heads"),
    "bf16-in-the-interpreter": ({"q_dtype": torch.bfloat16, "kv_cache_dtype": torch.bfloat16},
                                "the Triton interpreter computes bf16 dots wrongly"),
    "dcp-rank": ({"dcp_size": 2, "dcp_rank": 2}, "dcp rank 2 is not one of 0..1"),
    "dcp-size": ({"dcp_size": 0}, "dcp_size must be a positive integer, got 0"),
    "no-heads": ({"num_heads": 0}, "num_heads must be a positive integer, got 0"),
    "max-qlen": ({"max_qlen": 0}, "max_qlen must be a positive integer, got 0"),
    "scale": ({"softmax_scale": float("nan")}, "softmax scale must be finite, > 0"),
    "bool-scale": ({"softmax_scale": True}, "softmax scale must be a float, got bool"),
    "huge-scale": ({"softmax_scale": 1e39}, "softmax scale must be finite, > 0 and <= 1e+06"),
}


@pytest.mark.parametrize("changes", SERVED.values(), ids=SERVED)
def test_what_is_served(changes):
    assert refusal(_model(**changes)) is None


@pytest.mark.parametrize(("changes", "reason"), REFUSED.values(), ids=REFUSED)
def test_what_is_refused_and_why(changes, reason):
    said = refusal(_model(**changes))
    assert said is not None and reason in said, said


def test_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    said = refusal(_model())
    assert said.startswith("no mlatune route serves decode h16 q1 fp16/fp16 dcp1 p64 on ")
    assert "on the CPU set TRITON_INTERPRET=1" in said


def test_a_bad_accuracy_setting_is_the_reason(monkeypatch):
    monkeypatch.setenv("MLATUNE_ACCURACY", "sloppy")
    assert refusal(_model()).startswith("MLATUNE_ACCURACY: unknown accuracy policy 'sloppy'")


# --- the load ----------------------------------------------------------------------------
def test_one_rank_is_no_group():
    from types import SimpleNamespace

    from mlatune.integrations.core import rank_group

    assert rank_group(SimpleNamespace(cpu_group="tp", world_size=1)) is None
    assert rank_group(SimpleNamespace(cpu_group="tp", world_size=8)) == "tp"


def test_the_load_logs_one_line(caplog, monkeypatch):
    monkeypatch.setenv("MLATUNE_ACCURACY", "fp8-mma")
    with caplog.at_level(logging.INFO, logger="mlatune"):
        decoder = MLADecoder.load(_model(), device="cpu", engine="vllm")
    lines = [r.getMessage() for r in caplog.records if r.name == "mlatune"]
    assert lines == [f"mlatune: vllm MLA decode: table none (no table for this GPU: routes "
                     f"chosen by rule); GPU {cpu_device().name} (cpu); accuracy fp8-mma; "
                     f"61 layers plan once a step"]
    assert decoder.dispatcher.plan_calls == 61


def test_the_log_line_names_mlatune_table(caplog, monkeypatch, tmp_path):
    problem = MLAProblem(num_heads=16, q_dtype="fp16", kv_dtype="fp16")
    rows = [result_row(problem, "padded/triton", 5.0, device=cpu_device())]
    path = table.write(make_table(rows), tmp_path / "mine.parquet")
    monkeypatch.setenv("MLATUNE_TABLE", str(path))
    own = logging.getLogger("engine.attention")
    with caplog.at_level(logging.INFO, logger="engine.attention"):
        MLADecoder.load(_model(), device="cpu", engine="sglang", log=own)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "engine.attention"]
    assert f"table {path} (MLATUNE_TABLE), measured on {cpu_device().name}; " in line
    assert line.endswith("accuracy strict; 61 layers plan once a step")


def test_the_log_line_names_a_user_table_alone(caplog, monkeypatch, tmp_path):
    """No table ships for the CPU: the user's own serves alone, and the line says so."""
    problem = MLAProblem(num_heads=16, q_dtype="fp16", kv_dtype="fp16")
    path = table.write(make_table([result_row(problem, "padded/triton", 5.0,
                                              device=cpu_device())]), tmp_path / "user.parquet")
    monkeypatch.setenv("MLATUNE_USER_TABLE", str(path))
    with caplog.at_level(logging.INFO, logger="mlatune"):
        MLADecoder.load(_model(), device="cpu")
    assert f"table {path} (user table (MLATUNE_USER_TABLE), no bundled table for this GPU)" \
        in caplog.records[-1].getMessage()


def test_a_dispatcher_given_is_used_and_said(caplog, tmp_path):
    problem = MLAProblem(num_heads=4, batch=3, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    dispatcher = _dispatcher(problem, "padded/triton", TILES, tmp_path)
    with caplog.at_level(logging.INFO, logger="mlatune"):
        decoder = MLADecoder.load(_served(problem), device="cpu", dispatcher=dispatcher)
    assert decoder.dispatcher is dispatcher
    assert "(the engine's dispatcher)" in caplog.records[-1].getMessage()


def test_importing_mlatune_loads_no_integration_and_no_engine():
    assert "mlatune.integrations" not in _modules_after("import mlatune")
    assert not {"vllm", "sglang", "triton"} & _modules_after("import mlatune.integrations.core")


@pytest.mark.parametrize(("starts", "requests", "tokens", "qlen"), [
    ([0, 1, 2, 3], 3, 3, 1), ([0, 2, 4, 6, 9], 3, 6, 2), ([0, 4], 1, 4, 4),
    ([0, 1, 2, 3, 4, 4, 4], 6, 6, 1),  # two padded slots: length 0, their rows counted
    ([0, 2, 2], 2, 4, 2), ([0, 0, 0], 2, 4, 2),
    ([0, 0, 1, 2], 3, 3, 1)])  # an empty slot first: its rows are still its own
def test_a_steps_decodes_share_one_query_length(starts, requests, tokens, qlen):
    """Only the leading ``requests`` count (a prefill may follow them)."""
    assert uniform_qlen(starts, requests, tokens) == qlen


@pytest.mark.parametrize(("starts", "requests", "tokens"), [
    ([0, 1, 4], 2, 4),  # 1 and 3: the row count alone (4 = 2 x 2) would pass
    ([0, 2, 4, 5], 3, 5), ([0, 1, 2], 2, 3), ([0], 0, 0), ([0, 1], 2, 2),
    ([0, 1, 3, 4], 3, 3), ([0, 2, 3], 2, 4)])
def test_decodes_of_different_query_lengths_are_refused_by_name(starts, requests, tokens):
    with pytest.raises(ValueError, match=r"mlatune: .* not one query length each"):
        uniform_qlen(starts, requests, tokens)
