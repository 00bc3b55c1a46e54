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


def _regret(timed: Timed, problem: MLAProblem, choice, device) -> tuple[float, float]:
    runs = [t for (key, _), ran in timed.items() if key == problem.key for _, t in ran]
    best = min(runs)
    route_runs = [t for _, t in timed.get((problem.key, choice.route_id), ())]
    by_route = min(route_runs) / best - 1 if route_runs else math.nan
    with_params = time_with(timed, problem, choice.route_id, choice.params, device) / best - 1
    return by_route, with_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("journal", type=Path)
    parser.add_argument("--heldout", nargs=2, type=Path, metavar=("TABLE2", "JOURNAL2"))
    args = parser.parse_args()
    frame = table.read(args.table)
    (arch, name, cus), = frame[["arch", "device_name", "cu_count"]].drop_duplicates() \
        .itertuples(index=False, name=None)
    device = device_for_arch(arch, name, cus)
    routes = dispatch.registered_routes()
    entries, _, _ = dispatch._FrameSource(args.table).entries((arch, name, cus), set(routes))
    timed = candidate_times(args.journal)
    by_bucket: dict[tuple, int] = {}
    for entry in entries:
        by_bucket[entry[1]] = by_bucket.get(entry[1], 0) + 1
    regrets = []
    for entry in entries:
        if by_bucket[entry[1]] < 2:
            continue  # alone in its bucket: nothing to be nearest to
        rest = Dispatcher(device, [e for e in entries if e is not entry], routes=routes)
        problem = problem_of(entry[0])
        choice = rest.select(problem)
        assert choice.source == "nearest", (entry[0], choice)
        regrets.append(_regret(timed, problem, choice, device))
    _summary(f"leave-one-out on {args.table}", regrets)
    if args.heldout:
        held_table, held_journal = args.heldout
        dispatcher = Dispatcher.load(args.table, device=device, allow_arch=arch)
        held_timed = candidate_times(held_journal)
        held = table.read(held_table)
        keys = held.drop_duplicates(list(KEY_COLUMNS))
        regrets = []
        for row in keys.to_dict("records"):
            problem = MLAProblem.from_key_dict(row)
            regrets.append(_regret(held_timed, problem, dispatcher.select(problem), device))
        _summary(f"held-out {held_table}", regrets)


if __name__ == "__main__":
    main()
