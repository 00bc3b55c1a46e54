"""The report's plots, drawn with matplotlib's Agg canvas (no display, no pyplot state).

Only ``mlatune report`` imports this module, so matplotlib stays an optional extra
(``mlatune[report]``). Every figure function returns a Figure, so tests can read its
axes; ``save`` writes it. One colour per route across every plot (``route_colours``);
what is not a route (the rule fallback, a bound, a source, a statistic) is shown in
grey or black, with markers or hatching.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from mlatune.report.metrics import (
    Ceilings,
    SpeedupStats,
    Summary,
    pick_speedups,
    winner_cells,
)
from mlatune.report.terms import BATCH_BANDS

Colour = Any  # whatever matplotlib accepts as a colour
NOT_A_ROUTE = "0.45"  # the rule fallback: it answers different routes per problem
UNMEASURED = (0.93, 0.93, 0.93, 1.0)  # a winner-map cell without problems
FONT = 9


def route_colours(route_ids: Sequence[str]) -> dict[str, Colour]:
    """One colour per route, by sorted id. The palettes' greys are skipped: grey is kept
    for what is not a route."""
    names = sorted(set(route_ids))
    palette = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 7]
    if len(names) > len(palette):
        palette = [c for i, c in enumerate(colormaps["tab20"].colors) if i not in (14, 15)]
    return {route: palette[i % len(palette)] for i, route in enumerate(names)}


def save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)  # Agg: no display, no global pyplot state
    figure.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _route_legend(figure: Figure, colours: dict[str, Colour], shown: Sequence[str],
                  title: str) -> None:
    handles = [Patch(color=colours[r], label=r) for r in sorted(set(shown))]
    figure.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 7),
                  fontsize=FONT, title=title, title_fontsize=FONT, frameon=False)


def _marker_legend(ax: Axes, entries: Sequence[tuple[str, str]], title: str,
                   loc: str = "upper left") -> None:
    """A legend of black markers: categories that are not routes."""
    handles = [Line2D([], [], linestyle="", marker=marker, color="black", label=label)
               for marker, label in entries]
    ax.legend(handles=handles, fontsize=FONT - 1, title=title, title_fontsize=FONT - 1, loc=loc)


# Decode winner map -----------------------------------------------------------------------

# The winner map's key, under its route legend: a PNG read alone still explains its labels.
WINNER_MAP_KEY = ("Colour: the route that wins most of the cell's problems.   Number: runner-up "
                  "time / winner time, geomean over the cell (how much slower the next-best "
                  "route is).\n\"wins k/n\": the colour's route wins k of the cell's n problems "
                  "(shown when not all).   \"1 route\": only one route ran ok there.   Grey: no "
                  "problem measured.")


def winner_map(problems: pd.DataFrame, colours: dict[str, Colour]) -> Figure | None:
    """Decode winners per (kv dtype, batch band) panel over query heads x query length."""
    cells = winner_cells(problems)
    if cells.empty:
        return None
    dtypes = sorted(cells["kv_dtype"].unique())
    bands = [label for _, _, label in BATCH_BANDS if label in set(cells["band"])]
    heads, qlens = sorted(cells["num_heads"].unique()), sorted(cells["qlen"].unique())
    figure = Figure(figsize=(1.2 + 1.0 * len(qlens) * len(bands),
                             1.8 + 0.6 * len(heads) * len(dtypes)), layout="constrained")
    axes = figure.subplots(len(dtypes), len(bands), squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, band in enumerate(bands):
            panel = cells[(cells["kv_dtype"] == dtype) & (cells["band"] == band)]
            _winner_panel(axes[i][j], panel, heads, qlens, colours)
            axes[i][j].set_title(f"KV cache {dtype}, {band}", fontsize=FONT)
    _route_legend(figure, colours, cells["route"], WINNER_MAP_KEY)
    figure.suptitle("Decode: which route wins, by query heads and query length",
                    fontsize=FONT + 2)
    return figure


def _winner_panel(ax: Axes, cells: pd.DataFrame, heads: list[int], qlens: list[int],
                  colours: dict[str, Colour]) -> None:
    image = np.tile(np.array(UNMEASURED), (len(heads), len(qlens), 1))
    for row in cells.itertuples(index=False):
        y, x = heads.index(row.num_heads), qlens.index(row.qlen)
        image[y, x] = to_rgba(colours[row.route], 0.8)
        ax.text(x, y, row.label, ha="center", va="center", fontsize=FONT - 2)
    ax.imshow(image, aspect="auto", origin="lower")
    ax.set_xticks(range(len(qlens)), [str(q) for q in qlens], fontsize=FONT - 1)
    ax.set_yticks(range(len(heads)), [str(h) for h in heads], fontsize=FONT - 1)
    ax.set_xlabel("query length (tokens per request)", fontsize=FONT - 1)
    ax.set_ylabel("query heads", fontsize=FONT - 1)


# Speedup over fixed routes ----------------------------------------------------------------

def speedups(summary: Summary, problems: pd.DataFrame, times: pd.DataFrame,
             colours: dict[str, Colour]) -> Figure:
    """Bars: geomean and largest speedup per policy; a curve: per problem, against the
    best single fixed route."""
    figure = Figure(figsize=(12, 1.2 + 0.5 * (len(summary.fixed) + 1)), layout="constrained")
    bars, curve = figure.subplots(1, 2, width_ratios=[3, 2])
    _speedup_bars(bars, [s for s in [*summary.fixed, summary.rule] if s.served], colours)
    _speedup_curve(curve, summary.best_fixed.policy, problems, times, colours)
    return figure


def _speedup_bars(ax: Axes, policies: list[SpeedupStats], colours: dict[str, Colour]
                  ) -> None:
    y = np.arange(len(policies))
    shades = [colours.get(s.policy, NOT_A_ROUTE) for s in policies]
    # Bars start at 1.0x (no gain): a speedup is never below it.
    ax.barh(y - 0.2, [s.geomean - 1 for s in policies], left=1, height=0.4, color=shades)
    ax.barh(y + 0.2, [s.largest - 1 for s in policies], left=1, height=0.4, color=shades,
            alpha=0.35, hatch="///", edgecolor=shades)
    span = max(max(s.largest for s in policies) - 1.0, 0.05)  # all 1.00x: still an axis
    for i, s in enumerate(policies):
        for value, offset in ((s.geomean, -0.2), (s.largest, 0.2)):
            ax.text(value + span * 0.01, i + offset, f"{value:.2f}x", va="center",
                    fontsize=FONT - 1)
    ax.set_yticks(y, [f"{s.policy}\n(serves {s.served} of {s.total})" for s in policies],
                  fontsize=FONT - 1)
    ax.invert_yaxis()
    ax.set_xlim(1.0, 1.0 + span * 1.12)  # room for the value labels, no more
    ax.set_xlabel("speedup of the table's pick: the route's time / the pick's time")
    ax.set_title("The table's pick against each fixed route and the rule fallback",
                 fontsize=FONT + 1)
    ax.legend(handles=[Patch(color="0.3", label="geomean over the problems it serves"),
                       Patch(facecolor=to_rgba("0.3", 0.35), edgecolor="0.3", hatch="///",
                             label="largest: on the problem where the route loses most")],
              fontsize=FONT - 1, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2,
              frameon=False)  # below the axes: inside, it hid a bar's label
    ax.grid(axis="x", alpha=0.3)


def _speedup_curve(ax: Axes, best: str, problems: pd.DataFrame, times: pd.DataFrame,
                   colours: dict[str, Colour]) -> None:
    ratios = pick_speedups(problems, times, best).dropna().sort_values().to_numpy()
    ax.step(np.arange(1, len(ratios) + 1), ratios, where="mid", color=colours[best])
    ax.set_xlabel(f"problems {best} serves, sorted by speedup")
    ax.set_ylabel("speedup of the table's pick (x)")
    ax.set_title(f"Per problem, against the best single fixed route {best}\n"
                 f"({len(ratios)} of {len(problems)} problems served; 1.00x where it is "
                 f"the pick)", fontsize=FONT + 1)
    ax.grid(alpha=0.3)


# Roofline ----------------------------------------------------------------------------------

def roofline(frame: pd.DataFrame, ceilings: Ceilings, colours: dict[str, Colour]) -> Figure:
    """The picks against the memory and compute roofs, and the fraction of the nearer one."""
    figure = Figure(figsize=(12, 5.2), layout="constrained")
    roof, fractions = figure.subplots(1, 2)
    _roof_panel(roof, frame, ceilings, colours)
    _fraction_panel(fractions, frame)
    _route_legend(figure, colours, frame["winner"], "winning route (the table's pick)")
    return figure


def _log_limits(values: pd.Series, margin: float = 1.5) -> tuple[float, float]:
    return float(values.min()) / margin, float(values.max()) * margin


def _roof_panel(ax: Axes, frame: pd.DataFrame, ceilings: Ceilings,
                colours: dict[str, Colour]) -> None:
    low, high = _log_limits(frame["intensity"])
    x = np.geomspace(low, high, 200)
    roof = np.minimum(ceilings.memory_tb_per_s * x, ceilings.compute_tflops)
    ax.plot(x, roof, color="black", linewidth=1)
    _label_roofs(ax, ceilings, low, high)
    for (route, fp8), rows in frame.groupby(["winner", "fp8_q"], sort=True):
        ax.scatter(rows["intensity"], rows["tflops"], s=12, marker="^" if fp8 else "o",
                   color=colours[route], alpha=0.8, linewidths=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    # The data, and the roof where it is in view: a roof far above the points is not shown.
    ax.set_ylim(frame["tflops"].min() / 1.5, max(frame["tflops"].max(), roof.max()) * 1.5)
    ax.set_xlabel("arithmetic intensity (FLOP per byte of minimum memory traffic)")
    ax.set_ylabel("achieved compute (TFLOP/s)")
    ax.set_title("The table's picks against the roofline", fontsize=FONT + 1)
    _marker_legend(ax, [("o", "bf16 or fp16 query"), ("^", "fp8 query (against the bf16 "
                                                            "compute roof)")],
                   "query dtype", loc="lower right")
    ax.grid(alpha=0.3, which="both")


def _label_roofs(ax: Axes, ceilings: Ceilings, low: float, high: float) -> None:
    if low < ceilings.ridge:
        x = (low * min(high, ceilings.ridge)) ** 0.5  # midway along the memory roof in view
        # The memory roof is y = bandwidth * x, a straight line through the origin in data
        # units: its data-space angle, turned by the log-log transform, lies along it.
        ax.text(x, ceilings.memory_tb_per_s * x * 1.1, f"memory roof "
                f"{ceilings.memory_tb_per_s:g} TB/s", fontsize=FONT - 1, ha="center",
                va="bottom", rotation=float(np.degrees(np.arctan(ceilings.memory_tb_per_s))),
                rotation_mode="anchor", transform_rotates_text=True)
    if high > ceilings.ridge:
        ax.text(high / 1.1, ceilings.compute_tflops * 1.08, f"compute roof "
                f"{ceilings.compute_tflops:g} TFLOP/s", ha="right", fontsize=FONT - 1)


def _fraction_panel(ax: Axes, frame: pd.DataFrame) -> None:
    # Two sorted curves, one per bound: the share of picks reaching a fraction reads at a
    # glance, where 2,000 points coloured by route would hide each other.
    for bound, style in (("memory", "-"), ("compute", "--")):
        fractions = np.sort(frame.loc[frame["bound"] == bound, "fraction"].to_numpy())[::-1]
        if len(fractions):
            share = np.arange(1, len(fractions) + 1) / len(fractions) * 100
            ax.step(share, fractions * 100, where="post", color="black", linestyle=style,
                    label=f"{bound}-bound picks ({len(fractions)}): % of the {bound} roof")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)  # fractions of a ceiling: 100% is the end of both scales
    ax.set_xlabel("share of those picks (%), from the highest fraction down")
    ax.set_ylabel("% of the nearer roof reached")
    ax.set_title("How close the picks come to the nearer roof", fontsize=FONT + 1)
    ax.legend(fontsize=FONT - 1, loc="upper right")
    ax.grid(alpha=0.3)


# Nearest on held-out problems ---------------------------------------------------------------

SOURCE_MARKERS = {"table": "D", "predicted": "^", "nearest": "o", "law": "v", "rule": "s"}


def regret(per_problem: pd.DataFrame, colours: dict[str, Colour]) -> Figure:
    """Regret per held-out problem, sorted; with the dispatched parameters in a second panel
    when the held-out journal timed any."""
    panels = [("regret", "the chosen route at its best parameters there",
               "chosen route not measured there")]
    if per_problem["params_regret"].notna().any():
        panels.append(("params_regret", "the chosen route with the parameters it is passed",
                       "not timed with those parameters"))
    figure = Figure(figsize=(6 * len(panels), 4.6), layout="constrained")
    # Each panel on its own scale, fitted to its data; the tick labels carry the comparison.
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        _regret_panel(ax, per_problem, panel, colours)
    sources = sorted(set(per_problem["source"]))
    _marker_legend(axes[0], [(SOURCE_MARKERS.get(s, "*"), s) for s in sources],
                   "select() answered from")
    _route_legend(figure, colours, per_problem["chosen"], "route the dispatcher chose")
    return figure


def _regret_panel(ax: Axes, per_problem: pd.DataFrame, panel: tuple[str, str, str],
                  colours: dict[str, Colour]) -> None:
    column, what, unjudged = panel
    judged = per_problem.dropna(subset=[column]).sort_values(column).reset_index(drop=True)
    for (route, source), rows in judged.groupby(["chosen", "source"], sort=True):
        ax.scatter(rows.index, rows[column] * 100, s=14, marker=SOURCE_MARKERS.get(source, "*"),
                   color=colours[route], linewidths=0)
    left_out = len(per_problem) - len(judged)
    ax.set_xlabel("held-out problems, sorted by regret"
                  + (f" ({left_out} not shown: {unjudged})" if left_out else ""))
    ax.set_ylabel("regret: % slower than the held-out best")
    ax.set_title(f"The main table's choice on held-out problems:\n{what}", fontsize=FONT + 1)
    ax.grid(alpha=0.3)


# Every plot --------------------------------------------------------------------------------

def draw_all(summary: Summary, data: dict[str, Any], out: Path) -> dict[str, Path]:
    """Every plot of the report as a PNG in ``out``: name -> path (absent: not drawn)."""
    seen = set(data["times"].columns)
    if "regret" in data:
        seen |= set(data["regret"]["chosen"]) | set(data["regret"]["best"])
    colours = route_colours(sorted(seen))
    figures: dict[str, tuple[Figure | None, str]] = {
        "winner_map": (winner_map(data["problems"], colours), "winner-map.png"),
        "speedup": (speedups(summary, data["problems"], data["times"], colours),
                    "speedup.png"),
    }
    if summary.roofline is not None and len(summary.roofline) and summary.ceilings:
        figures["roofline"] = (roofline(summary.roofline, summary.ceilings, colours),
                               "roofline.png")
    if "regret" in data:
        figures["regret"] = (regret(data["regret"], colours), "regret.png")
    return {name: save(figure, out / file) for name, (figure, file) in figures.items()
            if figure is not None}

