"""Where the dispatcher's predicted answers lose: leave-one-out on the table, and a
held-out check, on the CPU from a table and sweep journals.

    python benchmarks/heldout_regret.py loo [--table T] [--journal J ...] [--show N] [--errors]
    python benchmarks/heldout_regret.py heldout [--table T] [--heldout H] [--journal HJ]
                                                [--show N]

``loo`` (the development metric): every measured problem of the table whose bucket holds
another point is answered by the dispatcher's predictor without that problem's rows
(every route's), as ``select`` answers an unmeasured shape (the routes the capability
rules let serve it, planning for the table's device), and the answer is timed from the
sweep's journal (every parameter set each route ran there). ``--errors`` adds each
route's prediction error at the left-out points (its predicted time, the least over its
recipes, against its measured step cost there).

``heldout`` (a check, never a thing to tune on): the dispatcher loaded from the table
answers the held-out sweep's problems, timed from that sweep's journal; also the figure
``mlatune report --heldout`` gives (mlatune.report.metrics.nearest_regret).

Regret = the time of the pick / the problem's best time over every route and parameter
set - 1, "by route" (the picked route at its best parameters there) and "with params" (the
parameters the dispatcher passes; NaN where the sweep did not run them: a miss), in two
currencies: launch times (the kernel alone) and step costs, what the dispatcher ranks by
and ``mlatune report`` judges by (``dispatch.step_cost``: the launch plus the share of its
plan a call pays, 61 calls sharing a plan). The predictor predicts step costs, so they
judge the model; launch regret adds the places where a plan's share changes the best
(FlashInfer's host plan, 19 us a call, at small shapes). Per problem (``--show N``: the N
worst by step-cost regret with params; -1 all): the pick, its predicted cost, the measured
cost of the pick and of the best, the regrets. Numbers only.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlatune import table
from mlatune.dispatch import Dispatcher, device_for_arch
from mlatune.dispatch.observations import rows_from_journal
from mlatune.dispatch.predict import Predictor
from mlatune.problem import MLAProblem
from mlatune.report.metrics import candidate_times, nearest_regret, one_device, params_as_run

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "tables/sm_90-h200.parquet"
# The journals of every sweep whose rows the shipped table holds, in the order they were
# applied (tables/journals/sm_90-h200/REBUILD.md): a later journal's runs of a problem and
# route replace an earlier one's. The held-out table is the one `mlatune report --heldout`
# judges the shipped table by.
JOURNAL_DIR = ROOT / "tables/journals/sm_90-h200"
JOURNALS = sorted(JOURNAL_DIR.glob("[0-9]-*.journal.jsonl.gz"))
HELDOUT = JOURNAL_DIR / "heldout/sm_90-traffic-s23.parquet"
HELDOUT_JOURNAL = JOURNAL_DIR / "heldout/sm_90-traffic-s23.journal.jsonl.gz"
CURRENCIES = ("cost", "launch")

# (problem key, route) -> [(params as run, us)]
Runs = dict[tuple[str, str], list[tuple[dict, float]]]


class Timings:
    """Sweep journals' ok candidates, timed in both currencies; a later journal's runs of a
    (problem, route) replace an earlier one's (a route re-timed)."""

    def __init__(self, journals: list[Path], dispatcher: Dispatcher):
        sharing = frozenset(r for r, route in dispatcher.routes.items()
                            if getattr(route, "shares_plan", False))
        self.runs: dict[str, Runs] = {"launch": {}, "cost": {}}
        for journal in journals:
            cost: Runs = {}
            for problem, route_id, params, us in rows_from_journal(
                    journal, plan_calls=dispatcher.plan_calls, sharing=sharing):
                cost.setdefault((problem.key, route_id), []).append((params, us))
            self.runs["cost"].update(cost)
            self.runs["launch"].update(candidate_times(journal))
        self.best: dict[str, dict[str, tuple[float, str]]] = {}
        for currency, runs in self.runs.items():
            best: dict[str, tuple[float, str]] = {}
            for (key, route_id), ran in runs.items():
                for _, us in ran:
                    if us < best.get(key, (math.inf, ""))[0]:
                        best[key] = (float(us), route_id)
            self.best[currency] = best
        self.device = dispatcher.device

    def problems(self) -> list[MLAProblem]:
        return sorted({MLAProblem.from_key(k) for k in self.best["cost"]}, key=lambda p: p.key)

    def of(self, currency: str, problem: MLAProblem, route_id: str, params) -> tuple[float, float]:
        """(the route at its best parameters there, called with ``params``); NaN: not run."""
        ran = self.runs[currency].get((problem.key, route_id), ())
        as_run = params_as_run(route_id, problem, self.device)  # both read as the route does
        want = as_run(params)
        with_params = next((float(us) for p, us in ran if as_run(p) == want), math.nan)
        return (min(us for _, us in ran) if ran else math.nan), with_params


@dataclass
class Judged:
    """One answered problem, in both currencies."""

    problem: MLAProblem
    route_id: str
    params: dict
    predicted_us: float  # the predicted step cost (NaN: not a predicted answer)
    uncertainty: float
    picked: dict[str, tuple[float, float]]  # currency -> (route best, with params)
    best: dict[str, tuple[float, str]]  # currency -> (best time, its route)

    def regret(self, currency: str, with_params: bool) -> float:
        return self.picked[currency][with_params] / self.best[currency][0] - 1


def judge(timings: Timings, problem: MLAProblem, route_id: str, params,
          predicted_us: float = math.nan, uncertainty: float = math.nan) -> Judged:
    return Judged(problem, route_id, dict(params), predicted_us, uncertainty,
                  {c: timings.of(c, problem, route_id, params) for c in CURRENCIES},
                  {c: timings.best[c][problem.key] for c in CURRENCIES})


def summary(label: str, judged: list[Judged]) -> None:
    print(f"{label}: {len(judged)} problems")
    for currency in CURRENCIES:
        for with_params in (False, True):
            values = [j.regret(currency, with_params) for j in judged]
            timed = np.sort([v for v in values if not math.isnan(v)])
            what = f"{currency:6s} {'with params' if with_params else 'by route   '}"
            if not len(timed):
                print(f"  {what}: nothing timed")
                continue
            geo = math.expm1(float(np.mean(np.log1p(timed))))
            print(f"  {what}: geomean +{100 * geo:.2f}%, median +{100 * np.median(timed):.2f}%, "
                  f"p90 +{100 * timed[int(0.9 * (len(timed) - 1))]:.1f}%, worst "
                  f"+{100 * timed[-1]:.1f}%, {int((timed > 0.10).sum())} over 10%, "
                  f"{len(values) - len(timed)} not timed")


def calibration(label: str, judged: list[Judged]) -> None:
    """How far the predicted step costs of the picks were from their measured ones (with
    the parameters passed), against the uncertainty the predictor gave."""
    pairs = [(j.uncertainty, abs(math.log(j.picked["cost"][1] / j.predicted_us)))
             for j in judged if not math.isnan(j.predicted_us)
             and not math.isnan(j.picked["cost"][1])]
    if not pairs:
        return
    data = np.array(pairs)
    within = float(np.mean(data[:, 1] <= np.log1p(data[:, 0])))
    median, p90 = (100 * math.expm1(np.quantile(data[:, 1], q)) for q in (0.5, 0.9))
    print(f"  {label}: the picks' predicted step costs off by {median:.1f}% in median, "
          f"{p90:.1f}% p90; {100 * within:.0f}% within their uncertainty (median "
          f"{100 * np.median(data[:, 0]):.0f}%)")


def show(judged: list[Judged], count: int, currency: str = "cost") -> None:
    if not count:
        return
    ordered = sorted(judged, key=lambda j: -np.nan_to_num(j.regret(currency, True), nan=9.0))
    print(f"  worst by {currency} with params: problem | pick | predicted us | pick us (route "
          "best / with params) | best | regret (route / params) | uncertainty")
    for j in ordered if count < 0 else ordered[:count]:
        (route_us, params_us), (best_us, best_route) = j.picked[currency], j.best[currency]
        print(f"  {j.problem.label} | {j.route_id} | {j.predicted_us:.1f} | {route_us:.1f}"
              f" / {params_us:.1f} | {best_route} {best_us:.1f} | "
              f"+{100 * j.regret(currency, False):.1f}% / +{100 * j.regret(currency, True):.1f}%"
              f" | {100 * j.uncertainty:.0f}%")


def by_axis(judged: list[Judged], currency: str = "cost") -> None:
    """Geomean regret with params (and the count over 10%) per value of each axis."""
    print(f"  by axis ({currency}, with params):")
    for axis in ("num_heads", "qlen", "kv_dtype", "dcp_size", "page_size", "batch"):
        groups: dict = defaultdict(list)
        for j in judged:
            value = j.regret(currency, True)
            if not math.isnan(value):
                groups[getattr(j.problem, axis)].append(value)
        cells = ", ".join(f"{k}: +{100 * math.expm1(np.mean(np.log1p(v))):.2f}% "
                          f"({sum(x > 0.1 for x in v)})" for k, v in sorted(groups.items()))
        print(f"    {axis}: {cells}")


def load(table_path: Path) -> Dispatcher:
    arch, name, cus = one_device(table.read(table_path), table_path)
    return Dispatcher.load(table_path, device_for_arch(arch, name, cus), allow_arch=arch)


def usable_for(dispatcher: Dispatcher, problem: MLAProblem) -> Callable[[str], bool]:
    return lambda route_id: dispatcher._supports(route_id, problem, None)


def leave_one_out(dispatcher: Dispatcher, timings: Timings, errors: bool = False
                  ) -> tuple[list[Judged], dict[str, list[float]]]:
    """Each measured problem (with a neighbour in its bucket and an ok run in the journal)
    answered by the dispatcher's predictor without its rows; with ``errors`` also each
    route's log prediction error there."""
    predictor: Predictor = dispatcher._ensure_predictor()
    out, route_errors = [], defaultdict(list)
    for key in dispatcher._winner:
        problem = MLAProblem.from_key(key)
        if key not in timings.best["cost"]:
            continue
        rest = predictor.without(problem)
        if problem.bucket not in rest._buckets:
            continue
        usable = usable_for(dispatcher, problem)
        found = rest.choose(problem, usable)
        if found is None:
            continue
        prediction, params = found
        out.append(judge(timings, problem, prediction.route_id, params, prediction.time_us,
                         prediction.uncertainty))
        if errors:
            measured = {c.route_id: c.time_us for c in dispatcher._ranked(key)}
            predicted: dict[str, float] = {}
            for p in rest.predict(problem, usable):
                predicted[p.route_id] = min(predicted.get(p.route_id, math.inf), p.time_us)
            for route_id, us in predicted.items():
                if route_id in measured:
                    route_errors[route_id].append(math.log(us / measured[route_id]))
    return out, route_errors


def heldout(dispatcher: Dispatcher, problems: Iterable[MLAProblem], timings: Timings
            ) -> list[Judged]:
    out = []
    for problem in problems:
        choice = dispatcher.select(problem)
        out.append(judge(timings, problem, choice.route_id, choice.params,
                         choice.time_us if choice.source == "predicted" else math.nan,
                         choice.uncertainty))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("loo", "heldout"))
    parser.add_argument("--table", type=Path, default=TABLE)
    parser.add_argument("--journal", type=Path, action="append",
                        help="a sweep journal that times the answers (loo: the table's, "
                        "default: the journals of every sweep whose rows the shipped table "
                        "holds; heldout: the held-out "
                        "sweep's); repeated, a later one's runs of a problem's route replace "
                        "an earlier one's")
    parser.add_argument("--heldout", type=Path, default=HELDOUT)
    parser.add_argument("--show", type=int, default=10)
    parser.add_argument("--errors", action="store_true")
    args = parser.parse_args()
    dispatcher = load(args.table)
    if args.mode == "loo":
        timings = Timings(args.journal or JOURNALS, dispatcher)
        start = time.perf_counter()
        judged, errors = leave_one_out(dispatcher, timings, args.errors)
        print(f"leave-one-out on {args.table} ({time.perf_counter() - start:.0f} s)")
        summary(" all", judged)
        inside = [j for j in judged if _interior(dispatcher, j.problem)]
        summary(" interior (measured batches and KV lengths on both sides)", inside)
        calibration("all", judged)
        calibration("interior", inside)
        by_axis(judged)
        show(judged, args.show)
        for route_id, values in sorted(errors.items()):
            e = np.abs(values)
            print(f"  {route_id}: {len(e)} points, |log error| median {np.median(e):.3f}, "
                  f"p90 {np.quantile(e, 0.9):.3f}, mean error {np.mean(values):+.3f}")
        return
    timings = Timings(args.journal or [HELDOUT_JOURNAL], dispatcher)
    judged = heldout(dispatcher, timings.problems(), timings)
    summary(f"held-out {args.heldout}", judged)
    calibration("held-out", judged)
    by_axis(judged)
    show(judged, args.show)
    show(judged, args.show, "launch")
    stats, _, _ = nearest_regret(args.table, table.read(args.heldout), dispatcher.device,
                                 timings.runs["launch"])
    print(f" mlatune report --heldout: {stats.judged} judged, the winner's route for "
          f"{stats.picked_winner}; by route geomean +{100 * stats.geomean:.2f}%, worst "
          f"+{100 * stats.max:.1f}%; with params geomean +{100 * stats.params_geomean:.2f}%, "
          f"worst +{100 * stats.params_max:.1f}%")


_SIZES: dict[int, dict[tuple, tuple[list[int], list[int]]]] = {}


def _interior(dispatcher: Dispatcher, problem: MLAProblem) -> bool:
    """Whether the bucket measured batches and KV lengths on both sides of the problem's."""
    sizes = _SIZES.get(id(dispatcher))
    if sizes is None:
        found: dict[tuple, tuple[set, set]] = {}
        for key in dispatcher._winner:
            p = MLAProblem.from_key(key)
            b, k = found.setdefault(p.bucket, (set(), set()))
            b.add(p.batch)
            k.add(p.kv_len)
        sizes = _SIZES[id(dispatcher)] = {bucket: (sorted(b), sorted(k))
                                          for bucket, (b, k) in found.items()}
    batches, kvs = sizes[problem.bucket]
    return batches[0] < problem.batch < batches[-1] and kvs[0] < problem.kv_len < kvs[-1]


if __name__ == "__main__":
    main()
