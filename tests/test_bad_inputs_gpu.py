"""Bad length values on a real GPU (``pytest -m gpu``): where each is caught, and that no
check reads a CUDA tensor inside a graph capture.

On CUDA tensors a read of the values is a host sync, so ``decode`` checks them when it
makes a step (outside a capture: once per tensor set) and at every call only with
``MLATUNE_CHECK`` on. Here: a bad page id or length is refused by name at the call that
makes the step, and the CUDA context stays usable; a step made with good values and then
given bad ones in place is refused per call under ``MLATUNE_CHECK=1``; a capture with
``MLATUNE_CHECK=1`` reads nothing (it would fail the capture) and its replays match the
reference; an out= over q is refused on the GPU too. The bundled dispatcher serves.
"""

from __future__ import annotations

import pytest
import torch

from mlatune import attention, runtime_checks
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs, poison_
from mlatune.dispatch import Dispatcher
from mlatune.errors import DecodeArgumentError
from mlatune.problem import MLAProblem
from tests.helpers import expected_now

pytestmark = pytest.mark.gpu
PROBLEM = MLAProblem(num_heads=16, batch=4, kv_len=1024, page_size=64, q_dtype="bf16",
                     kv_dtype="bf16")


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not torch.cuda.is_available():  # fail, not skip: -m gpu without a GPU is no pass
        pytest.fail("GPU tests need a GPU: run them on the device machine")


@pytest.fixture(scope="module")
def dispatcher() -> Dispatcher:
    return Dispatcher.from_bundled(capturable=True)


def _args(dispatcher: Dispatcher, seed: int = 3) -> tuple:
    """Pages for kv_len tokens a request (the block table's capacity, so that lengths may grow
    in place as an engine's do), the lengths ragged below it."""
    inputs = make_decode_inputs(PROBLEM, seed=seed, device="cuda")
    gen = torch.Generator().manual_seed(seed)
    inputs.seq_lens.copy_(torch.randint(1, PROBLEM.kv_len + 1, (PROBLEM.batch,), generator=gen))
    shard = inputs.shards[0]
    rows, heads = inputs.q.shape[:2]
    out = torch.empty(rows, heads, PROBLEM.d_v, dtype=torch.bfloat16, device="cuda")
    return inputs, dict(q=inputs.q, kv_cache=shard.kv_cache, block_table=shard.block_table,
                        seq_lens=inputs.seq_lens, num_heads=PROBLEM.num_heads, out=out,
                        max_kv_len=PROBLEM.kv_len, capturable=True, dispatcher=dispatcher)


@pytest.mark.parametrize(("where", "value", "message"), [
    ("page", 2**31 - 1, r"^block_table: request 2 uses page id 2147483647"),
    ("page", -1, r"^block_table: request 2 uses page id -1"),
    ("length", 10**6, r"^seq_lens: request 2 has length 1000000"),
    ("length", -5, r"^seq_lens: request 2 has length -5"),
])
def test_bad_values_are_refused_when_the_step_is_made(dispatcher, where, value, message):
    _, args = _args(dispatcher)
    if where == "page":
        args["block_table"][2, 0] = value
    else:
        args["seq_lens"][2] = value
    with pytest.raises(DecodeArgumentError, match=message):
        attention.decode(**args)
    with pytest.raises(DecodeArgumentError, match=message):
        attention.prepare_decode(**args)
    torch.cuda.synchronize()  # nothing ran: the context is fine


def test_values_rewritten_in_place_are_refused_per_call_under_mlatune_check(dispatcher,
                                                                            monkeypatch):
    inputs, args = _args(dispatcher, seed=4)
    attention.decode(**args)  # the step, made with good values
    step = attention.prepare_decode(**args)
    args["seq_lens"][1] = 10**6
    monkeypatch.setenv("MLATUNE_CHECK", "1")
    with pytest.raises(DecodeArgumentError, match=r"^seq_lens: request 1 has length"):
        attention.decode(**args)
    with pytest.raises(DecodeArgumentError, match=r"^seq_lens: request 1 has length"):
        step()
    args["seq_lens"][1] = 700
    poison_(args["out"])
    out = attention.decode(**args)
    assert check(PROBLEM, out, expected_now(inputs)[0]).ok


def test_a_capture_under_mlatune_check_reads_no_values(dispatcher, monkeypatch):
    monkeypatch.setenv("MLATUNE_CHECK", "1")
    inputs, args = _args(dispatcher, seed=5)
    lens = inputs.seq_lens
    assert runtime_checks.values_readable(lens)
    attention.decode(**args)  # eager: makes the step, checks the values (a sync, allowed)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert not runtime_checks.values_readable(lens)
        attention.decode(**args)
    for new in ([1024, 1, 0, 513], [64, 65, 1000, 2]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        poison_(args["out"])
        graph.replay()
        torch.cuda.synchronize()
        want = expected_now(inputs)[0].to(args["out"].device)
        live = lens > 0
        assert check(PROBLEM, args["out"][live], want[live]).ok, new
        assert (args["out"][~live] == 0).all(), new


def test_an_output_over_q_is_refused_on_the_gpu(dispatcher):
    _, args = _args(dispatcher, seed=6)
    rows, heads = args["q"].shape[:2]
    args["out"] = args["q"][..., :PROBLEM.d_v]  # the latent part of q, in place
    with pytest.raises(DecodeArgumentError, match=r"^out: shares memory with q "):
        attention.decode(**args)
    assert args["out"].shape == (rows, heads, PROBLEM.d_v)
