"""Triton's interpreter (``TRITON_INTERPRET=1``, the CPU runs) spared work that the CPU's
tiny sizes never need. ``quicken`` is called once, in a process that runs kernels there:
the CPU sweep's workers and the tests. It leaves a Triton without these internals as it is.

Imports no Triton at import time (a sweep worker starts light)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any


def quicken() -> None:
    """Skip the interpreter's int32 overflow checks and its re-patching of the language at
    every call of a jit function from a kernel."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    _skip_overflow_checks(interpreter)
    _patch_language_once_a_launch(interpreter)


def _skip_overflow_checks(interpreter: Any) -> None:
    """It checks every int32 add, sub and mul, where at the CPU's sizes no index comes near
    2**31 (what it costs: benchmarks/RESULTS.md, "Tests")."""
    try:
        builder = interpreter.interpreter_builder
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except (AttributeError, TypeError):
        pass


def _patch_language_once_a_launch(interpreter: Any) -> None:
    """A launch patches ``triton.language`` into its interpreted form; then every call of a
    jit function inside the kernel patches it again (a scan of the language's members each).
    Within a launch, a function that sees only modules patched since the launch began (by
    it or by a call before: triton undoes only the launch's own patches, at its end) is not
    patched again."""
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope_type is None:
        return
    if getattr(patch_lang, "_once_a_launch", False):
        return
    launch = executor.__call__
    patched: list[frozenset[int] | None] = []  # a launch's patched modules, innermost last

    def launch_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.append(None)  # its first patch is the launch's own
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def patch(fn: Any) -> Any:
        langs = _language_modules(fn)
        if patched and patched[-1] is not None and langs <= patched[-1]:
            return scope_type()  # nothing to change: the launch's patches hold
        scope = patch_lang(fn)
        if patched:  # a call's patches are never undone before its launch ends
            patched[-1] = langs | (patched[-1] or frozenset())
        return scope

    patch._once_a_launch = True  # type: ignore[attr-defined]
    executor.__call__ = launch_once
    interpreter._patch_lang = patch


def _language_modules(fn: Any) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(value) for value in fn.__globals__.values()
                     if inspect.ismodule(value) and value in (tl, tl.core))
