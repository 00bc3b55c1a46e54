"""`mlatune report`: plots and one self-contained HTML page about a table.

``--json``: ``table``, ``out``, ``html``, ``summary_json`` (the numbers' file beside the
page), ``images`` ({name: path}) and ``summary``: the numbers themselves, as in
summary.json (``mlatune.report.summary_document``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from mlatune.cli.app import (
    JsonFlag,
    app,
    check_output_dir,
    console,
    emit_json,
    note,
    one_line_errors,
    usage_error,
)
from mlatune.cli.frames import columns
from mlatune.cli.inputs import table_argument

if TYPE_CHECKING:
    from mlatune.report import Report


@app.command()
def report(
    table_path: Annotated[Path, table_argument("Parquet or CSV table.")],
    out: Annotated[Path, typer.Option(help="Directory for report.html and the PNGs.")],
    heldout: Annotated[Path | None, typer.Option(
        exists=True, help="A table of other problems on the same arch, to judge `nearest`.")]
        = None,
    heldout_journal: Annotated[list[Path] | None, typer.Option(
        exists=True, help="The held-out sweep's journal (.jsonl or .jsonl.gz): judges the "
                          "parameters `nearest` passes too. Repeated: a later journal's "
                          "runs of a problem's route replace an earlier one's.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Plots and one self-contained HTML page: winners, speedups, roofline, nearest regret."""
    from mlatune import report as reports

    if heldout_journal and heldout is None:
        usage_error("a held-out journal judges the held-out table's problems: name that "
                    "table too", "--heldout")
    check_output_dir(out, reports.HTML_NAME)
    with one_line_errors(str(table_path)):  # table errors name their own file
        made = reports.build_report(table_path, out, heldout, heldout_journal or ())
    if json_out:
        _notes(made)
        emit_json("report", {
            "table": str(table_path), "out": str(out), "html": str(made.html),
            "summary_json": None if made.summary_json is None else str(made.summary_json),
            "images": {name: str(path) for name, path in made.images.items()},
            "summary": reports.summary_document(made.summary)})
        return
    _print_report(table_path, made)
    _notes(made)
    console().print(f"[green]wrote[/] {made.html} and {len(made.images)} PNGs in {out}",
                    soft_wrap=True)


def _notes(made: Report) -> None:
    for text in made.summary.notes:
        note(text)


def _print_report(table_path: Path, made: Report) -> None:
    from mlatune import report as reports

    summary = made.summary
    headline = Table(show_header=False, title=f"report on {table_path}")
    headline.add_column("", no_wrap=True)
    headline.add_column("", overflow="fold")
    for label, value in reports.headline_rows(summary):
        headline.add_row(label, value)
    console().print(headline)
    policies = Table(
        title="speedup of the table's pick over fixed routes and the rule fallback")
    columns(policies, reports.POLICY_COLUMNS, ("served", "wins", "geomean speedup",
                                               "largest speedup"))
    for row in reports.policy_rows(summary):
        policies.add_row(*row)
    console().print(policies)
    dcp_rows = reports.dcp_rows(summary)
    if dcp_rows:
        dcp = Table(title="DCP measured across processes against its one-GPU simulation")
        columns(dcp, reports.DCP_COLUMNS, reports.DCP_COLUMNS[4:])
        for row in dcp_rows:
            dcp.add_row(*row)
        console().print(dcp)
