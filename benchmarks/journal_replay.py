"""What a finished sweep's journal says about tuning the sweep itself.

    python benchmarks/journal_replay.py JOURNAL [--untimed 8] [--keep 2]

From the ok rows, in plan order (each route's parameter sets most promising
first): the kernel time inside the sweep (median x repetitions, and with
``--untimed`` untimed runs per candidate added); per route, how often each
parameter set index was the fastest; how much slower the table's picks would be
had each route kept only its first ``--keep`` sets; and how many candidates a
race (stop when over RATIO x the problem's best so far) would have stopped.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter, defaultdict
from pathlib import Path

from mlatune.sweep.journal import read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("journal", type=Path)
    parser.add_argument("--untimed", type=int, default=8,
                        help="untimed runs per candidate (checks, warm-up, capture)")
    parser.add_argument("--keep", type=int, default=2)
    args = parser.parse_args()
    ok = [r for r in read(args.journal)[1] if r["status"] == "ok"]
    timed = sum(r["time_us"] * r["reps"] for r in ok) * 1e-6
    untimed = sum(r["time_us"] * args.untimed for r in ok) * 1e-6
    print(f"{len(ok)} ok candidates; kernel time {timed:.0f} s timed, "
          f"{timed + untimed:.0f} s with {args.untimed} untimed runs each")

    by_route: dict[tuple[str, str], list[float]] = defaultdict(list)  # (key, route) -> times
    for r in ok:
        by_route[repr(sorted(r["key"].items())), r["route"]].append(r["time_us"])
    wins: dict[str, Counter] = defaultdict(Counter)
    for (_, route), times in by_route.items():
        wins[route][times.index(min(times))] += 1
    for route, counts in sorted(wins.items()):
        print(f"{route}: fastest parameter set by index "
              + ", ".join(f"{i}: {n}" for i, n in sorted(counts.items())))

    best_all: dict[str, float] = defaultdict(lambda: math.inf)
    best_kept: dict[str, float] = defaultdict(lambda: math.inf)
    for (key, _), times in by_route.items():
        best_all[key] = min(best_all[key], min(times))
        best_kept[key] = min(best_kept[key], min(times[:args.keep]))
    slow = sorted(best_kept[k] / best_all[k] for k in best_all)
    geomean = math.exp(sum(math.log(s) for s in slow) / len(slow))
    print(f"keeping {args.keep} sets per route: picks slower by {geomean - 1:.1%} geomean, "
          f"{slow[len(slow) // 2] - 1:.2%} median, {slow[-1] - 1:.1%} at most; "
          f"over 1% on {sum(s > 1.01 for s in slow)} of {len(slow)} problems")

    for ratio in (1.5, 1.25):
        best: dict[str, float] = defaultdict(lambda: math.inf)
        raced = 0
        for r in ok:  # plan order: a problem's candidates one after another
            key = repr(sorted(r["key"].items()))
            raced += r["time_us"] > ratio * best[key]
            best[key] = min(best[key], r["time_us"])
        print(f"racing at {ratio}x would stop {raced} of {len(ok)} candidates")


if __name__ == "__main__":
    main()
