"""`mlatune report`: what a dispatch table buys, as PNG plots and one self-contained HTML page.

``build_report(table_path, out_dir, heldout_path=None, heldout_journals=())`` reads a
table (one device), computes its numbers (``metrics``: pandas only), draws the plots
(``plots``: matplotlib, imported only when a report is made) and writes ``report.html``
(``page``: the jinja2 template ``templates/report.html.j2``, the PNGs embedded as data URIs
so the file stands alone) plus each PNG into ``out_dir``. The page's last section defines
every number for readers.

Importing this package needs neither matplotlib nor jinja2's template files: the CLI and
``benchmarks/`` import the numbers from here. ``summary.json`` beside the page holds the
same numbers for programs (``metrics.summary_document``), the vendor policies
(``policies``: always FlashMLA, always FlashInfer fa3, vLLM's Hopper order) included; the
terms both use (a problem's label, the batch bands, the geometric mean) are ``terms``'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlatune import routes, table
from mlatune.report.metrics import (
    CEILINGS,
    RULE_POLICY,
    Ceilings,
    RegretStats,
    ReportError,
    SpeedupStats,
    Summary,
    Timed,
    candidate_times,
    chosen_times,
    dcp_measured,
    fixed_route_speedups,
    measured_problems,
    measured_with,
    nearest_regret,
    ok_times,
    one_device,
    pick_speedups,
    roofline,
    rule_routes,
    rule_speedup,
    summarize,
    time_with,
    timing_spread,
    winner_cells,
)
from mlatune.report.terms import BATCH_BANDS, batch_band, geomean, problem_label
from mlatune.report.text import (
    DCP_COLUMNS,
    POLICY_COLUMNS,
    PREFILL_COLUMNS,
    dcp_rows,
    headline_rows,
    percent_text,
    policy_rows,
    prefill_rows,
    speedup_text,
    summary_document,
)

HTML_NAME = "report.html"
JSON_NAME = "summary.json"

__all__ = [
    "BATCH_BANDS", "CEILINGS", "DCP_COLUMNS", "HTML_NAME", "JSON_NAME", "POLICY_COLUMNS",
    "PREFILL_COLUMNS", "RULE_POLICY",
    "Ceilings", "RegretStats", "Report", "ReportError", "SpeedupStats", "Summary", "Timed",
    "batch_band", "build_report", "candidate_times", "chosen_times", "dcp_measured",
    "dcp_rows", "fixed_route_speedups",
    "geomean", "headline_rows", "measured_problems", "measured_with", "nearest_regret",
    "ok_times", "one_device", "percent_text", "pick_speedups", "policy_rows", "prefill_rows",
    "problem_label", "roofline", "rule_routes", "rule_speedup", "speedup_text", "summarize",
    "summary_document", "time_with", "timing_spread", "winner_cells",
]


@dataclass
class Report:
    summary: Summary
    html: Path
    images: dict[str, Path] = field(default_factory=dict)
    summary_json: Path | None = None


def require_matplotlib() -> None:
    """Say a missing matplotlib before any work, in one line."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise ReportError("mlatune report needs matplotlib: pip install 'mlatune[report]' "
                          "(or pip install matplotlib)") from None


def _heldout_times(journal_paths: Sequence[str | os.PathLike]) -> dict:
    """``candidate_times`` of each held-out journal, a later one's runs replacing an earlier
    one's; a journal with no ok candidate (not a sweep's, or empty) is a ReportError."""
    timed = {}
    for journal_path in journal_paths:
        runs = candidate_times(journal_path)
        if not runs:
            raise ReportError(f"{journal_path}: no ok candidate in it; --heldout-journal takes "
                              f"the journal of the sweep that measured the held-out table")
        timed |= runs
    return timed


def build_report(table_path: str | os.PathLike, out_dir: str | os.PathLike,
                 heldout_path: str | os.PathLike | None = None,
                 heldout_journals: Sequence[str | os.PathLike] = ()) -> Report:
    """Read the table(s), compute the numbers, write the PNGs, report.html and
    summary.json to out_dir. ``heldout_journals``: the held-out sweeps' journals, a later
    one's runs of a problem's route replacing an earlier one's."""
    require_matplotlib()
    if heldout_journals and heldout_path is None:
        raise ReportError("a held-out journal needs its held-out table (--heldout)")
    from mlatune.report import page, plots  # matplotlib, jinja2: for a page only

    frame = table.read(table_path, facts=routes.FACTS)
    heldout = table.read(heldout_path, facts=routes.FACTS) \
        if heldout_path is not None else None
    timed = _heldout_times(heldout_journals) if heldout_journals else None
    summary, data = summarize(table_path, frame, heldout_path, heldout, timed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = plots.draw_all(summary, data, out)
    html_path = page.write_html(summary, data["problems"], dict(images), out / HTML_NAME)
    json_path = out / JSON_NAME
    json_path.write_text(json.dumps(summary_document(summary), indent=1, allow_nan=False)
                         + "\n", encoding="utf-8")
    return Report(summary, html_path, images, json_path)
