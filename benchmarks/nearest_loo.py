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
a stand-in device. Numbers only.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from mlatune import dispatch, table
from mlatune.dispatch import Dispatcher, device_for_arch
from mlatune.problem import MLAProblem
from mlatune.report import Timed, candidate_times, time_with
from mlatune.schema import KEY_COLUMNS
from mlatune.winners import problem_of


def _summary(label: str, regrets: list[tuple[float, float]]) -> None:
    def line(what: str, values: list[float]) -> str:
        timed = sorted(v for v in values if not math.isnan(v))
        if not timed:
            return f"  {what}: nothing timed"
        geo = math.exp(sum(math.log1p(v) for v in timed) / len(timed)) - 1
        p90 = timed[int(0.9 * (len(timed) - 1))]
        over = sum(v > 0.10 for v in timed)
        return (f"  {what}: {len(timed)} timed, geomean +{100 * geo:.2f}%, "
                f"p90 +{100 * p90:.1f}%, max +{100 * timed[-1]:.1f}%, {over} over 10%")
    print(f"{label}: {len(regrets)} problems")
    print(line("by route        ", [r for r, _ in regrets]))
    print(line("with parameters ", [p for _, p in regrets]))


def _best_times(timed: Timed) -> dict[str, float]:
    """Problem key -> its fastest ok candidate's time over every route and parameter set."""
    best: dict[str, float] = {}
    for (key, _), runs in timed.items():
        for _, time_us in runs:
            best[key] = min(best.get(key, math.inf), time_us)
    return best


def _regret(timed: Timed, best: dict[str, float], problem: MLAProblem, choice, device
            ) -> tuple[float, float]:
    route_runs = [t for _, t in timed.get((problem.key, choice.route_id), ())]
    by_route = min(route_runs) / best[problem.key] - 1 if route_runs else math.nan
    chosen = time_with(timed, problem, choice.route_id, choice.params, device)
    return by_route, chosen / best[problem.key] - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("journal", type=Path)
    parser.add_argument("--heldout", nargs=2, type=Path, metavar=("TABLE2", "JOURNAL2"))
    args = parser.parse_args()
    frame = table.read(args.table)
    devices = list(frame[["arch", "device_name", "cu_count"]].drop_duplicates()
                   .itertuples(index=False, name=None))
    if len(devices) != 1:
        raise SystemExit(f"{args.table}: rows of {len(devices)} devices; give one device's table")
    (arch, name, cus), = devices
    device = device_for_arch(arch, name, cus)
    routes = dispatch.registered_routes()
    entries, _, _ = dispatch._FrameSource(args.table).entries(devices[0], set(routes))
    timed = candidate_times(args.journal)
    best = _best_times(timed)
    in_bucket: dict[tuple, int] = {}
    for _, bucket, *_ in entries:
        in_bucket[bucket] = in_bucket.get(bucket, 0) + 1
    regrets, skipped = [], 0
    for entry in entries:
        key, bucket = entry[0], entry[1]
        problem = problem_of(key)
        if in_bucket[bucket] < 2 or key not in best:
            continue  # alone in its bucket, or nothing ran ok there to judge by
        rest = Dispatcher(device, [e for e in entries if e is not entry], routes=routes)
        choice = rest.select(problem)
        if choice.source != "nearest":  # no neighbour's winner serves it: the rule answers
            skipped += 1
            continue
        regrets.append(_regret(timed, best, problem, choice, device))
    _summary(f"leave-one-out on {args.table} ({skipped} answered by rule, left out)", regrets)
    if args.heldout:
        held_table, held_journal = args.heldout
        dispatcher = Dispatcher.load(args.table, device=device, allow_arch=arch)
        held_timed = candidate_times(held_journal)
        held_best = _best_times(held_timed)
        keys = table.read(held_table).drop_duplicates(list(KEY_COLUMNS))
        problems = [MLAProblem.from_key_dict(row) for row in keys.to_dict("records")]
        regrets = [_regret(held_timed, held_best, p, dispatcher.select(p), device)
                   for p in problems if p.key in held_best]
        _summary(f"held-out {held_table} ({len(problems) - len(regrets)} without an ok run, "
                 f"left out)", regrets)


if __name__ == "__main__":
    main()
