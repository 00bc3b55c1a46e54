"""The cost law's fit: relative least squares with coefficients >= 0 over the term subsets,
the log times a table lost (a recipe that lost to its route's best at a point) imputed
from the recipes that ran there (``predict``'s module docstring says why), and the law of a
recipe known at one point alone.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

FEATURES = 4  # the bucket law's terms: 1, W, B, C


@functools.cache
def _subsets(features: int) -> tuple[tuple[int, ...], ...]:
    return tuple(s for k in range(1, features + 1)
                 for s in itertools.combinations(range(features), k))


def nnls(a: np.ndarray, b: np.ndarray, yy: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """Per row r, the coefficients c >= 0 minimising |X_r c - y_r|² from the normal
    equations ``a`` (rows x F x F), ``b`` (rows x F) and ``yy`` = |y_r|²: the best of the
    feature subsets whose unconstrained solution is >= 0 (F is small). ``usable``: how
    many terms each row's points can fix."""
    rows, features = a.shape[0], a.shape[1]
    best = np.full(rows, np.inf)
    coef = np.zeros((rows, features))
    scale = np.sqrt(np.einsum("rii->ri", a)) + 1e-300  # conditions the solves
    a = a / scale[:, :, None] / scale[:, None, :]
    b = b / scale
    for subset in _subsets(features):
        idx = list(subset)
        sub = a[:, idx][:, :, idx] + 1e-12 * np.eye(len(idx))
        c = np.linalg.solve(sub, b[:, idx][:, :, None])[:, :, 0]
        residual = yy - 2 * np.einsum("ri,ri->r", c, b[:, idx]) \
            + np.einsum("ri,rij,rj->r", c, sub, c)
        ok = (c >= 0).all(axis=1) & (len(idx) <= usable) & (residual < best - 1e-12)
        best = np.where(ok, residual, best)
        coef[ok] = 0.0
        coef[np.ix_(ok, idx)] = c[ok]
    return coef / scale


def impute_lost(recipes: list[tuple[str, str]], logs: np.ndarray, penalty: float
                ) -> np.ndarray:
    """A table keeps each route's best recipe per point: where a route ran (its best
    known) and a recipe of it is missing, that recipe lost there: ``penalty`` x the best."""
    out = logs.copy()
    for route_id in {r for r, _ in recipes}:
        rows = [i for i, (r, _) in enumerate(recipes) if r == route_id]
        block = logs[rows]
        ran = ~np.isnan(block).all(axis=0)  # columns where the route ran (nanmin warns else)
        route_best = np.full(block.shape[1], np.nan)
        route_best[ran] = np.nanmin(block[:, ran], axis=0)
        for i in rows:
            lost = np.isnan(logs[i]) & ~np.isnan(route_best)
            out[i, lost] = route_best[lost] + math.log(penalty)
    return out


def one_point_laws(coef: np.ndarray, x: np.ndarray, logs: np.ndarray, known: np.ndarray
                    ) -> np.ndarray:
    """``coef`` with the law of each recipe known at one point alone taken as half fixed
    cost, half streaming there (a = t/2, c = t/2W): one point cannot tell the two apart,
    and the least-squares law may put it all in the fixed cost, flat however large the
    problem grows (a route the sweep ran once, pruned as slower everywhere else, then
    predicted at that one time at 8x the tokens: below the bandwidth floor)."""
    single = np.flatnonzero(known.sum(axis=1) == 1)
    if not len(single):
        return coef
    coef = coef.copy()
    for i in single.tolist():
        j = int(np.flatnonzero(known[i])[0])
        time_us, streamed = math.exp(logs[i, j]), x[i, j, 1]
        if streamed > 0:
            coef[i] = (time_us / 2, time_us / (2 * streamed), 0.0, 0.0)
    return coef
