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

from mlatune.report.metrics import (
    BATCH_BANDS,
    CEILINGS,
    POLICY_COLUMNS,
    PREFILL_COLUMNS,
    RULE_POLICY,
    Summary,
    headline_rows,
    policy_rows,
    prefill_rows,
)

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
        "images": {name: data_uri(images.get(name)) for name in IMAGES},
        "ceilings": summary.ceilings,
        "known_ceilings": sorted(CEILINGS),
        "bands": [label for _, _, label in BATCH_BANDS],
        "rule_policy": RULE_POLICY,
        "best": summary.best_fixed,
        "regret": summary.regret,
    }


def render(summary: Summary, problems: pd.DataFrame, images: dict[str, Path | None]) -> str:
    return _environment().get_template(TEMPLATE).render(context(summary, problems, images))


def write_html(summary: Summary, problems: pd.DataFrame, images: dict[str, Path | None],
               path: Path) -> Path:
    path.write_text(render(summary, problems, images), encoding="utf-8")
    return path
