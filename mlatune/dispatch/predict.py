"""Predicting each route's time at a shape the sweep never measured.

A sweep measures a grid of (batch, kv_len) per bucket (every key field but those
two). At an unmeasured shape of a measured bucket, ``Predictor.choose`` predicts
each parameter recipe's step cost there from the bucket's measured points and
picks the fastest. A recipe is a route with its parameters less the sized ones
(``route.sized_params``: KV splits, which ``routes.params_at`` redoes for the
asked sizes).

Each recipe's time is a fitted cost law times a local correction:

- the *law*, fitted per recipe over its bucket's points (relative least squares,
  coefficients >= 0): ``t = a + c W + d B + e C``. ``B`` is the batch; ``W`` the KV
  tokens one SM walks in turn and ``C`` the programs (CTAs, work items) per SM; ``a``
  is the fixed cost, ``c`` the streaming rate, ``d`` and ``e`` what each request and
  each program add (the partials a split writes and the reduce reads). ``W`` and
  ``C`` follow the launch where it is known, so that a batch that leaves the last
  round of work nearly empty costs the whole round. Each route declares how its launch
  makes them (``Route.launch_geometry``, the shapes in ``mlatune.routes.geometry``); a
  route that declares none is taken as balanced: ``W = B x shard KV / SMs``,
  ``C = B / SMs``.

- the *correction*: the log ratio of measured to law time at the measured points,
  averaged over the nearest ones (a Gaussian kernel in log2 (batch, kv_len) whose
  width follows the distance to the nearest point, so it stays local on a dense grid
  and widens on a sparse one). The law carries the shape of the curve between points
  (the fixed cost that bends log time against log size, the waves), the correction
  what it misses nearby.

The choice is the least predicted time among the routes ``usable`` allows. Distance
is measured as the dispatcher's ``point_distance`` does (total KV tokens first, then
batch) but with batch weighted 1. ``choose`` evaluates a split recipe's law at the
asked shape only while a lower bound (its law without the waves) could still win, and
asks ``usable`` of the fastest candidate's route only.

Each prediction says how far it is from the data (``distance``: log2 units to the
recipe's nearest measured point) and how much the law misses nearby (``spread``: the
weighted standard deviation of the correction over the neighbours); ``uncertainty``
combines the two into a relative error of the predicted time.

Data: a sweep journal holds every parameter set each route ran at each problem
(``observations.rows_from_journal``); a table holds only each route's best per problem
(``observations.rows_from_table``): there a recipe that lost to its route's best at a point is
not left out (which would make recipes look fast where only their wins were kept) but
counted as slow as the best's law makes it on the recipe's own launch, at least
``LOST_PENALTY`` over the best (``_Bucket.reimpute``; ``LOST_PENALTY`` alone in a first
fit), with ``LOST_WEIGHT`` of a measurement's weight. A route that failed (accuracy,
crash, timeout) at measured points close to the asked shape (``failed``) is not
chosen there: its failures hold at least ``FAILED_SHARE`` of the kernel weight of its
points.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from mlatune.arch import DeviceInfo
from mlatune.dispatch.fit import FEATURES, impute_lost, nnls, one_point_laws
from mlatune.problem import MLAProblem
from mlatune.routes import Route, params_at
from mlatune.routes.geometry import LaunchGeometry

if TYPE_CHECKING:
    pass

__all__ = ["Prediction", "Predictor", "Row"]

# (problem, route id, params as run, step cost in us): one measured candidate.
Row = tuple[MLAProblem, str, Mapping[str, Any], float]
_Measured = tuple[float, Mapping[str, Any], MLAProblem]  # one recipe's (cost, params, problem)

BATCH_WEIGHT = 1.0  # of d_batch² in the distance, beside d_tokens² (see the module doc)
_ROOT_BATCH_WEIGHT = math.sqrt(BATCH_WEIGHT)
CORRECTION_WIDTH = 1.0  # the correction's kernel width over the nearest distance
# Nearer than this (one doubling of tokens), the kernel keeps this width: next to a
# measured point the correction still rests on its neighbours, not on that point alone.
NEAREST_FLOOR = 1.0
LOST_PENALTY = 1.10  # a table's recipe that lost to its route's best there (module doc)
LOST_WEIGHT = 0.3  # its weight, against 1 for a measurement
FAILED_SHARE = 0.5  # a route's kernel weight on its failures from which it is not chosen
# uncertainty = hypot(spread, DISTANCE_ERROR * distance²): an interpolation's error grows
# with the square of the spacing. Leave-one-out on the H200 table (each point 2 log2 units
# from its nearest neighbours; benchmarks/heldout_regret.py loo): the chosen predictions'
# time errors are 2.7% in median, 79% of them within the uncertainty (93% of the interior
# points'), the spread alone 68%.
DISTANCE_ERROR = 0.01
# A recipe whose nearest known point (measured, or lost to its route's best) is this many
# log2 units farther from the asked shape than the nearest recipe's is not predicted there:
# its law would be extrapolated over sizes it never ran at (a route a prior pruned at large
# shapes keeps only its small ones), while others ran nearby.
REACH_MARGIN = 2.0


class Prediction(NamedTuple):
    """One recipe's predicted step cost at an asked shape, and how sure it is."""

    route_id: str
    recipe: Mapping[str, Any]  # the parameters less the sized ones
    time_us: float  # predicted step cost
    slowness: float  # predicted time over the predicted best here, minus 1
    distance: float  # log2 units to this recipe's nearest measured point (0: measured)
    spread: float  # weighted std of the law's log error over the neighbours (0: none)
    nearest: MLAProblem  # that nearest point: ``params`` are sized from there
    params: Mapping[str, Any]  # as run at ``nearest``
    # What sizing ``params`` for the asked shape needs (the predictor's own business):
    # (launch geometry, the rule's split at the asked shape, whether ``params`` ran with
    # the rule's split at ``nearest``); None for a recipe with nothing to size this way.
    sizing: tuple | None = None

    @property
    def uncertainty(self) -> float:
        """Relative error to expect of ``time_us`` (0.1: about 10%)."""
        return math.hypot(self.spread, DISTANCE_ERROR * self.distance ** 2)


def _geometry(route: Route | None, recipe: Mapping[str, Any], problem: MLAProblem,
              cus: int) -> LaunchGeometry | None:
    """A recipe's launch geometry as its route declares it; None (balanced) for a route not
    registered here or whose geometry cannot be worked out at ``problem``."""
    if route is None:
        return None
    try:
        return route.launch_geometry(problem, recipe, cus)
    except Exception:  # a layout the route cannot work out here: taken as balanced
        return None


class _Bucket:
    """One bucket's measured points and, per recipe, its fitted law and corrections."""

    def __init__(self, points: dict[tuple[int, int], dict[tuple[str, str], _Measured]],
                 complete: bool, routes: Mapping[str, Route], device: DeviceInfo,
                 failed: Iterable[tuple[int, int, str]] = (), fit: bool = True):
        """``fit``: solve the laws now; else ``normal`` holds their least-squares problems
        and ``finish`` takes the solution (the Predictor solves every bucket's at once)."""
        self.points = points
        self.complete = complete
        self.routes, self.device = routes, device
        self.cus = max(1, int(device.cu_count or 1))
        self.failed = frozenset(failed)
        self.shapes = sorted(points)
        self.recipes = sorted({r for p in points.values() for r in p})
        # Built once, so an answer parses and validates nothing.
        self.labels = [(route_id, MappingProxyType(json.loads(recipe)))
                       for route_id, recipe in self.recipes]
        self.problems = [next(iter(points[s].values()))[2] for s in self.shapes]
        self.log_batch = np.log2(np.array([s[0] for s in self.shapes], dtype=float))
        self.log_kv = np.log2(np.array([s[1] for s in self.shapes], dtype=float))
        logs = np.full((len(self.recipes), len(self.shapes)), np.nan)
        for j, shape in enumerate(self.shapes):
            for i, recipe in enumerate(self.recipes):
                if recipe in points[shape]:
                    logs[i, j] = math.log(points[shape][recipe][0])
        self.ran = ~np.isnan(logs)  # measured, not imputed: where parameters come from
        # Per recipe, its measured points (column indices): where ``nearest`` is looked up.
        self.ran_at = [np.flatnonzero(row) for row in self.ran]
        weight = self.ran.astype(float)
        self._measured = logs  # NaN where not measured
        if not complete:
            imputed = impute_lost(self.recipes, logs, LOST_PENALTY)
            weight[np.isnan(logs) & ~np.isnan(imputed)] = LOST_WEIGHT
            logs = imputed
        self.weight = weight
        self.geometry = [_geometry(routes.get(route_id), dict(recipe), self.problems[0],
                                   self.cus) for route_id, recipe in self.labels]
        self._splits: dict[tuple, int] = {}  # (route, block_m, block_n, point): its rule's
        self._prepare(logs)
        if fit:
            coef = nnls(*self.normal)
            if not complete:
                self.reimpute(coef)
                coef = nnls(*self.normal)
            self.finish(coef)

    # Fitting ----------------------------------------------------------------
    def _features_at(self, i: int, j: int) -> tuple[float, float, float, float]:
        """Split recipe i's law terms (1, W, B, C) at point j, with the split it ran there
        (its rule's where it did not)."""
        problem = self.problems[j]
        geometry = self.geometry[i]
        split = None
        if geometry.key is not None:
            ran = self.points[self.shapes[j]].get(self.recipes[i])
            split = ran[1].get(geometry.key) if ran is not None else None
            if split is None:
                split = self._rule_split(i, j, ask=False)
        w, c = geometry.features(problem, split, self.cus)
        return 1.0, w, float(problem.batch), c

    def _rule_split(self, i: int, j: int, ask: bool = True) -> int:
        """The split recipe i's route rule gives its tile at point j (recipes of one tile
        share it). ``ask``: from the route, checking ``fill`` against it; else from
        ``fill`` where it has agreed so far."""
        geometry = self.geometry[i]
        key = (id(geometry.owner), geometry.tile["block_m"], geometry.block_n, j)
        split = self._splits.get(key)
        if split is None:
            problem = self.problems[j]
            if not ask and geometry.own_rule:
                return geometry.fill(problem, self.cus)
            split = self._splits[key] = geometry.route_split(problem, self.device)
            if geometry.fill(problem, self.cus) != split:
                geometry.own_rule = False
        return split

    def _prepare(self, logs: np.ndarray) -> None:
        """Each recipe's law terms at its known points and its least-squares problem."""
        m, n = logs.shape
        known = self.weight > 0
        for i, geometry in enumerate(self.geometry):  # the split rule checked where it ran
            if geometry is not None and geometry.key is not None:
                for j in self.ran_at[i].tolist():
                    self._rule_split(i, j)
        x = np.zeros((m, n, FEATURES))
        batch = np.array([p.batch for p in self.problems], dtype=float)
        size = batch * np.array([p.shard_len for p in self.problems], dtype=float)
        balanced = np.stack([np.ones(n), size / self.cus, batch, batch / self.cus], axis=1)
        for i, geometry in enumerate(self.geometry):
            if geometry is None:
                x[i] = balanced * known[i][:, None]
            else:
                for j in np.flatnonzero(known[i]).tolist():
                    x[i, j] = self._features_at(i, j)
        self._x, self._known = x, known
        self._normal(logs)

    def _normal(self, logs: np.ndarray) -> None:
        """The laws' least-squares problems: each law relative to the time (law / t = 1),
        each point as much as its weight."""
        x, known = self._x, self._known
        times = np.exp(np.where(known, logs, 0.0))
        scaled = x * (np.sqrt(self.weight) / times)[:, :, None]
        target = np.sqrt(self.weight)
        self.normal = (np.einsum("rnf,rng->rfg", scaled, scaled),
                       np.einsum("rnf,rn->rf", scaled, target),
                       (target ** 2).sum(axis=1), known.sum(axis=1))
        self._logs = logs

    def reimpute(self, coef: np.ndarray) -> None:
        """A table's lost points again, from the laws fitted once: where recipe k lost to
        its route's best w at a point, k takes w's law on k's own launch there (its waves,
        its split), at least LOST_PENALTY over w's time: a split recipe that loses to the
        persistent one by a wave is counted as slow as that wave makes it, not 10%."""
        logs = self._logs.copy()
        lost = self._known & np.isnan(self._measured)
        columns = np.arange(len(self.shapes))
        for route_id in {r for r, _ in self.recipes}:
            rows = np.array([i for i, (r, _) in enumerate(self.recipes) if r == route_id])
            where = lost[rows]
            if not where.any():
                continue
            measured = np.where(np.isnan(self._measured[rows]), np.inf, self._measured[rows])
            best = rows[measured.argmin(axis=0)]  # per point, the route's best recipe
            law = coef[best]  # per point, its law
            own = np.einsum("nf,nf->n", self._x[best, columns], law)
            other = np.einsum("knf,nf->kn", self._x[rows], law)
            ratio = np.maximum(other / np.where(own > 0, own, np.inf), LOST_PENALTY)
            logs[rows] = np.where(where, measured.min(axis=0) + np.log(ratio), logs[rows])
        self._normal(logs)

    def finish(self, coef: np.ndarray) -> None:
        """Take the laws' coefficients: the log corrections at the known points and what
        answering needs."""
        x, logs, known = self._x, self._logs, self._known
        coef = one_point_laws(coef, x, logs, known)
        self.known = known  # measured, or lost to the route's best (a table's)
        del self._x, self._logs, self._known, self._measured, self.normal
        self.coef = coef
        law = np.einsum("rnf,rf->rn", x, coef)
        correction = np.where(known, logs - np.log(np.where(known, law, 1.0)), 0.0)
        # One product with the kernel gives every recipe's sum of weights, of weighted
        # corrections and of their squares (the correction and its spread).
        self.sums = np.vstack([self.weight, self.weight * correction,
                               self.weight * correction ** 2])
        # The law at the asked shape, for the balanced recipes and as a lower bound for
        # the split ones (waves and whole tiles only add): a + d B + c W0 + e C0, with
        # W0 = per_batch B S / SMs and C0 = per_batch B / SMs; against (1, B, B x S).
        per_batch = np.array([1.0 if g is None else g.per_batch for g in self.geometry])
        # W's least per B x S token and C's least constant, where a layout says otherwise
        w_floor = np.array([1.0 / self.cus if g is None else g.bound_w(self.cus)
                            for g in self.geometry])
        c_fixed = np.array([0.0 if g is None else g.c_fixed for g in self.geometry])
        a0, c0, d0, e0 = self.coef.T
        self.exact = [g is None or g.balanced for g in self.geometry]
        # Squared distance to (x, y) = log2 (batch, kv_len): |c|² - 2 c.q + |q|² over the
        # points' coordinates c = (log2 tokens, sqrt(BATCH_WEIGHT) log2 batch). One product
        # with (1, q_tokens, q_batch, B, B x S) gives the first two terms per point, then
        # the law's bound per recipe.
        tokens, batches = self.log_batch + self.log_kv, _ROOT_BATCH_WEIGHT * self.log_batch
        self.n, self.m = n, m = len(self.shapes), len(self.recipes)
        self.terms = np.zeros((n + m, 5))
        self.terms[:n, :3] = np.stack([tokens ** 2 + batches ** 2, -2 * tokens, -2 * batches],
                                      axis=1)
        self.terms[n:, 0] = a0 + e0 * c_fixed
        self.terms[n:, 3] = d0 + e0 * per_batch / self.cus
        self.terms[n:, 4] = c0 * w_floor
        # Where a split recipe ran with its rule's split: sized from there, it takes the
        # rule's split at the asked shape (what ``params_at`` gives, without its lists).
        self.at_rule = np.zeros_like(self.ran)
        for i, geometry in enumerate(self.geometry):
            if geometry is None or geometry.key is None:
                continue
            for j in self.ran_at[i].tolist():
                params = self.points[self.shapes[j]][self.recipes[i]][1]
                try:
                    rule = self._rule_split(i, j)
                except Exception:
                    continue
                self.at_rule[i, j] = params.get(geometry.key) == rule
        self._failures()

    def _failures(self) -> None:
        """Per route, the points where it failed and the points where it ran ok."""
        self.route_failed: dict[str, np.ndarray] = {}
        index = {s: j for j, s in enumerate(self.shapes)}
        by_route: dict[str, set[int]] = {}
        for batch, kv_len, route_id in self.failed:
            if (batch, kv_len) in index:
                by_route.setdefault(route_id, set()).add(index[(batch, kv_len)])
        for route_id, where in by_route.items():
            mask = np.zeros(len(self.shapes), dtype=bool)
            mask[list(where)] = True
            ok = np.zeros(len(self.shapes), dtype=bool)
            for i, (r, _) in enumerate(self.recipes):
                if r == route_id:
                    ok |= self.ran[i]
            self.route_failed[route_id] = np.stack([mask, ok & ~mask]).astype(float)

    # Answering ----------------------------------------------------------------
    def _terms(self, problem: MLAProblem) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
        """At ``problem``: the squared distances to the points less the asked point's own
        term (``offset``), that term, the correction's kernel over the points (unscaled:
        only its ratios are used) and each recipe's law bound."""
        batch = problem.batch
        x = math.log2(batch)
        t, b = x + math.log2(problem.kv_len), _ROOT_BATCH_WEIGHT * x
        offset = t * t + b * b
        # ndarray.dot, argmin and item: the cheapest calls for arrays this small
        terms = self.terms.dot(np.array([1.0, t, b, batch, batch * problem.shard_len]))
        n = self.n
        dist = terms[:n]
        nearest = max(dist.item(dist.argmin()) + offset, NEAREST_FLOOR)
        kernel = dist * (-0.5 / (CORRECTION_WIDTH * CORRECTION_WIDTH * nearest))
        return dist, offset, np.exp(kernel, out=kernel), terms[n:]

    def _exact(self, i: int, problem: MLAProblem) -> tuple[float, int | None]:
        """A split recipe's law at ``problem`` and the split it is sized with there (None:
        persistent)."""
        geometry = self.geometry[i]
        a, cw, d, e = self.coef[i].tolist()
        fixed = a + d * problem.batch
        if geometry.chooses:  # the least law over the splits it may run
            best, chosen = math.inf, None
            for split in geometry.splits(problem, self.device):
                w, c = geometry.features(problem, split, self.cus)
                law = fixed + cw * w + e * c
                if law < best:
                    best, chosen = law, split
            return best, chosen
        split = geometry.split(problem, self.device)
        w, c = geometry.features(problem, split, self.cus)
        return fixed + cw * w + e * c, split

    def _failing(self, route_id: str, kernel: np.ndarray) -> bool:
        marks = self.route_failed.get(route_id)  # kernel: the correction's (any scale)
        if marks is None:
            return False
        failed, ok = (marks @ kernel).tolist()
        return failed >= FAILED_SHARE * (failed + ok)

    def predict(self, problem: MLAProblem, usable: Callable[[str], bool] | None,
                first_only: bool) -> list[Prediction]:
        """The usable recipes' predictions at ``problem``'s sizes, fastest first (only the
        fastest with ``first_only``: the others' laws are not all evaluated)."""
        dist, offset, kernel, law = self._terms(problem)
        m = self.m
        sums = self.sums.dot(kernel)
        correction = sums[m:2 * m] / sums[:m]
        bound = np.log(law)
        bound += correction
        near = np.sqrt(np.maximum(np.where(self.known, dist, np.inf).min(axis=1) + offset,
                                  0.0))
        order = [i for i in bound.argsort(kind="stable").tolist()
                 if near[i] <= near.min() + REACH_MARGIN]
        bounds, corrections = bound.tolist(), correction.tolist()
        if not first_only:
            verdicts: dict[str, bool] = {}  # per route, asked once
            found = []
            for i in order:
                route_id = self.recipes[i][0]
                if route_id not in verdicts:
                    verdicts[route_id] = self._allowed(route_id, usable, kernel)
                if verdicts[route_id]:
                    found.append((*self._value(i, problem, bounds, corrections), i))
            found.sort(key=lambda f: f[0])
        else:
            found = self._fastest(order, problem, bounds, corrections, usable, kernel)
        floor = bounds[order[0]]
        return [self._prediction(i, value, floor, split, dist, offset, sums)
                for value, split, i in found]

    def _value(self, i: int, problem: MLAProblem, bounds: list[float],
               corrections: list[float]) -> tuple[float, int | None]:
        """Recipe i's predicted log time at ``problem`` and its split there."""
        if self.exact[i]:
            return bounds[i], None
        law, split = self._exact(i, problem)
        return math.log(law) + corrections[i], split

    def _allowed(self, route_id: str, usable: Callable[[str], bool] | None,
                 kernel: np.ndarray) -> bool:
        return (usable is None or usable(route_id)) \
            and not (self.route_failed and self._failing(route_id, kernel))

    def _fastest(self, order: list[int], problem: MLAProblem, bounds: list[float],
                 corrections: list[float], usable: Callable[[str], bool] | None,
                 kernel: np.ndarray) -> list[tuple[float, int | None, int]]:
        """[(log time, split, recipe)] of the fastest allowed recipe ([] if none): the least
        value among the recipes not refused yet, each law evaluated while a bound says it
        could win; then its route is asked (once, in the common case), and on a refusal
        the search goes on without that route."""
        refused: set[str] = set()
        values: dict[int, tuple[float, int | None]] = {}
        while True:
            best, best_split, chosen = math.inf, None, -1
            for i in order:
                if bounds[i] >= best:
                    break  # no later bound beats it: the choice is made
                if refused and self.recipes[i][0] in refused:
                    continue
                found = values.get(i)
                if found is None:
                    if self.exact[i]:
                        found = values[i] = (bounds[i], None)
                    else:
                        law, split = self._exact(i, problem)
                        found = values[i] = (math.log(law) + corrections[i], split)
                if found[0] < best:
                    (best, best_split), chosen = found, i
            if chosen < 0:
                return []
            route_id = self.recipes[chosen][0]
            if self._allowed(route_id, usable, kernel):
                return [(best, best_split, chosen)]
            refused.add(route_id)

    def _prediction(self, i: int, value: float, floor: float, split: int | None,
                    dist: np.ndarray, offset: float, sums: np.ndarray) -> Prediction:
        m = self.m
        total, first, second = sums.item(i), sums.item(m + i), sums.item(2 * m + i)
        mean = first / total
        spread = math.sqrt(max(0.0, second / total - mean * mean))
        ran = self.ran_at[i]
        j = int(ran[dist[ran].argmin()]) if len(ran) > 1 else int(ran[0])
        route_id, recipe = self.labels[i]
        measured = self.points[self.shapes[j]][self.recipes[i]]
        geometry = self.geometry[i]
        return Prediction(route_id, recipe, math.exp(value), math.expm1(value - floor),
                          math.sqrt(max(0.0, dist.item(j) + offset)), spread, self.problems[j],
                          measured[1], None if geometry is None or geometry.sized is None
                          else (geometry, split, self.at_rule.item(i, j)))

    def without(self, shape: tuple[int, int]) -> _Bucket | None:
        rest = {s: p for s, p in self.points.items() if s != shape}
        return _Bucket(rest, self.complete, self.routes, self.device, self.failed) \
            if rest else None


class Predictor:
    """Predicted step costs per recipe for unmeasured shapes of measured buckets."""

    def __init__(self, rows: Iterable[Row], routes: Mapping[str, Route], device: DeviceInfo,
                 complete: bool = True, failed: Iterable[tuple[MLAProblem, str]] = ()):
        """``rows``: every ok candidate (``complete``, from a journal) or each route's best
        per problem (a table's ok rows). ``routes`` name the sized parameters, redo them
        and say how split-KV recipes launch; ``device`` is the one the parameters are
        sized for. ``failed``: (problem, route id) where the route failed (accuracy,
        crash, timeout; not a refusal)."""
        self.routes = routes
        self.device = device
        self.complete = complete
        by_bucket: dict[tuple, dict] = {}
        recipes: dict[tuple, str] = {}  # (route, params' items) -> the recipe's JSON
        last, bucket = None, ()
        for problem, route_id, params, cost in rows:
            if problem is not last:  # a problem's rows come together: its bucket once
                last, bucket = problem, problem.bucket
            try:
                seen_as = (route_id, *sorted(params.items()))
                recipe = recipes.get(seen_as)
            except TypeError:  # a value that is no dict key: spelled out each time
                seen_as, recipe = None, None
            if recipe is None:
                route = routes.get(route_id)
                sized = () if route is None else route.sized_params
                recipe = json.dumps({k: v for k, v in params.items() if k not in sized},
                                    sort_keys=True)
                if seen_as is not None:
                    recipes[seen_as] = recipe
            point = by_bucket.setdefault(bucket, {}).setdefault(
                (problem.batch, problem.kv_len), {})
            seen = point.get((route_id, recipe))
            if seen is None or cost < seen[0]:  # a candidate run twice: its faster run
                point[(route_id, recipe)] = (float(cost), MappingProxyType(dict(params)),
                                             problem)
        failures: dict[tuple, set[tuple[int, int, str]]] = {}
        for problem, route_id in failed:
            failures.setdefault(problem.bucket, set()).add(
                (problem.batch, problem.kv_len, route_id))
        self._buckets = {b: _Bucket(p, complete, routes, device, failures.get(b, ()), fit=False)
                         for b, p in by_bucket.items()}
        # Every bucket's laws in one solve: its cost is in the calls, not the arithmetic.
        buckets = list(self._buckets.values())
        if buckets:
            ends = np.cumsum([len(b.recipes) for b in buckets]).tolist()
            spans = list(zip(buckets, [0, *ends[:-1]], ends, strict=True))

            def solve() -> np.ndarray:
                return nnls(*(np.concatenate([b.normal[k] for b in buckets])
                               for k in range(4)))

            coef = solve()
            if not complete:  # a table's lost points again, from the laws: then refitted
                for bucket, start, end in spans:
                    bucket.reimpute(coef[start:end])
                coef = solve()
            for bucket, start, end in spans:
                bucket.finish(coef[start:end])

    def predict(self, problem: MLAProblem, usable: Callable[[str], bool] | None = None,
                bucket_key: tuple | None = None) -> list[Prediction]:
        """Every recipe's prediction at ``problem``, fastest first; only routes for which
        ``usable(route_id)`` holds and that did not fail nearby; [] when nothing was
        measured in its bucket (``bucket_key``: ``problem.bucket`` when the caller has it)."""
        bucket = self._buckets.get(problem.bucket if bucket_key is None else bucket_key)
        if bucket is None:
            return []
        return bucket.predict(problem, usable, first_only=False)

    def choose(self, problem: MLAProblem, usable: Callable[[str], bool] | None = None,
               bucket_key: tuple | None = None) -> tuple[Prediction, dict[str, Any]] | None:
        """The fastest prediction whose route is usable, with its parameters sized for
        ``problem``; None when there is none."""
        bucket = self._buckets.get(problem.bucket if bucket_key is None else bucket_key)
        found = bucket.predict(problem, usable, first_only=True) if bucket is not None else []
        return (found[0], self.sized(found[0], problem)) if found else None

    def sized(self, prediction: Prediction, problem: MLAProblem) -> dict[str, Any]:
        """The prediction's parameters with the sized ones redone for ``problem``
        (``routes.params_at``: the rule's split where the recipe ran at the rule's)."""
        route = self.routes.get(prediction.route_id)
        params = dict(prediction.params)
        if route is None or not route.sized_params:
            return params
        if prediction.sizing is not None and prediction.nearest != problem:
            geometry, split, at_rule = prediction.sizing
            if geometry.key is None:  # persistent: no split (as run, the route's default)
                return {k: v for k, v in params.items() if k != geometry.sized}
            if at_rule or geometry.chooses:  # the rule's split (params_at's answer,
                # without its parameter lists) or the one the law chose
                if split is None:
                    try:
                        split = geometry.split(problem, self.device)
                    except Exception:  # the route's rule failed: params_at says why not
                        split = None
                if split is not None:
                    return {**params, geometry.key: split}
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
