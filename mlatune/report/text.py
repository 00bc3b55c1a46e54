"""A report's summary as text: the rows of its tables, its headline and its JSON document."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from mlatune.arch import units_text
from mlatune.report import accuracy, policies
from mlatune.report.metrics import RULE_POLICY, RegretStats, SpeedupStats, Summary
from mlatune.report.terms import problem_label


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
        ("device", " ".join(map(str, summary.device[:2]))
         + f" ({units_text(summary.device[0], summary.device[2])})"),
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
    the table, then held out), the accuracy policies, nearest's regret."""
    rows = _table_rows(summary)
    if summary.vendor:
        rows += policies.headline_rows(summary.vendor, summary.vendor_heldout)
    if summary.accuracy is not None:
        rows += accuracy.headline_rows(summary.accuracy)
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
        "accuracy_policies": accuracy.as_json(summary.accuracy),
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
