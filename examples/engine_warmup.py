"""An engine that tunes its buckets at model load, then serves from CUDA graphs without
compiling or timing anything.

    python examples/engine_warmup.py                  # on a GPU: 30 s of tuning, 200 steps
    python examples/engine_warmup.py --budget 10 --steps 50

At load: the shapes this engine serves (its batch buckets x its heads per rank, one query
token, bf16, pages of 64, graphs captured at the cache's capacity) go to
``mlatune.tune_at_load``, which times, within the budget, the candidates of those the
table does not measure and merges them into the user table; ``Dispatcher.from_bundled()``
then serves the bundled table with the user table over it. Warm-up: per bucket an eager
``attention.decode`` step (chooses, compiles, prepares) and a CUDA graph of it
(``examples/engine_loop.py``'s engine). Serving: every step writes the lengths and
block-table rows in place and replays. Triton's JIT compilations (its post-compile hook:
Triton and Gluon kernels alike) and mlatune's timings (the timer, the tuner's worker
processes) are counted from the end of the warm-up on: both stay zero, or this exits 1.

Heads 12 per rank: a count the bundled grid does not measure (Kimi-class models serve it),
so there is something to tune.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_loop, beside this file

from engine_loop import GPU, Config, Engine, deepseek_softmax_scale, serve

import mlatune
from mlatune.dispatch import Dispatcher
from mlatune.measure import timers
from mlatune.problem import MLAProblem
from mlatune.sweep import pool
from mlatune.sweep.at_load import ServingShapes

WARMUP = replace(GPU, heads=12, buckets=(1, 4, 24), steps=200, check_every=50)


@dataclass
class Served:
    tuned: int  # problems timed at load and written to the user table
    choices: dict[int, tuple[str, str]]  # batch bucket -> (route, source: "table", ...)
    steps: int
    checked: int
    warmup_compilations: int  # Triton JIT compilations while warming up
    compilations: int  # Triton JIT compilations after the warm-up
    timings: int  # mlatune timings or tuning workers started after the warm-up


class Counter:
    """Triton's JIT compilations and mlatune's timings in this process."""

    def __init__(self):
        import triton

        self.compilations, self.timings = 0, 0
        self._knobs = triton.knobs.runtime
        self._previous = self._knobs.jit_post_compile_hook
        self._knobs.jit_post_compile_hook = self._compiled
        self._measure, self._start = timers.measure, pool.WorkerProcess.start
        timers.measure = self._timed(self._measure)
        pool.WorkerProcess.start = self._timed(self._start)

    def _compiled(self, *args, **kwargs):
        self.compilations += 1
        return self._previous(*args, **kwargs) if self._previous else None

    def _timed(self, fn):
        def counted(*args, **kwargs):
            self.timings += 1
            return fn(*args, **kwargs)

        return counted

    def close(self) -> None:
        self._knobs.jit_post_compile_hook = self._previous
        timers.measure, pool.WorkerProcess.start = self._measure, self._start


def serving_shapes(cfg: Config, max_len: int) -> ServingShapes:
    """What this engine serves: a graph is captured per bucket at the cache's capacity."""
    return ServingShapes(batches=cfg.buckets, num_heads=cfg.heads, context=(max_len, max_len),
                         q_dtype="bf16", kv_dtype="bf16", page_size=cfg.page_size)


def run(cfg: Config = WARMUP, budget_s: float = 30.0, seed: int = 0) -> Served:
    random.seed(seed)
    torch.manual_seed(seed)
    max_len = cfg.max_pages_per_request * cfg.page_size
    report = mlatune.tune_at_load(serving_shapes(cfg, max_len), Dispatcher.from_bundled,
                                  budget_s=budget_s)
    print(report.summary())
    dispatcher = Dispatcher.from_bundled()
    choices = {}
    for b in cfg.buckets:
        choice = dispatcher.select(MLAProblem(num_heads=cfg.heads, batch=b, kv_len=max_len,
                                              page_size=cfg.page_size))
        choices[b] = (choice.route_id, choice.source)
    engine = Engine(cfg, dispatcher, deepseek_softmax_scale())
    counter = Counter()
    try:
        engine.capture()  # the warm-up: every bucket chosen, compiled, prepared, captured
        warm = (counter.compilations, counter.timings)
        checked = serve(engine, cfg)
        torch.cuda.synchronize()
    finally:
        counter.close()
    return Served(len(report.tuned), choices, cfg.steps, checked, warm[0],
                  counter.compilations - warm[0], counter.timings - warm[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=30.0, help="seconds of tuning at load")
    parser.add_argument("--steps", type=int, default=WARMUP.steps)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("engine_warmup needs a GPU (CUDA graphs); examples/engine_loop.py --cpu runs "
                 "on the CPU")
    served = run(replace(WARMUP, steps=args.steps), args.budget)
    print(f"buckets {WARMUP.buckets}: (route, source) {served.choices}; warm-up "
          f"{served.warmup_compilations} compilations; {served.steps} steps replayed, "
          f"{served.checked} checked; after the warm-up {served.compilations} compilations, "
          f"{served.timings} timings")
    if served.compilations or served.timings:
        sys.exit(1)


if __name__ == "__main__":
    main()
