"""`mlatune report`: what a dispatch table buys, as PNG plots and one self-contained HTML page.

``build_report(table_path, out_dir, heldout_path=None)`` reads a table (one
device), computes the numbers below, draws the plots with matplotlib (its Agg
canvas, no display, imported only here and only when a report is made) and
writes ``report.html`` (the PNGs embedded as base64 data URIs, so the file
stands alone) plus each PNG into ``out_dir``.

Numbers
-------
Problems and times. A *problem* is one key of the table (the whole
MLAProblem on the table's device). Only ``ok`` rows carry times; other rows
(rejected_accuracy, crashed, timeout, unsupported) are never winners and
never count as a route serving a problem. A problem with no ok row at all is
counted ("without an ok row") and left out of every other number. A route
has one row per problem: its fastest measured parameter set. "problems" is
the number with an ok row (decode and prefill counted apart); "routes" counts
the routes with an ok row somewhere, of the routes with any row ("tried").

- t(R, p): time_us (median) of route R's ok row for problem p.
- The table's pick for p: its rank-1 row (fastest ok route); t_pick(p).
- Speedup of the pick over route R on p: t(R, p) / t_pick(p), >= 1.

Fixed routes. For every route R with at least one ok row, over the problems
R can serve (those where R has an ok row):
- served: how many problems that is, of all problems with an ok row;
- wins: problems R is the table's pick for;
- geomean: the geometric mean of the speedups;
- worst case: the largest speedup, i.e. the problem where always using R
  costs most (1.00x: R is the pick wherever it serves).
The best single fixed route is the route with the most wins (ties: the lower
geomean), the route one would hard-code without a table.

Rule fallback. What ``Dispatcher.rules_only(device)`` (no table; device: a
stand-in for the table's arch, name and SM/CU count) answers for each
problem: the first route of the rule order whose ``supports()`` accepts it,
so the answer depends on the routes registered in this process. Its speedup
is t(rule's route, p) / t_pick(p), with t the rule route's fastest measured
parameter set (the rule itself runs default parameters: this flatters the
rule). Problems where the rule's route has no ok row are counted as "rule's
route not measured" and left out of its geomean and worst case.

Timing spread. For every ok row, (time_us_p80 - time_us_p20) / time_us: how
much its repetitions varied; the summary gives the median and the 99th
percentile over the table's ok rows, to judge how far apart two routes must
be for the pick between them to mean something.

Roofline (only for archs in ``CEILINGS``, each number with its source).
For each pick: memory fraction = tb_per_s / memory ceiling (TB/s), where
tb_per_s = problem.min_bytes() / t_pick (its KV shard, q and output moved
once); compute fraction = tflops / compute ceiling (TFLOP/s), where tflops
= problem.flops() / t_pick; the reported fraction is the larger of the two,
and bound says which. The summary gives the median and the largest fraction
over the picks. fp8 queries are compared with the bf16 compute ceiling
(no fp8 matmul ceiling is measured), which overstates their compute fraction
by up to 2x; their points are marked. An arch without ceilings gets no
roofline plot, with a note.

Nearest on held-out problems (``--heldout``, a table of other problems
measured on the same arch). The main table is loaded in a Dispatcher (the
stand-in device as above) and for every held-out problem with an ok row
``select`` names a route (source table, nearest or rule; the counts are
reported; like the rule, the answer depends on the routes registered here,
and routes of the table not registered here are skipped, with a note).
"held-out problems" counts those with an ok row; those without one are
counted apart and not judged. Regret = t_h(chosen route) / t_h(best) - 1, both times from the
held-out table (each route at its fastest parameter set there, so this judges
the route, not the parameters the neighbour used):
- geomean regret: geomean over problems of (1 + regret), minus 1;
- median and max regret;
- picked the winner: share of held-out problems whose chosen route is the
  held-out table's rank-1 route;
- misses: problems where the chosen route has no ok row in the held-out
  table. Their regret is unknown: they are left out of the regret statistics
  and counted as not picking the winner.
With the held-out sweep's journal (``--heldout-journal``, every parameter set
it timed), regret is also judged with the parameters the dispatcher passes:
t_h(chosen route, chosen parameters) / t_h(best) - 1, over the problems where
the sweep timed exactly those parameters (counted; geomean, median and max as
above).

Winner map: decode problems, one panel per (kv dtype, batch band; bands in
BATCH_BANDS), cells heads x qlen. A cell holds every problem of that panel,
heads and qlen (other batches of the band, every kv_len, DCP size, q dtype,
causal flag and page size); its colour is the route that wins most of them
(ties: route id), its label the geometric mean over the cell's problems of
t(runner-up) / t(winner), each problem with its own winner and runner-up,
over problems that have a runner-up ("1 route" if none has), and "k/n" below
when the colour's route wins only k of the cell's n problems.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mlatune import journal, routes, table
from mlatune.dispatch import Dispatcher, device_for_arch
from mlatune.problem import FP8_DTYPES, MLAProblem
from mlatune.schema import DEVICE_COLUMNS, KEY_COLUMNS


class ReportError(ValueError):
    """A report that cannot be made; one line (the CLI prints it in red)."""


@dataclass(frozen=True)
class Ceilings:
    memory_tb_per_s: float
    compute_tflops: float  # dense bf16 matmul
    source: str


# Measured ceilings per arch; an arch missing here gets no roofline plot.
CEILINGS: dict[str, Ceilings] = {
    "sm_90": Ceilings(
        memory_tb_per_s=4.38, compute_tflops=790.0,
        source="NVIDIA H200, as the project brief gives them: streaming read 4.38 TB/s, "
               "dense bf16 matmul about 790 TFLOP/s (the device machine's notes record a "
               "4.3 TB/s device copy and 769-798 TFLOP/s, 2026-10-28 and 2026-11-04); "
               "not re-measured by mlatune's own runs yet"),
}

# Decode batch bands of the winner map: (lowest, highest or None, label).
BATCH_BANDS: tuple[tuple[int, int | None, str], ...] = (
    (1, 4, "batch 1-4"), (5, 64, "batch 5-64"), (65, None, "batch >= 65"))

RULE_POLICY = "rule fallback"
HTML_NAME = "report.html"


# Numbers ----------------------------------------------------------------------

@dataclass(frozen=True)
class SpeedupStats:
    """The table's pick against one policy (a fixed route or the rule fallback)."""

    policy: str
    served: int  # problems where the policy's route has an ok time
    total: int  # problems with an ok row
    wins: int  # problems the policy's route is the pick for (0 for the rule)
    geomean: float  # NaN when nothing is served
    worst: float
    worst_key: str  # the problem of the worst case


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

    @property
    def best_fixed(self) -> SpeedupStats:
        return self.fixed[0]


def geomean(values: Sequence[float] | pd.Series) -> float:
    array = np.asarray(values, dtype="float64")
    return float(np.exp(np.log(array).mean())) if len(array) else math.nan


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


def ok_times(frame: pd.DataFrame) -> pd.DataFrame:
    """time_us of every ok row: index problem key, one column per route (NaN: no ok row)."""
    ok = frame[frame["status"] == "ok"]
    long = pd.DataFrame({"key": table.key_strings(ok), "route": ok["route"].astype(str).to_numpy(),
                         "time_us": ok["time_us"].to_numpy()})
    return long.pivot(index="key", columns="route", values="time_us")


def _stats(policy: str, ratios: pd.Series, total: int, wins: int) -> SpeedupStats:
    served = ratios.dropna()
    if served.empty:
        return SpeedupStats(policy, 0, total, wins, math.nan, math.nan, "")
    return SpeedupStats(policy, len(served), total, wins, geomean(served),
                        float(served.max()), str(served.idxmax()))


def fixed_route_speedups(problems: pd.DataFrame, times: pd.DataFrame) -> list[SpeedupStats]:
    """Per route with an ok row; the best single fixed route (most wins) first."""
    pick = problems.set_index("key")["winner_us"]
    wins = problems["winner"].value_counts()
    stats = [_stats(route, times[route].reindex(pick.index) / pick, len(pick),
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


Timed = dict[tuple[str, str], list[tuple[dict[str, Any], float]]]


def candidate_times(journal_path: str | os.PathLike) -> Timed:
    """(problem key, route) -> [(parameters as run, time_us)] of every ok candidate of
    a sweep journal (plain or gzipped)."""
    timed: Timed = {}
    for r in journal.read(Path(journal_path))[1]:
        if r.get("status") == "ok":
            key = (MLAProblem.from_key_dict(r["key"]).key, r["route"])
            timed.setdefault(key, []).append((json.loads(r["route_params"]), r["time_us"]))
    return timed


def time_with(timed: Timed, problem: MLAProblem, route_id: str, params: Any, device) -> float:
    """The time of ``route_id`` called with ``params`` on ``problem``: the candidate
    that ran with exactly those, defaults filled in from the route's first set as the
    routes do; NaN if none was timed."""
    want = dict(params)
    with contextlib.suppress(Exception):  # a route not registered here: as given
        want = {**routes.get(route_id).param_space(problem, device)[0], **want}
    return next((float(t) for ran, t in timed.get((problem.key, route_id), ()) if ran == want),
                math.nan)


def nearest_regret(table_path: str | os.PathLike, heldout: pd.DataFrame, device,
                   timed: Timed | None = None
                   ) -> tuple[RegretStats, pd.DataFrame, dict[str, int]]:
    """Judge the main table's Dispatcher on the held-out problems (see the module doc);
    also the rows it skipped per route not registered here. ``timed``: the held-out
    sweep's candidate_times, to judge the chosen parameters too."""
    dispatcher = Dispatcher.load(table_path, device=device, allow_arch=device.arch)
    problems = measured_problems(heldout)
    times = ok_times(heldout)
    choices = [dispatcher.select(MLAProblem.from_key_dict(row))
               for row in problems.to_dict("records")]
    chosen = pd.Series([c.route_id for c in choices], index=problems["key"].to_numpy(),
                       dtype="object")
    per_problem = pd.DataFrame({
        "key": problems["key"].to_numpy(),
        "chosen": chosen.to_numpy(),
        "source": [c.source for c in choices],
        "best": problems["winner"].astype(str).to_numpy(),
        "regret": (chosen_times(times, chosen) / problems.set_index("key")["winner_us"]
                   - 1.0).to_numpy(),
    })
    timed = timed or {}
    per_problem["params_regret"] = [
        time_with(timed, MLAProblem.from_key_dict(row), c.route_id, c.params, device)
        / row["winner_us"] - 1.0
        for row, c in zip(problems.to_dict("records"), choices, strict=True)]
    with_params = per_problem["params_regret"].dropna()
    judged = per_problem["regret"].dropna()
    no_ok = int(heldout.drop_duplicates(list(KEY_COLUMNS)).shape[0] - len(problems))
    stats = RegretStats(
        judged=len(per_problem), no_ok_row=no_ok, misses=int(per_problem["regret"].isna().sum()),
        picked_winner=int((per_problem["chosen"] == per_problem["best"]).sum()),
        geomean=geomean(1.0 + judged) - 1.0 if len(judged) else math.nan,
        median=float(judged.median()) if len(judged) else math.nan,
        max=float(judged.max()) if len(judged) else math.nan,
        sources=per_problem["source"].value_counts().sort_index().astype(int).to_dict(),
        params_timed=len(with_params),
        params_geomean=geomean(1.0 + with_params) - 1.0 if len(with_params) else math.nan,
        params_median=float(with_params.median()) if len(with_params) else math.nan,
        params_max=float(with_params.max()) if len(with_params) else math.nan)
    return stats, per_problem, dict(dispatcher.skipped_routes)


def timing_spread(frame: pd.DataFrame) -> tuple[float, float]:
    """Median and 99th percentile of (p80 - p20) / median over the ok rows."""
    ok = frame[frame["status"] == "ok"]
    spread = ((ok["time_us_p80"] - ok["time_us_p20"]) / ok["time_us"]).astype("float64")
    spread = spread[np.isfinite(spread)]
    if spread.empty:
        return math.nan, math.nan
    return float(spread.median()), float(spread.quantile(0.99))


def summarize(table_path: str | os.PathLike, frame: pd.DataFrame,
              heldout_path: str | os.PathLike | None = None,
              heldout: pd.DataFrame | None = None,
              heldout_timed: Timed | None = None
              ) -> tuple[Summary, dict[str, Any]]:
    """Every number of the report, and the per-problem frames the plots draw."""
    arch, name, cus = one_device(frame, table_path)
    device = device_for_arch(arch, name, cus)
    problems = measured_problems(frame)
    if problems.empty:
        raise ReportError(f"{table_path}: no ok row in the table: nothing to report")
    times = ok_times(frame)
    rule, rule_unmeasured = rule_speedup(problems, times, device)
    ceilings = CEILINGS.get(arch)
    notes = []
    if ceilings is None:
        notes.append(f"no measured ceilings for arch {arch} (known: {', '.join(CEILINGS)}): "
                     f"no roofline plot")
    if rule_unmeasured:
        notes.append(f"rule fallback: on {rule_unmeasured} problem(s) the rule's route has no "
                     f"ok row in the table; left out of its speedup")
    all_keys = frame.drop_duplicates(list(KEY_COLUMNS)).shape[0]
    summary = Summary(
        table_path=str(table_path), device=(arch, name, cus),
        measured_with=measured_with(frame), problems=len(problems),
        decode=int((problems["phase"] == "decode").sum()),
        prefill=int((problems["phase"] == "prefill").sum()),
        without_ok=all_keys - len(problems), routes_ok=len(times.columns),
        routes_tried=int(frame["route"].nunique()),
        fixed=fixed_route_speedups(problems, times), rule=rule, rule_unmeasured=rule_unmeasured,
        roofline=roofline(problems, ceilings) if ceilings else None,
        spread=timing_spread(frame), notes=notes)
    plot_data: dict[str, Any] = {"problems": problems, "times": times}
    if heldout is not None:
        h_device = one_device(heldout, heldout_path or "held-out table")
        if h_device[0] != arch:
            raise ReportError(f"{heldout_path}: held-out table is for arch {h_device[0]}, the "
                              f"table for {arch}")
        summary.heldout_path = str(heldout_path)
        summary.regret, plot_data["regret"], skipped = nearest_regret(table_path, heldout,
                                                                      device, heldout_timed)
        if skipped:
            notes.append("nearest: the dispatcher skipped rows of routes not registered here: "
                         + ", ".join(f"{r} ({n})" for r, n in sorted(skipped.items())))
        if summary.regret.misses:
            notes.append(f"nearest: {summary.regret.misses} held-out problem(s) where the chosen "
                         f"route has no ok row in the held-out table (misses): left out of "
                         f"the regret statistics, counted as not picking the winner")
    return summary, plot_data


# Text shared by the console and the HTML page -------------------------------------

def speedup_text(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def percent_text(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 100:+.1f}%"


def headline_rows(summary: Summary) -> list[tuple[str, str]]:
    """The summary numbers, as (label, value) lines."""
    best, rule = summary.best_fixed, summary.rule
    rows = [
        ("device", " ".join(map(str, summary.device[:2])) + f" ({summary.device[2]} SMs/CUs)"),
        ("measured", summary.measured_with),
        ("problems", f"{summary.problems} ({summary.decode} decode, {summary.prefill} prefill)"
                     + (f"; {summary.without_ok} without an ok row"
                        if summary.without_ok else "")),
        ("routes", f"{summary.routes_ok} with an ok row, of {summary.routes_tried} tried"),
        ("best single fixed route", f"{best.policy} (wins {best.wins}, serves {best.served})"),
        ("pick vs best fixed route", f"geomean {speedup_text(best.geomean)}, "
                                     f"worst case {speedup_text(best.worst)}"),
        ("pick vs rule fallback", f"geomean {speedup_text(rule.geomean)}, "
                                  f"worst case {speedup_text(rule.worst)} "
                                  f"(over {rule.served} of {rule.total} problems)"),
    ]
    if not math.isnan(summary.spread[0]):
        rows.append(("timing spread of ok rows", f"(p80 - p20) / median: median "
                     f"{summary.spread[0] * 100:.1f}%, 99th percentile "
                     f"{summary.spread[1] * 100:.1f}%"))
    if summary.roofline is not None and len(summary.roofline):
        fractions = summary.roofline["fraction"]
        rows.append(("roofline fraction of the picks",
                     f"median {fractions.median() * 100:.0f}%, "
                     f"max {fractions.max() * 100:.0f}%"))
    regret = summary.regret
    if regret is not None:
        sources = ", ".join(f"{s} {n}" for s, n in regret.sources.items())
        rows += [
            ("held-out problems", f"{regret.judged} ({sources})"
                                  + (f"; {regret.no_ok_row} without an ok row"
                                     if regret.no_ok_row else "")),
            ("nearest regret", f"geomean {percent_text(regret.geomean)}, "
                               f"median {percent_text(regret.median)}, "
                               f"max {percent_text(regret.max)}"),
            *([("nearest regret, its parameters",
                f"geomean {percent_text(regret.params_geomean)}, "
                f"median {percent_text(regret.params_median)}, "
                f"max {percent_text(regret.params_max)} (over the {regret.params_timed} "
                f"problems whose chosen parameters the held-out sweep timed)")]
              if regret.params_timed else []),
            ("nearest picked the winner", f"{regret.picked_winner} of {regret.judged} "
                                          f"({_share(regret.picked_winner, regret.judged)}); "
                                          f"misses {regret.misses}"),
        ]
    return rows


def problem_label(key: str) -> str:
    """A problem key in a few words: "decode h8 q2 bf16/fp8_e4m3fn dcp1 b64 kv4096"."""
    if not key:
        return "-"
    f = dict(part.split("=", 1) for part in key.split("|"))
    causal = "" if f["causal"] == "1" else " non-causal"
    return (f"{f['phase']} h{f['num_heads']} q{f['qlen']} {f['q_dtype']}/{f['kv_dtype']}"
            f"{causal} dcp{f['dcp_size']} p{f['page_size']} b{f['batch']} kv{f['kv_len']}")


def _share(part: int, whole: int) -> str:
    return f"{part / whole * 100:.0f}%" if whole else "-"


POLICY_COLUMNS = ("policy", "served", "wins", "geomean speedup", "worst case", "worst problem")


def policy_rows(summary: Summary) -> list[tuple[str, ...]]:
    """One line per fixed route, then the rule fallback."""
    return [(s.policy, f"{s.served}/{s.total}", "-" if s.policy == RULE_POLICY else str(s.wins),
             speedup_text(s.geomean), speedup_text(s.worst), problem_label(s.worst_key))
            for s in [*summary.fixed, summary.rule]]


# Plots ------------------------------------------------------------------------------

def _matplotlib():
    """matplotlib's Figure and Agg canvas, imported here so mlatune works without it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("mlatune report needs matplotlib: pip install 'mlatune[report]' "
                          "(or pip install matplotlib)") from None
    return Figure, FigureCanvasAgg


def _save(figure, canvas_class, path: Path) -> Path:
    canvas_class(figure)  # Agg: no display, no global pyplot state
    figure.savefig(path, dpi=110, bbox_inches="tight")
    return path


def route_colours(routes: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    palette = colormaps["tab20"] if len(routes) > 10 else colormaps["tab10"]
    return {route: palette(i % palette.N) for i, route in enumerate(sorted(routes))}


def batch_band(batch: int) -> str:
    for low, high, label in BATCH_BANDS:
        if batch >= low and (high is None or batch <= high):
            return label
    raise AssertionError(batch)  # the bands cover every positive batch


def winner_cells(problems: pd.DataFrame) -> pd.DataFrame:
    """Decode winner-map cells: kv_dtype, band, num_heads, qlen, route, won, n, label."""
    decode = problems[problems["phase"] == "decode"].copy()
    if decode.empty:
        return pd.DataFrame(columns=["kv_dtype", "band", "num_heads", "qlen", "route", "won",
                                     "n", "label"])
    decode["band"] = [batch_band(int(b)) for b in decode["batch"]]
    cells = []
    for (kv_dtype, band, heads, qlen), rows in decode.groupby(
            ["kv_dtype", "band", "num_heads", "qlen"], sort=True):
        counts = rows["winner"].astype(str).value_counts()
        route = sorted(counts.index, key=lambda r: (-counts[r], r))[0]
        ratios = (rows["runner_up_us"] / rows["winner_us"]).dropna()
        label = f"{geomean(ratios):.2f}x" if len(ratios) else "1 route"
        if counts[route] < len(rows):
            label += f"\n{counts[route]}/{len(rows)}"
        cells.append((kv_dtype, band, int(heads), int(qlen), route, int(counts[route]),
                      len(rows), label))
    return pd.DataFrame(cells, columns=["kv_dtype", "band", "num_heads", "qlen", "route", "won",
                                        "n", "label"])


def plot_winner_map(problems: pd.DataFrame, colours: dict[str, Any], path: Path) -> Path | None:
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    Figure, Canvas = _matplotlib()
    cells = winner_cells(problems)
    if cells.empty:
        return None
    dtypes = sorted(cells["kv_dtype"].unique())
    bands = [label for _, _, label in BATCH_BANDS if label in set(cells["band"])]
    heads = sorted(cells["num_heads"].unique())
    qlens = sorted(cells["qlen"].unique())
    figure = Figure(figsize=(1.0 + 0.9 * len(qlens) * len(bands), 0.8 + 0.55 * len(heads)
                             * len(dtypes) + 0.6), layout="constrained")
    axes = figure.subplots(len(dtypes), len(bands), squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, band in enumerate(bands):
            _winner_panel(axes[i][j], cells[(cells["kv_dtype"] == dtype)
                                            & (cells["band"] == band)],
                          heads, qlens, colours, to_rgba)
            axes[i][j].set_title(f"kv {dtype}, {band}", fontsize=9)
    shown = sorted(set(cells["route"]))
    figure.legend(handles=[Patch(color=colours[r], label=r) for r in shown], loc="outside lower "
                  "center", ncol=min(len(shown), 4), fontsize=8)
    figure.suptitle("decode winner per heads x qlen (label: geomean runner-up / winner time; "
                    "k/n: problems won when not all)", fontsize=9)
    return _save(figure, Canvas, path)


def _winner_panel(ax, cells: pd.DataFrame, heads: list[int], qlens: list[int],
                  colours: dict[str, Any], to_rgba) -> None:
    image = np.ones((len(heads), len(qlens), 4))
    image[..., :3] = 0.93  # light grey: nothing measured there
    for row in cells.itertuples(index=False):
        y, x = heads.index(row.num_heads), qlens.index(row.qlen)
        image[y, x] = to_rgba(colours[row.route], 0.85)
        ax.text(x, y, row.label, ha="center", va="center", fontsize=7)
    ax.imshow(image, aspect="auto", origin="lower")
    ax.set_xticks(range(len(qlens)), [str(q) for q in qlens], fontsize=8)
    ax.set_yticks(range(len(heads)), [str(h) for h in heads], fontsize=8)
    ax.set_xlabel("qlen", fontsize=8)
    ax.set_ylabel("heads", fontsize=8)


def plot_speedups(summary: Summary, problems: pd.DataFrame, times: pd.DataFrame,
                  colours: dict[str, Any], path: Path) -> Path:
    Figure, Canvas = _matplotlib()
    figure = Figure(figsize=(12, 0.5 + 0.45 * (len(summary.fixed) + 1)), layout="constrained")
    bars, curve = figure.subplots(1, 2, width_ratios=[3, 2])
    policies = [s for s in [*summary.fixed, summary.rule] if s.served]
    y = np.arange(len(policies))
    bars.barh(y - 0.2, [s.geomean for s in policies], height=0.4, label="geomean",
              color=[colours.get(s.policy, "0.4") for s in policies])
    bars.barh(y + 0.2, [s.worst for s in policies], height=0.4, label="worst case",
              color=[colours.get(s.policy, "0.4") for s in policies], alpha=0.45)
    for i, s in enumerate(policies):
        bars.text(max(s.worst, 1.0) * 1.05, i, f"{speedup_text(s.geomean)} / "
                  f"{speedup_text(s.worst)}, serves {s.served}/{s.total}", va="center",
                  fontsize=7)
    bars.set_yticks(y, [s.policy for s in policies], fontsize=8)
    bars.invert_yaxis()
    bars.set_xscale("log")
    bars.axvline(1.0, color="black", linewidth=0.8)
    bars.set_xlim(0.9, max(s.worst for s in policies) * 8)
    bars.set_xlabel("speedup of the table's pick (dark: geomean, light: worst case)")
    bars.set_title("table's pick vs each fixed route and the rule fallback", fontsize=9)

    best = summary.best_fixed.policy
    pick = problems.set_index("key")["winner_us"]
    ratios = (times[best].reindex(pick.index) / pick).dropna().sort_values().to_numpy()
    curve.step(np.arange(1, len(ratios) + 1), ratios, where="mid", color=colours[best])
    curve.set_xlabel(f"problems {best} serves, sorted")
    curve.set_ylabel("speedup of the table's pick")
    curve.set_title(f"per problem vs the best single fixed route, {best} "
                    f"({len(ratios)} of {len(pick)} served)", fontsize=9)
    curve.grid(alpha=0.3)
    return _save(figure, Canvas, path)


def plot_roofline(frame: pd.DataFrame, ceilings: Ceilings, colours: dict[str, Any],
                  path: Path) -> Path:
    Figure, Canvas = _matplotlib()
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    roof, fractions = figure.subplots(1, 2)
    low = min(frame["intensity"].min() / 2, ceilings.compute_tflops / ceilings.memory_tb_per_s
              / 10)
    high = max(frame["intensity"].max() * 2, ceilings.compute_tflops
               / ceilings.memory_tb_per_s * 10)
    x = np.geomspace(low, high, 200)
    roof.plot(x, np.minimum(ceilings.memory_tb_per_s * x, ceilings.compute_tflops),
              color="black", linewidth=1, label="roof")
    for route, rows in frame.groupby("winner", sort=True):
        for fp8, marker in ((False, "o"), (True, "^")):
            part = rows[rows["fp8_q"] == fp8]
            if len(part):
                roof.scatter(part["intensity"], part["tflops"], s=14, marker=marker,
                             color=colours[route], label=f"{route}{' (fp8 q)' if fp8 else ''}")
    roof.set_xscale("log")
    roof.set_yscale("log")
    roof.set_xlabel("FLOP per byte (problem.flops() / problem.min_bytes())")
    roof.set_ylabel("TFLOP/s")
    roof.set_title(f"picks against the roof ({ceilings.memory_tb_per_s} TB/s, "
                   f"{ceilings.compute_tflops:.0f} TFLOP/s)", fontsize=9)
    roof.legend(fontsize=7)
    ordered = frame.sort_values("fraction").reset_index(drop=True)
    for bound, colour in (("memory", "tab:blue"), ("compute", "tab:orange")):
        part = ordered[ordered["bound"] == bound]
        if len(part):
            fractions.scatter(part.index, part["fraction"] * 100, s=12, color=colour,
                              label=f"{bound} bound ({len(part)})")
    fractions.set_xlabel("picks, sorted by fraction")
    fractions.set_ylabel("% of the nearer roof")
    fractions.set_ylim(0, max(100.0, ordered["fraction"].max() * 105))
    fractions.set_title("fraction of the memory or compute roof (the larger)", fontsize=9)
    fractions.legend(fontsize=7)
    fractions.grid(alpha=0.3)
    return _save(figure, Canvas, path)


def plot_regret(per_problem: pd.DataFrame, path: Path) -> Path:
    Figure, Canvas = _matplotlib()
    figure = Figure(figsize=(7, 3.8), layout="constrained")
    ax = figure.subplots()
    judged = per_problem.dropna(subset=["regret"]).sort_values("regret").reset_index(drop=True)
    for source, rows in judged.groupby("source", sort=True):
        ax.scatter(rows.index, rows["regret"] * 100, s=12, label=f"{source} ({len(rows)})")
    misses = int(per_problem["regret"].isna().sum())
    ax.set_xlabel("held-out problems with a judged choice, sorted by regret")
    ax.set_ylabel("regret, % slower than the held-out best")
    ax.set_title(f"main table's choice on held-out problems ({misses} misses not shown)",
                 fontsize=9)
    if len(judged):
        ax.legend(fontsize=7, title="select() source", title_fontsize=7)
    ax.grid(alpha=0.3)
    return _save(figure, Canvas, path)


# HTML ------------------------------------------------------------------------------

_STYLE = """body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;
font-size:14px;text-align:left}th{background:#f3f3f3}img{max-width:100%}
pre{background:#f7f7f7;padding:1em;white-space:pre-wrap;font-size:13px}.note{color:#8a5a00}"""


def _html_table(header: Sequence[str] | None, rows: Sequence[Sequence[Any]]) -> str:
    head = "" if header is None else \
        "<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table>{head}{body}</table>"


def _image(path: Path | None, alt: str) -> str:
    if path is None:
        return ""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>'


def definitions() -> str:
    """The 'Numbers' section of this module's docstring: what every number means."""
    text = __doc__ or ""
    return text[text.index("Numbers\n"):].strip() if "Numbers\n" in text else text


def prefill_rows(problems: pd.DataFrame) -> list[tuple[str, ...]]:
    prefill = problems[problems["phase"] == "prefill"]
    return [(f"h{r.num_heads} {r.q_dtype}/{r.kv_dtype} {'causal' if r.causal else 'non-causal'}",
             str(r.batch), str(r.qlen), str(r.kv_len), str(r.winner), f"{r.winner_us:.4g}",
             str(r.runner_up) or "-", percent_text(r.margin))
            for r in prefill.itertuples(index=False)]


def write_html(summary: Summary, problems: pd.DataFrame, images: dict[str, Path | None],
               path: Path) -> Path:
    arch, name, _ = summary.device
    sections = [
        f"<h1>mlatune report: {html.escape(arch)} {html.escape(name)}</h1>",
        f"<p>table: {html.escape(summary.table_path)}"
        + (f"; held-out: {html.escape(summary.heldout_path)}" if summary.heldout_path else "")
        + "</p>",
        "<h2>Summary</h2>", _html_table(None, headline_rows(summary)),
        "".join(f'<p class="note">note: {html.escape(n)}</p>' for n in summary.notes),
        "<h2>Speedup of the table's pick over fixed routes and the rule fallback</h2>",
        _html_table(POLICY_COLUMNS, policy_rows(summary)),
        _image(images.get("speedup"), "speedups"),
        "<h2>Decode winner map</h2>",
        _image(images.get("winner_map"), "winner map") or "<p>no decode problems</p>",
    ]
    prefill = prefill_rows(problems)
    if prefill:
        sections += ["<h2>Prefill winners</h2>", _html_table(
            ("problem", "batch", "qlen", "kv_len", "winner", "us", "runner-up", "margin"),
            prefill)]
    sections.append("<h2>Roofline</h2>")
    if summary.roofline is None:
        sections.append(f"<p>no measured ceilings for arch {html.escape(arch)}: no roofline "
                        f"plot</p>")
    else:
        sections += [f"<p>ceilings: {html.escape(CEILINGS[arch].source)}</p>",
                     _image(images.get("roofline"), "roofline")]
    sections.append("<h2>Nearest on held-out problems</h2>")
    if summary.regret is None:
        sections.append("<p>no held-out table given (--heldout)</p>")
    else:
        sections.append(_image(images.get("regret"), "regret"))
    sections += ["<h2>What each number means</h2>",
                 f"<pre>{html.escape(definitions())}</pre>"]
    page = (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>mlatune report "
            f"{html.escape(arch)}</title><style>{_STYLE}</style></head><body>"
            + "\n".join(sections) + "</body></html>\n")
    path.write_text(page, encoding="utf-8")
    return path


# The whole report -------------------------------------------------------------------

@dataclass
class Report:
    summary: Summary
    html: Path
    images: dict[str, Path] = field(default_factory=dict)


def build_report(table_path: str | os.PathLike, out_dir: str | os.PathLike,
                 heldout_path: str | os.PathLike | None = None,
                 heldout_journal: str | os.PathLike | None = None) -> Report:
    """Read the table(s), compute the numbers, write the PNGs and report.html to out_dir."""
    _matplotlib()  # a missing matplotlib is said before any work
    if heldout_journal is not None and heldout_path is None:
        raise ReportError("a held-out journal needs its held-out table (--heldout)")
    frame = table.read(table_path)
    heldout = table.read(heldout_path) if heldout_path is not None else None
    timed = candidate_times(heldout_journal) if heldout_journal is not None else None
    summary, data = summarize(table_path, frame, heldout_path, heldout, timed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    routes = set(data["times"].columns)
    if "regret" in data:
        routes |= set(data["regret"]["chosen"]) | set(data["regret"]["best"])
    colours = route_colours(sorted(routes))
    images: dict[str, Path | None] = {
        "winner_map": plot_winner_map(data["problems"], colours, out / "winner-map.png"),
        "speedup": plot_speedups(summary, data["problems"], data["times"], colours,
                                 out / "speedup.png"),
    }
    if summary.roofline is not None and len(summary.roofline):
        images["roofline"] = plot_roofline(summary.roofline, CEILINGS[summary.device[0]],
                                           colours, out / "roofline.png")
    if "regret" in data:
        images["regret"] = plot_regret(data["regret"], out / "regret.png")
    html_path = write_html(summary, data["problems"], images, out / HTML_NAME)
    return Report(summary, html_path, {k: v for k, v in images.items() if v is not None})
