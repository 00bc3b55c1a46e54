"""What each accuracy policy (``check.policy``: strict, fp8-mma, fast) buys in speed and costs
in measured error, over a table's decode problems.

A policy's pick at a problem is the rank-1 row of the table as that policy serves it
(``dispatch.admission.admitted_table``: the ok rows it admits, ranked again by step cost
as the table ranks its rows). Its speed is compared by ``time_us``, as the rest of the
report compares: always FlashMLA's time over the pick's, strict's pick's time over the
pick's. Its error is the recorded error of its picks: ``rel_err``, and ``lse_err`` where the
table has that column. Each policy is judged over every decode problem with an ok row,
then over those where the policies can differ: a 16-bit q over an fp8 cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from mlatune import table
from mlatune.check.policy import POLICIES, STRICT
from mlatune.dispatch.admission import admitted_table
from mlatune.dispatch.loading import registered_routes
from mlatune.problem import FP8_DTYPES
from mlatune.report.policies import ALWAYS_FLASHMLA, FLASHMLA
from mlatune.report.terms import geomean
from mlatune.routes import Route

Scope = Callable[[pd.DataFrame], pd.Series]

# (name, which problems of the decode rows): every decode problem, then those where a
# kernel's own rounding can go past the problem's dtypes.
SCOPES: tuple[tuple[str, Scope], ...] = (
    ("decode", lambda rows: pd.Series(True, index=rows.index)),
    ("decode, 16-bit q over an fp8 cache",
     lambda rows: ~rows["q_dtype"].isin(FP8_DTYPES) & rows["kv_dtype"].isin(FP8_DTYPES)),
)


@dataclass(frozen=True)
class ErrorStats:
    recorded: int  # picks with a recorded value
    median: float  # NaN where none is recorded
    max: float


@dataclass(frozen=True)
class PolicyNumbers:
    """One policy over one scope of problems."""

    policy: str
    scope: str
    problems: int  # problems of the scope with an ok row
    served: int  # problems with a row the policy admits
    over_flashmla: float  # geomean of FlashMLA's time over the pick's; NaN: none to compare
    flashmla_served: int  # problems where both have a time
    over_strict: float  # geomean of strict's pick's time over this pick's
    strict_served: int  # problems where both have a pick
    differs: int  # problems whose pick (route or parameters) is not strict's
    rel_err: ErrorStats
    lse_err: ErrorStats | None  # None: the table has no lse_err column


@dataclass(frozen=True)
class AccuracySection:
    device: str  # the table's device, in words
    measured: str  # the dates of the table's runs (provenance created_utc)
    numbers: list[PolicyNumbers]

    @property
    def has_lse(self) -> bool:
        """Whether the table has an lse_err column."""
        return any(n.lse_err is not None for n in self.numbers)

    @property
    def lse_recorded(self) -> bool:
        """Whether any pick has an lse_err recorded."""
        return any(n.lse_err is not None and n.lse_err.recorded for n in self.numbers)


# Numbers ------------------------------------------------------------------------------

def measured_dates(frame: pd.DataFrame) -> str:
    """The days the table's runs were made on (provenance ``created_utc``), and how many
    runs; "-" without a provenance."""
    runs = table.provenances(frame)
    days = sorted({str(r["created_utc"])[:10] for r in runs})
    if not days:
        return "-"
    span = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    return span + (f" ({len(runs)} runs)" if len(runs) > 1 else "")


def keyed(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` indexed by problem key (``MLAProblem.key``)."""
    keys = table.key_strings(rows) if len(rows) else []
    return rows.set_index(pd.Index(keys, name="key", dtype="object"))


def policy_picks(decode: pd.DataFrame, policy: str, routes: Mapping[str, Route]
                 ) -> pd.DataFrame:
    """The policy's pick per problem key: the rank-1 row of the table as it serves it."""
    ranked = admitted_table(decode, POLICIES[policy], routes)
    return keyed(ranked[ranked["rank"] == 1])


def error_stats(values: pd.Series) -> ErrorStats:
    recorded = values.dropna().astype("float64")
    if recorded.empty:
        return ErrorStats(0, math.nan, math.nan)
    return ErrorStats(len(recorded), float(recorded.median()), float(recorded.max()))


def ratio_geomean(numerator: pd.Series, denominator: pd.Series) -> tuple[float, int]:
    """Geomean of numerator / denominator over the keys where both have a value, and how
    many those are."""
    ratios = (numerator.reindex(denominator.index) / denominator).dropna()
    return (geomean(ratios) if len(ratios) else math.nan), len(ratios)


def _choice(picks: pd.DataFrame, keys: pd.Index) -> pd.Series:
    """Route and parameters of each key's pick; "" where there is none."""
    chosen = picks["route"].astype(str) + " " + picks["route_params"].astype(str)
    return chosen.reindex(keys).fillna("")


def policy_numbers(policy: str, scope: str, keys: pd.Index, picks: pd.DataFrame,
                   strict: pd.DataFrame, flashmla: pd.Series) -> PolicyNumbers:
    """``policy``'s numbers over the problem ``keys``, its picks and strict's given."""
    pick_us = picks["time_us"].reindex(keys).dropna().astype("float64")
    over_flashmla, flashmla_served = ratio_geomean(flashmla, pick_us)
    over_strict, strict_served = ratio_geomean(strict["time_us"].astype("float64"), pick_us)
    served = picks.index.intersection(keys)
    lse = error_stats(picks["lse_err"].reindex(served)) if "lse_err" in picks else None
    return PolicyNumbers(
        policy, scope, len(keys), len(pick_us), over_flashmla, flashmla_served, over_strict,
        strict_served, int((_choice(picks, keys) != _choice(strict, keys)).sum()),
        error_stats(picks["rel_err"].reindex(served)), lse)


def section(frame: pd.DataFrame, times: pd.DataFrame, device_name: str,
            routes: Mapping[str, Route] | None = None) -> AccuracySection | None:
    """Every policy over every scope; ``times``: the report's ok times (problem key x
    route). None where the table has no decode problem with an ok row."""
    decode = frame[frame["phase"] == "decode"]
    problems = keyed(decode[decode["status"] == "ok"])
    problems = problems[~problems.index.duplicated()]
    if problems.empty:
        return None
    routes = registered_routes(routes)
    picks = {name: policy_picks(decode, name, routes) for name in POLICIES}
    flashmla = (times[FLASHMLA] if FLASHMLA in times.columns
                else pd.Series(dtype="float64")).dropna()
    numbers = [policy_numbers(name, scope, problems.index[in_scope(problems).to_numpy()],
                              picks[name], picks[STRICT.name], flashmla)
               for scope, in_scope in SCOPES for name in POLICIES]
    return AccuracySection(f"{device_name} ({frame['arch'].iloc[0]})", measured_dates(frame),
                           numbers)


# Text ---------------------------------------------------------------------------------

def _x(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _e(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2g}"


def error_text(name: str, stats: ErrorStats | None) -> str:
    if stats is None:
        return f"{name} not in the table"
    if not stats.recorded:
        return f"{name} not recorded"
    return f"{name} median {_e(stats.median)}, max {_e(stats.max)}"


def numbers_text(n: PolicyNumbers) -> str:
    """One line: what the policy serves, its speedups, how often it leaves strict's pick,
    the error of its picks."""
    return (f"serves {n.served}/{n.problems}; {_x(n.over_flashmla)} over {ALWAYS_FLASHMLA} "
            f"(over {n.flashmla_served}), {_x(n.over_strict)} over the strict picks, pick "
            f"differs from strict on {n.differs}; {error_text('rel_err', n.rel_err)}; "
            f"{error_text('lse_err', n.lse_err)}")


def headline_rows(accuracy: AccuracySection) -> list[tuple[str, str]]:
    """The summary lines: where and when, then each policy over each scope."""
    return [("accuracy policies, measured on", f"{accuracy.device}, {accuracy.measured}"),
            *((f"accuracy {n.policy} ({n.scope})", numbers_text(n)) for n in accuracy.numbers)]


def columns(accuracy: AccuracySection) -> tuple[str, ...]:
    lse = ("lse_err median", "lse_err max") if accuracy.has_lse else ()
    return ("problems", "policy", "served", f"vs {ALWAYS_FLASHMLA} (served)",
            "vs the strict picks", "differs from strict", "rel_err median", "rel_err max", *lse)


def _error_cells(stats: ErrorStats | None) -> tuple[str, ...]:
    if stats is None:
        return ()
    return (_e(stats.median), _e(stats.max))


def table_rows(accuracy: AccuracySection) -> list[tuple[str, ...]]:
    """One line per scope and policy, for the page (``columns``)."""
    return [(n.scope, n.policy, f"{n.served}/{n.problems}",
             f"{_x(n.over_flashmla)} ({n.flashmla_served})", _x(n.over_strict), str(n.differs),
             *_error_cells(n.rel_err), *_error_cells(n.lse_err))
            for n in accuracy.numbers]


def as_json(accuracy: AccuracySection | None) -> dict[str, Any] | None:
    """The section's numbers for summary.json (NaN as null)."""
    if accuracy is None:
        return None

    def num(value: float) -> float | None:
        return None if math.isnan(value) else value

    def errors(stats: ErrorStats | None) -> dict[str, Any] | None:
        return None if stats is None else {"recorded": stats.recorded,
                                           "median": num(stats.median), "max": num(stats.max)}

    return {"device": accuracy.device, "measured": accuracy.measured, "policies": [
        {"policy": n.policy, "scope": n.scope, "problems": n.problems, "served": n.served,
         "over_always_flashmla": num(n.over_flashmla), "flashmla_served": n.flashmla_served,
         "over_strict": num(n.over_strict), "strict_served": n.strict_served,
         "differs_from_strict": n.differs, "rel_err": errors(n.rel_err),
         "lse_err": errors(n.lse_err)}
        for n in accuracy.numbers]}
