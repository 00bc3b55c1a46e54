"""The interpreter's quickening (``mlatune.kernels.interpreter``): the same results, the
language patched once a launch instead of once a call, and restored after it."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter runs where there is no GPU")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime import interpreter  # noqa: E402

from mlatune.kernels.interpreter import quicken  # noqa: E402


@triton.jit
def _row_max(x):
    return tl.max(x, axis=0)  # a triton.language function: its module is tl.core's


@triton.jit
def _maxes_kernel(x_ptr, out_ptr, CALLS: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    best = tl.load(x_ptr + offs * 0)  # x[0] in every lane
    for i in tl.static_range(CALLS):
        best = tl.maximum(best, _row_max(tl.load(x_ptr + i * N + offs)))
    tl.store(out_ptr + offs, best)


def _patches_in_a_launch(monkeypatch, calls: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    count = 0
    original = interpreter._patch_builtin

    def counted(*args, **kwargs):
        nonlocal count
        count += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    x = torch.randn(calls, 16)
    out = torch.full((16,), float("nan"))
    _maxes_kernel[(1,)](x, out, CALLS=calls, N=16)
    return x, out, count


def test_a_launch_patches_the_language_once_not_once_a_call(monkeypatch):
    quicken()
    _patches_in_a_launch(monkeypatch, 3)  # a kernel's first launch also rewrites its code
    x, out, few = _patches_in_a_launch(monkeypatch, 3)
    assert torch.equal(out, x.max().expand(16))
    x, out, many = _patches_in_a_launch(monkeypatch, 24)
    assert torch.equal(out, x.max().expand(16))
    assert many == few  # not 21 calls' more scans of the language


def test_the_language_is_restored_after_a_launch(monkeypatch):
    quicken()
    _patches_in_a_launch(monkeypatch, 3)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.arange)


def test_quicken_twice_wraps_once():
    quicken()
    patch, call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    quicken()
    assert (interpreter._patch_lang, interpreter.GridExecutor.__call__) == (patch, call)
