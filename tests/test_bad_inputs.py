"""Bad calls an engine can make, on the CPU: each is one DecodeArgumentError (or
SettingError) naming the argument or variable, or is served correctly; never a crash,
NaN or silently wrong numbers. docs/faults.md keeps the table of what each gives.
The GPU side (checks when a step is made, MLATUNE_CHECK per call, inside a capture):
tests/test_bad_inputs_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from mlatune import attention
from mlatune.arch import cpu_device
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs, poison_
from mlatune.dispatch import Dispatcher
from mlatune.errors import DecodeArgumentError, SettingError
from mlatune.problem import DTYPES, MLAProblem
from tests.helpers import expected_now

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                     kv_dtype="fp16")


def call_args(problem: MLAProblem = PROBLEM, seed: int = 21) -> tuple:
    """(inputs, decode's keyword arguments) for rank 0, with a rules-only CPU dispatcher."""
    inputs = make_decode_inputs(problem, seed=seed, ragged=True)
    shard = inputs.shards[0]
    return inputs, dict(q=inputs.q, kv_cache=shard.kv_cache, block_table=shard.block_table,
                        seq_lens=inputs.seq_lens, kv_scale=inputs.kv_scale,
                        q_scale=inputs.q_scale, num_heads=problem.num_heads,
                        qlen=problem.qlen, max_kv_len=problem.kv_len,
                        dispatcher=Dispatcher.rules_only(cpu_device()))


def held(args: dict, **extra) -> attention.DecodeStep:
    return attention.prepare_decode(**args, **extra)


# A held step checks the length values on every call where they are free to read ---------

def _page(value: int):
    def corrupt(args):
        args["block_table"][1, 0] = value
    return corrupt


def _length(value: int):
    def corrupt(args):
        args["seq_lens"][0] = value
    return corrupt


@pytest.mark.parametrize(("corrupt", "message"), [
    (_page(2**31 - 1), r"^block_table: request 1 uses page id 2147483647 at position 0"),
    (_page(-1), r"^block_table: request 1 uses page id -1"),
    (_page(10_000), r"^block_table: request 1 uses page id 10000"),
    (_length(10_000), r"^seq_lens: request 0 has length 10000, more than block_table's"),
    (_length(-1), r"^seq_lens: request 0 has length -1"),
], ids=["page-2**31-1", "negative-page", "page-past-cache", "length-past-table",
        "negative-length"])
def test_a_held_step_refuses_values_rewritten_in_place(corrupt, message):
    """The values were fine when the step was made; rewritten in place (as an engine does
    every step) they are checked again at the call, before any kernel reads them (the
    interpreter crashed on page 2**31-1; a length past the table gave wrong numbers, a
    negative page NaN). The out buffer is left as it was."""
    inputs, args = call_args()
    step = held(args)
    out = step()
    assert check(PROBLEM, out, expected_now(inputs)[0]).ok
    poison_(out)
    corrupt(args)
    with pytest.raises(DecodeArgumentError, match=message):
        step()
    assert torch.isnan(out).all()  # nothing ran
    with pytest.raises(DecodeArgumentError, match=message):  # decode's own step too
        attention.decode(**args)


def test_a_held_step_serves_again_once_the_values_are_good():
    inputs, args = call_args()
    step = held(args)
    args["seq_lens"][0] = 10_000
    with pytest.raises(DecodeArgumentError):
        step()
    args["seq_lens"].copy_(torch.tensor([17, 0], dtype=torch.int32))
    out = step()
    assert check(PROBLEM, out, expected_now(inputs)[0]).ok
    assert (out[1] == 0).all()  # the empty request


@pytest.mark.parametrize("grown", ["q", "block_table", "seq_lens", "all"])
def test_a_held_step_refuses_tensors_resized_in_place(grown):
    """An engine that grows its batch with resize_ gets an error naming the cause, not the
    old batch's output with the new requests never computed."""
    _, args = call_args()
    step = held(args)
    poison_(step())
    batch = args["seq_lens"].shape[0]
    for name in ("q", "block_table", "seq_lens") if grown == "all" else (grown, ):
        tensor = args[name]
        tensor.resize_((tensor.shape[0] // batch * (batch + 1), *tensor.shape[1:]))
    named = "q, block_table, seq_lens" if grown == "all" else grown
    with pytest.raises(DecodeArgumentError,
                       match=f"^{named}: a held decode step's tensors were resized or moved"):
        step()


def test_a_held_steps_out_resized_is_named():
    _, args = call_args()
    out = torch.empty(PROBLEM.batch * PROBLEM.qlen, PROBLEM.num_heads, 512,
                      dtype=DTYPES[PROBLEM.out_dtype])
    step = held(args, out=out)
    step()
    out.resize_(1, PROBLEM.num_heads, 512)
    with pytest.raises(DecodeArgumentError, match=r"^out: a held decode step's tensors"):
        step()


# Outputs that overlap an input --------------------------------------------------------

def _views_of(args: dict, name: str, shape: tuple, dtype: torch.dtype,
              offset: int = 0) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` laid over ``args[name]``'s bytes from ``offset``."""
    raw = args[name].view(-1).view(torch.uint8)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return raw[offset:offset + nbytes].view(dtype).view(shape)


@pytest.mark.parametrize(("arg", "over", "offset"), [
    ("out", "q", 0), ("out", "q", 64), ("out", "kv_cache", 128), ("lse_out", "q", 0),
    ("lse_out", "kv_cache", 4), ("out", "seq_lens", 0), ("lse_out", "block_table", 0)])
@pytest.mark.parametrize("entry", ["decode", "prepare_decode"])
def test_an_output_over_an_input_is_refused(arg, over, offset, entry):
    _, args = call_args()
    rows, heads = args["q"].shape[:2]
    shapes = {"out": ((rows, heads, PROBLEM.kv_lora_rank), torch.float16),
              "lse_out": ((rows, heads), torch.float32)}
    shape, dtype = shapes[arg]
    if over in ("seq_lens", "block_table"):  # too small to hold an output: a bigger one
        big = torch.zeros(2 * torch.Size(shape).numel(), dtype=dtype)
        args[over] = big.view(torch.int32)[:args[over].numel()].view(args[over].shape)
        args[over].copy_(call_args()[1][over])
        buffer = big[:torch.Size(shape).numel()].view(shape)
    else:
        buffer = _views_of(args, over, shape, dtype, offset)
    args[arg] = buffer
    call = attention.decode if entry == "decode" else attention.prepare_decode
    with pytest.raises(DecodeArgumentError, match=rf"^{arg}: shares memory with {over} "):
        call(**args)


def test_out_over_lse_out_is_refused_and_disjoint_parts_of_one_buffer_serve():
    """out (fp16) and lse_out (fp32) carved from one NaN-filled buffer: apart they serve,
    out running 8 elements into lse_out is refused."""
    inputs, args = call_args()
    rows, heads = args["q"].shape[:2]
    shape = (rows, heads, PROBLEM.kv_lora_rank)
    n_out = torch.Size(shape).numel()
    pool = torch.full((2 * n_out + 2 * rows * heads,), float("nan"), dtype=torch.float16)
    lse_out = pool[2 * n_out:].view(torch.float32).view(rows, heads)
    into_lse = pool[n_out + 8:2 * n_out + 8].view(shape)
    with pytest.raises(DecodeArgumentError, match=r"^out: shares memory with lse_out "):
        attention.decode(**args, out=into_lse, lse_out=lse_out)
    apart = pool[n_out:2 * n_out].view(shape)  # ends where lse_out starts
    out, lse = attention.decode(**args, out=apart, lse_out=lse_out)
    assert out.data_ptr() == apart.data_ptr() and lse.data_ptr() == lse_out.data_ptr()
    want_out, want_lse = expected_now(inputs)
    assert check(PROBLEM, out, want_out, lse, want_lse).ok
    assert torch.isnan(pool[:n_out]).all()  # nothing written outside the two


# Arguments of foreign types -----------------------------------------------------------

@pytest.mark.parametrize(("arg", "value", "message"), [
    ("q", [[1.0]], r"^q: must be a torch.Tensor, got list"),
    ("kv_cache", None, r"^kv_cache: must be a torch.Tensor, got NoneType"),
    ("block_table", ((0,),), r"^block_table: must be a torch.Tensor, got tuple"),
    ("seq_lens", [40, 40], r"^seq_lens: must be a torch.Tensor, got list"),
    ("out", [0.0], r"^out: must be a torch.Tensor or None, got list"),
    ("kv_scale", 1.0, r"^kv_scale: must be a torch.Tensor or None, got float"),
    ("num_heads", [4], r"^num_heads: must be an int, got \[4\]"),
    ("qlen", "1", r"^qlen: must be an int, got '1'"),
    ("dispatcher", "bundled", r"^dispatcher: must be a mlatune.dispatch.Dispatcher or None, "
                              r"got str"),
    ("dispatcher", object(), r"^dispatcher: .* got object"),
    ("max_kv_len", "40", r"^max_kv_len: must be an int or None, got '40'"),
    ("max_kv_len", -1, r"^max_kv_len: must be >= 0"),
    ("max_kv_len", 2**40, r"^max_kv_len: must be at most 2\*\*30"),
    ("causal", None, r"^causal: must be a bool, got None"),
    ("causal", numpy.bool_(True), r"^causal: must be a bool, got np.True_ of .*numpy"),
    ("causal", 1, r"^causal: must be a bool, got 1"),
    ("softmax_scale", 1e39, r"^softmax_scale: must be finite, > 0 and <= 1e\+06, got 1e\+39"),
    ("softmax_scale", True, r"^softmax_scale: must be a float or None, got bool"),
    ("return_lse", "yes", r"^return_lse: must be a bool, got 'yes'"),
])
@pytest.mark.parametrize("capturable", [None, False])
def test_arguments_of_foreign_types_are_named(arg, value, message, capturable):
    _, args = call_args()
    args[arg] = value
    with pytest.raises(DecodeArgumentError, match=message):
        attention.decode(**args, capturable=capturable)
    if arg != "max_kv_len" or value != -1:  # (prepare_decode's check of it: the same)
        if arg == "max_kv_len":  # prepare_decode's is not optional
            message = message.replace(" or None", "")
        with pytest.raises(DecodeArgumentError, match=message):
            attention.prepare_decode(**args)


@pytest.mark.parametrize(("arg", "value", "message"), [
    ("num_heads", 4.0, r"^num_heads: must be an int, got 4.0"),
    ("causal", 1, r"^causal: must be a bool, got 1"),
    ("qlen", True, r"^qlen: must be an int, got True"),
    ("softmax_scale", True, r"^softmax_scale: must be a float or None, got bool"),
    ("capturable", "no", r"^capturable: must be a bool or None, got 'no'"),
    ("reuse_plan", "False", r"^reuse_plan: must be a bool, got 'False'"),
])
def test_an_option_equal_to_a_held_steps_is_still_checked(arg, value, message):
    """A held step is found by its options, and 4.0 == 4, 1 == True: the same call after a
    good one is refused as on a fresh dispatcher, never served by the held step."""
    _, args = call_args()
    attention.decode(**args, softmax_scale=1, capturable=False)  # a step held for these
    good = {"num_heads": args["num_heads"], "causal": True, "qlen": 1, "softmax_scale": 1,
            "capturable": False, "reuse_plan": False}
    with pytest.raises(DecodeArgumentError, match=message):
        attention.decode(**{**args, **good, arg: value})
    if arg != "reuse_plan":
        with pytest.raises(DecodeArgumentError, match=message):
            attention.prepare_decode(**_prepare_args(args, good, arg, value))


def _prepare_args(args: dict, good: dict, arg: str, value: object) -> dict:
    """``prepare_decode``'s arguments: ``decode``'s less ``reuse_plan``."""
    given = {**args, **good, arg: value}
    given.pop("reuse_plan")
    return given


@pytest.mark.parametrize("scale", [numpy.float32(0.07), numpy.float64(0.07), 0.07])
def test_a_numpy_softmax_scale_serves_as_its_float(scale):
    """A real of another type (a numpy scalar, as a config loader gives) is the same scale."""
    _, args = call_args()
    want = attention.decode(**args, softmax_scale=0.07).clone()
    got = attention.decode(**args, softmax_scale=scale)
    assert torch.equal(got, want)
    assert torch.equal(attention.prepare_decode(**args, softmax_scale=scale)(), want)
    assert not torch.equal(want, attention.decode(**args))  # the scale made a difference


def test_torch_compile_names_a_q_of_a_dtype_decode_refuses():
    """Compiled, a float32 q is refused by name, as eager refuses it (not a KeyError in the
    traced wrapper that allocates out)."""
    _, args = call_args()
    dispatcher = args.pop("dispatcher")

    def attend(q, kv_cache, block_table, seq_lens):
        return attention.decode(q, kv_cache, block_table, seq_lens, dispatcher=dispatcher,
                                **{k: v for k, v in args.items() if k not in
                                   ("q", "kv_cache", "block_table", "seq_lens")})

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    with pytest.raises(DecodeArgumentError, match=r"^q: dtype float32 is not one of"):
        compiled(args["q"].float(), args["kv_cache"], args["block_table"], args["seq_lens"])


def test_reuse_plan_names_a_layer_whose_max_kv_len_needs_another_step():
    _, args = call_args()
    attention.decode(**args)
    with pytest.raises(DecodeArgumentError, match=r"^reuse_plan: the step's planning call .* "
                                                  r"pass every layer of a step the same "
                                                  r"max_kv_len"):
        attention.decode(**{**args, "max_kv_len": 2 * args["max_kv_len"] + 1},
                         reuse_plan=True)


def test_prepare_decode_asks_for_max_kv_len():
    _, args = call_args()
    with pytest.raises(DecodeArgumentError, match=r"^max_kv_len: must be an int, got None"):
        attention.prepare_decode(**{**args, "max_kv_len": None})


def test_plan_from_must_be_a_held_step():
    _, args = call_args()
    with pytest.raises(DecodeArgumentError, match=r"^plan_from: must be a step prepare_decode "
                                                  r"returned, or None, got dict"):
        attention.prepare_decode(**args, plan_from={})


def test_plan_from_refuses_lengths_or_a_table_it_would_not_read():
    """A layer's step made with plan_from reads the planner's lengths and block table: other
    tensors (other values, or a copy) are refused by name, never silently replaced."""
    _, args = call_args()
    first = held(args)
    other_lens = args["seq_lens"].clone()
    other_table = args["block_table"].clone()
    for name, tensor in (("seq_lens", other_lens), ("block_table", other_table)):
        with pytest.raises(DecodeArgumentError, match=rf"^{name}: plan_from's step reads its "
                                                      rf"own {name}"):
            attention.prepare_decode(**{**args, name: tensor}, plan_from=first)
    layer = attention.prepare_decode(**args, plan_from=first)  # the planner's own tensors
    assert layer.route.id == first.route.id
    with pytest.raises(DecodeArgumentError, match=r"^plan_from was made for"):
        attention.prepare_decode(**args, plan_from=first, return_lse=True)


def test_foreign_types_are_named_on_a_step_already_made():
    """The same tensors served once (a step held for them), then a bad call."""
    _, args = call_args()
    attention.decode(**args)
    with pytest.raises(DecodeArgumentError, match=r"^num_heads: must be an int"):
        attention.decode(**{**args, "num_heads": [4]})
    with pytest.raises(DecodeArgumentError, match=r"^seq_lens: must be a torch.Tensor"):
        attention.decode(**{**args, "seq_lens": args["seq_lens"].tolist(), "max_kv_len": None})


# Environment variables ----------------------------------------------------------------

@pytest.mark.parametrize("value", ["maybe", "2", "enable", "tru", " -1"])
def test_a_bad_mlatune_check_is_refused_at_every_call(monkeypatch, value):
    _, args = call_args()
    step = held(args)
    monkeypatch.setenv("MLATUNE_CHECK", value)
    with pytest.raises(SettingError, match=r"^MLATUNE_CHECK: .* is neither on \(1, true"):
        step()
    with pytest.raises(SettingError, match=r"^MLATUNE_CHECK: "):
        attention.decode(**args)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          timeout=300)


def test_a_plugin_that_does_not_import_is_named_not_blamed_on_a_table():
    code = ("from mlatune.cli import app\n"
            "app(['lookup', '--heads', '16', '--batch', '4', '--kv-len', '2048', "
            "'--arch', 'sm_90'])\n")
    done = _python(code, MLATUNE_PLUGINS="tests.fault_routes, no_such.plugin")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert lines == ["error: MLATUNE_PLUGINS: plugin module 'no_such.plugin' does not import "
                     "(ModuleNotFoundError: No module named 'no_such')"]
    engine = _python("import mlatune.attention", MLATUNE_PLUGINS="no_such.plugin")
    assert engine.returncode == 1
    assert engine.stderr.strip().splitlines()[-1].startswith(
        "mlatune.errors.SettingError: MLATUNE_PLUGINS: plugin module 'no_such.plugin'")
    # An engine that caught it and imports again hears the same cause, not a duplicate id.
    again = _python("from mlatune.errors import SettingError\n"
                    "for _ in range(2):\n"
                    "    try:\n"
                    "        import mlatune.attention\n"
                    "    except SettingError as exc:\n"
                    "        print(exc)\n", MLATUNE_PLUGINS="no_such.plugin")
    assert again.stdout.splitlines() == [
        "MLATUNE_PLUGINS: plugin module 'no_such.plugin' does not import "
        "(ModuleNotFoundError: No module named 'no_such')"] * 2, again.stdout + again.stderr


def test_reuse_plan_over_another_cache_dtype_names_reuse_plan():
    """The layers of a step share one plan; a layer over a cache of another dtype cannot
    read it, and the error says so in decode's words (no plan_from, which decode lacks)."""
    _, args = call_args()
    attention.decode(**args)  # the step's planning call
    fp8 = make_decode_inputs(PROBLEM.with_(kv_dtype="fp8_e4m3fn"), seed=3, ragged=True)
    with pytest.raises(DecodeArgumentError,
                       match=r"^reuse_plan: the step's planning call was made for .*"
                             r"kv_dtype=fp16.*; this call is .*kv_dtype=fp8_e4m3fn"):
        attention.decode(**{**args, "kv_cache": fp8.shards[0].kv_cache,
                            "kv_scale": fp8.kv_scale}, reuse_plan=True)
