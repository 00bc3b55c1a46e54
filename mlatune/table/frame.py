"""Dispatch tables as DataFrames: one row per (device, problem, route) with exactly the
columns of ``schema.COLUMN_TYPES``. Building a table from result rows, its ranking by step
cost (``cost``), its problem keys and provenance records. Storage is ``files``, the checks
``checks``, merging and summaries ``combine``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from mlatune.problem import KEY_FIELDS
from mlatune.steps import RouteFacts
from mlatune.table.cost import DEFAULT_CALLER, Caller, caller_cost
from mlatune.table.schema import (
    COLUMN_TYPES,
    COLUMNS,
    DCP_COLUMNS,
    DCP_MEASURED,
    KEY_COLUMNS,
    PROVENANCE_TYPES,
    STEP_COST_COLUMNS,
    STEP_KIND_COLUMNS,
    UNKNOWN_STEP_KIND,
    Provenance,
    competing,
    default_dcp_timing,
)


def _dtype(name: str):
    return pd.api.types.pandas_dtype(name)


def _has_type(series: pd.Series, name: str) -> bool:
    """Whether a column holds the schema type (any pandas string storage counts as string)."""
    if name == "string":
        return isinstance(series.dtype, pd.StringDtype)
    return series.dtype == _dtype(name)


# Building ------------------------------------------------------------------

_STEP_COLUMNS = (*STEP_KIND_COLUMNS, *STEP_COST_COLUMNS)


def build(rows: Iterable[Mapping[str, Any]], provenance: Provenance,
          facts: RouteFacts | None = None, sharing: Collection[str] = ()) -> pd.DataFrame:
    """A table from result rows (KEY_COLUMNS + RESULT_COLUMNS but ``rank``), ranked for the
    default caller (``sharing``: the routes whose host plan one step's calls share).

    The step, DCP and LSE-error columns are optional: a row without plan_on or capturable
    gets the route's declaration, one without a cost or lse_err NaN (not measured), one
    without DCP columns was not measured across processes.
    """
    optional = (*_STEP_COLUMNS, *DCP_COLUMNS, "lse_err")
    required = [c for c in COLUMNS if c != "rank" and c not in PROVENANCE_TYPES
                and c not in optional]
    records = []
    for i, row in enumerate(rows):
        missing = [c for c in required if c not in row]
        if missing:
            raise ValueError(f"result row {i} lacks {', '.join(missing)}")
        records.append({c: row[c] for c in (*required, *optional) if c in row})
    frame = pd.DataFrame.from_records(records, columns=[*required, *optional])
    frame = _fill_dcp_columns(_fill_step_kinds(frame, facts))
    for name, value in provenance.as_dict().items():
        frame[name] = value
    frame["rank"] = 0
    frame = coerce(frame[list(COLUMNS)])
    return assign_ranks(frame, DEFAULT_CALLER, sharing)


def _declared_step_kinds(frame: pd.DataFrame, facts: RouteFacts | None
                         ) -> tuple[pd.Series, pd.Series]:
    """(plan_on, capturable) the routes declare for each row's params, asked once per
    distinct (route, params); UNKNOWN_STEP_KIND where either column is missing."""
    if "route" not in frame or "route_params" not in frame or frame.empty:
        return (pd.Series(UNKNOWN_STEP_KIND[0], index=frame.index, dtype=object),
                pd.Series(UNKNOWN_STEP_KIND[1], index=frame.index, dtype=object))
    pair_id = frame.groupby(["route", "route_params"], sort=False,
                            dropna=False).ngroup().to_numpy()
    firsts = np.unique(pair_id, return_index=True)[1]
    declared = facts.step_kind if facts else (lambda route, params: UNKNOWN_STEP_KIND)
    kinds = [declared(str(route), str(params)) for route, params in
             zip(frame["route"].iloc[firsts], frame["route_params"].iloc[firsts], strict=True)]
    plan_on = np.array([k[0] for k in kinds], dtype=object)
    capturable = np.array([k[1] for k in kinds], dtype=object)
    return (pd.Series(plan_on[pair_id], index=frame.index),
            pd.Series(capturable[pair_id], index=frame.index))


def _fill_step_kinds(frame: pd.DataFrame, facts: RouteFacts | None) -> pd.DataFrame:
    """plan_on and capturable from the routes' declarations where a row has none."""
    out = frame.copy()
    unset = out["plan_on"].isna() | out["capturable"].isna()
    if unset.any():
        plan_on, capturable = _declared_step_kinds(out[unset], facts)
        out["plan_on"] = out["plan_on"].astype(object)
        out["capturable"] = out["capturable"].astype(object)
        out.loc[unset & out["plan_on"].isna(), "plan_on"] = plan_on
        out.loc[unset & out["capturable"].isna(), "capturable"] = capturable
    return out


def _fill_dcp_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """Where a row has no DCP timing, it was not measured across processes."""
    out = frame.copy()
    unset = out["dcp_timing"].isna()
    if unset.any():
        out["dcp_timing"] = out["dcp_timing"].astype(object)
        out.loc[unset, "dcp_timing"] = [default_dcp_timing(int(d))
                                        for d in out.loc[unset, "dcp_size"]]
    out["dcp_scheme"] = out["dcp_scheme"].astype(object).where(out["dcp_scheme"].notna(), "")
    return out


def coerce(frame: pd.DataFrame) -> pd.DataFrame:
    """Cast known columns to their schema types (for tables built in memory)."""
    out = frame.copy()
    for name, kind in COLUMN_TYPES.items():
        if name in out:
            out[name] = out[name].astype(_dtype(kind))
    return out


def _simulated_tier(frame: pd.DataFrame) -> pd.Series:
    """0 for a row measured across processes, 1 otherwise: measured rows rank first."""
    return (frame["dcp_timing"] != DCP_MEASURED).astype("int64")


def competing_rows(frame: pd.DataFrame, by: Sequence[str] = KEY_COLUMNS) -> pd.Series:
    """``schema.competing`` over a frame: True for the rows that compete within their group
    of ``by`` (a problem by default; a bucket for what a predictor learns from). Only an
    ``ok`` measured row counts: a group whose measured runs all failed keeps its simulated
    rows, as the dispatcher (which reads ok rows alone) does."""
    measured = frame["dcp_timing"] == DCP_MEASURED
    if "status" in frame.columns:
        measured &= frame["status"] == "ok"
    if not measured.any():
        return pd.Series(True, index=frame.index)
    groups = frame.groupby(list(by), sort=False, dropna=False).ngroup()
    return pd.Series(competing(groups.tolist(), measured.tolist()), index=frame.index)


def step_costs(frame: pd.DataFrame, caller: Caller = DEFAULT_CALLER,
               sharing: Collection[str] = ()) -> np.ndarray:
    """Each row's ``cost.step_cost`` for ``caller``; ``sharing``: the routes whose host plan
    the calls of one step share."""
    return caller_cost(caller, frame["time_us"].to_numpy(dtype=float),
                       frame["plan_on"].to_numpy(dtype=object),
                       frame["plan_us"].to_numpy(dtype=float),
                       frame["plan_host_us"].to_numpy(dtype=float),
                       frame["route"].isin(list(sharing)).to_numpy())


def assign_ranks(frame: pd.DataFrame, caller: Caller = DEFAULT_CALLER,
                 sharing: Collection[str] = ()) -> pd.DataFrame:
    """rank 1, 2, ... among the ``ok`` rows of each key that ``caller`` can call (a capturable
    caller: steps a graph replays): measured DCP rows first, then by what a step costs
    ``caller`` (``cost.step_cost``; ties by route id); 0 otherwise."""
    out = frame.reset_index(drop=True)
    ok = out[(out["status"] == "ok") & (out["capturable"].astype(bool) | (not caller.capturable))]
    ok = ok.assign(_tier=_simulated_tier(ok), _cost=step_costs(ok, caller, sharing))
    ok = ok.sort_values(["_tier", "_cost", "route"], kind="stable")
    ranks = ok.groupby(list(KEY_COLUMNS), sort=False, dropna=False).cumcount() + 1
    out["rank"] = np.zeros(len(out), dtype="int64")
    out.loc[ranks.index, "rank"] = ranks.astype("int64")
    out["rank"] = out["rank"].astype("int64")
    return out.sort_values([*KEY_COLUMNS, "route"], kind="stable").reset_index(drop=True)


def key_strings(frame: pd.DataFrame) -> list[str]:
    """``MLAProblem.key`` of every row, built column-wise (tested against the class)."""
    parts: list[Any] = []
    for i, name in enumerate(KEY_FIELDS):
        column = frame[name]
        if name == "causal":
            column = column.astype("int64")  # the key spells a bool as 1 or 0
        parts += [f"{'|' if i else ''}{name}=", pa.Array.from_pandas(column).cast(pa.string())]
    return pc.binary_join_element_wise(*parts, "").to_pylist()


def provenances(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The distinct provenance records of a table, sorted, as plain dicts."""
    cols = list(PROVENANCE_TYPES)
    if frame.empty or any(c not in frame or not _has_type(frame[c], PROVENANCE_TYPES[c])
                          or frame[c].isna().any() for c in cols):
        return []
    if all(frame[c].nunique() == 1 for c in cols):  # the common case, and cheap to see
        distinct = frame[cols].iloc[:1]
    else:
        distinct = frame[cols].drop_duplicates().sort_values(cols)
    return [{c: (int(v) if c == "schema_version" else str(v)) for c, v in zip(cols, row,
                                                                           strict=True)}
            for row in distinct.itertuples(index=False, name=None)]


