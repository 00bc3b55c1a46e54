"""Predicting each route's time at a shape the sweep never measured.

A sweep measures a grid of (batch, kv_len) per bucket (every key field but those
two). At an unmeasured shape of a measured bucket, ``Predictor.choose`` predicts
each parameter recipe's step cost there from the bucket's measured points and
picks the fastest. A recipe is a route with its parameters less the sized ones
(``route.sized_params``: KV splits, which ``routes.params_at`` redoes for the
asked sizes).

The model has two parts, both in log2 (batch, kv_len) space:

- the *envelope*: the bucket's best time at each measured point, fitted locally
  linearly (log time against log sizes). It carries the trend: times grow about
  in proportion to total KV tokens once the device is full.
- each recipe's *slowness*: log(its time / the best time) at each point, averaged
  over the nearest points (a Gaussian kernel whose width follows the distance to
  the nearest point, so it stays local on a dense grid and widens on a sparse
  one). Slowness is bounded and varies slowly where the trend does not, so an
  average of the neighbours' answers beats any one neighbour's: where winners
  change between grid points, each recipe's average margin picks the one that
  loses least on either side.

A recipe's predicted time is envelope x exp(slowness); the choice is the least
slowness, so it does not depend on the envelope. Distance is measured as the
dispatcher's ``point_distance`` does (total KV tokens first, then batch) but with
batch weighted 1, which averages the same-size neighbours with the same-batch ones
(leave-one-out on the H200 journal, benchmarks/predict_loo.py).

Each prediction says how far it is from the data (``distance``: log2 units to the
recipe's nearest measured point) and how much the neighbours disagree
(``spread``: the weighted standard deviation of the recipe's slowness over them);
``uncertainty`` combines the two into a relative error of the predicted time.

Data: a sweep journal holds every parameter set each route ran at each problem
(``rows_from_journal``); a table holds only each route's best per problem
(``rows_from_table``): there a recipe that lost to its route's best at a point is
counted ``LOST_PENALTY`` slower than that best, not left out (which would make
recipes look fast where only their wins were kept).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from mlatune.arch import DeviceInfo
from mlatune.problem import MLAProblem
from mlatune.routes import Route, params_at

__all__ = ["Prediction", "Predictor", "Row", "rows_from_journal", "rows_from_table"]

# (problem, route id, params as run, step cost in us): one measured candidate.
Row = tuple[MLAProblem, str, Mapping[str, Any], float]
_Measured = tuple[float, Mapping[str, Any], MLAProblem]  # one recipe's (cost, params, problem)

BATCH_WEIGHT = 1.0  # of d_batch² in the distance, beside d_tokens² (see the module doc)
SLOWNESS_WIDTH = 0.5  # kernel width over the nearest distance, for slowness
ENVELOPE_WIDTH = 1.0  # wider for the envelope: a linear fit needs three points
# Nearer than this (one doubling of tokens), a kernel keeps this width: next to a
# measured point a plane still rests on its neighbours, not on that point alone.
NEAREST_FLOOR = 1.0
RIDGE = 1e-3  # keeps the envelope's fit defined when its points are collinear
LOST_PENALTY = 1.10  # a table's recipe that lost to its route's best there (module doc)
# uncertainty = hypot(spread, DISTANCE_ERROR * distance²): an interpolation's error grows
# with the square of the spacing. 0.04 puts about two thirds of the chosen predictions'
# time errors within it on the H200 journal (distance 1 held-out, 2 leave-one-out).
DISTANCE_ERROR = 0.04


@dataclass(frozen=True, slots=True)
class Prediction:
    """One recipe's predicted step cost at an asked shape, and how sure it is."""

    route_id: str
    recipe: Mapping[str, Any]  # the parameters less the sized ones
    time_us: float  # predicted step cost
    slowness: float  # predicted time over the predicted best here, minus 1
    distance: float  # log2 units to this recipe's nearest measured point (0: measured)
    spread: float  # weighted std of log slowness over the neighbours (0: they agree)
    nearest: MLAProblem  # that nearest point: ``params`` are sized from there
    params: Mapping[str, Any]  # as run at ``nearest``

    @property
    def uncertainty(self) -> float:
        """Relative error to expect of ``time_us`` (0.1: about 10%)."""
        return math.hypot(self.spread, DISTANCE_ERROR * self.distance ** 2)


def _distance(d_batch: np.ndarray, d_kv: np.ndarray) -> np.ndarray:
    """Squared distance from log2 differences: total KV tokens first, then batch."""
    return (d_batch + d_kv) ** 2 + BATCH_WEIGHT * d_batch ** 2


def _weights(dist: np.ndarray, known: np.ndarray, width: float) -> np.ndarray:
    """Per row, a Gaussian kernel over its known points whose width scales with that
    row's nearest distance (0 where unknown)."""
    masked = np.where(known, dist, np.inf)  # every row has a known point (a recipe is seen)
    nearest = masked.min(axis=1, keepdims=True)
    return np.exp((nearest - masked) / (2 * width * width * np.maximum(nearest, NEAREST_FLOOR)))


class _Bucket:
    """One bucket's measured points and, per recipe, its log slowness at each."""

    def __init__(self, points: dict[tuple[int, int], dict[tuple[str, str], _Measured]],
                 complete: bool):
        self.points = points
        self.complete = complete
        self.shapes = sorted(points)
        self.recipes = sorted({r for p in points.values() for r in p})
        # Built once, so an answer parses and validates nothing.
        self.labels = [(route_id, MappingProxyType(json.loads(recipe)))
                       for route_id, recipe in self.recipes]
        self.problems = [next(iter(points[s].values()))[2] for s in self.shapes]
        # Rows 1, log2 batch, log2 kv_len: less the asked sizes, the envelope's design.
        self.grid = np.vstack([np.ones(len(self.shapes)),
                               np.log2(np.array(self.shapes, dtype=float)).T])
        logs = np.full((len(self.recipes), len(self.shapes)), np.nan)
        for j, shape in enumerate(self.shapes):
            for i, recipe in enumerate(self.recipes):
                if recipe in points[shape]:
                    logs[i, j] = math.log(points[shape][recipe][0])
        self.ran = ~np.isnan(logs)  # measured, not imputed: where parameters come from
        if not complete:
            logs = _impute_lost(self.recipes, logs)
        self.log_best = np.nanmin(logs, axis=0)
        self.known = ~np.isnan(logs)
        self.slowness = np.where(self.known, logs - self.log_best, 0.0)

    def predict(self, problem: MLAProblem, usable: Callable[[str], bool] | None,
                first_only: bool) -> list[Prediction]:
        """The usable recipes' predictions at ``problem``'s sizes, fastest first (only the
        fastest with ``first_only``: the others are not built)."""
        x = self.grid - np.array([[0.0], [math.log2(problem.batch)], [math.log2(problem.kv_len)]])
        dist = _distance(x[1], x[2])
        weights = _weights(np.broadcast_to(dist, self.known.shape), self.known, SLOWNESS_WIDTH)
        weights /= weights.sum(axis=1, keepdims=True)
        mean = (weights * self.slowness).sum(axis=1)
        order = [i for i in np.argsort(mean, kind="stable").tolist()
                 if usable is None or usable(self.recipes[i][0])]
        if first_only:
            order = order[:1]
        if not order:
            return []
        envelope = self._envelope(dist, x)
        return [self._prediction(i, problem, dist, weights[i], mean, envelope) for i in order]

    def _prediction(self, i: int, problem: MLAProblem, dist: np.ndarray, weights: np.ndarray,
                    mean: np.ndarray, envelope: float) -> Prediction:
        spread = math.sqrt(float(weights @ (self.slowness[i] - mean[i]) ** 2))
        j = int(np.where(self.ran[i], dist, np.inf).argmin())
        route_id, recipe = self.labels[i]
        return Prediction(route_id, recipe, math.exp(envelope + mean[i]),
                          math.expm1(mean[i] - mean.min()), math.sqrt(dist[j]), spread,
                          self.problems[j],
                          self.points[self.shapes[j]][self.recipes[i]][1])

    def _envelope(self, dist: np.ndarray, x: np.ndarray) -> float:
        """The best log time at the asked shape: the intercept of a weighted local plane
        through the measured points' best log times (the slopes lightly damped)."""
        nearest = float(dist.min())
        xw = x * np.exp((nearest - dist) / (2 * ENVELOPE_WIDTH ** 2 * max(nearest, NEAREST_FLOOR)))
        lhs = (xw @ x.T).tolist()
        lhs[1][1] += RIDGE
        lhs[2][2] += RIDGE
        return _intercept(lhs, (xw @ self.log_best).tolist())

    def without(self, shape: tuple[int, int]) -> _Bucket | None:
        rest = {s: p for s, p in self.points.items() if s != shape}
        return _Bucket(rest, self.complete) if rest else None


def _intercept(a: list[list[float]], b: list[float]) -> float:
    """The first unknown of a x = b, 3 x 3 (Cramer's rule: numpy's solver costs more
    than the arithmetic at this size)."""
    def det(m: list[list[float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
                - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
    return det([[b[r], a[r][1], a[r][2]] for r in range(3)]) / det(a)


def _impute_lost(recipes: list[tuple[str, str]], logs: np.ndarray) -> np.ndarray:
    """A table keeps each route's best recipe per point: where a route ran (its best
    known) and a recipe of it is missing, that recipe lost there."""
    out = logs.copy()
    for route_id in {r for r, _ in recipes}:
        rows = [i for i, (r, _) in enumerate(recipes) if r == route_id]
        block = logs[rows]
        ran = ~np.isnan(block).all(axis=0)  # columns where the route ran (nanmin warns else)
        route_best = np.full(block.shape[1], np.nan)
        route_best[ran] = np.nanmin(block[:, ran], axis=0)
        for i in rows:
            lost = np.isnan(logs[i]) & ~np.isnan(route_best)
            out[i, lost] = route_best[lost] + math.log(LOST_PENALTY)
    return out


class Predictor:
    """Predicted step costs per recipe for unmeasured shapes of measured buckets."""

    def __init__(self, rows: Iterable[Row], routes: Mapping[str, Route], device: DeviceInfo,
                 complete: bool = True):
        """``rows``: every ok candidate (``complete``, from a journal) or each route's best
        per problem (a table's ok rows). ``routes`` name the sized parameters and redo
        them; ``device`` is the one the parameters are sized for."""
        self.routes = routes
        self.device = device
        self.complete = complete
        by_bucket: dict[tuple, dict] = {}
        for problem, route_id, params, cost in rows:
            sized = getattr(routes.get(route_id), "sized_params", ())
            recipe = json.dumps({k: v for k, v in params.items() if k not in sized},
                                sort_keys=True)
            point = by_bucket.setdefault(problem.bucket, {}).setdefault(
                (problem.batch, problem.kv_len), {})
            seen = point.get((route_id, recipe))
            if seen is None or cost < seen[0]:  # a candidate run twice: its faster run
                point[(route_id, recipe)] = (float(cost), MappingProxyType(dict(params)),
                                             problem)
        self._buckets = {b: _Bucket(p, complete) for b, p in by_bucket.items()}

    def predict(self, problem: MLAProblem,
                usable: Callable[[str], bool] | None = None) -> list[Prediction]:
        """Every recipe's prediction at ``problem``, fastest first; only routes for which
        ``usable(route_id)`` holds; [] when nothing was measured in its bucket."""
        bucket = self._buckets.get(problem.bucket)
        if bucket is None:
            return []
        return bucket.predict(problem, usable, first_only=False)

    def choose(self, problem: MLAProblem, usable: Callable[[str], bool] | None = None
               ) -> tuple[Prediction, dict[str, Any]] | None:
        """The fastest prediction whose route is usable, with its parameters sized for
        ``problem``; None when there is none."""
        bucket = self._buckets.get(problem.bucket)
        found = bucket.predict(problem, usable, first_only=True) if bucket is not None else []
        return (found[0], self.sized(found[0], problem)) if found else None

    def sized(self, prediction: Prediction, problem: MLAProblem) -> dict[str, Any]:
        """The prediction's parameters with the sized ones redone for ``problem``."""
        route = self.routes.get(prediction.route_id)
        params = dict(prediction.params)
        if route is None or not getattr(route, "sized_params", ()):
            return params
        try:
            return params_at(route, params, prediction.nearest, problem, self.device)
        except Exception:  # a broken param_space: the neighbour's own parameters
            return params

    def without(self, problem: MLAProblem) -> Predictor:
        """This predictor less every measurement at ``problem`` (leave-one-out)."""
        clone = object.__new__(Predictor)
        clone.routes, clone.device, clone.complete = self.routes, self.device, self.complete
        clone._buckets = dict(self._buckets)
        bucket = self._buckets.get(problem.bucket)
        if bucket is not None:
            rest = bucket.without((problem.batch, problem.kv_len))
            if rest is None:
                del clone._buckets[problem.bucket]
            else:
                clone._buckets[problem.bucket] = rest
        return clone

    def measured(self, problem: MLAProblem) -> bool:
        bucket = self._buckets.get(problem.bucket)
        return bucket is not None and (problem.batch, problem.kv_len) in bucket.points


def rows_from_journal(path: str | Path, capturable: bool = False,
                      plan_calls: int | None = None, sharing: frozenset[str] = frozenset()
                      ) -> list[Row]:
    """Every ok candidate of a sweep journal, with its step cost as the dispatcher ranks
    it (``dispatch.step_cost``; plan costs a journal lacks count as 0); with
    ``capturable`` only steps a CUDA graph replays. A record without its step kind gets
    the one its route declares, as a table's row does."""
    from mlatune.dispatch import step_cost  # lazily: the dispatcher may import this module
    from mlatune.sweep import journal
    from mlatune.table.schema import declared_step_kind

    rows = []
    for r in journal.read(Path(path))[1]:
        if r.get("status") != "ok":
            continue
        params = json.loads(r["route_params"])
        plan_on, replays = (r["plan_on"], r["capturable"]) if "plan_on" in r \
            and "capturable" in r else declared_step_kind(r["route"], params)
        if capturable and not replays:
            continue
        cost = step_cost(float(r["time_us"]), plan_on, _number(r.get("plan_us")),
                         _number(r.get("plan_host_us")), capturable, **_calls(plan_calls),
                         shares_host_plan=r["route"] in sharing)
        rows.append((MLAProblem.from_key_dict(r["key"]), str(r["route"]), params, float(cost)))
    return rows


def _calls(plan_calls: int | None) -> dict[str, int]:
    """``step_cost``'s keyword: the dispatcher's default when None."""
    return {} if plan_calls is None else {"plan_calls": plan_calls}


def rows_from_table(frame: Any, capturable: bool = False,
                    plan_calls: int | None = None, sharing: frozenset[str] = frozenset()
                    ) -> list[Row]:
    """A table's ok rows (a DataFrame as ``mlatune.table.read`` gives), costed as the
    dispatcher ranks them (``sharing``: the routes whose host plan a step's calls share);
    with ``capturable`` only steps a CUDA graph replays."""
    from mlatune.dispatch import step_cost

    ok = frame[frame["status"] == "ok"]
    if capturable:
        ok = ok[ok["capturable"].astype(bool)]
    costs = step_cost(ok["time_us"].to_numpy(dtype=float), ok["plan_on"].to_numpy(dtype=object),
                      ok["plan_us"].to_numpy(dtype=float),
                      ok["plan_host_us"].to_numpy(dtype=float), capturable,
                      **_calls(plan_calls), shares_host_plan=ok["route"].isin(sharing).to_numpy())
    return [(MLAProblem.from_key_dict(row), str(row["route"]), json.loads(row["route_params"]),
             float(cost)) for row, cost in zip(ok.to_dict("records"), costs, strict=True)]


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)
