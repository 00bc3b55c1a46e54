"""The transposed Gluon decode's host side (mlatune/kernels/gluon_transposed.py) on the CPU:
what its launcher refuses, with a ValueError that says why, before any GPU work."""

from __future__ import annotations

import math

import pytest
import torch

from mlatune.kernels import gluon_transposed as t


def _tensors(batch=2, heads=16, qlen=1, kv=torch.bfloat16, pages=8):
    q = torch.randn(batch * qlen, heads, 576, dtype=torch.bfloat16)
    cache = torch.randn(pages, 64, 576).to(kv)
    table = torch.arange(batch * 4, dtype=torch.int32).reshape(batch, 4) % pages
    lens = torch.full((batch, ), 200, dtype=torch.int32)
    return q, cache, table, lens


def _launch(q, cache, table, lens, **kw):
    return t.decode_launcher(q, cache, table, lens, qlen=kw.pop("qlen", 1), sm_scale=0.1, **kw)


@pytest.mark.parametrize(("change", "message"), [
    (dict(merge="fused"), "merge must be"),
    (dict(widen_cols=1024), "widen_cols must be one of"),
    (dict(widen_cols=0), "widen_cols must be one of"),
    (dict(num_splits=0), "num_splits must be at least 1"),
    (dict(qlen=3), "expected 6 .batch x qlen."),
    (dict(out=torch.empty(2, 16, 256, dtype=torch.bfloat16)), "out must be"),
    (dict(out=torch.empty(2, 16, 512, dtype=torch.float16)), "out must be"),
    (dict(lse=torch.empty(16, 2).t()), "lse must be"),
])
def test_bad_options_and_buffers_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        _launch(*_tensors(), **change)


def test_bad_tensors_are_refused_with_the_reason():
    q, cache, table, lens = _tensors()
    fp8 = cache.to(torch.float8_e4m3fn)
    scale = torch.ones(1)
    cases = [
        ((q, fp8, table, lens, None), "needs its per-tensor scale"),
        ((q, fp8, table, lens, torch.ones(1, dtype=torch.float64)), "one fp32 value"),
        ((q, fp8, table, lens, torch.ones(2)), "one fp32 value"),
        ((q, cache.half(), table, lens, None), "cache dtype"),
        ((q.float(), cache, table, lens, None), "q dtype"),
        ((q, cache, table[:1], lens, None), "a row of contiguous page ids per request"),
        ((q, cache, table.t().contiguous().t(), lens, None), "contiguous page ids"),
        ((q, cache, table.long(), lens, None), "int32"),
        ((q[0], cache, table, lens, None), "expected"),
        ((q, cache[:, :32], table, lens, None), "page_size 32"),
    ]
    for args, message in cases:
        why = t.check_supported(*args)
        assert why is not None and message in why, (message, why)
    # A well-formed fp8 call gets as far as the triton check (none on this machine's 3.9,
    # or None where triton 3.6 is installed).
    why = t.check_supported(q, fp8, table, lens, scale)
    assert why is None or "triton" in why



def test_the_warp_specialized_form_refuses_what_it_cannot_widen():
    from mlatune.kernels import gluon_transposed_ws as ws

    q, cache, table, lens = _tensors(kv=torch.bfloat16)
    with pytest.raises(ValueError, match="reads an fp8 cache only"):
        ws.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=0.1,
                           kv_scale=torch.ones(1))


def test_the_fp8_mma_form_reads_fp8_caches_only():
    from mlatune.kernels import gluon_transposed_fp8 as f

    q, cache, table, lens = _tensors()
    with pytest.raises(ValueError, match="reads an fp8 cache only"):
        f.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=0.1)
    q, cache, table, lens = _tensors(kv=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_terms must be 1 or 2"):
        f.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=0.1, q_terms=3)
    # warp_max keeps P's sums per key slot: without defer_sums no row sum would be taken
    with pytest.raises(ValueError, match="defer_sums=True only"):
        f.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=0.1, warp_max=True)
    # slim is warp_max's softmax with the scale in the exponent: a positive scale only
    with pytest.raises(ValueError, match="warp_max=True only"):
        f.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=0.1, slim=True)
    with pytest.raises(ValueError, match="sm_scale > 0 only"):
        f.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=-0.1, defer_sums=True,
                          warp_max=True, slim=True)


def test_gluon_check_keeps_unrun_kernels_behind_experimental_and_its_roundings_honest():
    """benchmarks/gluon_check.py: fp8-only variants never run over 16-bit caches, those held
    to a looser tolerance (their roundings) are fp8-only, and the experimental ones leave
    the variant lists unless asked for (a hang in the smoke child would stop every Gluon
    timing)."""
    import benchmarks.gluon_check as gc

    assert set(gc.ROUNDING) <= set(gc.FP8_ONLY) and set(gc.EXPERIMENTAL) <= set(gc.VARIANTS)
    # one term quantizes q; two keep it near 16 bits and round P: never both, never neither
    assert all(r["q_quantized"] != r["p_rounded"] for r in gc.ROUNDING.values())
    assert gc.ROUNDING[gc.TRANSPOSED_FP8MMA_1TERM]["q_quantized"]
    assert not set(gc.variants_for("bf16")) & set(gc.FP8_ONLY)
    assert set(gc.FP8_ONLY) <= set(gc.variants_for("fp8")) | gc.SKIPPED
    saved = set(gc.SKIPPED)
    # None may be experimental now (every form has run on a GPU): hide a stand-in then.
    experimental = set(gc.EXPERIMENTAL or (gc.SEESAW_SLIM, ))  # none: a stand-in
    try:
        assert experimental & set(gc.variants_for("bf16") + gc.variants_for("fp8"))
        gc.SKIPPED.update(experimental)  # what main() does without --experimental
        for dtype in ("bf16", "fp8"):
            assert not set(gc.variants_for(dtype)) & experimental
        assert gc.TRANSPOSED in gc.variants_for("fp8")
    finally:
        gc.SKIPPED.clear()
        gc.SKIPPED.update(saved)


def test_decode_benchmark_judges_issue_19_targets_on_own_routes_against_flashmla():
    """benchmarks/decode.py: a target is met or missed by mlatune's fastest own route, a
    vendor route (FlashMLA, FlashInfer) never counts as mlatune's, and the fp8 target needs
    both 0.6x the own bf16 time and FlashMLA's fp8 time."""
    from benchmarks import decode as d

    def result(point, kv, route, us):
        return d.Result(point, kv, route, {}, "ok", time_us=us, tb_s=1.0)

    p = (128, 128, 4096, 1)
    best = {"seesaw/gluon": result(p, "bf16", "seesaw/gluon", 110.0),
            "fa3/flashinfer": result(p, "bf16", "fa3/flashinfer", 90.0),
            "dense/flashmla": result(p, "bf16", "dense/flashmla", 100.0)}
    assert "seesaw/gluon 1.10 met" in d.target_note(p, best)
    best["seesaw/gluon"] = result(p, "bf16", "seesaw/gluon", 111.0)
    assert "MISSED" in d.target_note(p, best)
    assert "not measured" in d.target_note(p, {"fa3/flashinfer": best["fa3/flashinfer"]})
    f = d.FP8_TARGET_POINT
    runs = [result(f, "bf16", "transposed/gluon", 280.0),
            result(f, "fp8", "transposed/gluon", 160.0), result(f, "fp8", "dense/flashmla", 250.0)]
    assert d.fp8_target_note(runs).endswith("met")
    runs[1] = result(f, "fp8", "transposed/gluon", 200.0)  # beats FlashMLA, not 0.6x bf16
    assert d.fp8_target_note(runs).endswith("MISSED")


def test_decode_benchmark_lays_each_form_over_each_set_of_its_route_only():
    """benchmarks/decode.py --forms: every selected set of the named route runs once per
    form (``{}`` as it is), other routes' sets untouched; a malformed value is refused."""
    from benchmarks import decode as d

    forms = d.parse_forms('{"seesaw/gluon": [{}, {"lone_bars": false, "afresh_q": false}]}')
    pick = d.Selection(max_params=2, forms=forms)
    space = [{"num_splits": 1, "lone_bars": True}, {"num_splits": 2, "lone_bars": True},
             {"num_splits": 4, "lone_bars": True}]
    got = pick.params(space, "seesaw/gluon")
    assert got == [space[0], {"num_splits": 1, "lone_bars": False, "afresh_q": False},
                   space[1], {"num_splits": 2, "lone_bars": False, "afresh_q": False}]
    assert pick.params(space, "transposed/gluon") == space[:2]
    for bad in ('["seesaw/gluon"]', '{"seesaw/gluon": {"pdl": true}}', '{"r": [1]}'):
        with pytest.raises(SystemExit):
            d.parse_forms(bad)


def test_decode_benchmark_sums_up_each_form_against_the_first():
    """benchmarks/decode.py --forms: per point, dtype, route and set, each form's times in
    run order and its median over the first form's; a failed run shown, not counted; runs
    without forms left out."""
    from benchmarks import decode as d

    point, base = (128, 128, 4096, 1), {"num_splits": 1}

    def run(form, us, status="ok"):
        return d.Result(point, "bf16", "seesaw/gluon", {**base, **form}, status, time_us=us,
                        base=base, form=form)

    results = [run({}, 270.0), run({"afresh_q": True}, 266.0), run({}, 272.0),
               run({"afresh_q": True}, math.nan, "rejected_accuracy: x"),
               d.Result(point, "bf16", "dense/flashmla", {}, "ok", time_us=240.0)]
    (line,) = d.form_lines(results)
    assert line.startswith(f'{point} bf16 seesaw/gluon {{"num_splits": 1}}: ')
    assert '{} 270.0, 272.0 (1.000x)' in line
    assert '{"afresh_q": true} 266.0, failed (0.982x)' in line


def test_gluon_check_leaves_out_a_variant_that_loses_the_cuda_context(monkeypatch):
    """benchmarks/gluon_check.py: the smoke child names a variant whose error loses its CUDA
    context; the parent leaves that variant out and runs the smoke again, so one faulting
    experimental form does not stop every Gluon timing of the call."""
    import benchmarks.gluon_check as gc

    bad = gc.TRANSPOSED_FP8MMA_DEFERRED
    runs = iter([(False, f"smoke x: error CUDA error: an illegal memory access\n"
                         f"{gc.FATAL_LINE}{bad}\n"),
                 (True, "smoke: 9/9 cases passed\n")])
    monkeypatch.setattr(gc, "run_smoke_child", lambda timeout_s: next(runs))
    monkeypatch.setattr(gc, "SKIPPED", set())
    monkeypatch.setenv("GLUON_CHECK_SKIP", "")
    meta: dict = {}
    assert gc.smoke_until_clean(10, meta)
    left_out = gc.SKIPPED
    assert left_out == {bad} and meta["left_out"] == [bad] and meta["smoke_finished"]
    assert gc.os.environ["GLUON_CHECK_SKIP"] == bad
    # A hang (or a failure that names no variant) is not retried: the kernels stay out.
    monkeypatch.setattr(gc, "run_smoke_child", lambda timeout_s: (False, "smoke: timed out"))
    assert not gc.smoke_until_clean(10, {})
    assert gc.fatal_variant("smoke: 3/3 cases passed") is None


class _RecordedKernel:
    """Stands for a Gluon kernel on the CPU: ``kernel[grid](*args, **meta)`` records the call."""

    def __init__(self, kernel):
        self.fn, self.calls = kernel.fn, []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((args, meta))


LAUNCH_OPTIONS = {"num_warps", "num_stages", "maxnreg", "ptx_options", "num_ctas"}


@pytest.mark.parametrize(("module", "options"), [
    ("gluon_transposed", {}), ("gluon_transposed_ws", {}), ("gluon_transposed_fp8", {}),
    ("gluon_transposed_fp8", {"stacked": True}),
    ("gluon_transposed_fp8", {"stacked": True, "defer_sums": True, "wide_vt": True,
                              "warp_max": True}),
    ("gluon_transposed_fp8", {"stacked": True, "defer_sums": True, "wide_vt": True,
                              "warp_max": True, "slim": True})])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_each_transposed_launch_binds_exactly_its_kernels_arguments(monkeypatch, module,
                                                                    options, num_splits):
    """A launcher passes its kernel every argument the kernel takes and none it does not
    (a launch missing arguments an experimental form had added failed only on the GPU)."""
    import importlib
    import inspect

    mod = importlib.import_module(f"mlatune.kernels.{module}")
    kernel_name = {"gluon_transposed": "transposed_kernel", "gluon_transposed_ws":
                   "transposed_ws_kernel", "gluon_transposed_fp8": "transposed_fp8_kernel"}
    recorded = _RecordedKernel(getattr(mod, kernel_name[module]))
    monkeypatch.setattr(mod, kernel_name[module], recorded)
    monkeypatch.setattr(t, "check_supported", lambda *a: None)
    monkeypatch.setattr(mod, "tma_descriptors", lambda *a, **k: ("d",) * 4)
    q, cache, table, lens = _tensors(kv=torch.float8_e4m3fn)
    launch, _, _ = mod.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=0.1,
                                       kv_scale=torch.ones(1), num_splits=num_splits,
                                       merge="kernel", **options)
    launch()
    (args, meta), = recorded.calls
    params = inspect.signature(recorded.fn).parameters
    bound = inspect.signature(recorded.fn).bind(
        *args, **{k: v for k, v in meta.items() if k in params or k not in LAUNCH_OPTIONS})
    missing = [n for n, p in params.items()
               if n not in bound.arguments and p.default is inspect.Parameter.empty]
    assert not missing, missing
