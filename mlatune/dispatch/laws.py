"""Each route's cost law in device terms, fitted over a whole table: it answers another GPU
model (a transfer) and buckets the table never measured.

Per route and phase, over every ok row of the table (all its buckets), the law

    t = a + m x memory + k x compute + v x convert + d x requests + e x programs

in the terms of ``mlatune.dispatch.device_terms`` (bytes over bandwidth, FLOPs over tensor
throughput, waves over SMs, fixed costs at the clock) is fitted by relative least squares
with coefficients >= 0. Across buckets the heads, qlen and cache dtype move the ratio of
FLOPs to bytes: that is what tells a memory-bound route from a compute-bound one.

- Transfer (``transfer_ratio``, ``transfer_times``): a time measured on one GPU, times
  (law(target) / law(source))^``TRUST`` at the same problem and parameters: the measured
  time keeps its local truth, the law carries how each term moves with bandwidth,
  throughput, SMs and clock, as far as it is trusted. Two routes measured a factor g apart
  at a problem swap only where the laws move them apart by more than g^(1/TRUST): a law's
  ratio errs, and a small movement of it does not overturn a measurement.
- An unmeasured bucket (``Laws.predict``, ``Laws.choose``): the law at the problem times a
  correction, the weighted mean log ratio of measured to law time over the route's nearest
  measured rows (a Gaussian kernel in log2 heads, qlen, page size, batch, KV length and
  DCP size, a different dtype counting ``DTYPE_DISTANCE``; its width follows the distance
  to the nearest row). The recipe is the nearest row's where the route lists it at the
  problem (else the route's first set), its split the route's rule (the law's least over
  the listed splits for a route whose law chooses).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from mlatune.dispatch import device_terms as dt
from mlatune.dispatch.fit import nnls
from mlatune.hardware import Hardware
from mlatune.problem import FP8_DTYPES, MLAProblem
from mlatune.routes import Route

__all__ = ["LawPrediction", "Laws", "transfer_time", "transfer_times"]

Row = tuple[MLAProblem, str, Mapping[str, Any], float]  # as predict.Row
DTYPE_DISTANCE = 3.0  # log2 units a different q or cache dtype counts as
WIDTH_FLOOR = 1.0  # the correction kernel's least squared width (one doubling)
# uncertainty = hypot(spread, DISTANCE_ERROR x distance): a borrowed correction's error grows
# with the distance it is borrowed over.
DISTANCE_ERROR = 0.03
# Rows whose DRAM floor is this share of their time are at the floor (left out of the
# pace's fit); the floor's bandwidth is this quantile of the shares the table's rows reach.
BOUND_SHARE = 0.85
REACH_QUANTILE = 0.99
# A table whose steps all stay far below the bandwidth says little of where the floor is:
# it is taken at least this share of the peak (streaming decode kernels reach 0.9 and more).
MIN_REACH = 0.7
FAILED_SHARE = 0.5  # a route's kernel weight on its failures from which it is not chosen
# The share of a law's movement (in log) a transfer applies: chosen over 0, 1/8, ..., 1 on
# half 0 of the H100 <-> H200 decode problems by the sum of both directions' geomean regret
# (`benchmarks/transfer_regret.py --choose-trust`: 0.625 gives 0.398 points, 0 (as measured)
# 0.471, 1 (the whole law) 0.610); half 1 alone chooses 0.5, 0.002 points below 0.625 there.
TRUST = 0.625


class LawPrediction(NamedTuple):
    """One route's predicted step cost at a problem of an unmeasured bucket."""

    route_id: str
    params: Mapping[str, Any]  # as the route is to be called at the problem
    time_us: float
    uncertainty: float  # relative error to expect of ``time_us``
    nearest: MLAProblem  # the measured row the recipe and most of the correction come from


def coordinates(problem: MLAProblem) -> np.ndarray:
    """Where a problem sits for the correction's kernel (log2 units; dtypes as flags)."""
    return np.array([
        math.log2(problem.kernel_heads), math.log2(problem.qlen), math.log2(problem.page_size),
        math.log2(problem.batch), math.log2(problem.kv_len), math.log2(problem.dcp_size),
        DTYPE_DISTANCE * (problem.q_dtype in FP8_DTYPES),
        DTYPE_DISTANCE * (problem.kv_dtype in FP8_DTYPES),
        DTYPE_DISTANCE * ("fp16" in (problem.q_dtype, problem.kv_dtype)),
        DTYPE_DISTANCE * (not problem.causal)])


class _Law:
    """One route's (one phase's) fitted coefficients, its rows' log corrections and where
    it failed (accuracy, crash, timeout)."""

    def __init__(self, route_id: str, coef: np.ndarray, problems: list[MLAProblem],
                 params: list[Mapping[str, Any]], residual: np.ndarray,
                 failed: Iterable[MLAProblem] = ()):
        self.route_id, self.coef = route_id, coef
        self.problems, self.params, self.residual = problems, params, residual
        self.coords = np.stack([coordinates(p) for p in problems])
        self.norms = (self.coords ** 2).sum(axis=1)
        failures = [coordinates(p) for p in failed]
        self.failed = np.stack(failures) if failures else None

    def correction(self, problem: MLAProblem) -> tuple[float, float, float, int, bool]:
        """(mean log correction, its spread, distance to the nearest row, that row, whether
        failures hold at least ``FAILED_SHARE`` of the kernel's weight there)."""
        q = coordinates(problem)
        d2 = np.maximum(self.norms - 2 * self.coords @ q + q @ q, 0.0)
        j = int(d2.argmin())
        width2 = max(float(d2[j]), WIDTH_FLOOR)
        w = np.exp(-0.5 * d2 / width2)
        total = float(w.sum())
        mean = float(w @ self.residual / total)
        spread = math.sqrt(max(0.0, float(w @ (self.residual - mean) ** 2 / total)))
        return mean, spread, math.sqrt(float(d2[j])), j, self._failing(q, d2)

    def _failing(self, q: np.ndarray, d2: np.ndarray) -> bool:
        """Whether failures hold ``FAILED_SHARE`` of the kernel's weight at ``q``, the width
        following the nearest row, ok or failed (many ok rows of another category do not
        outvote the failures next to it)."""
        if self.failed is None:
            return False
        f2 = ((self.failed - q) ** 2).sum(axis=1)
        width2 = max(min(float(d2.min()), float(f2.min())), WIDTH_FLOOR)
        failed = float(np.exp(-0.5 * f2 / width2).sum())
        ok = float(np.exp(-0.5 * d2 / width2).sum())
        return failed >= FAILED_SHARE * (failed + ok)


class Laws:
    """Per route and phase, a cost law in device terms fitted over one table's ok rows."""

    def __init__(self, laws: Mapping[tuple[str, str], _Law], routes: Mapping[str, Route],
                 hardware: Hardware, reach: float = 1.0):
        self._laws = dict(laws)
        self.routes, self.hardware = routes, hardware
        self.reach = reach  # the share of peak DRAM bandwidth the table's best steps reach
        self._device = dt.device(hardware)

    @classmethod
    def fit(cls, rows: Iterable[Row], routes: Mapping[str, Route], hardware: Hardware,
            failed: Iterable[tuple[MLAProblem, str]] = ()) -> Laws:
        """Laws for the routes of ``rows`` (each ok row: problem, route, params as run, time),
        measured on ``hardware``; a route with fewer rows than terms gets none. ``failed``:
        (problem, route) where a route failed: it is not predicted next to its failures."""
        dev = dt.device(hardware)
        grouped: dict[tuple[str, str], list[tuple[MLAProblem, Mapping, float, np.ndarray]]] = {}
        for problem, route_id, params, time_us in rows:
            if not (time_us > 0 and math.isfinite(time_us)):
                continue
            x = dt.terms(problem, routes.get(route_id), params, dev)
            grouped.setdefault((route_id, problem.phase), []).append(
                (problem, params, float(time_us), x))
        keys = [k for k, v in grouped.items() if len(v) >= dt.TERMS]
        if not keys:
            return cls({}, routes, hardware)
        xs = [np.stack([r[3] for r in grouped[k]]) for k in keys]
        ts = [np.array([r[2] for r in grouped[k]]) for k in keys]
        reach = _reach(xs, ts)
        coef = nnls(*_normal(*zip(*(_paced(x, t, reach) for x, t in zip(xs, ts, strict=True)),
                                  strict=True)))
        failures: dict[tuple[str, str], list[MLAProblem]] = {}
        for problem, route_id in failed:
            failures.setdefault((route_id, problem.phase), []).append(problem)
        laws = {}
        for k, x, t, c in zip(keys, xs, ts, coef, strict=True):
            law = evaluate(x, c, reach)
            laws[k] = _Law(k[0], c, [r[0] for r in grouped[k]], [r[1] for r in grouped[k]],
                           np.log(t / law), failures.get(k, ()))
        return cls(laws, routes, hardware, reach)

    def law(self, problem: MLAProblem, route_id: str, params: Mapping[str, Any],
            hardware: Hardware | None = None, split: int | None = None) -> float | None:
        """The bare law (no correction) at ``problem`` on ``hardware`` (default: the
        table's); None where the route has no law."""
        fitted = self._laws.get((route_id, problem.phase))
        if fitted is None:
            return None
        dev = self._device if hardware is None else dt.device(hardware)
        x = dt.terms(problem, self.routes.get(route_id), params, dev, split)
        return float(evaluate(x, fitted.coef, self.reach))

    def transfer_ratio(self, problem: MLAProblem, route_id: str, params: Mapping[str, Any],
                       source: Hardware, target: Hardware) -> float:
        """law(target) / law(source) at ``problem``: what a time measured on ``source``
        is multiplied by on ``target`` (1 where the route has no law or a device lacks
        the figures)."""
        if not (dt.knows(source) and dt.knows(target)):
            return 1.0
        there = self.law(problem, route_id, params, target)
        here = self.law(problem, route_id, params, source)
        return 1.0 if there is None or here is None else there / here

    def predict(self, problem: MLAProblem, route_id: str) -> LawPrediction | None:
        """The route's predicted cost at ``problem`` with the recipe it would be called
        with there (the module doc); None where it has no law, no set to run, or failed
        next to ``problem`` (its failures hold ``FAILED_SHARE`` of the kernel's weight)."""
        fitted = self._laws.get((route_id, problem.phase))
        route = self.routes.get(route_id)
        if fitted is None or route is None:
            return None
        mean, spread, distance, j, failing = fitted.correction(problem)
        if failing:
            return None
        chosen = self._params_at(route, fitted.params[j], problem)
        if chosen is None:
            return None
        params, law = chosen
        return LawPrediction(route_id, MappingProxyType(params), law * math.exp(mean),
                             math.hypot(spread, DISTANCE_ERROR * distance),
                             fitted.problems[j])

    def choose(self, problem: MLAProblem, usable: Callable[[str], bool] | None = None
               ) -> list[LawPrediction]:
        """Every usable route's prediction at ``problem``, fastest first (``usable`` asked
        of the routes with a law, fastest first, until one holds: the rest are not asked)."""
        found = [p for r, phase in self._laws if phase == problem.phase
                 for p in [self.predict(problem, r)] if p is not None]
        found.sort(key=lambda p: p.time_us)
        if usable is None:
            return found
        for i, p in enumerate(found):
            if usable(p.route_id):
                return [p, *found[i + 1:]]
        return []

    def _params_at(self, route: Route, near: Mapping[str, Any], problem: MLAProblem
                   ) -> tuple[dict[str, Any], float] | None:
        """The set to call ``route`` with at ``problem`` and its law there: the nearest
        row's recipe where the route lists it here (else the route's first set), its split
        the rule's or, for a route whose law chooses, the least law's among the listed."""
        try:
            space = route.param_space(problem, self._device.info)
        except Exception:  # a broken param_space: no set to call it with
            return None
        if not space:
            return None
        want = dt.recipe_of(route, near)
        sets = [p for p in space if dt.recipe_of(route, p) == want] or \
            [p for p in space if dt.recipe_of(route, p) == dt.recipe_of(route, space[0])]
        best: tuple[dict[str, Any], float] | None = None
        for params in _by_split(route, problem, sets, self._device):
            law = self.law(problem, route.id, params)
            if law is not None and (best is None or law < best[1]):
                best = (dict(params), law)
        return best


def _by_split(route: Route, problem: MLAProblem, sets: list[Mapping[str, Any]],
              dev: dt.Device) -> list[Mapping[str, Any]]:
    """Of one recipe's sets, those its law weighs: every listed split where the route's law
    chooses among them, else the set at the route's rule split (the first without one)."""
    launch = dt.geometry(route, problem, dt.recipe_of(route, sets[0]), dev.cus)
    if launch is None or launch.key is None or launch.chooses:
        return sets if launch is not None and launch.chooses else sets[:1]
    try:
        rule = launch.split(problem, dev.info)
    except Exception:  # the route's rule failed: its first set
        return sets[:1]
    return [next((p for p in sets if p.get(launch.key) == rule), sets[0])]


def evaluate(x: np.ndarray, coef: np.ndarray, reach: float) -> np.ndarray:
    """The law at terms ``x`` (rows x TERMS, or one row): its fixed parts plus the slower of
    the DRAM floor (the bytes at the share of peak bandwidth the table reaches) and the
    route's own pace (its walk, compute and conversion)."""
    fixed = coef[0] + x[..., 4] * coef[4] + x[..., 5] * coef[5]
    pace = x[..., 2] * coef[2] + x[..., 3] * coef[3] + x[..., 6] * coef[6]
    return np.maximum(fixed + np.maximum(x[..., 1] / reach, pace), 1e-9)


def _reach(xs: list[np.ndarray], ts: list[np.ndarray]) -> float:
    """The share of peak DRAM bandwidth the table's fastest steps reach (a high quantile of
    bytes over bandwidth over time, so one odd row does not set it)."""
    shares = np.concatenate([x[:, 1] / t for x, t in zip(xs, ts, strict=True)])
    return float(min(1.0, max(np.quantile(shares, REACH_QUANTILE), MIN_REACH)))


def _paced(x: np.ndarray, t: np.ndarray, reach: float) -> tuple[np.ndarray, np.ndarray]:
    """A route's rows for the linear fit of its pace: the DRAM term left out (the law takes
    it as a floor), and the rows at that floor too (their time says only that the pace is
    no slower). With fewer rows off the floor than terms, none: its law is the floor."""
    paced = x.copy()
    paced[:, 1] = 0.0
    free = x[:, 1] / reach < BOUND_SHARE * t
    return (paced[free], t[free]) if free.sum() >= dt.TERMS else (paced[:0], t[:0])


def _normal(xs: list[np.ndarray], ts: list[np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The relative least-squares problems (law / t = 1 at every row), one per law."""
    a, b, yy, usable = [], [], [], []
    for x, t in zip(xs, ts, strict=True):
        scaled = x / t[:, None]
        a.append(scaled.T @ scaled)
        b.append(scaled.sum(axis=0))
        yy.append(float(len(t)))
        usable.append(len(t))
    return np.stack(a), np.stack(b), np.array(yy), np.array(usable)


def transfer_time(laws: Laws, problem: MLAProblem, route_id: str, params: Mapping[str, Any],
                  time_us: float, target: Hardware, trust: float = TRUST) -> float:
    """A time measured on ``laws.hardware`` as it would be on ``target`` (``trust``: the
    share of the law's movement applied, as ``TRUST``)."""
    return time_us * laws.transfer_ratio(problem, route_id, params, laws.hardware,
                                         target) ** trust


def transfer_times(rows: Any, routes: Mapping[str, Route], source: Hardware,
                   target: Hardware, trust: float = TRUST) -> np.ndarray:
    """Each row's ``time_us`` as it would be on ``target``, from laws fitted over the
    ok rows (a DataFrame with the table's key columns, route, route_params, time_us and,
    where present, status; rows not ok keep their time); ``trust`` as ``transfer_time``."""
    times = rows["time_us"].to_numpy(dtype=float).copy()
    ok = np.isfinite(times) & (times > 0)
    if "status" in rows:
        ok &= (rows["status"] == "ok").to_numpy()
    if not ok.any() or not (dt.knows(source) and dt.knows(target)):
        return times
    picked = rows[ok]
    problems = _problems(picked)
    params = [json.loads(p) for p in picked["route_params"].tolist()]
    route_ids = [str(r) for r in picked["route"].tolist()]
    fitted = Laws.fit(zip(problems, route_ids, params, times[ok], strict=True), routes, source)
    ratios = [fitted.transfer_ratio(p, r, q, source, target)
              for p, r, q in zip(problems, route_ids, params, strict=True)]
    times[ok] *= np.array(ratios) ** trust
    return times


def _problems(frame: Any) -> list[MLAProblem]:
    """Each row's problem, built once per distinct key."""
    from mlatune.problem import KEY_FIELDS

    seen: dict[tuple, MLAProblem] = {}
    out = []
    for values in zip(*(frame[c].tolist() for c in KEY_FIELDS), strict=True):
        problem = seen.get(values)
        if problem is None:
            problem = seen[values] = MLAProblem.from_key_dict(dict(zip(KEY_FIELDS, values,
                                                                       strict=True)))
        out.append(problem)
    return out
