"""Separate processes for the tests' process groups and races, forked from multiprocessing's
forkserver, which imported torch once: a spawned process imports torch again (about 2 s of
the CI machine's two cores, for each of some thirty processes)."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
from typing import Any

import torch.multiprocessing as torch_mp


def context() -> Any:
    """The forkserver context, its server importing torch (as the sweep's pool asks, so
    either may start it). A process forked from it starts with the environment and folder
    of the server's start, not of now."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def _as_called(rank: int, environ: dict[str, str], cwd: str, target: str,
               args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(rank, *args)  # imported in that environment


def spawn(target: str, args: tuple, nprocs: int) -> None:
    """As ``torch.multiprocessing.spawn``: ``target`` ("module:function") called with each
    rank and ``args`` in ``nprocs`` processes, joined; one that raises raises here. Each
    runs in this process's environment and folder of now, as a spawned one would."""
    context()
    torch_mp.start_processes(_as_called, args=(dict(os.environ), os.getcwd(), target, args),
                             nprocs=nprocs, join=True, start_method="forkserver")
