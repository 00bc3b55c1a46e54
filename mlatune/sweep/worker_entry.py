"""Where a worker process starts: the sweep's environment of now applied, SIGINT ignored,
then ``worker.serve``. Light to import: under the forkserver a worker is a fork of a
process that imported torch once, whose environment is that of its own start (a plugin
named since, ``TRITON_INTERPRET``, would be missing)."""

from __future__ import annotations

import os
import signal
from typing import Any


def main(conn: Any, device: str, environ: dict[str, str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the sweep's to handle
    os.environ.clear()
    os.environ.update(environ)
    if environ.get("TRITON_INTERPRET") == "1":
        from mlatune.kernels.interpreter import quicken

        quicken()
    from mlatune.sweep import worker

    worker.serve(conn, device)
