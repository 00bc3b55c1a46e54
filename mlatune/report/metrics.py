"""The report's numbers, from a table (and a held-out table and journal): pandas, no matplotlib.

What each number means is written for readers once, in the page's last section
(``templates/report.html.j2``, "What each number means"); the functions here say
how they compute it. The console (``mlatune report``) and the page print the same
lines (``text.headline_rows``, ``text.policy_rows``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mlatune import routes, table
from mlatune.dispatch import Dispatcher, device_for_arch
from mlatune.dispatch.dispatcher import DEFAULT_UNMEASURED
from mlatune.measure import journal
from mlatune.measure.records import at_home
from mlatune.problem import FP8_DTYPES, MLAProblem
from mlatune.report import accuracy, policies
from mlatune.report.accuracy import AccuracySection
from mlatune.report.terms import batch_band, geomean
from mlatune.table.cost import DEFAULT_PLAN_CALLS
from mlatune.table.schema import (
    DCP_MEASURED,
    DEVICE_COLUMNS,
    GRAPH_TIMER,
    KEY_COLUMNS,
    competing,
)


class ReportError(ValueError):
    """A report that cannot be made; one line (the CLI prints it in red)."""


@dataclass(frozen=True)
class Ceilings:
    memory_tb_per_s: float
    compute_tflops: float  # dense bf16 matmul
    source: str

    @property
    def ridge(self) -> float:
        """FLOP per byte where the memory roof meets the compute roof."""
        return self.compute_tflops / self.memory_tb_per_s


# Measured ceilings per arch; an arch missing here gets no roofline plot.
CEILINGS: dict[str, Ceilings] = {
    "sm_90": Ceilings(
        memory_tb_per_s=4.38, compute_tflops=790.0,
        source="NVIDIA H200, as the project brief gives them: streaming read 4.38 TB/s, "
               "dense bf16 matmul about 790 TFLOP/s (the device machine's notes record a "
               "4.3 TB/s device copy and 769-798 TFLOP/s, 2026-10-28 and 2026-11-04); "
               "not re-measured by mlatune's own runs yet"),
}

RULE_POLICY = "rule fallback"


# Results ----------------------------------------------------------------------------

@dataclass(frozen=True)
class SpeedupStats:
    """The table's pick against one policy (a fixed route or the rule fallback)."""

    policy: str
    served: int  # problems where the policy's route has an ok time
    total: int  # problems with an ok row
    wins: int  # problems the policy's route is the pick for (0 for the rule)
    geomean: float  # NaN when nothing is served
    largest: float  # the largest speedup: where using the policy costs most
    largest_key: str  # the problem of the largest speedup


@dataclass(frozen=True)
class RegretStats:
    judged: int  # held-out problems with an ok row
    no_ok_row: int  # held-out problems without one (not judged)
    misses: int  # chosen route has no ok row there
    picked_winner: int
    geomean: float  # NaN when every problem is a miss
    median: float
    max: float
    sources: dict[str, int]  # select()'s source -> problems
    # With the chosen parameters too (a held-out journal): problems whose chosen
    # parameters were timed there (0 without a journal), and their regret.
    params_timed: int = 0
    params_geomean: float = math.nan
    params_median: float = math.nan
    params_max: float = math.nan


@dataclass
class Summary:
    table_path: str
    device: tuple[str, str, int]
    measured_with: str  # provenance: when, and with which versions
    problems: int  # with an ok row
    decode: int
    prefill: int
    without_ok: int
    routes_ok: int  # routes with at least one ok row
    routes_tried: int
    fixed: list[SpeedupStats]  # best single fixed route first
    rule: SpeedupStats
    rule_unmeasured: int
    roofline: pd.DataFrame | None  # per pick; None without ceilings
    spread: tuple[float, float] = (math.nan, math.nan)  # timing spread: median, 99th pct
    regret: RegretStats | None = None
    heldout_path: str = ""
    notes: list[str] = field(default_factory=list)
    # The pick against the vendor policies (policies.PolicyStats): on the table, and on
    # the held-out table with the dispatcher's choice as the pick.
    vendor: list[Any] = field(default_factory=list)
    vendor_heldout: list[Any] = field(default_factory=list)
    # DCP rows measured across processes beside their one-GPU simulation (dcp_measured).
    dcp: pd.DataFrame = field(default_factory=pd.DataFrame)
    # What each accuracy policy's picks buy and cost over the decode problems; None
    # without a decode problem.
    accuracy: AccuracySection | None = None

    @property
    def best_fixed(self) -> SpeedupStats:
        return self.fixed[0]

    @property
    def ceilings(self) -> Ceilings | None:
        return CEILINGS.get(self.device[0])


# Reading a table ----------------------------------------------------------------------

def one_device(frame: pd.DataFrame, path: str | os.PathLike) -> tuple[str, str, int]:
    devices = frame[list(DEVICE_COLUMNS)].drop_duplicates()
    if len(devices) != 1:
        names = ", ".join(f"{a} {n} ({c})" for a, n, c in devices.itertuples(index=False))
        raise ReportError(f"{path}: a report covers one device, this table holds "
                          f"{len(devices)}: {names}")
    arch, name, cus = devices.iloc[0]
    return str(arch), str(name), int(cus)


def measured_with(frame: pd.DataFrame) -> str:
    """The table's provenance in one line (the newest run where there are several)."""
    runs = table.provenances(frame)
    if not runs:
        return "-"
    last = max(runs, key=lambda r: r["created_utc"])
    return (f"{last['created_utc']}, mlatune {last['mlatune_version']}, torch "
            f"{last['torch_version']}, triton {last['triton_version']}, driver {last['driver']}"
            + (f" ({len(runs)} runs)" if len(runs) > 1 else ""))


def measured_problems(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per problem with an ok row: its key fields, ``key`` (MLAProblem.key),
    winner, winner_us, winner_params, runner_up, runner_up_us, margin, ok_routes, and the
    winner's tb_per_s and tflops (of its launch). winner_us and runner_up_us are what a step
    costs (``table.summary``), the measure the table ranks by."""
    summary = table.summary(frame, sharing=routes.plan_sharing())
    summary = summary[summary["winner"] != ""]
    picks = table.winners(frame)[[*KEY_COLUMNS, "tb_per_s", "tflops"]]
    out = summary.merge(picks, on=list(KEY_COLUMNS), how="left").reset_index(drop=True)
    out["key"] = table.key_strings(out) if len(out) else []
    return out


def dcp_measured(frame: pd.DataFrame) -> pd.DataFrame:
    """The ok rows measured across processes, one per (problem, route): key, route, scheme,
    timed ("graph": a CUDA graph's replay, else "eager"), simulated_us (the one-GPU
    simulation), measured_us (the real step), ratio (measured / simulated) and comm_share
    (the step's time beyond the attention alone, as a share)."""
    rows = frame[(frame["dcp_timing"] == DCP_MEASURED) & (frame["status"] == "ok")]
    out = pd.DataFrame({
        "key": table.key_strings(rows) if len(rows) else [], "route": rows["route"].to_numpy(),
        "scheme": rows["dcp_scheme"].to_numpy(),
        "timed": np.where(rows["timer"].to_numpy(dtype=object) == GRAPH_TIMER, "graph", "eager"),
        "simulated_us": rows["simulated_us"].to_numpy(),
        "measured_us": rows["time_us"].to_numpy()})
    out["ratio"] = out["measured_us"] / out["simulated_us"]
    out["comm_share"] = rows["comm_us"].to_numpy() / out["measured_us"]
    return out.sort_values(["key", "measured_us"], kind="stable").reset_index(drop=True)


def ok_times(frame: pd.DataFrame) -> pd.DataFrame:
    """What a step of every ok row that competes (``table.competing_rows``: at a problem
    with DCP rows measured across processes, only those) costs the default caller, in
    microseconds: its launch plus its share of a plan, as the table ranks its rows
    (``table.step_costs``). Index problem key, one column per route (NaN: no such row)."""
    ok = frame[(frame["status"] == "ok") & table.competing_rows(frame)]
    long = pd.DataFrame({"key": table.key_strings(ok), "route": ok["route"].astype(str).to_numpy(),
                         "time_us": table.step_costs(ok, sharing=routes.plan_sharing())})
    return long.pivot(index="key", columns="route", values="time_us")


# Speedup over fixed routes and the rule fallback ---------------------------------------

def _stats(policy: str, ratios: pd.Series, total: int, wins: int) -> SpeedupStats:
    served = ratios.dropna()
    if served.empty:
        return SpeedupStats(policy, 0, total, wins, math.nan, math.nan, "")
    return SpeedupStats(policy, len(served), total, wins, geomean(served),
                        float(served.max()), str(served.idxmax()))


def pick_speedups(problems: pd.DataFrame, times: pd.DataFrame, route: str) -> pd.Series:
    """t(route, p) / t_pick(p) per problem key; NaN where the route has no ok row."""
    pick = problems.set_index("key")["winner_us"]
    return times[route].reindex(pick.index) / pick


def fixed_route_speedups(problems: pd.DataFrame, times: pd.DataFrame) -> list[SpeedupStats]:
    """Per route with an ok row; the best single fixed route (most wins) first."""
    wins = problems["winner"].value_counts()
    stats = [_stats(route, pick_speedups(problems, times, route), len(problems),
                    int(wins.get(route, 0)))
             for route in times.columns]
    return sorted(stats, key=lambda s: (-s.wins, s.geomean, s.policy))


# The report's picks and best rows are among every ok row (the table's own ranks), so the
# dispatcher it judges serves them all: accuracy policy "fast". What a stricter policy costs
# is the Accuracy policies section's (report.accuracy).
JUDGED_POLICY = "fast"


def rule_routes(problems: pd.DataFrame, device) -> pd.Series:
    """The rule fallback's route per problem key."""
    rules = Dispatcher.rules_only(device, accuracy=JUDGED_POLICY)
    chosen = [rules.select(MLAProblem.from_key_dict(row)).route_id
              for row in problems.to_dict("records")]
    return pd.Series(chosen, index=problems["key"].to_numpy(), dtype="object")


def chosen_times(times: pd.DataFrame, chosen: pd.Series) -> pd.Series:
    """t(chosen route, p) per key of ``chosen``; NaN where that route has no ok row."""
    values = [times.at[key, route] if key in times.index and route in times.columns
              else math.nan for key, route in chosen.items()]
    return pd.Series(values, index=chosen.index, dtype="float64")


def rule_speedup(problems: pd.DataFrame, times: pd.DataFrame, device
                 ) -> tuple[SpeedupStats, int]:
    """The rule fallback's stats, and how many problems its route was not measured ok on."""
    pick = problems.set_index("key")["winner_us"]
    rule_times = chosen_times(times, rule_routes(problems, device))
    ratios = rule_times / pick
    return _stats(RULE_POLICY, ratios, len(pick), 0), int(ratios.isna().sum())


# Roofline and timing spread -------------------------------------------------------------

def roofline(problems: pd.DataFrame, ceilings: Ceilings) -> pd.DataFrame:
    """Per pick: intensity (FLOP/byte), memory, compute and reached fraction, bound."""
    out = problems[["key", "phase", "q_dtype", "winner", "tb_per_s", "tflops"]].copy()
    out = out[np.isfinite(out["tb_per_s"]) & np.isfinite(out["tflops"])]
    out["intensity"] = out["tflops"] / out["tb_per_s"]  # both over the same time
    out["memory_fraction"] = out["tb_per_s"] / ceilings.memory_tb_per_s
    out["compute_fraction"] = out["tflops"] / ceilings.compute_tflops
    out["fraction"] = out[["memory_fraction", "compute_fraction"]].max(axis=1)
    out["bound"] = np.where(out["memory_fraction"] >= out["compute_fraction"], "memory",
                            "compute")
    out["fp8_q"] = out["q_dtype"].isin(FP8_DTYPES)
    return out.reset_index(drop=True)


def timing_spread(frame: pd.DataFrame) -> tuple[float, float]:
    """Median and 99th percentile of (p80 - p20) / median over the ok rows."""
    ok = frame[frame["status"] == "ok"]
    spread = ((ok["time_us_p80"] - ok["time_us_p20"]) / ok["time_us"]).astype("float64")
    spread = spread[np.isfinite(spread)]
    if spread.empty:
        return math.nan, math.nan
    return float(spread.median()), float(spread.quantile(0.99))


# Nearest on held-out problems ---------------------------------------------------------

Timed = dict[tuple[str, str], list[tuple[dict[str, Any], float]]]


def candidate_times(journal_path: str | os.PathLike) -> Timed:
    """(problem key, route) -> [(parameters as run, time_us)] of every ok candidate of
    a sweep journal (plain or gzipped); at a problem with DCP steps measured across
    processes only those, each scheme's (``schema.competing``), as the table keeps them; each
    run under the route its set belongs to now (``records.at_home``)."""
    ok = [at_home(r) for r in journal.read_records(Path(journal_path))[1] if r.ok]
    keys = [r.problem_key for r in ok]
    keep = competing(keys, [r.measured_dcp for r in ok])
    timed: Timed = {}
    for key, r, kept in zip(keys, ok, keep, strict=True):
        if kept:
            timed.setdefault((key, r.route), []).append((json.loads(r.route_params), r.time_us))
    return timed


def params_as_run(route_id: str, problem: MLAProblem, device) -> Callable[[Any], dict]:
    """How ``route_id`` reads a parameter set on ``problem`` (in its current spelling, then
    ``routes.with_defaults``: its defaults filled in, a kernel option missing from a stored
    set at the value it ran),
    so that a chosen set and a journal's run compare; as given for a route not registered
    here."""
    try:
        route = routes.get(route_id)
        space = route.param_space(problem, device)
    except Exception:  # a route not registered here: parameters as given
        return dict

    def as_run(params: Any) -> dict:
        current = route.upgrade_params(dict(params))  # a journal keeps the spelling it ran
        return routes.with_defaults(route, dict(params) if current is None else current, space)

    return as_run


def time_with(timed: Timed, problem: MLAProblem, route_id: str, params: Any, device) -> float:
    """The time of ``route_id`` called with ``params`` on ``problem``: the candidate
    that ran with those, both read as the route does (``params_as_run``; the fastest,
    where it ran more than once); NaN if none was timed."""
    as_run = params_as_run(route_id, problem, device)
    want = as_run(params)
    # Several runs with the same parameters: a DCP step measured in each scheme.
    return min((float(t) for ran, t in timed.get((problem.key, route_id), ())
                if as_run(ran) == want), default=math.nan)


def _regret_summary(regret: pd.Series) -> tuple[float, float, float]:
    """Geomean (of 1 + regret, minus 1), median and max over the judged problems."""
    judged = regret.dropna()
    if judged.empty:
        return math.nan, math.nan, math.nan
    return geomean(1.0 + judged) - 1.0, float(judged.median()), float(judged.max())


def _regret_stats(per_problem: pd.DataFrame, no_ok_row: int) -> RegretStats:
    route_level = _regret_summary(per_problem["regret"])
    with_params = _regret_summary(per_problem["params_regret"])
    return RegretStats(
        judged=len(per_problem), no_ok_row=no_ok_row,
        misses=int(per_problem["regret"].isna().sum()),
        picked_winner=int((per_problem["chosen"] == per_problem["best"]).sum()),
        geomean=route_level[0], median=route_level[1], max=route_level[2],
        sources=per_problem["source"].value_counts().sort_index().astype(int).to_dict(),
        params_timed=int(per_problem["params_regret"].notna().sum()),
        params_geomean=with_params[0], params_median=with_params[1], params_max=with_params[2])


def nearest_regret(table_path: str | os.PathLike, heldout: pd.DataFrame, device,
                   timed: Timed | None = None
                   ) -> tuple[RegretStats, pd.DataFrame, dict[str, int]]:
    """Judge the main table's Dispatcher on the held-out problems; also the rows it skipped
    per route not registered here. ``timed``: the held-out sweep's candidate_times, to
    judge the chosen parameters too."""
    dispatcher = Dispatcher.load(table_path, device=device, allow_arch=device.arch,
                                 accuracy=JUDGED_POLICY)
    problems = measured_problems(heldout)
    asked = [MLAProblem.from_key_dict(row) for row in problems.to_dict("records")]
    choices = [dispatcher.select(problem) for problem in asked]
    chosen = pd.Series([c.route_id for c in choices], index=problems["key"].to_numpy(),
                       dtype="object")
    best_us = problems["winner_us"].to_numpy()
    per_problem = pd.DataFrame({
        "key": problems["key"].to_numpy(),
        "chosen": chosen.to_numpy(),
        "source": [c.source for c in choices],
        "best": problems["winner"].astype(str).to_numpy(),
        "regret": chosen_times(ok_times(heldout), chosen).to_numpy() / best_us - 1.0,
        "params_regret": np.array([
            time_with(timed or {}, problem, c.route_id, c.params, device)
            for problem, c in zip(asked, choices, strict=True)]) / best_us - 1.0,
    })
    no_ok = int(heldout.drop_duplicates(list(KEY_COLUMNS)).shape[0] - len(problems))
    return _regret_stats(per_problem, no_ok), per_problem, dict(dispatcher.skipped_routes)


# Decode winner map ---------------------------------------------------------------------

WINNER_CELL_COLUMNS = ["kv_dtype", "band", "num_heads", "qlen", "route", "won", "n", "saving",
                       "label"]


def _winner_cell(rows: pd.DataFrame) -> tuple[str, int, float, str]:
    """A cell's colour route, its wins there, the runner-up/winner geomean, and its label."""
    counts = rows["winner"].astype(str).value_counts()
    route = sorted(counts.index, key=lambda r: (-counts[r], r))[0]
    ratios = (rows["runner_up_us"] / rows["winner_us"]).dropna()
    saving = geomean(ratios) if len(ratios) else math.nan
    label = f"{saving:.2f}x" if len(ratios) else "1 route"
    if counts[route] < len(rows):  # said only when the colour does not tell the whole cell
        label += f"\nwins {counts[route]}/{len(rows)}"
    return route, int(counts[route]), saving, label


def winner_cells(problems: pd.DataFrame) -> pd.DataFrame:
    """Decode winner-map cells: kv_dtype, band, num_heads, qlen, route, won, n, saving,
    label."""
    decode = problems[problems["phase"] == "decode"].copy()
    if decode.empty:
        return pd.DataFrame(columns=WINNER_CELL_COLUMNS)
    decode["band"] = [batch_band(int(b)) for b in decode["batch"]]
    cells = []
    for (kv_dtype, band, heads, qlen), rows in decode.groupby(
            ["kv_dtype", "band", "num_heads", "qlen"], sort=True):
        route, won, saving, label = _winner_cell(rows)
        cells.append((kv_dtype, band, int(heads), int(qlen), route, won, len(rows), saving,
                      label))
    return pd.DataFrame(cells, columns=WINNER_CELL_COLUMNS)


# Every number --------------------------------------------------------------------------

def _table_notes(arch: str, rule_unmeasured: int, dcp: pd.DataFrame) -> list[str]:
    notes = []
    if len(dcp):
        notes.append(f"{dcp['key'].nunique()} DCP problem(s) have routes measured across "
                     f"processes: those rank first and are their pick; the other routes' times "
                     f"there are one-GPU simulations, without the collectives")
    if arch not in CEILINGS:
        notes.append(f"no measured ceilings for arch {arch} (known: {', '.join(CEILINGS)}): "
                     f"no roofline plot")
    if rule_unmeasured:
        notes.append(f"rule fallback: on {rule_unmeasured} problem(s) the rule's route has no "
                     f"ok row in the table; left out of its speedup")
    return notes


def _table_summary(table_path: str | os.PathLike, frame: pd.DataFrame
                   ) -> tuple[Summary, dict[str, Any]]:
    arch, name, cus = one_device(frame, table_path)
    problems = measured_problems(frame)
    if problems.empty:
        raise ReportError(f"{table_path}: no ok row in the table: nothing to report")
    times = ok_times(frame)
    rule, rule_unmeasured = rule_speedup(problems, times, device_for_arch(arch, name, cus))
    ceilings = CEILINGS.get(arch)
    dcp = dcp_measured(frame)
    summary = Summary(
        table_path=str(table_path), device=(arch, name, cus),
        measured_with=measured_with(frame), problems=len(problems),
        decode=int((problems["phase"] == "decode").sum()),
        prefill=int((problems["phase"] == "prefill").sum()),
        without_ok=frame.drop_duplicates(list(KEY_COLUMNS)).shape[0] - len(problems),
        routes_ok=len(times.columns), routes_tried=int(frame["route"].nunique()),
        fixed=fixed_route_speedups(problems, times), rule=rule, rule_unmeasured=rule_unmeasured,
        roofline=roofline(problems, ceilings) if ceilings else None,
        spread=timing_spread(frame), notes=_table_notes(arch, rule_unmeasured, dcp), dcp=dcp)
    picks = problems.set_index("key")
    summary.vendor = policies.vendor_policies(problems, times, picks["winner_us"],
                                              picks["winner"].astype(str), arch)
    summary.accuracy = accuracy.section(frame, times, name)
    return summary, {"problems": problems, "times": times}


def _add_heldout(summary: Summary, heldout_path: str | os.PathLike | None,
                 heldout: pd.DataFrame, timed: Timed | None) -> pd.DataFrame:
    """Judge nearest on the held-out table into ``summary``; the per-problem regrets."""
    arch, name, cus = summary.device
    h_arch = one_device(heldout, heldout_path or "held-out table")[0]
    if h_arch != arch:
        raise ReportError(f"{heldout_path}: held-out table is for arch {h_arch}, the "
                          f"table for {arch}")
    summary.heldout_path = str(heldout_path)
    summary.regret, per_problem, skipped = nearest_regret(
        summary.table_path, heldout, device_for_arch(arch, name, cus), timed)
    h_times = ok_times(heldout)
    chosen = per_problem.set_index("key")["chosen"]
    summary.vendor_heldout = policies.vendor_policies(
        measured_problems(heldout), h_times, chosen_times(h_times, chosen), chosen, arch,
        pick="nearest")

    summary.notes.append(
        f"held out: the dispatcher answers unmeasured shapes by {DEFAULT_UNMEASURED!r} and "
        f"ranks routes by the launch plus 1/{DEFAULT_PLAN_CALLS} of a plan shared by the "
        f"layers of a step (Dispatcher plan_calls); regrets and speedups compare those step "
        f"costs")
    if skipped:
        summary.notes.append("nearest: the dispatcher skipped rows of routes not registered "
                             "here: " + ", ".join(f"{r} ({n})" for r, n in sorted(skipped.items())))
    if summary.regret.misses:
        summary.notes.append(
            f"nearest: {summary.regret.misses} held-out problem(s) where the chosen route has "
            f"no ok row in the held-out table (misses): left out of the regret statistics, "
            f"counted as not picking the winner")
    return per_problem


def summarize(table_path: str | os.PathLike, frame: pd.DataFrame,
              heldout_path: str | os.PathLike | None = None,
              heldout: pd.DataFrame | None = None,
              heldout_timed: Timed | None = None
              ) -> tuple[Summary, dict[str, Any]]:
    """Every number of the report, and the per-problem frames the plots draw: problems,
    times, and with a held-out table regret."""
    summary, plot_data = _table_summary(table_path, frame)
    if heldout is not None:
        plot_data["regret"] = _add_heldout(summary, heldout_path, heldout, heldout_timed)
    return summary, plot_data


# Text shared by the console and the page ------------------------------------------------
