"""`mlatune merge`: tables joined into one (shares of a sharded sweep, runs on other
devices), or a route's rows replaced by a newer sweep's (--replace-routes).

``--json``: ``out``, ``rows``, ``problems`` and ``devices`` of the joined table,
``spec_sha256`` (the specs joined, sorted), ``tables``: every input as {"path", "rows",
"problems", "devices", "spec_sha256" (list), "shard" ("I/N" from the journal beside it, or
null)}; ``missing_shards``: per sharded sweep with shares not given, {"spec_sha256",
"count", "missing": [I]}; ``replaced``: {"routes", "rows"} (the first table's rows dropped)
with --replace-routes, else null.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlatune.cli import frames
from mlatune.cli.app import (
    JsonFlag,
    app,
    check_outputs,
    console,
    device_json,
    emit_json,
    fail,
    note,
    one_line_errors,
    plain,
    usage_error,
)
from mlatune.cli.frames import Device, device_text, problem_count

if TYPE_CHECKING:
    import pandas as pd

    from mlatune.sweep.candidates import Shard

TablesArgument = Annotated[list[Path], typer.Argument(
    metavar="TABLE...", show_default=False,
    help="Parquet or CSV tables: the shares of a sweep run with --shard, or runs on other "
         "devices; with --replace-routes, the table whose rows are replaced, then the newer "
         "ones.")]
OutOption = Annotated[Path | None, typer.Option(
    help="The joined table, .parquet or .csv (`mlatune export` then writes a JSON winners "
         "map).  [required]", show_default=False)]
AllowSpecsFlag = Annotated[bool, typer.Option(
    "--allow-different-specs", help="Join tables of different specs (spec_sha256) too.")]
ReplaceRoutesOption = Annotated[str | None, typer.Option(
    metavar="ROUTE[,ROUTE]",
    help="Drop the first table's rows of these routes where the other tables hold a row of "
         "the route for the problem, then join: the newer rows replace the old whatever "
         "their times (a route whose parameter sets changed is judged by what it runs now). "
         "Implies "
         "--allow-different-specs: a sweep of some routes often runs a cut of the table's "
         "spec.")]
WhereOption = Annotated[str | None, typer.Option(
    metavar="QUERY",
    help="With --replace-routes: only the newer tables' rows that match QUERY replace and "
         "join (a pandas query over the table's columns, e.g. \"num_heads * qlen <= 16\").")]


@app.command()
def merge(tables: TablesArgument, out: OutOption = None,
          allow_different_specs: AllowSpecsFlag = False,
          replace_routes: ReplaceRoutesOption = None, where: WhereOption = None,
          json_out: JsonFlag = False) -> None:
    """Join tables into one: per (device, problem, route) the best row (an ok row before
    any other, then the fastest), re-ranked.

    Refused: tables measured on one device under different environments (torch, triton,
    driver, library versions), shares of one sharded sweep from different devices or
    environments, and tables of different specs unless --allow-different-specs. A share
    (read from the sweep's journal beside its table) missing from a sharded sweep is
    warned about: the joined table lacks its problems.
    """
    from mlatune import routes, table

    out = _checked_out(out, tables)
    replaced = _replaced_routes(replace_routes, where, tables)
    inputs = [_MergeInput(path) for path in tables]
    _refuse_mixed_environments(inputs)
    specs = _joined_specs(inputs, allow_different_specs or bool(replaced))
    missing = _missing_shards(inputs)
    parts, dropped = [i.frame for i in inputs], 0
    if replaced:
        parts, dropped = _replace(parts, replaced, where)
    with one_line_errors("merge"):
        merged = table.merge(parts, routes.plan_sharing())
    with one_line_errors(str(out)):
        table.write(merged, out)
    for m in missing:
        shares = ", ".join(f"{i}/{m['count']}" for i in m["missing"])
        note(f"spec {m['spec_sha256'][:12]}: shard{'s' if len(m['missing']) > 1 else ''} "
             f"{shares} not given (as the journals beside the tables say): the joined "
             f"table lacks their problems")
    replacement = {"routes": replaced, "rows": dropped} if replaced else None
    if json_out:
        emit_json("merge", {
            "out": str(out), "rows": len(merged), "problems": problem_count(merged),
            "devices": [device_json(*d) for d in frames.devices(merged)],
            "spec_sha256": specs, "tables": [i.as_json() for i in inputs],
            "missing_shards": missing, "replaced": replacement})
        return
    _print_merged(out, merged, inputs, replacement)


def _checked_out(out: Path | None, tables: list[Path]) -> Path:
    """--out, checked before any table is read; the old form (OUT first) is a usage
    error that says the new one."""
    if out is None:
        old_form = len(tables) > 1 and not tables[0].exists()
        usage_error("missing. Name the joined table with --out: mlatune merge TABLE... "
                    "--out OUT" + (f" (the output is no longer the first argument: "
                                   f"{tables[0]})" if old_form else ""), "--out")
    if out.suffix.lower() not in (".parquet", ".csv"):
        usage_error(f"{out}: name the joined table .parquet or .csv (`mlatune export` then "
                    f"writes a JSON winners map)", "--out")
    for path in tables:
        if not path.exists():
            usage_error(f"Path '{path}' does not exist.", "TABLE...")
    check_outputs(out)
    return out


def _replaced_routes(replace_routes: str | None, where: str | None, tables: list[Path]
                    ) -> list[str]:
    routes = sorted({r.strip() for r in (replace_routes or "").split(",") if r.strip()})
    if replace_routes is not None and not routes:
        usage_error("name at least one route id", "--replace-routes")
    if routes and len(tables) < 2:
        usage_error("replacing rows takes the table to change and at least one newer table",
                    "--replace-routes")
    if where is not None and not routes:
        usage_error("it picks the rows that replace: only with --replace-routes", "--where")
    return routes


def _replace(parts: list[pd.DataFrame], routes: list[str], where: str | None
             ) -> tuple[list[pd.DataFrame], int]:
    """The first table without its rows of ``routes`` where the newer ones (their rows
    matching ``where``) hold a row of that route for the problem (per device), then the
    newer ones, each re-ranked where rows left it; and how many rows of the first were
    dropped. A route no newer
    row holds is a usage error: its rows would go with nothing in their place."""
    from mlatune import table
    from mlatune.table.schema import ROW_KEY

    base, newer = parts[0], [_matching(p, where) for p in parts[1:]]
    newer = [table.assign_ranks(p) for p in newer if not p.empty]
    held_routes = {r for p in newer for r in p["route"]}
    absent = sorted(set(routes) - held_routes)
    if absent:
        usage_error(f"{', '.join(absent)}: no rows in the newer tables to replace with"
                    + (" (that match --where)" if where else ""), "--replace-routes")
    held = {key for p in newer for key in p[list(ROW_KEY)].itertuples(index=False, name=None)}
    dropped = [key[-1] in routes and key in held
               for key in base[list(ROW_KEY)].itertuples(index=False, name=None)]
    kept = base[[not d for d in dropped]]
    return ([] if kept.empty else [table.assign_ranks(kept)]) + newer, sum(dropped)


def _matching(frame: pd.DataFrame, where: str | None) -> pd.DataFrame:
    if where is None:
        return frame
    try:
        return frame.query(where)
    except Exception as exc:  # pandas raises many kinds for a bad query
        usage_error(f"{where!r}: {type(exc).__name__}: {exc}", "--where")


def _print_merged(out: Path, merged: pd.DataFrame, inputs: list[_MergeInput],
                  replacement: dict[str, Any] | None) -> None:
    console().print(f"[green]joined[/] {len(inputs)} table{'s' if len(inputs) > 1 else ''} "
                    f"into {out}: {len(merged)} rows, {problem_count(merged)} problems, "
                    f"devices: {', '.join(map(device_text, frames.devices(merged)))}",
                    soft_wrap=True, highlight=False)
    if replacement:
        console().print(f"  replaced: {replacement['rows']} rows of {inputs[0].path} "
                        f"({', '.join(replacement['routes'])}) where the newer tables hold "
                        f"the route's row", soft_wrap=True, highlight=False)
    for i in inputs:
        share = f", shard {i.shard}" if i.shard else ""
        console().print(f"  {i.path}: {len(i.frame)} rows, {problem_count(i.frame)} "
                        f"problems, {', '.join(map(device_text, i.devices))}{share}",
                        soft_wrap=True, highlight=False)


class _MergeInput:
    """One table given to merge: its devices, each device's environment (the provenance
    fields that must not differ on one device), its specs and, when the sweep's journal
    lies beside it, the share of the spec it ran."""

    def __init__(self, path: Path):
        from mlatune.table.checks import ENVIRONMENT_FIELDS
        from mlatune.table.schema import DEVICE_COLUMNS

        with one_line_errors(str(path)):
            frame = frames.read_table(path)
        self.path, self.frame = path, frame
        self.devices = frames.devices(frame)
        found = frame[[*DEVICE_COLUMNS, *ENVIRONMENT_FIELDS]].drop_duplicates()
        self.environments: dict[Device, dict[str, Any]] = {
            (str(a), str(n), int(c)): {f: plain(v) for f, v in
                                       zip(ENVIRONMENT_FIELDS, rest, strict=True)}
            for a, n, c, *rest in found.itertuples(index=False, name=None)}
        self.specs = frozenset(str(v) for v in frame["spec_sha256"].unique())
        self.shard = _shard_beside(path, self.specs)

    def as_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "rows": len(self.frame),
                "problems": problem_count(self.frame),
                "devices": [device_json(*d) for d in self.devices],
                "spec_sha256": sorted(self.specs),
                "shard": None if self.shard is None else str(self.shard)}


def _specs_text(specs: frozenset[str]) -> str:
    return "+".join(sha[:12] or '""' for sha in sorted(specs))


def _joined_specs(inputs: list[_MergeInput], allow_different: bool) -> list[str]:
    """The specs the inputs ran, sorted. Inputs that ran different specs are joined only
    when allowed (exit 1 otherwise); a table already joined from several specs joins
    tables of the same specs."""
    specs = sorted({sha for i in inputs for sha in i.specs})
    a = inputs[0]
    b = next((i for i in inputs if i.specs != a.specs), None)
    if b is not None and not allow_different:
        fail(f"{a.path} and {b.path} come from different specs (spec_sha256 "
             f"{_specs_text(a.specs)} and {_specs_text(b.specs)}); "
             f"--allow-different-specs joins them anyway")
    return specs


def _shard_beside(path: Path, specs: frozenset[str]) -> Shard | None:
    """The share a sweep ran, from the header of the journal beside its table
    (``<table>.journal.jsonl``, or gzipped); None where there is none, or it is another
    spec's (the table was moved or renamed)."""
    import gzip

    from mlatune.sweep.candidates import Shard

    for journal in (path.with_suffix(".journal.jsonl"), path.with_suffix(".journal.jsonl.gz")):
        if not journal.is_file():
            continue
        try:
            opener = gzip.open if journal.suffix == ".gz" else open
            with opener(journal, "rb") as f:
                header = json.loads(f.readline().decode("utf-8"))
            if not isinstance(header, dict) or header.get("kind") != "header":
                return None
            if {header.get("spec_sha256")} != set(specs) or not header.get("shard"):
                return None
            return Shard.parse(str(header["shard"]))
        except (OSError, ValueError, EOFError):  # damaged: the shard is just not known
            return None
    return None


def _environment_clash(a: dict[str, Any], b: dict[str, Any]) -> str:
    field = next(f for f in a if a[f] != b[f])
    return f"{field} {a[field]} and {b[field]}"


def _refuse_mixed_environments(inputs: list[_MergeInput]) -> None:
    """One line, exit 1: two tables measured on one device under different environments
    (timings from different torch or driver versions do not rank against each other), or
    shares of one sharded sweep measured on different devices or environments (each
    device's table would hold only some of the spec's problems)."""
    seen: dict[Device, _MergeInput] = {}
    for i in inputs:
        for device, env in i.environments.items():
            first = seen.setdefault(device, i)
            if first.environments[device] != env:
                fail(f"{first.path} and {i.path} were measured on {device_text(device)} "
                     f"under different environments "
                     f"({_environment_clash(first.environments[device], env)}): timings "
                     f"from different environments do not rank against each other")
    sweeps: dict[tuple[frozenset[str], int], _MergeInput] = {}
    for i in inputs:
        if i.shard is None:
            continue
        first = sweeps.setdefault((i.specs, i.shard.count), i)
        if first.environments != i.environments:
            fail(f"{first.path} (shard {first.shard}) and {i.path} (shard {i.shard}) are "
                 f"shares of one sweep measured in different environments "
                 f"({_share_clash(first.environments, i.environments)}): run every share "
                 f"on the same kind of machine and software")


def _share_clash(a: dict[Device, dict[str, Any]], b: dict[Device, dict[str, Any]]) -> str:
    if set(a) != set(b):
        return f"{', '.join(map(device_text, a))} and {', '.join(map(device_text, b))}"
    device = next(d for d in a if a[d] != b[d])
    return f"on {device_text(device)}: {_environment_clash(a[device], b[device])}"


def _missing_shards(inputs: list[_MergeInput]) -> list[dict[str, Any]]:
    """Per sharded sweep among the inputs (spec and N), the shares not given; none where a
    table of that spec not known to be a share is given too (a whole run of it)."""
    given: dict[tuple[str, int], set[int]] = {}
    whole = {sha for i in inputs if i.shard is None or i.shard.count == 1 for sha in i.specs}
    for i in inputs:
        if i.shard is not None:
            given.setdefault((next(iter(i.specs)), i.shard.count), set()).add(i.shard.index)
    return [{"spec_sha256": sha, "count": count,
             "missing": sorted(set(range(count)) - indices)}
            for (sha, count), indices in sorted(given.items())
            if len(indices) < count and sha not in whole]
