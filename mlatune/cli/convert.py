"""`mlatune export` and `mlatune upgrade`: one table written anew, for deployment or the
current schema.

``export --json``: ``table``, ``out``, ``format``, ``winners_only``, ``accuracy`` (the
policy the rows were filtered by; null: none), ``held_back`` (ok rows it left out),
``rows`` (written; null for a JSON winners map), ``winners``.

``upgrade --json``: ``table``, ``from_version``, ``to_version``, ``rows``, ``written``: the
files written (none when the table is current already).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from mlatune.cli import frames
from mlatune.cli.app import (
    JsonFlag,
    app,
    check_outputs,
    console,
    emit_json,
    one_line_errors,
    refuse_writing_over,
    usage_error,
)
from mlatune.cli.inputs import Accuracy, Format, table_argument, value

if TYPE_CHECKING:
    import pandas as pd


@app.command()
def export(
    table_path: Annotated[Path, table_argument("Parquet or CSV table.")],
    fmt: Annotated[Format, typer.Option("--format", help="A table, or a JSON winners map.")],
    out: Annotated[Path, typer.Option(
        help="Where to write (suffix must match; .csv.gz / .json.gz gzip-compressed).")],
    winners_only: Annotated[bool, typer.Option(
        "--winners-only", help="Only each problem's winner (json: no alternatives).")] = False,
    accuracy: Annotated[Accuracy | None, typer.Option(
        help="Keep only the ok rows this accuracy policy serves (the rest ranked again); "
             "a JSON map records the policy. Default: every row.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Write a table for deployment: Parquet, CSV, or a JSON winners map for engines."""
    from mlatune import table

    fmt = fmt.value
    gzipped = fmt in ("csv", "json") and out.name.lower().endswith(f".{fmt}.gz")
    if out.suffix.lower() != f".{fmt}" and not gzipped:
        usage_error(f"{out} must end in .{fmt}{' or .' + fmt + '.gz' if fmt != 'parquet' else ''}"
                    f" for --format {fmt}", "--out")
    refuse_writing_over(out, table_path)
    check_outputs(out)
    with one_line_errors(str(table_path)):
        frame = frames.read_table(table_path)
        before = len(frame)
        if accuracy is not None:
            frame = frames.for_policy(frame, value(accuracy))
        held_back = before - len(frame)
        if fmt == "json":
            document = table.winners_json(frame, winners_only)
            if accuracy is not None:
                document["accuracy"] = value(accuracy)
            table.write_json(document, out)
            rows, winners = None, sum(len(d["winners"]) for d in document["devices"])
        else:
            winners = len(table.winners(frame))
            if winners_only:
                frame = table.winners(frame)
            table.write(frame, out, fmt)
            rows = len(frame)
    if json_out:
        emit_json("export", {"table": str(table_path), "out": str(out), "format": fmt,
                             "winners_only": winners_only, "accuracy": value(accuracy),
                             "held_back": held_back, "rows": rows, "winners": winners})
        return
    count = f"{winners} winners" if rows is None else f"{rows} rows"
    if accuracy is not None:
        count += f"; accuracy {value(accuracy)} held back {held_back} ok rows"
    console().print(f"[green]wrote[/] {out} ({count})", soft_wrap=True)



@app.command()
def upgrade(
    table_path: Annotated[Path, table_argument("Parquet or CSV table of an older schema.")],
    out: Annotated[Path | None, typer.Option(
        help="Where to write, .parquet or .csv (both are written). Default: over TABLE, and "
             "its other format beside it unless a file is there already (left as it is).")]
        = None,
    json_out: JsonFlag = False,
) -> None:
    """Rewrite an older table (any schema before the current) as the current one: from v1,
    step kinds as the routes declare them and per-step costs not measured (empty); DCP rows
    timed "simulated"; provenance converted_from the version it had."""
    from mlatune import table
    from mlatune.routes import FACTS
    from mlatune.table.schema import SCHEMA_VERSION

    target = out or table_path
    if target.suffix.lower() not in (".parquet", ".csv"):
        usage_error(f"{target}: name the table .parquet or .csv (both are written)", "--out")
    targets = [target.with_suffix(s) for s in (".parquet", ".csv")]
    if out is None:  # over TABLE: a file beside it may be another table; it is not ours
        targets = [t for t in targets if t == table_path or not t.exists()]
    if out is not None:  # a named destination is checked before anything is read
        check_outputs(*targets)
    with one_line_errors(str(table_path)):
        frame, stored = table.read_versioned(table_path, facts=FACTS)
    written = []
    if stored != SCHEMA_VERSION or out is not None:  # --out: a copy of a current table too
        if out is None:  # over TABLE, a current table needs no writable folder
            check_outputs(*targets)
        with one_line_errors(str(table_path)):
            # Both formats, as a sweep writes them; each write is atomic (the old file or
            # the new one, never half of either).
            written = [table.write(frame, t) for t in targets]
    if json_out:
        emit_json("upgrade", {"table": str(table_path), "from_version": stored,
                              "to_version": SCHEMA_VERSION, "rows": len(frame),
                              "written": [str(w) for w in written]})
    elif not written:
        console().print(f"{table_path}: already v{SCHEMA_VERSION}; nothing written",
                        soft_wrap=True, highlight=False)
    else:
        _say_upgraded(table_path, frame, stored, written)
    if written:
        frames.warn_unregistered(frame)


def _say_upgraded(table_path: Path, frame: pd.DataFrame, stored: int,
                  written: list[Path]) -> None:
    from mlatune.table.schema import SCHEMA_VERSION

    filled = []
    if stored == 1:
        kinds = frame.groupby(["plan_on", "capturable"], sort=True).size()
        filled.append("step kinds as the routes here declare them ("
                      + ", ".join(f"{plan_on}{' capturable' if cap else ''}: {n}"
                                  for (plan_on, cap), n in kinds.items())
                      + "), per-step costs not measured (empty)")
    if stored <= 2:  # (dcp_timing came with v3)
        filled.append("DCP rows timed 'simulated'")
    said = f"upgraded[/] {table_path} from schema v{stored} to v{SCHEMA_VERSION}" \
        if stored != SCHEMA_VERSION else f"copied[/] {table_path} (already v{stored})"
    console().print(f"[green]{said}: wrote {' and '.join(map(str, written))} "
                    f"({len(frame)} rows)" + "".join(f"; {f}" for f in filled),
                    soft_wrap=True, highlight=False)
