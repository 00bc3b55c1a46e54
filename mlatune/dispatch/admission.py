"""Which measured rows an accuracy policy lets the dispatcher serve (``check.policy``): a
row's class is its route's declaration for its parameters (``routes.rounding``, asked once
per route, parameters and dtypes, at the first problem with them: a stored set names what
it ran, so its class follows from it and the dtypes), and its recorded error must be
within that class's bound."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from mlatune.check.accuracy import Rounding
from mlatune.check.policy import Policy
from mlatune.problem import FP8_DTYPES, MLAProblem
from mlatune.routes import Route, rounding

_GROUP = ["route", "route_params", "q_dtype", "kv_dtype"]


def row_classes(rows, routes: Mapping[str, Route]):
    """Each row's numeric class, as (classes of the row groups, each row's group number);
    rows of routes not in ``routes``, or whose parameters do not parse: NONE (such rows are
    never usable anyway)."""
    import numpy as np

    group = rows.groupby(_GROUP, sort=False, dropna=False).ngroup().to_numpy()
    firsts = np.unique(group, return_index=True)[1]  # by group number: group g at [g]
    firsts_rows = rows.iloc[firsts].to_dict("records")
    return [_class_of(row, routes) for row in firsts_rows], firsts_rows, group


def _class_of(row: Mapping, routes: Mapping[str, Route]) -> Rounding:
    route = routes.get(str(row["route"]))
    if route is None or row["q_dtype"] in FP8_DTYPES:
        return Rounding.NONE
    try:
        params = json.loads(row["route_params"])
        return rounding(route, MLAProblem.from_key_dict(row), params)
    except Exception:  # a damaged row or a broken hook: the table's checks name it
        return Rounding.NONE


def admitted(rows, policy: Policy, routes: Mapping[str, Route]):
    """(mask, classes): the rows ``policy`` lets serve (``Policy.admits_row``) and each
    row's class."""
    import numpy as np

    if rows.empty:
        return np.zeros(0, dtype=bool), np.zeros(0, dtype=object)
    classes, firsts, group = row_classes(rows, routes)
    fits = np.array([policy.admits_class(r["q_dtype"], c) for r, c in
                     zip(firsts, classes, strict=True)])
    bounds = np.array([policy.bound(r["q_dtype"], r["kv_dtype"], c) for r, c in
                       zip(firsts, classes, strict=True)])
    errors = rows["rel_err"].to_numpy(dtype=float)
    mask = fits[group] & (np.isnan(errors) | (errors <= bounds[group]))
    return mask, np.array(classes, dtype=object)[group]


def option_class(option: Mapping, problem: MLAProblem, routes: Mapping[str, Route]
                 ) -> Rounding:
    """A winners-map option's numeric class at its problem (NONE for an unknown route)."""
    route = routes.get(str(option["route"]))
    if route is None or problem.q_dtype in FP8_DTYPES:
        return Rounding.NONE
    try:
        return rounding(route, problem, dict(option.get("params") or {}))
    except Exception:  # a broken hook: as a damaged row
        return Rounding.NONE


def option_error(option: Mapping) -> float:
    """A winners-map option's recorded output error (NaN where the map has none)."""
    value = option.get("rel_err")
    return math.nan if value is None else float(value)


def admitted_table(frame, policy: Policy, routes: Mapping[str, Route]):
    """A table as an export for ``policy`` holds it: its ok rows the policy admits (ranked
    again) and every row that is not ok; the held-back rows left out."""
    from mlatune.table.frame import assign_ranks

    ok = (frame["status"] == "ok").to_numpy()
    keep = ~ok
    keep[ok] = admitted(frame[ok], policy, routes)[0]
    sharing = [r for r, route in routes.items() if route.shares_plan]
    return assign_ranks(frame[keep], sharing=sharing)
