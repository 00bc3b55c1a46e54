"""Which measured rows an accuracy policy lets the dispatcher serve (``check.policy``): a
row's class is its route's declaration for its parameters at its problem
(``routes.rounding``, asked once per route, parameters, dtypes and head and query shape: what
a class may depend on besides the set), and its recorded error must be within that class's
bound. A row whose class cannot be told (a hook that raises) is never served."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from mlatune.check.accuracy import Rounding
from mlatune.check.policy import Policy
from mlatune.problem import KEY_FIELDS, MLAProblem
from mlatune.routes import Route, rounding

_GROUP = ["route", "route_params", "q_dtype", "kv_dtype", "num_heads", "qlen", "dcp_size"]
_READ = [*KEY_FIELDS, "route", "route_params"]  # what a group's class is told from


def class_of(route: Route | None, problem: MLAProblem, params: Mapping[str, Any]
             ) -> Rounding | None:
    """``routes.rounding`` of a stored set; None where it cannot be told (an unknown route, a
    hook that raises)."""
    if route is None:
        return None
    try:
        return rounding(route, problem, dict(params))
    except Exception:  # a broken hook: held back, never served on a guess
        return None


def _group_class(row: Mapping, routes: Mapping[str, Route]) -> Rounding | None:
    try:
        params = json.loads(row["route_params"])
        problem = MLAProblem.from_key_dict(row)
    except Exception:  # a damaged row: the table's checks name it
        return None
    return class_of(routes.get(str(row["route"])), problem, params)


def admitted(rows, policy: Policy, routes: Mapping[str, Route]):
    """(mask, classes, class_ok): the rows ``policy`` lets serve (``Policy.admits_row``: the
    class admitted and the recorded error within its bound), each row's class, and whether
    its class alone is admitted (a row admitted by class but not by error failed there)."""
    import numpy as np

    if rows.empty:
        empty = np.zeros(0, dtype=bool)
        return empty, np.zeros(0, dtype=object), empty
    group = rows.groupby(_GROUP, sort=False, dropna=False).ngroup().to_numpy()
    firsts = _records(rows.iloc[np.unique(group, return_index=True)[1]])
    classes = [_group_class(row, routes) for row in firsts]  # group g at [g]
    fits = np.array([c is not None and policy.admits_class(r["q_dtype"], c)
                     for r, c in zip(firsts, classes, strict=True)])
    bounds = np.array([policy.bound(r["q_dtype"], r["kv_dtype"], c) if c is not None else 0.0
                       for r, c in zip(firsts, classes, strict=True)])
    errors = rows["rel_err"].to_numpy(dtype=float)
    class_ok = fits[group]
    mask = class_ok & (np.isnan(errors) | (errors <= bounds[group]))
    return mask, np.array(classes, dtype=object)[group], class_ok


def _records(rows) -> list[dict[str, Any]]:
    """The rows as dicts of the columns a class is told from (those present): as
    ``to_dict("records")`` gives them, without boxing every other column's cells."""
    present = [c for c in _READ if c in rows]
    return [dict(zip(present, values, strict=True))
            for values in zip(*(rows[c].tolist() for c in present), strict=True)]


def option_admitted(option: Mapping, problem: MLAProblem, routes: Mapping[str, Route],
                    policy: Policy) -> tuple[bool, bool, Rounding | None]:
    """A winners-map option as ``admitted`` rows: (admitted, its class admitted, class)."""
    cls = class_of(routes.get(str(option["route"])), problem, option.get("params") or {})
    if cls is None or not policy.admits_class(problem.q_dtype, cls):
        return False, False, cls
    error = option.get("rel_err")
    return policy.admits_row(problem.q_dtype, problem.kv_dtype, cls,
                             math.nan if error is None else float(error)), True, cls


def admitted_table(frame, policy: Policy, routes: Mapping[str, Route]):
    """A table as an export for ``policy`` holds it: its ok rows the policy admits (ranked
    again) and every row that is not ok; the held-back rows left out."""
    from mlatune.table.frame import assign_ranks

    ok = (frame["status"] == "ok").to_numpy()
    keep = ~ok
    keep[ok] = admitted(frame[ok], policy, routes)[0]
    sharing = [r for r, route in routes.items() if route.shares_plan]
    return assign_ranks(frame[keep], sharing=sharing)
