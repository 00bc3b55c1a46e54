"""report.html: the numbers and the plots in one self-contained page.

The page is ``templates/report.html.j2`` (jinja2, autoescaped), which also holds the
definition of every number for readers ("What each number means"). Images go in as
base64 data URIs, so the file stands alone: no links, scripts or outside URLs.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from mlatune.check.policy import POLICIES
from mlatune.report import accuracy, policies
from mlatune.report.metrics import (
    CEILINGS,
    RULE_POLICY,
    Summary,
)
from mlatune.report.terms import BATCH_BANDS, problem_label
from mlatune.report.text import (
    DCP_COLUMNS,
    POLICY_COLUMNS,
    PREFILL_COLUMNS,
    dcp_rows,
    headline_rows,
    policy_rows,
    prefill_rows,
    speedup_text,
)
from mlatune.table.cost import DEFAULT_PLAN_CALLS

TEMPLATES = Path(__file__).parent / "templates"
TEMPLATE = "report.html.j2"
IMAGES = ("speedup", "winner_map", "roofline", "regret")  # the template asks for each


def _environment() -> jinja2.Environment:
    # StrictUndefined: a name the template misspells fails the report, not a blank.
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True,
                              lstrip_blocks=True, keep_trailing_newline=True)


def data_uri(path: Path | None) -> str | None:
    if path is None:
        return None
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def context(summary: Summary, problems: pd.DataFrame, images: dict[str, Path | None]
            ) -> dict[str, Any]:
    """Everything the template reads."""
    return {
        "summary": summary,
        "arch": summary.device[0],
        "device_name": summary.device[1],
        "headline": headline_rows(summary),
        "policy_columns": POLICY_COLUMNS,
        "policy_rows": policy_rows(summary),
        "prefill_columns": PREFILL_COLUMNS,
        "prefill_rows": prefill_rows(problems),
        "dcp_columns": DCP_COLUMNS,
        "dcp_rows": dcp_rows(summary),
        "images": {name: data_uri(images.get(name)) for name in IMAGES},
        "ceilings": summary.ceilings,
        "known_ceilings": sorted(CEILINGS),
        "bands": [label for _, _, label in BATCH_BANDS],
        "rule_policy": RULE_POLICY,
        "best": summary.best_fixed,
        "regret": summary.regret,
        "plan_calls": DEFAULT_PLAN_CALLS,
        **vendor_context(summary),
        **accuracy_context(summary),
    }


def accuracy_context(summary: Summary) -> dict[str, Any]:
    """What the accuracy-policy section reads (``accuracy``)."""
    section = summary.accuracy
    return {
        "accuracy": section,
        "accuracy_columns": () if section is None else accuracy.columns(section),
        "accuracy_rows": [] if section is None else accuracy.table_rows(section),
        "accuracy_policies": [(p.name, ", ".join(sorted(p.admits)), p.description)
                              for p in POLICIES.values()],
    }


def vendor_context(summary: Summary) -> dict[str, Any]:
    """What the vendor-policy section reads (``policies``)."""
    both = [*summary.vendor, *summary.vendor_heldout]
    flashmla = next((s for s in summary.vendor if s.policy == policies.ALWAYS_FLASHMLA), None)
    return {
        "vendor_columns": policies.POLICY_TABLE_COLUMNS,
        "vendor_rows": policies.table_rows(summary.vendor),
        "vendor_heldout_rows": policies.table_rows(summary.vendor_heldout),
        "vendor_measured": any(s.measured for s in both),
        "vendor_losses": [(s.policy, s.pick, problem_label(k), speedup_text(r),
                           f"{(1 / r - 1) * 100:.1f}%", pick, route)
                          for s in both for k, r, pick, route in s.losses],
        "vendor_gains": [(s.policy, s.pick, problem_label(k), speedup_text(r), pick)
                         for s in both for k, r, pick in s.gains],
        "flashmla_groups": [] if flashmla is None else [
            (g.value, g.served, speedup_text(g.geomean),
             "-" if g.share != g.share else f"{g.share * 100:.0f}%")
            for g in flashmla.groups],
        "goal": policies.GOAL_OVER_FLASHMLA,
        "goal_text": "" if flashmla is None else policies.goal_text(flashmla),
        "tolerance": f"{policies.LOSS_TOLERANCE:.0%}",
        "vllm_order": [(b.name, f"runs here as {b.route}" if b.runs_here
                        else f"cannot run here: {b.not_here}") for b in policies.VLLM_HOPPER],
        "vllm_source": policies.VLLM_SOURCE,
        "vllm_policy": policies.VLLM_POLICY,
    }


def render(summary: Summary, problems: pd.DataFrame, images: dict[str, Path | None]) -> str:
    return _environment().get_template(TEMPLATE).render(context(summary, problems, images))


def write_html(summary: Summary, problems: pd.DataFrame, images: dict[str, Path | None],
               path: Path) -> Path:
    path.write_text(render(summary, problems, images), encoding="utf-8")
    return path
