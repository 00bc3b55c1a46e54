"""The report's numbers, from a table (and a held-out table and journal): pandas, no matplotlib.

What each number means is written for readers once, in the page's last section
(``templates/report.html.j2``, "What each number means"); the functions here say
how they compute it. The console (``mlatune report``) and the page print the same
lines (``headline_rows``, ``policy_rows``).
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
from mlatune.measure import journal
from mlatune.problem import FP8_DTYPES, MLAProblem
from mlatune.report import policies
from mlatune.report.terms import batch_band, geomean, problem_label
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
    winner's tb_per_s and tflops."""
    summary = table.summary(frame)
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
    """time_us of every ok row that competes (``table.competing_rows``: at a problem with
    DCP rows measured across processes, only those): index problem key, one column per
    route (NaN: no such row)."""
    ok = frame[(frame["status"] == "ok") & table.competing_rows(frame)]
    long = pd.DataFrame({"key": table.key_strings(ok), "route": ok["route"].astype(str).to_numpy(),
                         "time_us": ok["time_us"].to_numpy()})
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


def rule_routes(problems: pd.DataFrame, device) -> pd.Series:
    """The rule fallback's route per problem key."""
    rules = Dispatcher.rules_only(device)
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
    processes only those, each scheme's (``schema.competing``), as the table keeps them."""
    ok = [r for r in journal.read_records(Path(journal_path))[1] if r.ok]
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
    dispatcher = Dispatcher.load(table_path, device=device, allow_arch=device.arch)
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
    from mlatune.dispatch.dispatcher import DEFAULT_UNMEASURED
    from mlatune.table.cost import DEFAULT_PLAN_CALLS

    summary.notes.append(
        f"held out: the dispatcher answers unmeasured shapes by {DEFAULT_UNMEASURED!r} and "
        f"ranks routes by the launch plus 1/{DEFAULT_PLAN_CALLS} of a plan shared by the "
        f"layers of a step (Dispatcher plan_calls); regrets compare launch times")
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

def speedup_text(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def percent_text(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 100:+.1f}%"


def _share(part: int, whole: int) -> str:
    return f"{part / whole * 100:.0f}%" if whole else "-"


def _speedup_line(stats: SpeedupStats) -> str:
    return f"geomean {speedup_text(stats.geomean)}, largest {speedup_text(stats.largest)}"


def _table_rows(summary: Summary) -> list[tuple[str, str]]:
    best, rule = summary.best_fixed, summary.rule
    without = f"; {summary.without_ok} without an ok row" if summary.without_ok else ""
    rows = [
        ("device", " ".join(map(str, summary.device[:2])) + f" ({summary.device[2]} SMs/CUs)"),
        ("measured", summary.measured_with),
        ("problems", f"{summary.problems} ({summary.decode} decode, {summary.prefill} "
                     f"prefill){without}"),
        ("routes", f"{summary.routes_ok} with an ok row, of {summary.routes_tried} tried"),
        ("best single fixed route", f"{best.policy} (wins {best.wins}, serves {best.served})"),
        ("pick vs best fixed route", _speedup_line(best)),
        ("pick vs rule fallback", f"{_speedup_line(rule)} (over {rule.served} of {rule.total} "
                                  f"problems)"),
    ]
    if not math.isnan(summary.spread[0]):
        rows.append(("timing spread of ok rows", f"(p80 - p20) / median: median "
                     f"{summary.spread[0] * 100:.1f}%, 99th percentile "
                     f"{summary.spread[1] * 100:.1f}%"))
    if summary.roofline is not None and len(summary.roofline):
        fractions = summary.roofline["fraction"]
        rows.append(("roofline fraction of the picks", f"median {fractions.median() * 100:.0f}%, "
                                                       f"max {fractions.max() * 100:.0f}%"))
    return rows


def _regret_rows(regret: RegretStats) -> list[tuple[str, str]]:
    sources = ", ".join(f"{s} {n}" for s, n in regret.sources.items())
    without = f"; {regret.no_ok_row} without an ok row" if regret.no_ok_row else ""
    rows = [
        ("held-out problems", f"{regret.judged} ({sources}){without}"),
        ("dispatcher regret", f"geomean {percent_text(regret.geomean)}, median "
                           f"{percent_text(regret.median)}, max {percent_text(regret.max)}"),
    ]
    if regret.params_timed:
        rows.append(("dispatcher regret, its parameters",
                     f"geomean {percent_text(regret.params_geomean)}, "
                     f"median {percent_text(regret.params_median)}, "
                     f"max {percent_text(regret.params_max)} (over the {regret.params_timed} "
                     f"problems whose chosen parameters the held-out sweep timed)"))
    rows.append(("dispatcher picked the winner", f"{regret.picked_winner} of {regret.judged} "
                                              f"({_share(regret.picked_winner, regret.judged)}); "
                                              f"misses {regret.misses}"))
    return rows


def headline_rows(summary: Summary) -> list[tuple[str, str]]:
    """The summary numbers, as (label, value) lines: the table, the vendor policies (on
    the table, then held out), nearest's regret."""
    rows = _table_rows(summary)
    if summary.vendor:
        rows += policies.headline_rows(summary.vendor, summary.vendor_heldout)
    return rows + (_regret_rows(summary.regret) if summary.regret is not None else [])


def _number(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def _speedup_json(stats: SpeedupStats) -> dict[str, Any]:
    return {"policy": stats.policy, "served": stats.served, "total": stats.total,
            "wins": stats.wins, "geomean": _number(stats.geomean),
            "largest": _number(stats.largest), "largest_problem": stats.largest_key or None}


def summary_document(summary: Summary) -> dict[str, Any]:
    """The report's numbers as one JSON-ready document (``summary.json``): the headline
    lines as printed, and every policy's numbers (NaN as null)."""
    regret = summary.regret
    return {
        "table": summary.table_path, "heldout": summary.heldout_path or None,
        "device": {"arch": summary.device[0], "name": summary.device[1],
                   "cu_count": summary.device[2]},
        "measured_with": summary.measured_with,
        "problems": {"ok": summary.problems, "decode": summary.decode,
                     "prefill": summary.prefill, "without_ok": summary.without_ok},
        "headline": [{"label": label, "value": value} for label, value in
                     headline_rows(summary)],
        "fixed_routes": [_speedup_json(s) for s in summary.fixed],
        "rule_fallback": _speedup_json(summary.rule),
        "vendor_policies": [policies.as_json(s) for s in summary.vendor],
        "vendor_policies_heldout": [policies.as_json(s) for s in summary.vendor_heldout],
        "dcp_measured": [{k: _number(v) if isinstance(v, float) else v for k, v in r.items()}
                         for r in summary.dcp.to_dict("records")],
        "goal_over_always_flashmla": policies.GOAL_OVER_FLASHMLA,
        "vllm_hopper_order": {"source": policies.VLLM_SOURCE,
                              "backends": policies.vllm_order_json()},
        "nearest_regret": None if regret is None else {
            "judged": regret.judged, "misses": regret.misses,
            "picked_winner": regret.picked_winner, "geomean": _number(regret.geomean),
            "median": _number(regret.median), "max": _number(regret.max)},
        "notes": list(summary.notes),
    }


DCP_COLUMNS = ("problem", "route", "scheme", "timed", "simulated (us)", "measured (us)",
               "measured / simulated", "communication share")


def dcp_rows(summary: Summary) -> list[tuple[str, ...]]:
    """One line per DCP route measured across processes, beside its one-GPU simulation."""
    return [(problem_label(r.key), str(r.route), str(r.scheme), str(r.timed),
             f"{r.simulated_us:.4g}",
             f"{r.measured_us:.4g}", speedup_text(r.ratio),
             "-" if math.isnan(r.comm_share) else f"{r.comm_share * 100:.0f}%")
            for r in summary.dcp.itertuples(index=False)]


POLICY_COLUMNS = ("policy", "served", "wins", "geomean speedup", "largest speedup",
                  "largest on problem")


def policy_rows(summary: Summary) -> list[tuple[str, ...]]:
    """One line per fixed route, then the rule fallback."""
    return [(s.policy, f"{s.served}/{s.total}", "-" if s.policy == RULE_POLICY else str(s.wins),
             speedup_text(s.geomean), speedup_text(s.largest), problem_label(s.largest_key))
            for s in [*summary.fixed, summary.rule]]


def prefill_rows(problems: pd.DataFrame) -> list[tuple[str, ...]]:
    """One line per prefill problem: its shape, winner, time and the runner-up's margin."""
    prefill = problems[problems["phase"] == "prefill"]
    return [(f"h{r.num_heads} {r.q_dtype}/{r.kv_dtype} {'causal' if r.causal else 'non-causal'}",
             str(r.batch), str(r.qlen), str(r.kv_len), str(r.winner), f"{r.winner_us:.4g}",
             str(r.runner_up) or "-", percent_text(r.margin))
            for r in prefill.itertuples(index=False)]


PREFILL_COLUMNS = ("problem", "batch", "qlen", "kv_len", "winner", "time (us)", "runner-up",
                   "runner-up slower by")
