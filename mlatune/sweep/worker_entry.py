"""Where a worker process starts: the sweep's environment of now applied, SIGINT ignored,
then ``worker.serve``. Light to import: under the forkserver a worker is a fork of a
process that imported torch once, whose environment is that of its own start (a plugin
named since, ``TRITON_INTERPRET``, would be missing)."""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any


def main(conn: Any, device: str, environ: dict[str, str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the sweep's to handle
    os.environ.clear()
    os.environ.update(environ)
    if environ.get("TRITON_INTERPRET") == "1":
        skip_interpreter_overflow_checks()
    from mlatune.sweep import worker

    worker.serve(conn, device)


def skip_interpreter_overflow_checks() -> None:
    """Triton's interpreter checks every int32 add, sub and mul for overflow: a quarter of
    a CPU sweep's time (and four fifths of some kernels'), at the CPU's tiny sizes where no
    index comes near 2**31. A Triton without this option keeps its checks."""
    try:
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):
        pass
