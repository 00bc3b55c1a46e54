"""How well the dispatcher's ``nearest`` answer does, judged on measured problems.

    python benchmarks/nearest_loo.py TABLE JOURNAL [--heldout TABLE2 JOURNAL2]

Leave-one-out: for every measured problem of TABLE, a dispatcher built from the
table without that problem answers it (by ``nearest`` from the rest of its
bucket), and the answer is timed from JOURNAL, the sweep's record of every
candidate it ran there. With ``--heldout``, also TABLE's dispatcher on the
problems of a held-out sweep (TABLE2, JOURNAL2), as ``mlatune report`` judges it.

For each: regret = the chosen route's time / the problem's best time - 1, by
route (the route at its best parameters there) and with the parameters the
dispatcher passes (NaN where the sweep did not run those). Runs on the CPU with
a stand-in device. Numbers only. benchmarks/predict_loo.py reuses its parts.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlatune import table
from mlatune.arch import DeviceInfo
from mlatune.dispatch import Dispatcher, device_for_arch, dispatcher
from mlatune.problem import MLAProblem
from mlatune.report import Timed, candidate_times, geomean, nearest_regret, one_device, time_with
from mlatune.routes import Route
from mlatune.table.winners_map import problem_of


def summary(label: str, regrets: list[tuple[float, float]]) -> None:
    """Print one judged set: (by route, with parameters) regret per problem."""
    def line(what: str, values: list[float]) -> str:
        timed = sorted(v for v in values if not math.isnan(v))
        if not timed:
            return f"  {what}: nothing timed"
        geo = geomean([1 + v for v in timed]) - 1
        p90 = timed[int(0.9 * (len(timed) - 1))]
        over = sum(v > 0.10 for v in timed)
        return (f"  {what}: {len(timed)} timed, geomean +{100 * geo:.2f}%, "
                f"p90 +{100 * p90:.1f}%, max +{100 * timed[-1]:.1f}%, {over} over 10%")
    print(f"{label}: {len(regrets)} problems")
    print(line("by route        ", [r for r, _ in regrets]))
    print(line("with parameters ", [p for _, p in regrets]))


def best_times(timed: Timed) -> dict[str, float]:
    """Problem key -> its fastest ok candidate's time over every route and parameter set."""
    best: dict[str, float] = {}
    for (key, _), runs in timed.items():
        for _, time_us in runs:
            best[key] = min(best.get(key, math.inf), time_us)
    return best


def regret(timed: Timed, best: dict[str, float], problem: MLAProblem, route_id: str,
           params: Mapping[str, Any], device) -> tuple[float, float]:
    """(by route, with parameters): the route at its best parameters there, and called
    with ``params``, over the problem's best time, minus 1 (NaN: not timed)."""
    route_runs = [t for _, t in timed.get((problem.key, route_id), ())]
    by_route = min(route_runs) / best[problem.key] - 1 if route_runs else math.nan
    chosen = time_with(timed, problem, route_id, params, device)
    return by_route, chosen / best[problem.key] - 1


@dataclass
class Measured:
    """A table's dispatcher entries and its sweep's journal, for a stand-in device."""

    device: DeviceInfo
    routes: dict[str, Route]
    entries: list
    timed: Timed
    best: dict[str, float]

    @classmethod
    def load(cls, table_path: Path, journal_path: Path) -> Measured:
        arch, name, cus = one_device(table.read(table_path), table_path)
        routes = dispatcher.registered_routes()
        entries, _, _ = dispatcher._FrameSource(table_path).entries((arch, name, cus),
                                                                  set(routes))
        timed = candidate_times(journal_path)
        return cls(device_for_arch(arch, name, cus), routes, entries, timed, best_times(timed))

    def judged(self) -> Iterator[tuple[tuple, MLAProblem]]:
        """Each entry that leave-one-out can judge: not alone in its bucket, and with an
        ok run to judge by."""
        in_bucket: dict[tuple, int] = {}
        for _, bucket, *_ in self.entries:
            in_bucket[bucket] = in_bucket.get(bucket, 0) + 1
        for entry in self.entries:
            if in_bucket[entry[1]] >= 2 and entry[0] in self.best:
                yield entry, problem_of(entry[0])


def nearest_loo(measured: Measured) -> tuple[dict[str, tuple[float, float]], int]:
    """Per judged problem key, the regret of the ``nearest`` answer of a dispatcher built
    without it; also how many were answered by rule instead (left out)."""
    regrets, skipped = {}, 0
    for entry, problem in measured.judged():
        rest = Dispatcher(measured.device, [e for e in measured.entries if e is not entry],
                          routes=measured.routes, planning=True, unmeasured="nearest")
        choice = rest.select(problem)
        if choice.source != "nearest":  # no neighbour's winner serves it: the rule answers
            skipped += 1
            continue
        regrets[problem.key] = regret(measured.timed, measured.best, problem, choice.route_id,
                                      choice.params, measured.device)
    return regrets, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("journal", type=Path)
    parser.add_argument("--heldout", nargs=2, type=Path, metavar=("TABLE2", "JOURNAL2"))
    args = parser.parse_args()
    measured = Measured.load(args.table, args.journal)
    regrets, skipped = nearest_loo(measured)
    summary(f"leave-one-out on {args.table} ({skipped} answered by rule, left out)",
            list(regrets.values()))
    if args.heldout:
        held_table, held_journal = args.heldout
        _, judged, _ = nearest_regret(args.table, table.read(held_table), measured.device,
                                      candidate_times(held_journal))
        summary(f"held-out {held_table} (problems with an ok run)",
                list(zip(judged["regret"], judged["params_regret"], strict=True)))


if __name__ == "__main__":
    main()
