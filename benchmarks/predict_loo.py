"""Predicting unmeasured shapes, judged on measured ones: ``nearest`` against
mlatune.dispatch.predict.

    python benchmarks/predict_loo.py TABLE JOURNAL [--heldout TABLE2 JOURNAL2]

Leave-one-out on TABLE, as benchmarks/nearest_loo.py does (whose code this reuses):
each measured problem is answered without its own measurements and the answer is
timed from JOURNAL, the sweep's record of every candidate it ran. Three answers:

- (a) the dispatcher's ``nearest``: the nearest point's winner, its sized parameters
  redone for the problem;
- (b) ``mlatune.dispatch.predict`` fitted on JOURNAL (every parameter set of every route);
- (b') ``mlatune.dispatch.predict`` fitted on TABLE alone (each route's best per problem).

With ``--heldout``, the same three answers from all of TABLE and JOURNAL on the
problems of a held-out sweep, timed from its journal. Regret = the chosen time / the
problem's best time - 1, by route (at its best parameters there) and with the
parameters passed. Also: the predictor's cost per answer, and how its uncertainty
relates to its errors. Runs on the CPU with a stand-in device.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from nearest_loo import Measured, best_times, nearest_loo, regret, summary

from mlatune import capability, table
from mlatune.dispatch import Dispatcher
from mlatune.dispatch.predict import Predictor, rows_from_journal, rows_from_table
from mlatune.problem import MLAProblem
from mlatune.report import candidate_times
from mlatune.table.winners_map import problem_of

Regrets = dict[str, tuple[float, float]]
# (uncertainty of the chosen prediction, |log(measured / predicted time)|, regret)
Calibration = list[tuple[float, float, float]]


def _usable(measured: Measured, problem: MLAProblem) -> Callable[[str], bool]:
    """As the dispatcher asks when planning for the table's device: the route is
    registered here and the capability rules let it serve the problem (this machine's
    libraries do not count: FlashMLA need not be installed to judge its rows)."""
    def usable(route_id: str) -> bool:
        route = measured.routes.get(route_id)
        if route is None:
            return False
        if capability.known(route_id):
            return capability.check(route_id, problem, measured.device.arch).ok
        try:
            return bool(route.supports(problem, measured.device).ok)
        except Exception:
            return False
    return usable


def _judge(predictor: Predictor, measured: Measured, problem: MLAProblem, timed, best,
           calibration: Calibration | None = None) -> tuple[float, float] | None:
    """The predictor's answer at ``problem``, judged from ``timed``; None: no answer."""
    chosen = predictor.choose(problem, _usable(measured, problem))
    if chosen is None:
        return None
    prediction, params = chosen
    result = regret(timed, best, problem, prediction.route_id, params, measured.device)
    if calibration is not None and not math.isnan(result[1]):
        actual = (1 + result[1]) * best[problem.key]
        calibration.append((prediction.uncertainty, abs(math.log(actual / prediction.time_us)),
                            result[1]))
    return result


def predictor_loo(predictor: Predictor, measured: Measured,
                  calibration: Calibration | None = None) -> Regrets:
    """Per judged problem, the answer of the predictor without that problem's data."""
    out = {}
    for _, problem in measured.judged():
        judged = _judge(predictor.without(problem), measured, problem, measured.timed,
                        measured.best, calibration)
        if judged is not None:
            out[problem.key] = judged
    return out


def _interior(measured: Measured) -> set[str]:
    """Judged problems with measured batches and KV lengths on both sides in their bucket
    (leave-one-out of them interpolates; the others extrapolate)."""
    sizes: dict[tuple, list[tuple[int, int]]] = {}
    for _, bucket, batch, kv_len, *_ in measured.entries:
        sizes.setdefault(bucket, []).append((batch, kv_len))
    inside = set()
    for _, problem in measured.judged():
        batches, kvs = zip(*sizes[problem.bucket], strict=True)
        if min(batches) < problem.batch < max(batches) and min(kvs) < problem.kv_len < max(kvs):
            inside.add(problem.key)
    return inside


def heldout(measured: Measured, table_path: Path, predictors: dict[str, Predictor],
            journal_path: Path, calibration: Calibration) -> dict[str, Regrets]:
    """The main table's answers on a held-out sweep's problems, timed from its journal."""
    timed = candidate_times(journal_path)
    best = best_times(timed)
    dispatcher = Dispatcher.load(table_path, measured.device, allow_arch=measured.device.arch,
                                 unmeasured="nearest")
    out: dict[str, Regrets] = {"(a) nearest": {}, **{name: {} for name in predictors}}
    for key in sorted(best):
        problem = problem_of(key)
        choice = dispatcher.select(problem)
        out["(a) nearest"][key] = regret(timed, best, problem, choice.route_id, choice.params,
                                         measured.device)
        for name, predictor in predictors.items():
            judged = _judge(predictor, measured, problem, timed, best,
                            calibration if name.startswith("(b) ") else None)
            if judged is not None:
                out[name][key] = judged
    return out


def cost_per_answer(predictor: Predictor, problems: Iterable[MLAProblem], repeats: int = 5
                    ) -> tuple[float, float]:
    """Median microseconds of ``predict`` and of ``choose`` (which sizes the parameters),
    each call a first one: the predictor remembers nothing."""
    problems = list(problems)
    timings: dict[str, list[float]] = {"predict": [], "choose": []}
    for _ in range(repeats):
        for problem in problems:
            for name, call in (("predict", predictor.predict), ("choose", predictor.choose)):
                start = time.perf_counter()
                call(problem)
                timings[name].append((time.perf_counter() - start) * 1e6)
    return float(np.median(timings["predict"])), float(np.median(timings["choose"]))


def _calibration_lines(calibration: Calibration) -> None:
    """How the chosen prediction's uncertainty relates to its time error and regret."""
    data = np.array(calibration)
    edges = [0.0, 0.02, 0.05, 0.1, 0.2, math.inf]
    print("  uncertainty band: problems, median |time error|, share within the "
          "uncertainty, geomean regret")
    for low, high in itertools.pairwise(edges):
        band = data[(data[:, 0] >= low) & (data[:, 0] < high)]
        if len(band):
            error = np.expm1(np.median(band[:, 1]))
            within = np.mean(band[:, 1] <= np.log1p(band[:, 0]))
            geo = np.expm1(np.mean(np.log1p(band[:, 2])))
            print(f"    [{low:.2f}, {high:.2f}): {len(band)}, {100 * error:.1f}%, "
                  f"{100 * within:.0f}%, +{100 * geo:.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("journal", type=Path)
    parser.add_argument("--heldout", nargs=2, type=Path, metavar=("TABLE2", "JOURNAL2"))
    args = parser.parse_args()
    measured = Measured.load(args.table, args.journal)
    # The routes whose host plan a step's layers share, as the dispatcher costs them.
    sharing = frozenset(r for r, route in measured.routes.items()
                        if getattr(route, "shares_plan", False))
    predictors = {
        "(b) predictor, journal": Predictor(rows_from_journal(args.journal, sharing=sharing),
                                            measured.routes, measured.device),
        "(b') predictor, table alone": Predictor(
            rows_from_table(table.read(args.table), sharing=sharing), measured.routes,
            measured.device, complete=False),
    }
    calibration: Calibration = []
    loo = {"(a) nearest": nearest_loo(measured)[0]}
    for name, predictor in predictors.items():
        loo[name] = predictor_loo(predictor, measured,
                                  calibration if name.startswith("(b) ") else None)
    inside = _interior(measured)
    print(f"leave-one-out on {args.table}:")
    for name, regrets in loo.items():
        summary(f" {name}, all", list(regrets.values()))
        summary(f" {name}, interior", [r for k, r in regrets.items() if k in inside])
    held_calibration: Calibration = []
    if args.heldout:
        held_table, held_journal = args.heldout
        print(f"held-out {held_table}:")
        for name, regrets in heldout(measured, args.table, predictors, held_journal,
                                     held_calibration).items():
            summary(f" {name}", list(regrets.values()))
        problems = [problem_of(k) for k in best_times(candidate_times(held_journal))]
    else:  # shapes next to the measured ones: a measured one costs less (nothing to size)
        problems = [p.with_(batch=p.batch + 1) for _, p in measured.judged()]
    for name, predictor in predictors.items():
        problems = [p for p in problems if not predictor.measured(p)]
        predict_us, choose_us = cost_per_answer(predictor, problems)
        print(f"cost per answer, {name}: predict {predict_us:.0f} us, choose (with "
              f"params_at) {choose_us:.0f} us (median over {len(problems)} problems x 5)")
    print("(b) uncertainty, leave-one-out:")
    _calibration_lines(calibration)
    if held_calibration:
        print("(b) uncertainty, held-out:")
        _calibration_lines(held_calibration)


if __name__ == "__main__":
    main()
