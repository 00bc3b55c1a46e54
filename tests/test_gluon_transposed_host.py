"""The transposed Gluon decode's host side (mlatune/kernels/gluon_transposed.py) on the CPU:
what its launcher refuses, with a ValueError that says why, before any GPU work."""

from __future__ import annotations

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
        ((q, cache[:, :48], table, lens, None), "page_size 48"),
        ((q, cache[:, :32], table, lens, None), "pages must be contiguous rows"),
    ]
    for args, message in cases:
        why = t.check_supported(*args)
        assert why is not None and message in why, (message, why)
    # A well-formed fp8 call gets as far as the triton check (none on this machine's 3.9,
    # or None where triton 3.6 is installed).
    why = t.check_supported(q, fp8, table, lens, scale)
    assert why is None or "triton" in why


def test_each_kernel_refuses_the_caches_of_the_others():
    """The transposed kernel reads a cache of q's dtype; the warp-specialized widening and the
    fp8-MMA kernel an fp8 cache only (the latter with a positive sm_scale: it is folded into
    the exponent)."""
    from mlatune.kernels import gluon_transposed_fp8 as f
    from mlatune.kernels import gluon_transposed_ws as ws

    q, fp8, table, lens = _tensors(kv=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="an fp8 cache runs gluon_transposed_ws"):
        t.decode_launcher(q, fp8, table, lens, qlen=1, sm_scale=0.1, kv_scale=torch.ones(1))
    q, cache, table, lens = _tensors(kv=torch.bfloat16)
    for module in (ws, f):
        with pytest.raises(ValueError, match="reads an fp8 cache only"):
            module.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=0.1,
                                   kv_scale=torch.ones(1))
    with pytest.raises(ValueError, match="sm_scale > 0 only"):
        f.decode_launcher(q, fp8, table, lens, qlen=1, sm_scale=-0.1)


class _RecordedKernel:
    """Stands for a Gluon kernel on the CPU: ``kernel[grid](*args, **meta)`` records the call."""

    def __init__(self, kernel):
        self.fn, self.calls = kernel.fn, []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((args, meta))


LAUNCH_OPTIONS = {"num_warps", "num_stages", "maxnreg", "ptx_options", "num_ctas"}


@pytest.mark.parametrize("module", ["gluon_transposed", "gluon_transposed_ws",
                                    "gluon_transposed_fp8"])
@pytest.mark.parametrize("num_splits", [1, 2, 3])  # direct, merged in the kernel, reduced
def test_each_transposed_launch_binds_exactly_its_kernels_arguments(monkeypatch, module,
                                                                    num_splits):
    """A launcher passes its kernel every argument the kernel takes and none it does not
    (a launch missing arguments fails only on the GPU)."""
    import importlib
    import inspect

    mod = importlib.import_module(f"mlatune.kernels.{module}")
    kernel_name = {"gluon_transposed": "transposed_kernel", "gluon_transposed_ws":
                   "transposed_ws_kernel", "gluon_transposed_fp8": "transposed_fp8_kernel"}
    recorded = _RecordedKernel(getattr(mod, kernel_name[module]))
    monkeypatch.setattr(mod, kernel_name[module], recorded)
    monkeypatch.setattr(t, "check_supported", lambda *a, **k: None)
    monkeypatch.setattr(mod, "tma_descriptors", lambda *a, **k: ("d",) * 4)
    q, cache, table, lens = _tensors(
        kv=torch.bfloat16 if module == "gluon_transposed" else torch.float8_e4m3fn)
    launch, _, _ = mod.decode_launcher(q, cache, table, lens, qlen=1, sm_scale=0.1,
                                       kv_scale=torch.ones(1), num_splits=num_splits)
    launch()
    (args, meta), = recorded.calls
    params = inspect.signature(recorded.fn).parameters
    bound = inspect.signature(recorded.fn).bind(
        *args, **{k: v for k, v in meta.items() if k in params or k not in LAUNCH_OPTIONS})
    missing = [n for n, p in params.items()
               if n not in bound.arguments and p.default is inspect.Parameter.empty]
    assert not missing, missing
