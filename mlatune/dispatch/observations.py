"""The predictor's observations: each ok candidate of a sweep journal, or each route's row of
a table, as (problem, route id, params as run, step cost for the caller) (``predict.Row``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlatune import table
from mlatune.dispatch.predict import Row
from mlatune.measure import journal
from mlatune.problem import BUCKET_FIELDS, MLAProblem
from mlatune.routes import declared_step_kind
from mlatune.table.cost import step_cost
from mlatune.table.schema import DEVICE_COLUMNS, competing

if TYPE_CHECKING:
    from mlatune.measure.records import Record

__all__ = ["rows_from_journal", "rows_from_table"]


def rows_from_journal(path: str | Path, capturable: bool = False,
                      plan_calls: int | None = None, sharing: frozenset[str] = frozenset()
                      ) -> list[Row]:
    """Every ok candidate of a sweep journal, with its step cost as the dispatcher ranks
    it (``dispatch.step_cost``; plan costs a journal lacks count as 0); with
    ``capturable`` only steps a CUDA graph replays; in a bucket with DCP steps timed
    across processes, only those (``_learnable``). A record without its step kind gets
    the one its route declares, as a table's row does."""

    stepped = []  # (record, params, plan_on): the ok steps the caller can take
    for r in journal.read_records(Path(path))[1]:
        if not r.ok:
            continue
        params = json.loads(r.route_params)
        plan_on, replays = (r.plan_on, r.capturable) if r.plan_on is not None \
            and r.capturable is not None else declared_step_kind(r.route, params)
        if replays or not capturable:
            stepped.append((r, params, plan_on))
    rows = []
    for r, params, plan_on in _learnable(stepped):
        cost = step_cost(float(r.time_us), plan_on, _number(r.plan_us), _number(r.plan_host_us),
                         capturable, **_calls(plan_calls), shares_host_plan=r.route in sharing)
        rows.append((r.problem, r.route, params, float(cost)))
    return rows


def _learnable(stepped: list[tuple[Record, Any, Any]]) -> list[tuple[Record, Any, Any]]:
    """Of (record, ...) tuples, those a predictor learns from: in a bucket with DCP steps
    timed across processes only those (``schema.competing``: a simulated time leaves the
    collectives out, so a law is never fitted over both kinds)."""

    buckets = [r.problem.bucket for r, *_ in stepped]
    keep = competing(buckets, [r.measured_dcp for r, *_ in stepped])
    return [s for s, kept in zip(stepped, keep, strict=True) if kept]


def _calls(plan_calls: int | None) -> dict[str, int]:
    """``step_cost``'s keyword: the dispatcher's default when None."""
    return {} if plan_calls is None else {"plan_calls": plan_calls}


def rows_from_table(frame: Any, capturable: bool = False,
                    plan_calls: int | None = None, sharing: frozenset[str] = frozenset()
                    ) -> list[Row]:
    """A table's ok rows (a DataFrame as ``mlatune.table.read`` gives), costed as the
    dispatcher ranks them (``sharing``: the routes whose host plan a step's calls share);
    with ``capturable`` only steps a CUDA graph replays; in a bucket with DCP rows timed
    across processes, only those (as ``rows_from_journal``)."""

    ok = frame[frame["status"] == "ok"]
    if capturable:
        ok = ok[ok["capturable"].astype(bool)]
    ok = ok[table.competing_rows(ok, by=[*DEVICE_COLUMNS, *BUCKET_FIELDS])]
    costs = step_cost(ok["time_us"].to_numpy(dtype=float), ok["plan_on"].to_numpy(dtype=object),
                      ok["plan_us"].to_numpy(dtype=float),
                      ok["plan_host_us"].to_numpy(dtype=float), capturable,
                      **_calls(plan_calls), shares_host_plan=ok["route"].isin(sharing).to_numpy())
    return [(MLAProblem.from_key_dict(row), str(row["route"]), json.loads(row["route_params"]),
             float(cost)) for row, cost in zip(ok.to_dict("records"), costs, strict=True)]


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)
