import pytest
import torch

from mlatune import attention, routes, table
from mlatune.arch import cpu_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import DecodeInputs, KVShard, make_decode_inputs, poison_, shard_lengths
from mlatune.dispatch import Dispatcher
from mlatune.lse import combine
from mlatune.problem import MLAProblem
from tests.helpers import expected_now
from tests.table_helpers import FakeRoute, make_table, result_row

PROBLEMS = [
    MLAProblem(num_heads=4, qlen=1, batch=3, kv_len=40, page_size=8, q_dtype="fp16",
               kv_dtype="fp16"),
    MLAProblem(num_heads=2, qlen=3, batch=2, kv_len=37, page_size=4, kv_dtype="fp8_e4m3fn",
               dcp_size=4),
    MLAProblem(num_heads=2, qlen=2, batch=2, kv_len=30, page_size=1, causal=False,
               q_dtype="fp8_e4m3fnuz", kv_dtype="fp8_e4m3fnuz", dcp_size=2),
]


def run_ranks(inputs: DecodeInputs, dispatcher, **overrides):
    """decode() on every DCP rank from the caller's tensors, merged as an engine would."""
    p = inputs.problem
    outs, lses = [], []
    for shard in inputs.shards:
        out, lse = attention.decode(
            inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
            num_heads=p.num_heads, qlen=p.qlen, causal=p.causal, kv_scale=inputs.kv_scale,
            q_scale=inputs.q_scale, dcp_rank=shard.rank, dcp_size=p.dcp_size,
            kv_lora_rank=p.kv_lora_rank, return_lse=True, dispatcher=dispatcher, **overrides)
        outs.append(out.float().clone())
        lses.append(lse.clone())
    return combine(outs, lses) if len(outs) > 1 else (outs[0], lses[0])


@pytest.mark.parametrize("problem", PROBLEMS, ids=["decode-fp16", "verify-fp8kv-dcp4",
                                                   "noncausal-fp8-dcp2"])
def test_decode_matches_the_reference(problem):
    inputs = make_decode_inputs(problem, seed=5, ragged=True)
    dispatcher = Dispatcher.rules_only(cpu_device())
    out, lse = run_ranks(inputs, dispatcher)
    want_out, want_lse = reference.run(inputs, torch.float64)
    accuracy = check(problem, out, want_out, lse, want_lse)
    assert accuracy.ok, accuracy.reason


def test_a_four_dimensional_cache_and_out_only():
    problem = PROBLEMS[0]
    inputs = make_decode_inputs(problem, seed=1)
    shard = inputs.shards[0]
    out = attention.decode(inputs.q, shard.kv_cache.unsqueeze(2), shard.block_table,
                           inputs.seq_lens, num_heads=problem.num_heads,
                           max_kv_len=problem.kv_len,
                           dispatcher=Dispatcher.rules_only(cpu_device()))
    assert isinstance(out, torch.Tensor)
    assert check(problem, out, reference.run(inputs, torch.float64)[0]).ok


def test_plans_are_cached_and_follow_new_lengths_in_place(tmp_path):
    problem = PROBLEMS[1]  # dcp 4: each rank derives its share of the lengths per call
    recorder = FakeRoute("recording/fake")
    routes.register(recorder)
    try:
        rows = [result_row(problem, "recording/fake", 1.0, device=cpu_device(),
                           params={"splits": 2}),
                result_row(problem, "reference/torch", 9.0, device=cpu_device())]
        path = table.write(make_table(rows), tmp_path / "cpu.parquet")
        dispatcher = Dispatcher.load(path, device=cpu_device())
        inputs = make_decode_inputs(problem, seed=2)
        first, _ = run_ranks(inputs, dispatcher, max_kv_len=problem.kv_len)
        assert len(recorder.prepared) == problem.dcp_size  # one plan per rank
        assert {tuple(sorted(p.items())) for _, p in recorder.prepared} == {(("splits", 2),)}
        plans = attention.plans_of(dispatcher)
        assert len(plans) == problem.dcp_size
        assert all(plan.choice.source == "table" for plan in plans.values())

        # Shorter requests, written into the same tensor: no new plan, new answer.
        inputs.seq_lens.copy_(torch.tensor([problem.qlen + 5, 20], dtype=torch.int32))
        again, lse = run_ranks(inputs, dispatcher, max_kv_len=problem.kv_len)
        assert len(recorder.prepared) == problem.dcp_size and len(plans) == problem.dcp_size
        shards = tuple(KVShard(s.rank, s.kv_cache, s.block_table,
                               shard_lengths(inputs.seq_lens, s.rank, problem.dcp_size))
                       for s in inputs.shards)
        shorter = DecodeInputs(problem, inputs.q, inputs.q_scale, inputs.kv_scale,
                               inputs.seq_lens, shards)
        want_out, want_lse = reference.run(shorter, torch.float64)
        assert check(problem, again, want_out, lse, want_lse).ok
        assert not torch.allclose(first, again)
    finally:
        routes.unregister("recording/fake")


def test_the_returned_buffer_is_the_plans_own():
    problem = PROBLEMS[0]
    inputs = make_decode_inputs(problem, seed=3)
    shard = inputs.shards[0]
    dispatcher = Dispatcher.rules_only(cpu_device())

    def call():
        return attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                                num_heads=problem.num_heads, max_kv_len=problem.kv_len,
                                dispatcher=dispatcher)

    assert call() is call()


@pytest.mark.parametrize(("change", "message"), [
    (dict(num_heads=3), "^q: must be"),
    (dict(qlen=2), "^q: must be"),
    (dict(dcp_rank=4, dcp_size=4, num_heads=1), r"^dcp_rank: .*4"),
])
def test_inconsistent_arguments_are_refused(change, message):
    problem = PROBLEMS[0]
    inputs = make_decode_inputs(problem, seed=4)
    shard = inputs.shards[0]
    kwargs = dict(num_heads=problem.num_heads, dispatcher=Dispatcher.rules_only(cpu_device()))
    with pytest.raises(ValueError, match=message):
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         **{**kwargs, **change})


# --- plans whose schedules read the lengths; DCP first calls; LSE on demand -------------
PERSISTENT = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1,
              "persistent": True, "num_workers": 3}
SEGMENTED = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1,
             "num_segments": 2}


def forced(problem: MLAProblem, route_id: str, params: dict, tmp_path) -> Dispatcher:
    """A dispatcher whose table makes ``route_id`` with ``params`` win ``problem``."""
    rows = [result_row(problem, route_id, 1.0, device=cpu_device(), params=params),
            result_row(problem, "reference/torch", 9.0, device=cpu_device())]
    return Dispatcher.load(table.write(make_table(rows), tmp_path / "cpu.parquet"),
                           device=cpu_device())


def assert_matches_reference(inputs: DecodeInputs, dispatcher, **overrides):
    out, lse = run_ranks(inputs, dispatcher, **overrides)
    want_out, want_lse = expected_now(inputs)
    accuracy = check(inputs.problem, out, want_out, lse, want_lse)
    assert accuracy.ok, accuracy.reason


@pytest.mark.parametrize(("problem", "route_id", "params"), [
    (MLAProblem(num_heads=4, qlen=1, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                kv_dtype="fp16"), "padded/triton", PERSISTENT),
    (MLAProblem(num_heads=2, qlen=2, batch=2, kv_len=40, page_size=4, q_dtype="fp16",
                kv_dtype="fp16", dcp_size=2), "segmented/triton", SEGMENTED),
], ids=["padded-persistent", "segmented-dcp2-verify"])
def test_lengths_changed_in_place_are_followed(problem, route_id, params, tmp_path):
    """Routes that plan from the length contents re-plan when an engine rewrites them."""
    dispatcher = forced(problem, route_id, params, tmp_path)
    inputs = make_decode_inputs(problem, seed=6)  # pages for kv_len tokens per request
    inputs.seq_lens.copy_(torch.tensor([9, problem.kv_len], dtype=torch.int32))
    assert_matches_reference(inputs, dispatcher, max_kv_len=problem.kv_len)
    plans = attention.plans_of(dispatcher)
    assert {(p.choice.route_id, p.prepared.plan_reads_lengths) for p in plans.values()} \
        == {(route_id, True)}
    assert attention.last_step(dispatcher) in plans.values()  # the last rank's call's step
    assert attention.last_step(dispatcher).route.id == route_id
    # The first request grows and the second shrinks; the max stays where it was.
    inputs.seq_lens.copy_(torch.tensor([problem.kv_len, 23], dtype=torch.int32))
    assert_matches_reference(inputs, dispatcher, max_kv_len=problem.kv_len)
    assert len(plans) == problem.dcp_size


def test_the_first_dcp_call_plans_from_this_ranks_lengths(tmp_path, monkeypatch):
    problem = MLAProblem(num_heads=4, qlen=1, batch=3, kv_len=40, page_size=8,
                         q_dtype="fp16", kv_dtype="fp16", dcp_size=2)
    dispatcher = forced(problem, "padded/triton", PERSISTENT, tmp_path)
    inputs = make_decode_inputs(problem, seed=7, ragged=True)
    # Uninitialised tensors come poisoned (NaN, or 0 for integers: a request without keys
    # gets no work): the allocator may hand back a freed block that holds the right
    # lengths by chance, and a plan made from unfilled lengths must not pass.
    empty_like = torch.empty_like

    def poisoned(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else 0)

    monkeypatch.setattr(torch, "empty_like", poisoned)
    assert_matches_reference(inputs, dispatcher)


def test_a_growing_max_kv_len_reuses_the_plan_until_it_doubles(tmp_path):
    problem = MLAProblem(num_heads=4, qlen=1, batch=2, kv_len=72, page_size=8,
                         q_dtype="fp16", kv_dtype="fp16")
    recorder = FakeRoute("recording/fake")
    routes.register(recorder)
    try:
        dispatcher = forced(problem, "recording/fake", {}, tmp_path)
        inputs = make_decode_inputs(problem, seed=8)  # pages for 72 tokens per request
        for step, length in enumerate((33, 34, 50, 64)):  # one engine step per length
            inputs.seq_lens.copy_(torch.tensor([length - 7, length], dtype=torch.int32))
            assert_matches_reference(inputs, dispatcher, max_kv_len=length)
            assert len(recorder.prepared) == 1, f"re-planned at step {step}"
        assert recorder.prepared[0][0].kv_len == 64  # prepared for the power of two
        # Past the power of two above the first max: a new plan, for the same tensors.
        inputs.seq_lens.copy_(torch.tensor([20, 65], dtype=torch.int32))
        assert_matches_reference(inputs, dispatcher, max_kv_len=65)
        assert [p.kv_len for p, _ in recorder.prepared] == [64, 128]
        assert len(attention.plans_of(dispatcher)) == 1
    finally:
        routes.unregister("recording/fake")


class NoLseRoute(FakeRoute):
    """Computes like the reference but returns no LSE (as AITER's Gluon decode does)."""

    def prepare(self, problem, inputs, *, rank=0, params=None, want_lse=True):
        prepared = super().prepare(problem, inputs, rank=rank, params=params, want_lse=False)
        prepared.lse = None
        return prepared


def test_return_lse_passes_over_routes_that_give_none(tmp_path):
    problem = PROBLEMS[0]
    no_lse = NoLseRoute("nolse/fake")
    routes.register(no_lse)
    try:
        dispatcher = forced(problem, "nolse/fake", {}, tmp_path)
        inputs = make_decode_inputs(problem, seed=9, ragged=True)
        assert_matches_reference(inputs, dispatcher, max_kv_len=problem.kv_len)
        (plan,) = attention.plans_of(dispatcher).values()
        assert plan.choice.route_id != "nolse/fake" and plan.prepared.lse is not None
        # Without return_lse the table's winner serves.
        shard = inputs.shards[0]
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=problem.num_heads, dispatcher=dispatcher)
        assert len(no_lse.prepared) == 2
        assert {p.choice.route_id for p in attention.plans_of(dispatcher).values()} \
            == {"nolse/fake", plan.choice.route_id}
    finally:
        routes.unregister("nolse/fake")


# --- what an engine passes: its scale, its buffers, torch.compile, capturability ---------
def test_the_callers_softmax_scale_is_used():
    problem = PROBLEMS[0]
    inputs = make_decode_inputs(problem, seed=10, ragged=True)
    shard = inputs.shards[0]
    dispatcher = Dispatcher.rules_only(cpu_device())
    scale = 0.3 * problem.softmax_scale  # as a YaRN mscale would change it
    out, lse = attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                                num_heads=problem.num_heads, softmax_scale=scale,
                                return_lse=True, dispatcher=dispatcher)
    scaled = DecodeInputs(problem, inputs.q, inputs.q_scale, inputs.kv_scale, inputs.seq_lens,
                          inputs.shards, sm_scale=scale)
    want_out, want_lse = reference.run(scaled, torch.float64)
    assert check(problem, out, want_out, lse, want_lse).ok
    default_out, _ = reference.run(inputs, torch.float64)
    assert not check(problem, out, default_out).ok  # the scale made a difference


@pytest.mark.parametrize("given", ["both", "lse_out"])
@pytest.mark.parametrize("route_id", ["padded/triton", "recording/fake"])
def test_out_and_lse_out_are_the_callers(route_id, given, tmp_path):
    """A route that writes into the caller's buffers, and one whose result is copied there;
    lse_out= filled with or without out=."""
    problem = PROBLEMS[0]
    routes.register(FakeRoute("recording/fake"))
    try:
        params = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1,
                  "num_splits": 2} if route_id == "padded/triton" else {}
        dispatcher = forced(problem, route_id, params, tmp_path)
        inputs = make_decode_inputs(problem, seed=11, ragged=True)
        shard = inputs.shards[0]
        out = torch.empty(inputs.q.shape[0], problem.num_heads, problem.d_v,
                          dtype=inputs.q.dtype)
        lse_out = torch.empty(inputs.q.shape[0], problem.num_heads)
        poison_(out, lse_out)
        got, lse = attention.decode(inputs.q, shard.kv_cache, shard.block_table,
                                    inputs.seq_lens, num_heads=problem.num_heads,
                                    out=out if given == "both" else None,
                                    lse_out=lse_out, dispatcher=dispatcher)
        assert (got is out) == (given == "both") and lse is lse_out
        (plan,) = attention.plans_of(dispatcher).values()
        assert plan.choice.route_id == route_id
        assert (plan.prepared.lse is lse_out) == (route_id == "padded/triton")
        want_out, want_lse = reference.run(inputs, torch.float64)
        assert check(problem, got, want_out, lse_out, want_lse).ok
    finally:
        routes.unregister("recording/fake")


class BrokenRoute(FakeRoute):
    """A plugin's route that supports the problem and then fails to prepare."""

    def prepare(self, problem, inputs, **kwargs):
        raise RuntimeError("prepare exploded")


def test_a_route_that_fails_to_prepare_gives_way_to_the_next(tmp_path, caplog):
    """The table's winner raising in prepare (a plugin's bug, out of memory) is one warning
    naming it; the next route in the dispatcher's order serves the call."""
    import logging

    problem = PROBLEMS[0]
    routes.register(BrokenRoute("broken/fake"))
    try:
        dispatcher = forced(problem, "broken/fake", {}, tmp_path)
        inputs = make_decode_inputs(problem, seed=14, ragged=True)
        shard = inputs.shards[0]
        with caplog.at_level(logging.WARNING, logger="mlatune"):
            out, lse = attention.decode(inputs.q, shard.kv_cache, shard.block_table,
                                        inputs.seq_lens, num_heads=problem.num_heads,
                                        return_lse=True, dispatcher=dispatcher)
        assert attention.last_step(dispatcher).route.id != "broken/fake"
        want_out, want_lse = expected_now(inputs)
        assert check(problem, out, want_out, lse, want_lse).ok
        assert any("broken/fake" in r.getMessage() and "prepare exploded" in r.getMessage()
                   for r in caplog.records)
    finally:
        routes.unregister("broken/fake")


@pytest.mark.parametrize("backend", ["inductor"])
def test_torch_compile_fullgraph_matches_eager(backend, monkeypatch):
    """Compiled (its out a new buffer each call) as eager; the compiled calls' step is made
    once and prepared again over each new out."""
    problem = MLAProblem(num_heads=4, qlen=2, batch=2, kv_len=40, page_size=8,
                         q_dtype="fp16", kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=12, ragged=True)
    shard = inputs.shards[0]
    dispatcher = Dispatcher.rules_only(cpu_device())

    def attend(q, kv_cache, block_table, seq_lens):
        out, lse = attention.decode(q, kv_cache, block_table, seq_lens, num_heads=4, qlen=2,
                                    softmax_scale=0.05, max_kv_len=problem.kv_len,
                                    return_lse=True, dispatcher=dispatcher)
        return out.float() * 2.0, lse  # work around the op, as a model has

    args = (inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens)
    compiled = torch.compile(attend, fullgraph=True, backend=backend)
    made = _counting_makes(monkeypatch)
    for lens in ([7, 31], [5, 20], [2, 3]):  # each call the next step's lengths
        inputs.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        got_out, got_lse = compiled(*args)
        compiled_made = len(made)
        want_out, want_lse = attend(*args)
        torch.testing.assert_close(got_out, want_out)
        torch.testing.assert_close(got_lse, want_lse)
    assert compiled_made == 2  # the compiled calls' step and the eager calls' (out=None)


def test_torch_compile_takes_the_scale_as_an_argument():
    """A float argument of a compiled function is traced without a value: decode's checks
    of it run where the op runs, not while tracing."""
    problem = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=13, ragged=True)
    shard = inputs.shards[0]
    dispatcher = Dispatcher.rules_only(cpu_device())

    def attend(q, kv_cache, block_table, seq_lens, scale):
        return attention.decode(q, kv_cache, block_table, seq_lens, num_heads=4,
                                softmax_scale=scale, max_kv_len=40, dispatcher=dispatcher) * 1.0

    args = (inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens)
    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    for scale in (0.05, 0.07):
        torch.testing.assert_close(compiled(*args, scale), attend(*args, scale))
    with pytest.raises(Exception, match="softmax_scale: must be finite, > 0"):
        compiled(*args, -1.0)


@pytest.mark.parametrize("capturable", [None, True, False])
def test_torch_compile_leaves_capturability_to_the_op(capturable, monkeypatch):
    """decode's capturable reaches the op as given: None (the default) is decided when the op
    runs, as an eager call decides it (capturable while a CUDA graph is captured:
    torch.compile's reduce-overhead mode captures the op), not fixed to False at tracing."""
    problem = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=13, ragged=True)
    shard = inputs.shards[0]
    dispatcher = Dispatcher.rules_only(cpu_device())
    seen, real = [], attention._decode_step
    monkeypatch.setattr(attention, "_decode_step", lambda tensors, max_kv_len, reuse, d, a,
                        made: seen.append(made["capturable"]) or real(tensors, max_kv_len,
                                                                      reuse, d, a, made))

    def attend(q, kv_cache, block_table, seq_lens):
        return attention.decode(q, kv_cache, block_table, seq_lens, num_heads=4,
                                max_kv_len=problem.kv_len, dispatcher=dispatcher,
                                capturable=capturable) * 1.0

    args = (inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens)
    torch.compile(attend, fullgraph=True)(*args)
    assert seen and set(seen) == {capturable}


class HostPlannedRoute(FakeRoute):
    """Plans from the lengths on the host every step, like the AITER decode routes."""

    def step_kind(self, params):
        return routes.HOST_PLANNED

    def prepare(self, problem, inputs, *, rank=0, params=None, want_lse=True):
        prepared = super().prepare(problem, inputs, rank=rank, params=params, want_lse=want_lse)
        prepared.plan_reads_lengths = True
        return prepared


def test_capturable_steps_pass_over_host_planned_routes(tmp_path):
    problem = PROBLEMS[0]
    host = HostPlannedRoute("host/fake")
    routes.register(host)
    try:
        dispatcher = forced(problem, "host/fake", {}, tmp_path)
        inputs = make_decode_inputs(problem, seed=13, ragged=True)
        shard = inputs.shards[0]

        def call(capturable):
            return attention.decode(inputs.q, shard.kv_cache, shard.block_table,
                                    inputs.seq_lens, num_heads=problem.num_heads,
                                    capturable=capturable, dispatcher=dispatcher)

        call(False)
        call(False)  # host-planned: prepared again for the second step
        assert len(host.prepared) == 2
        out = call(True)
        assert len(host.prepared) == 2  # never chosen when a capturable step is asked
        eager, captured = attention.plans_of(dispatcher).values()
        assert eager.choice.route_id == "host/fake" != captured.choice.route_id
        assert routes.step_kind_of(captured.route, dict(captured.choice.params)).capturable
        assert check(problem, out, reference.run(inputs, torch.float64)[0]).ok
    finally:
        routes.unregister("host/fake")


def test_a_prepared_step_follows_the_tensors_it_was_made_for(tmp_path):
    """prepare_decode once, then every step a call: lengths rewritten in place are read."""
    problem = MLAProblem(num_heads=4, qlen=2, batch=2, kv_len=40, page_size=4,
                         q_dtype="fp16", kv_dtype="fp16", dcp_size=2)
    dispatcher = forced(problem, "segmented/triton", SEGMENTED, tmp_path)
    inputs = make_decode_inputs(problem, seed=14)  # pages for kv_len tokens per request
    steps = [attention.prepare_decode(inputs.q, s.kv_cache, s.block_table, inputs.seq_lens,
                                      num_heads=problem.num_heads, qlen=2,
                                      max_kv_len=problem.kv_len, dcp_rank=s.rank, dcp_size=2,
                                      return_lse=True, dispatcher=dispatcher)
             for s in inputs.shards]
    for lens in ([9, 40], [40, 23], [2, 3]):
        inputs.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        outs, lses = zip(*(step() for step in steps), strict=True)
        out, lse = combine([o.float() for o in outs], list(lses))
        want_out, want_lse = expected_now(inputs)
        assert check(problem, out, want_out, lse, want_lse).ok, lens
    assert not attention.plans_of(dispatcher)  # nothing cached: the caller holds the steps


# --- bad inputs an engine can pass: one clear error naming the argument ----------------
def _decode_args(problem, seed=15):
    inputs = make_decode_inputs(problem, seed=seed)
    shard = inputs.shards[0]
    return inputs, dict(q=inputs.q, kv_cache=shard.kv_cache, block_table=shard.block_table,
                        seq_lens=inputs.seq_lens, kv_scale=inputs.kv_scale,
                        q_scale=inputs.q_scale, num_heads=problem.num_heads,
                        qlen=problem.qlen, dispatcher=Dispatcher.rules_only(cpu_device()))


FP8_KV = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                    kv_dtype="fp8_e4m3fn")


def _table_entry(value):
    def corrupt(args):
        args["block_table"] = args["block_table"].clone()
        args["block_table"][1, 0] = value
    return corrupt


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda a: a.update(kv_scale=None), "^kv_scale: "),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), "^seq_lens: "),
    (lambda a: a.update(block_table=a["block_table"][:0], seq_lens=a["seq_lens"][:0],
                        q=a["q"][:0]), "^block_table: .*batch"),
    (_table_entry(-1), "^block_table: request 1"),
    (_table_entry(2**31 - 1), "^block_table: request 1 .*2147483647"),
    (_table_entry(10_000), "^block_table: request 1"),
    (lambda a: a["seq_lens"].fill_(10_000), "^seq_lens: "),
], ids=["fp8-without-scale", "int64-lengths", "batch-0", "negative-page", "page-2**31-1",
        "page-past-cache", "length-past-table"])
def test_bad_inputs_are_refused_naming_the_argument(corrupt, message):
    from mlatune.errors import DecodeArgumentError

    _, args = _decode_args(FP8_KV)
    corrupt(args)
    with pytest.raises(DecodeArgumentError, match=message):
        attention.decode(**args)


def test_values_are_checked_on_every_call_where_they_are_free_to_read():
    """CPU lengths cost no sync to read: a step reused with a bad length is still refused."""
    from mlatune.errors import DecodeArgumentError

    _, args = _decode_args(FP8_KV)
    attention.decode(**args)
    args["seq_lens"][0] = 10_000  # in place: the same tensor set, the cached step
    with pytest.raises(DecodeArgumentError, match=r"^seq_lens: "):
        attention.decode(**args)


def test_a_nan_in_q_comes_out_as_nan_not_zeros():
    problem = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    _, args = _decode_args(problem)
    args["q"] = args["q"].clone()
    args["q"][0, 1, 3] = float("nan")  # request 0, head 1
    for route in ("reference/torch", "gluon/triton"):
        dispatcher = Dispatcher.rules_only(cpu_device())
        dispatcher._rule_order = (routes.get(route),)  # this route answers
        out = attention.decode(**{**args, "dispatcher": dispatcher})
        assert torch.isnan(out[0, 1]).all(), route
        assert not torch.isnan(out[1]).any() and not torch.isnan(out[0, 0]).any(), route


def test_torch_compile_carries_the_accuracy_policy():
    """decode(accuracy=...) under torch.compile(fullgraph=True) reaches the op: the policy
    its dispatcher serves matches eager, another is refused as eagerly."""
    problem = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=13, ragged=True)
    shard = inputs.shards[0]
    dispatcher = Dispatcher.rules_only(cpu_device(), accuracy="fast")

    def attend(accuracy):
        def call(q, kv_cache, block_table, seq_lens):
            return attention.decode(q, kv_cache, block_table, seq_lens, num_heads=4,
                                    max_kv_len=problem.kv_len, dispatcher=dispatcher,
                                    accuracy=accuracy).float()
        return call

    args = (inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens)
    got = torch.compile(attend("fast"), fullgraph=True)(*args)
    torch.testing.assert_close(got, attend("fast")(*args))
    from mlatune.errors import DecodeArgumentError

    with pytest.raises(DecodeArgumentError, match=r"^accuracy: 'strict' asked"):
        torch.compile(attend("strict"), fullgraph=True)(*args)


def _calls(inputs, dispatcher, qs) -> list:
    """An eager decode call for each q of ``qs`` (fresh ones, as an eager model's
    activations, or the same again), no out=, each checked; returns a weak reference to
    each q."""
    import weakref

    shard, held = inputs.shards[0], []
    for q in qs:
        held.append(weakref.ref(q))
        out = attention.decode(q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                               num_heads=4, max_kv_len=40, dispatcher=dispatcher)
        want = expected_now(inputs)[0]
        torch.testing.assert_close(out.float(), want.float(), atol=2e-3, rtol=2e-3)
        del q, out
    return held


def _fresh(inputs, n: int):
    """``n`` fresh copies of q, one made as each is asked for."""
    return (inputs.q.clone() for _ in range(n))


def _counting_makes(monkeypatch) -> list:
    """Record each step ``decode`` makes anew (route chosen, tensors checked)."""
    made, make = [], attention._make_plan

    def counted(*args, **kwargs):
        made.append(1)
        return make(*args, **kwargs)

    monkeypatch.setattr(attention, "_make_plan", counted)
    return made


def test_fresh_tensors_each_call_are_served_and_let_go(monkeypatch):
    """An eager caller's fresh q each call: the route is chosen once; later calls prepare
    the same route over the new q and hold it no longer than the next call (the first
    call's step alone is kept, and the last call's as ``last_step``)."""
    import gc

    problem = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=14, ragged=True)
    dispatcher = Dispatcher.rules_only(cpu_device())
    made = _counting_makes(monkeypatch)
    held = _calls(inputs, dispatcher, _fresh(inputs, 12))
    gc.collect()
    assert len(made) == 1
    assert len(attention.plans_of(dispatcher)) == 1
    assert [r() is not None for r in held] == [True] + [False] * 10 + [True]


def test_the_kept_steps_hold_a_bounded_share_of_the_callers_tensors(monkeypatch):
    """Tensors passed twice in a row are kept (their step with them); past PLAN_BYTES of
    them the least recently used go, and with them their tensors."""
    import gc

    problem = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=14, ragged=True)
    dispatcher = Dispatcher.rules_only(cpu_device())
    one = inputs.q.nbytes + 2 * 4 * 512 * 2  # q and out (fp16): the LSE is not asked for
    monkeypatch.setattr(attention, "PLAN_BYTES", 3 * one)
    held = []
    for q in _fresh(inputs, 8):
        held += _calls(inputs, dispatcher, [q, q])[:1]
        del q
    gc.collect()
    assert len(attention.plans_of(dispatcher)) == 3
    assert [r() is not None for r in held] == [False] * 5 + [True] * 3


def test_the_bound_counts_the_routes_workspace(monkeypatch):
    """What a route allocates when prepared (split partials, plans: measured on a GPU; here
    each prepare allocates 5x the caller's tensors) counts toward PLAN_BYTES beside them."""
    import gc

    from mlatune import decode_step

    problem = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=14, ragged=True)
    dispatcher = Dispatcher.rules_only(cpu_device())
    out = 2 * 4 * 512 * 2  # the route's own out (fp16)
    one = inputs.q.nbytes + out
    allocated, calls = [0], [0]

    def measured(q: torch.Tensor) -> int:  # before, then after each prepare: out and 5 * one
        calls[0] += 1
        allocated[0] += out + 5 * one if calls[0] % 2 == 0 else 0
        return allocated[0]

    monkeypatch.setattr(decode_step, "_allocated", measured)
    monkeypatch.setattr(attention, "PLAN_BYTES", 3 * 6 * one)
    held = []
    for q in _fresh(inputs, 8):
        held += _calls(inputs, dispatcher, [q, q])[:1]
        del q
    gc.collect()
    steps = attention.plans_of(dispatcher).values()
    assert {s.prepared.workspace_bytes for s in steps} == {5 * one}
    assert len(steps) == 3
    assert [r() is not None for r in held] == [False] * 5 + [True] * 3


def test_a_caller_that_moves_to_new_buffers_finds_its_step_again(monkeypatch):
    """Buffers replaced once and kept from then on (or two kept alternately): served from
    the second call with them by a kept step, found again with no prepare."""
    problem = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=16, ragged=True)
    dispatcher = Dispatcher.rules_only(cpu_device())
    made = _counting_makes(monkeypatch)
    a, b = inputs.q.clone(), inputs.q.clone()
    _calls(inputs, dispatcher, [a, b, b])
    assert len(attention.plans_of(dispatcher)) == 2  # a's (made), b's (kept at its 2nd)
    b_step = attention.last_step(dispatcher)
    _calls(inputs, dispatcher, [a, b])
    assert attention.last_step(dispatcher) is b_step
    assert len(made) == 1 and len(attention.plans_of(dispatcher)) == 2


def test_a_step_used_again_is_kept_before_older_ones(monkeypatch):
    """Least recently used, not first made: a persistent q's step, called between other
    kept ones, stays while those come and go."""
    problem = MLAProblem(num_heads=4, batch=2, kv_len=40, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    inputs = make_decode_inputs(problem, seed=15, ragged=True)
    shard = inputs.shards[0]
    dispatcher = Dispatcher.rules_only(cpu_device())
    monkeypatch.setattr(attention, "PLAN_LIMIT", 2)

    def kept() -> object:
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=4, max_kv_len=40, dispatcher=dispatcher)
        return attention.last_step(dispatcher)

    first = kept()
    for q in _fresh(inputs, 3):
        _calls(inputs, dispatcher, [q, q])  # kept at its second call
        assert kept() is first  # found again: no new step for the persistent q
    assert len(attention.plans_of(dispatcher)) == 2


def test_two_threads_decoding_their_own_layers(monkeypatch, tmp_path):
    """Threads calling decode at once (each its own cache, fresh lengths each call: new steps
    made while the other thread evicts) share the step caches safely, each answer right.
    The route computes in torch (Triton's CPU interpreter is not thread-safe itself)."""
    import sys
    import threading

    monkeypatch.setattr(attention, "PLAN_LIMIT", 4)  # evictions all along
    problem = MLAProblem(num_heads=4, batch=3, kv_len=32, page_size=8, q_dtype="fp16",
                         kv_dtype="fp16")
    routes.register(FakeRoute("recording/fake"))
    rows = [result_row(problem, "recording/fake", 1.0, device=cpu_device())]
    dispatcher = Dispatcher.load(table.write(make_table(rows), tmp_path / "cpu.parquet"),
                                 device=cpu_device())
    layers = [make_decode_inputs(problem, seed=40 + t, ragged=True) for t in range(2)]
    errors, answers = [], {}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: the race shows in a few calls

    def worker(t):
        inputs = layers[t]
        shard = inputs.shards[0]
        try:
            for _ in range(150):
                out = attention.decode(inputs.q, shard.kv_cache, shard.block_table,
                                       inputs.seq_lens.clone(), num_heads=4, max_kv_len=32,
                                       dispatcher=dispatcher)
            answers[t] = out
        except Exception as error:  # the test reports any
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
        routes.unregister("recording/fake")
    assert errors == []
    for t, inputs in enumerate(layers):
        want, _ = reference.run(inputs, torch.float64)
        assert check(problem, answers[t], want).ok


@pytest.mark.parametrize("problem", PROBLEMS[:2], ids=["decode-fp16", "verify-fp8kv-dcp4"])
def test_a_step_inside_a_checked_graph_pool_keeps_nothing(problem, monkeypatch):
    """Inside torch.compile's CUDA graph trees (simulated here: ``graph_pools``) a step is
    made for its call alone: every call right, reuse_plan served by planning again, none of
    those steps (nor their outputs) alive once the caller lets go of what they returned
    (Inductor checks that its pool holds only the graph's outputs), and ``last_step`` says
    what ran, holding no tensor."""
    import gc
    import weakref

    from mlatune import graph_pools

    monkeypatch.setattr(graph_pools, "in_graph_tree", lambda device: True)
    made, make = [], attention._make_plan

    def recorded(*args, **kwargs):
        step = make(*args, **kwargs)
        made.append((weakref.ref(step), weakref.ref(step.out), step.route.id,
                     step.prepared.step_kind))
        return step

    monkeypatch.setattr(attention, "_make_plan", recorded)
    inputs = make_decode_inputs(problem, seed=31, ragged=True)
    dispatcher = Dispatcher.rules_only(cpu_device())
    want_out, want_lse = reference.run(inputs, torch.float64)
    for reuse_plan in (False, True, False):
        out, lse = run_ranks(inputs, dispatcher, max_kv_len=problem.kv_len,
                             reuse_plan=reuse_plan)  # (copies of what decode returned)
        accuracy = check(problem, out, want_out, lse, want_lse)
        assert accuracy.ok, accuracy.reason
    gc.collect()
    assert len(made) == 3 * problem.dcp_size  # a step a call: none kept, none read again
    assert [(step(), out()) for step, out, _, _ in made] == [(None, None)] * len(made)
    assert not attention.plans_of(dispatcher)
    assert not attention._seen.get(dispatcher) and not attention._planners.get(dispatcher)
    ran = attention.last_step(dispatcher)
    assert (ran.route.id, ran.prepared.step_kind) == made[-1][2:]
    assert (ran.out, ran.lse, ran.inputs, ran.local_lens) == (None, None, None, None)
