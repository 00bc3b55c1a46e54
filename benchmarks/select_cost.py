"""select() latency of a real table on a spec's problems, first call and repeated.

    python benchmarks/select_cost.py TABLE SPEC [--arch sm_90] [--name "NVIDIA H200"] [--cus 132]

Loads TABLE in a Dispatcher for a stand-in device (so it runs on any machine),
then times ``select`` on every problem of SPEC one call at a time: the first
call resolves the problem (supports() checks and, for a nearest answer, the
route's parameters redone for its sizes), later calls find it in the memo.
Numbers only.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mlatune.dispatch import Dispatcher, device_for_arch
from mlatune.sweep.spec import load


def _quantile_us(ns: list[int], q: float) -> float:
    ordered = sorted(ns)
    return ordered[int(q * (len(ordered) - 1))] / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("spec", type=Path)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--name", default="NVIDIA H200")
    parser.add_argument("--cus", type=int, default=132)
    args = parser.parse_args()
    device = device_for_arch(args.arch, args.name, args.cus)
    dispatcher = Dispatcher.load(args.table, allow_arch=args.arch, device=device)
    problems = load(args.spec).problems
    for label in ("first", "again"):
        ns = []
        for problem in problems:
            t0 = time.perf_counter_ns()
            dispatcher.select(problem)
            ns.append(time.perf_counter_ns() - t0)
        print(f"{label}: {len(ns)} problems, p50 {_quantile_us(ns, 0.5):.2f} us, "
              f"p99 {_quantile_us(ns, 0.99):.2f} us")


if __name__ == "__main__":
    main()
