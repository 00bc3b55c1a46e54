"""The `mlatune` command line."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

import mlatune

app = typer.Typer(
    help="Autotune MLA attention routes per shape and ship the winners as a dispatch table.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()


def _version(value: bool) -> None:
    if value:
        console.print(f"mlatune {mlatune.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """mlatune: measure every MLA route per shape; ship the winners as a table."""


@app.command()
def doctor() -> None:
    """Say what this machine has: library versions, GPUs, and which route backends import."""
    from mlatune.arch import driver_version, gpu_devices, library_versions
    from mlatune.routes import all_routes, backend_status

    versions = Table(title="libraries", show_header=False)
    for name, version in library_versions().items():
        versions.add_row(name, version or "[yellow]not installed[/]")
    versions.add_row("gpu driver", driver_version())
    console.print(versions)

    gpus = gpu_devices()
    if gpus:
        table = Table(title="GPUs")
        for col in ("index", "arch", "name", "SMs/CUs", "memory"):
            table.add_column(col)
        for g in gpus:
            table.add_row(str(g.index), g.arch, g.name, str(g.cu_count),
                          f"{g.memory_bytes / 2**30:.0f} GiB")
        console.print(table)
    else:
        console.print("[yellow]no GPU found[/]: only CPU-capable routes can run here "
                      "(`mlatune plan` needs no GPU).")
    from mlatune.dispatch import Dispatcher

    try:
        here = Dispatcher.from_bundled().source or "none (the dispatcher answers by rule)"
    except (ValueError, OSError) as exc:  # MLATUNE_TABLE names an unusable table
        here = f"[red]unusable[/]: {exc}"
    console.print(f"dispatch table here: {here}", highlight=False)

    backends = Table(title="route backends")
    for col in ("backend", "importable", "detail", "routes"):
        backends.add_column(col)
    routes = all_routes()
    for name in ("torch", "triton", "aiter"):
        ok, detail = backend_status(name)
        ids = ", ".join(r.id for r in routes if r.id.endswith("/" + name)) or "-"
        backends.add_row(name, "[green]yes[/]" if ok else "[red]no[/]", detail, ids)
    console.print(backends)


def _rate_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed:.2f} cand/s" if task.speed else "- cand/s")

    return RateColumn()


class _SweepProgress:
    """Rich progress for a sweep: candidates done, rate, ETA, failures so far."""

    def __init__(self, progress):
        self.progress = progress
        self.task = None
        self.failures = 0

    def started(self, total: int, already_done: int, what: str = "sweep") -> None:
        self.failures = 0
        self.task = self.progress.add_task(what, total=total, completed=already_done,
                                           failures=0)

    def finished(self, record: dict) -> None:
        if record["status"] not in ("ok", "unsupported", "checked"):
            self.failures += 1
        self.progress.update(self.task, advance=1, failures=self.failures)


@app.command()
def sweep(
    spec_path: str = typer.Argument(None, metavar="[SPEC]",
                                    help="Sweep spec (TOML); default: the bundled smoke.toml."),
    arch: str = typer.Option(None, help="The arch this sweep is for (e.g. sm_90, gfx950); "
                                        "stops if the device differs."),
    out: str = typer.Option(None, help="Table path, .parquet or .csv (both are written, with "
                                       "the journal beside them). Default: "
                                       "runs/<spec>-<arch>.parquet"),
    resume: bool = typer.Option(False, help="Continue the sweep recorded in the journal."),
    gpus: int = typer.Option(1, min=1, help="Worker processes, one per GPU."),
    timeout: float = typer.Option(300.0, min=0.1, help="Seconds one candidate may take."),
    compile_workers: int = typer.Option(None, min=0, help="Processes per GPU that compile "
                                        "kernels before timing starts (default: the spare CPU "
                                        "cores, at most 8; 0: none)."),
    routes: str = typer.Option(None, help="Comma-separated route ids (default: every viable)."),
) -> None:
    """Measure every viable route for each problem of a spec and write a dispatch table."""
    import time
    from pathlib import Path

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from mlatune import runner
    from mlatune import spec as specs
    from mlatune.arch import current_device, gpu_devices
    from mlatune.journal import Journal, JournalError

    device = current_device()
    if arch and arch != device.arch:
        _fail(f"--arch {arch} but this machine's device is {device.arch} ({device.name}). "
              f"To see which routes {arch} would run without its GPU: "
              f"mlatune plan SPEC --arch {arch}")
    if device.is_gpu and gpus > len(gpu_devices()):
        _fail(f"--gpus {gpus} but only {len(gpu_devices())} GPU(s) are visible")
    path = Path(spec_path) if spec_path else specs.bundled_spec_path()
    try:
        spec = specs.load(path, gpu=device.is_gpu)
    except specs.SpecError as exc:
        _fail(str(exc))
    only = [r.strip() for r in routes.split(",") if r.strip()] if routes else None
    from mlatune.routes import get
    for r in [*(only or []), *spec.routes]:  # before anything is written
        try:
            get(r)
        except KeyError as exc:
            _fail(f"{exc.args[0]}" + ("" if only and r in only else f" (named in {path})"))
    table_path = Path(out) if out else Path("runs") / f"{spec.name}-{device.arch}.parquet"
    if table_path.suffix not in (".parquet", ".csv"):
        _fail(f"--out {out}: name the table .parquet or .csv (both are written)")
    table_path = table_path.with_suffix(".parquet")
    journal_path = table_path.with_suffix(".journal.jsonl")
    if not device.is_gpu:
        console.print("[yellow]no GPU[/]: running the CPU-capable routes on the spec's CPU "
                      "grid; wall-clock timings, not for dispatch.")
    console.print(f"spec {path} ({len(spec.problems)} problems, "
                  f"{len(spec.skipped)} invalid combinations skipped) on {device.arch} "
                  f"({device.name})")
    header = {"spec_sha256": spec.sha256, "spec": str(path), **device.as_dict(),
              "device_name": device.name}
    try:
        journal = Journal(journal_path, header, resume)
    except JournalError as exc:
        _fail(str(exc))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               _rate_column(), TextColumn("[red]{task.fields[failures]} failed"),
               TimeElapsedColumn(), TimeRemainingColumn())
    t0 = time.monotonic()
    try:
        with Progress(*columns, console=console) as progress:
            result = runner.run(spec, device, journal, workers=gpus if device.is_gpu else 1,
                                timeout_s=timeout, only=only, observer=_SweepProgress(progress),
                                compile_workers=compile_workers)
    except KeyboardInterrupt:
        _fail(f"interrupted; finished candidates are in {journal_path}: rerun with --resume")
    finally:
        journal.close()
    wall = time.monotonic() - t0
    _write_table(runner.table_rows(result.records, device), spec, table_path)
    summary = Table(title=f"sweep {spec.name}: {result.ran} candidates run in {wall:.1f}s "
                          f"({result.ran / wall if wall else 0:.2f}/s)")
    summary.add_column("status")
    summary.add_column("candidates", justify="right")
    for status, n in sorted(result.counts.items()):
        summary.add_row(status, str(n))
    console.print(summary)
    if result.ran:
        cost = dict(result.seconds)
        ahead = cost.pop("compile_ahead_wall_s", None)
        if ahead is not None:
            console.print(f"compiled ahead in {ahead:.1f}s (wall)", highlight=False)
        console.print("worker time: " + ", ".join(
            f"{part.removesuffix('_s')} {cost[part]:.1f}s" for part in cost)
            + " (setup: inputs and references; first_check: the first accuracy run, "
              "with kernel compiles; check: the second; bench: timing)",
            highlight=False)
    console.print(f"table: {table_path} (and {table_path.with_suffix('.csv')}); "
                  f"journal: {journal_path}")


def _write_table(rows: list[dict], spec, path) -> None:
    from mlatune import table
    from mlatune.schema import Provenance

    frame = table.build(rows, Provenance.here(spec.sha256))
    table.write(frame, path)
    table.write(frame, path.with_suffix(".csv"))




@app.command()
def plan(
    spec_path: str = typer.Argument(..., metavar="SPEC", help="Sweep spec (TOML)."),
    arch: str = typer.Option(..., help="The arch to plan for: gfx942, gfx950, gfx1250, sm_90 "
                                       "or sm_100. Its GPU need not be here."),
    out: str = typer.Option(None, help="Also write the plan as CSV: one row per problem and "
                                       "route, with its status and reason."),
) -> None:
    """Which routes a sweep would run on ARCH for each problem, and why the others would not."""
    from pathlib import Path

    from mlatune import capability, planning
    from mlatune import spec as specs

    try:
        device = capability.device_for_arch(arch)
    except KeyError as exc:
        _fail(str(exc.args[0]))
    try:
        spec = specs.load(Path(spec_path), gpu=True)
        rows = planning.plan_rows(spec, device)
    except specs.SpecError as exc:
        _fail(str(exc))
    except KeyError as exc:  # a route id in the spec that is not registered
        _fail(f"{spec_path}: {exc.args[0]}")
    cus = f"{device.cu_count} CUs" if device.cu_count else "CU count unknown"
    console.print(f"plan for {arch} ({device.name}, {cus}): {len(spec.problems)} problems from "
                  f"{spec_path}, {len({r.route for r in rows})} routes")
    console.print("[yellow]capability rules only[/]: the installed-AITER probe (entry points, "
                  "kernel manifest, native 24-head build) was not applied; `mlatune doctor` and "
                  "a sweep on the target machine apply it.", soft_wrap=True)
    table = Table(title="routes per problem (problems differing only in batch/kv_len share a row)")
    for col in ("problem", "batch x kv_len", "viable", "refused: why"):
        table.add_column(col)
    for group in planning.grouped(rows):
        table.add_row(
            planning.describe(group.problem),
            f"{sorted(group.batches)} x {sorted(group.kv_lens)}",
            "\n".join(r.route for r in group.rows if r.viable) or "[red]none[/]",
            planning.refusals_text(group.rows))
    console.print(table)
    summary = Table(title=f"per route on {arch}")
    for col in ("route", "viable", "refused", "most frequent refusal"):
        summary.add_column(col)
    for route, viable, refused, top in planning.route_summary(rows):
        summary.add_row(route, str(viable), str(refused), top)
    console.print(summary)
    if out:
        try:
            planning.write_csv(rows, device, Path(out))
        except OSError as exc:
            _fail(f"cannot write {out}: {exc.strerror or exc}")
        console.print(f"plan table: {out} ({len(rows)} rows)")


# Tables: show, lookup, export, validate, diff ---------------------------------
# Every failure here is one red line on stderr and exit code 1, never a traceback:
# these commands read files from elsewhere, and a damaged file is an input error.

err_console = Console(stderr=True)


def _fail(message: str) -> NoReturn:
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(' '.join(message.split()))}",
                      soft_wrap=True, highlight=False)
    raise typer.Exit(1)


@contextmanager
def _one_line_errors(what: str):
    """Turn any failure into one line; the CLI boundary is where that belongs."""
    try:
        yield
    except typer.Exit:
        raise
    except ValueError as exc:  # TableError, invalid problems, bad options
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{what}: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""))
    except Exception as exc:  # a file damaged in a way no check foresaw
        _fail(f"{what}: {type(exc).__name__}: {exc}")


def _read_table(path: Path):
    from mlatune import table

    return table.read(path)


def _warn_unregistered(frame) -> None:
    from mlatune.routes import all_routes

    known = {r.id for r in all_routes()}
    missing = sorted(set(frame["route"].tolist()) - known)
    if missing:
        err_console.print(f"[yellow]note:[/] routes not registered here (the dispatcher skips "
                          f"their rows): {', '.join(missing)}", soft_wrap=True, highlight=False)


def _problem_text(row) -> str:
    """A problem in a few characters: "h16 q1 bf16/fp8_e4m3fn causal dcp1 p64"."""
    causal = "causal" if row["causal"] else "non-causal"
    phase = "" if row["phase"] == "decode" else f"{row['phase']} "
    return (f"{phase}h{row['num_heads']} q{row['qlen']} {row['q_dtype']}/{row['kv_dtype']} "
            f"{causal} dcp{row['dcp_size']} p{row['page_size']}")


def _grouped(rows, several_devices: bool):
    """Rows with their problem label, given on the first row of each bucket only
    (batch and kv_len have their own columns); True where a new bucket starts."""
    previous = None
    for _, row in rows.iterrows():
        label = _problem_text(row)
        if several_devices:
            label = f"{row['arch']} {row['device_name']} {label}"
        yield ("" if label == previous else label), row, label != previous
        previous = label


def _devices_title(frame) -> tuple[str, bool]:
    devices = frame[["arch", "device_name"]].drop_duplicates()
    if len(devices) == 1:
        return f"{devices.iloc[0]['arch']} {devices.iloc[0]['device_name']}", False
    return f"{len(devices)} devices", True


def _columns(out: Table, names: tuple[str, ...], numeric: tuple[str, ...]) -> None:
    # Fold rather than elide: a narrow terminal wraps a cell, it never hides a value.
    for name in names:
        out.add_column(name, justify="right" if name in numeric else "left", overflow="fold",
                       min_width=12 if name == "problem" else None)


def _us(value: float) -> str:
    return "-" if value != value else f"{value:.4g}"  # NaN -> "-"


@app.command()
def show(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE", help="Parquet or CSV table.")],
    limit: Annotated[int, typer.Option(help="Keys to print (0: all).")] = 50,
) -> None:
    """Per problem: the winning route, the runner-up and the margin between them."""
    from mlatune import table

    with _one_line_errors(str(table_path)):
        frame = _read_table(table_path)
        rows = table.summary(frame)
    devices, several = _devices_title(frame)
    out = Table(title=f"{table_path}: {devices}, {len(rows)} problems, {len(frame)} rows")
    _columns(out, ("problem", "batch", "kv_len", "winner", "us", "runner-up", "us", "margin"),
             ("batch", "kv_len", "us", "margin"))
    shown = rows if limit <= 0 else rows.head(limit)
    for label, row, starts in _grouped(shown, several):
        if starts and out.row_count:
            out.add_section()
        margin = "-" if row["margin"] != row["margin"] else f"+{row['margin'] * 100:.1f}%"
        winner = row["winner"] or f"[red]none ok[/] ({row['routes']} tried)"
        out.add_row(label, str(row["batch"]), str(row["kv_len"]), winner, _us(row["winner_us"]),
                    row["runner_up"] or "-", _us(row["runner_up_us"]), margin)
    console.print(out)
    if len(shown) < len(rows):
        console.print(f"... {len(rows) - len(shown)} more (--limit 0 shows all)")
    _warn_unregistered(frame)


@app.command()
def lookup(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE",
                                               help="Parquet, CSV or JSON winners table.")],
    heads: Annotated[int, typer.Option(help="Query heads per rank.")],
    batch: Annotated[int, typer.Option(help="Requests in the batch.")],
    kv_len: Annotated[int, typer.Option(help="KV tokens per request.")],
    qlen: Annotated[int, typer.Option(help="Query tokens per request (1: decode).")] = 1,
    kv_dtype: Annotated[str, typer.Option(help="KV cache dtype.")] = "bf16",
    q_dtype: Annotated[str | None, typer.Option(
        help="Query dtype (default: bf16 for an fp8 cache, else the cache's).")] = None,
    dcp: Annotated[int, typer.Option(help="Decode-context-parallel size.")] = 1,
    page_size: Annotated[int, typer.Option(help="KV cache page size.")] = 64,
    causal: Annotated[bool, typer.Option("--causal/--no-causal")] = True,
    phase: Annotated[str, typer.Option(help="decode or prefill.")] = "decode",
    arch: Annotated[str | None, typer.Option(
        help="Plan for this arch (the table's) instead of this machine's.")] = None,
) -> None:
    """Which route the dispatcher picks for one problem, and why."""
    from mlatune.dispatch import Dispatcher
    from mlatune.problem import FP8_DTYPES, MLAProblem

    with _one_line_errors(str(table_path)):
        if q_dtype is None:
            q_dtype = "bf16" if kv_dtype in FP8_DTYPES else kv_dtype
        problem = MLAProblem(phase=phase, num_heads=heads, qlen=qlen, q_dtype=q_dtype,
                             kv_dtype=kv_dtype, batch=batch, kv_len=kv_len, dcp_size=dcp,
                             page_size=page_size, causal=causal)
        dispatcher = Dispatcher.load(table_path, allow_arch=arch)
        choice, notes = dispatcher.explain(problem)
    arch_name, device_name, cu_count = dispatcher.table_device or ("", "", 0)
    out = Table(show_header=False, title=f"lookup in {table_path}")
    out.add_column("", no_wrap=True)
    out.add_column("", overflow="fold")
    out.add_row("problem", problem.key)
    out.add_row("table device", f"{arch_name} {device_name} ({cu_count} CUs/SMs)")
    out.add_row("route", f"[bold]{choice.route_id}[/]")
    out.add_row("params", json.dumps(dict(choice.params), sort_keys=True))
    out.add_row("source", choice.source)
    out.add_row("why", "\n".join(notes))
    console.print(out)
    if dispatcher.skipped_routes:
        err_console.print("[yellow]note:[/] skipped rows of routes not registered here: "
                          + ", ".join(f"{r} ({n})" for r, n in
                                      sorted(dispatcher.skipped_routes.items())),
                          soft_wrap=True, highlight=False)


_SOURCES = ("table", "nearest", "rule")


@app.command()
def coverage(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC",
                                              help="Sweep spec whose problems to answer.")],
    table_path: Annotated[Path | None, typer.Option(
        "--table", help="Parquet, CSV or JSON winners table. Default: the one the dispatcher "
                        "loads here (bundled for this device, or MLATUNE_TABLE).")] = None,
    arch: Annotated[str | None, typer.Option(
        help="Plan for this arch (the table's) instead of this machine's.")] = None,
    require: Annotated[str, typer.Option(
        help="Exit 1 unless every problem is answered this well: table (measured), "
             "nearest or rule.")] = "rule",
) -> None:
    """How the dispatcher answers every problem of a spec: measured, nearest point or rule."""
    from collections import Counter

    from mlatune import spec as specs
    from mlatune.dispatch import Dispatcher, device_for_arch

    if require not in _SOURCES:
        _fail(f"--require must be one of {', '.join(_SOURCES)}, got {require!r}")
    with _one_line_errors(str(table_path or spec_path)):
        problems = specs.load(spec_path, gpu=True).problems
        if table_path is not None:
            dispatcher = Dispatcher.load(table_path, allow_arch=arch)
        else:
            dispatcher = Dispatcher.from_bundled(device_for_arch(arch) if arch else None)
        choices = [(p, dispatcher.select(p)) for p in problems]
    console.print(f"table: {dispatcher.source or 'none (every answer by rule)'}",
                  highlight=False)
    by_route = Counter((c.source, c.route_id) for _, c in choices)
    out = Table(title=f"{len(problems)} problems of {spec_path}")
    out.add_column("answered by")
    out.add_column("problems", justify="right")
    out.add_column("routes")
    for source in _SOURCES:
        mine = sorted((r, n) for (s, r), n in by_route.items() if s == source)
        out.add_row(source, str(sum(n for _, n in mine)),
                    ", ".join(f"{r} ({n})" for r, n in mine))
    console.print(out)
    worse = [(p, c) for p, c in choices if _SOURCES.index(c.source) > _SOURCES.index(require)]
    for p, c in worse[:20]:
        console.print(f"  {c.source}: {p.key} -> {c.route_id}", highlight=False)
    if worse:
        _fail(f"{len(worse)} problem(s) answered by worse than --require {require}"
              + (" (first 20 above)" if len(worse) > 20 else ""))


@app.command()
def export(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE", help="Parquet or CSV table.")],
    fmt: Annotated[str, typer.Option("--format", help="parquet, csv or json (a winners map).")],
    out: Annotated[Path, typer.Option("--out", help="Where to write (suffix must match).")],
    winners_only: Annotated[bool, typer.Option(
        "--winners-only", help="Only each problem's winner (json: no alternatives).")] = False,
) -> None:
    """Write a table for deployment: Parquet, CSV, or a JSON winners map for engines."""
    from mlatune import table

    with _one_line_errors(str(table_path)):
        if fmt not in ("parquet", "csv", "json"):
            raise ValueError(f"--format must be parquet, csv or json, got {fmt!r}")
        if out.suffix.lower() != f".{fmt}":
            raise ValueError(f"--out {out} must end in .{fmt} for --format {fmt}")
        frame = _read_table(table_path)
        if fmt == "json":
            document = table.winners_json(frame, winners_only)
            table.write_json(document, out)
            count = sum(len(d["winners"]) for d in document["devices"])
        else:
            if winners_only:
                frame = table.winners(frame)
            table.write(frame, out, fmt)
            count = len(frame)
    what = "winners" if fmt == "json" else "rows"
    console.print(f"[green]wrote[/] {out} ({count} {what})", soft_wrap=True)


@app.command()
def validate(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE",
                                               help="Parquet, CSV or JSON winners table.")],
) -> None:
    """Check a table against the current schema (a v1 table as upgraded on reading);
    every problem is reported at once."""
    with _one_line_errors(str(table_path)):
        if table_path.suffix.lower() == ".json":
            from mlatune import winners

            document = winners.read(table_path).document
            count = sum(len(d["winners"]) for d in document["devices"])
            devices = sorted({f"{d['arch']} {d['device_name']}" for d in document["devices"]})
            console.print(f"[green]ok[/]: {table_path}: winners map, {count} winners, "
                          f"devices: {', '.join(devices)}", soft_wrap=True)
            return
        frame = _read_table(table_path)
    keys = frame.drop_duplicates(["arch", "device_name", "cu_count", "phase", "num_heads",
                                  "qlen", "q_dtype", "kv_dtype", "causal", "dcp_size",
                                  "page_size", "batch", "kv_len", "d_qk", "d_v"])
    devices = sorted({f"{a} {n}" for a, n in zip(frame["arch"], frame["device_name"],
                                                   strict=True)})
    converted = set(frame.get("converted_from", [])) - {""}
    version = f"schema v{int(frame['schema_version'].max())}" + \
        (f" (upgraded from {', '.join(sorted(converted))} on reading)" if converted else "")
    console.print(f"[green]ok[/]: {table_path}: {version}, "
                  f"{len(frame)} rows, {len(keys)} problems, devices: {', '.join(devices)}",
                  soft_wrap=True)
    _warn_unregistered(frame)


@app.command()
def upgrade(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE",
                                               help="Parquet or CSV table of an older schema.")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="Where to write, .parquet or .csv (both are written). Default: over "
                      "TABLE.")] = None,
) -> None:
    """Rewrite a schema v1 table as the current schema: step kinds as the routes declare
    them, per-step costs not measured (empty), provenance converted_from "v1"."""
    from mlatune import table
    from mlatune.schema import SCHEMA_VERSION

    with _one_line_errors(str(table_path)):
        target = out or table_path
        if target.suffix.lower() not in (".parquet", ".csv"):
            raise ValueError(f"--out {target}: name the table .parquet or .csv (both are "
                             f"written)")
        frame, stored = table.read_versioned(table_path)
        if stored == SCHEMA_VERSION:
            console.print(f"{table_path}: already v{SCHEMA_VERSION}; nothing written",
                          soft_wrap=True, highlight=False)
            return
        # Both formats, as a sweep writes them; each write is atomic (the old file or
        # the new one, never half of either).
        written = [table.write(frame, target.with_suffix(s)) for s in (".parquet", ".csv")]
    kinds = frame.groupby(["plan_on", "capturable"], sort=True).size()
    console.print(f"[green]upgraded[/] {table_path} from schema v{stored} to "
                  f"v{SCHEMA_VERSION}: wrote {written[0]} and {written[1]} ({len(frame)} rows); "
                  "step kinds as the routes here declare them ("
                  + ", ".join(f"{plan_on}{' capturable' if cap else ''}: {n}"
                              for (plan_on, cap), n in kinds.items())
                  + "), per-step costs not measured (empty)", soft_wrap=True, highlight=False)
    _warn_unregistered(frame)


@app.command()
def diff(
    a_path: Annotated[Path, typer.Argument(metavar="A", help="The old table.")],
    b_path: Annotated[Path, typer.Argument(metavar="B", help="The new table.")],
    limit: Annotated[int, typer.Option(help="Changed winners to print (0: all).")] = 50,
) -> None:
    """Winners that changed between two tables, and by how much."""
    import pandas as pd

    from mlatune import table

    with _one_line_errors(str(a_path)):
        a = _read_table(a_path)
    with _one_line_errors(str(b_path)):
        b = _read_table(b_path)
    changed, counts = table.diff(a, b)
    console.print(f"{counts['same']} winners unchanged, {counts['changed']} changed, "
                  f"{counts['only_a']} problems only in A, {counts['only_b']} only in B",
                  soft_wrap=True)
    if changed.empty:
        return
    devices, several = _devices_title(pd.concat([a, b]))
    out = Table(title=f"changed winners, {devices} (change: B's winner time vs A's)")
    _columns(out, ("problem", "batch", "kv_len", "A winner", "A us", "B winner", "B us",
                   "change"), ("batch", "kv_len", "A us", "B us", "change"))
    shown = changed if limit <= 0 else changed.head(limit)
    for label, row, starts in _grouped(shown, several):
        if starts and out.row_count:
            out.add_section()
        change = row["change"] * 100
        color = "green" if change < 0 else "red" if change > 0 else "white"
        a_winner = row["route_a"] + ("" if row["route_a"] != row["route_b"] else " (params)")
        out.add_row(label, str(row["batch"]), str(row["kv_len"]), a_winner,
                    _us(row["time_us_a"]), row["route_b"], _us(row["time_us_b"]),
                    f"[{color}]{change:+.1f}%[/]")
    console.print(out)
    if len(shown) < len(changed):
        console.print(f"... {len(changed) - len(shown)} more (--limit 0 shows all)")


@app.command()
def report(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE", help="Parquet or CSV table.")],
    out: Annotated[Path, typer.Option("--out", help="Directory for report.html and the PNGs.")],
    heldout: Annotated[Path | None, typer.Option(
        "--heldout", help="A table of other problems on the same arch, to judge `nearest`.")]
        = None,
    heldout_journal: Annotated[Path | None, typer.Option(
        "--heldout-journal", help="The held-out sweep's journal (.jsonl or .jsonl.gz): "
        "judges the parameters `nearest` passes too.")] = None,
) -> None:
    """Plots and one self-contained HTML page: winners, speedups, roofline, nearest regret."""
    from mlatune import report as reports

    with _one_line_errors(str(table_path)):  # table errors name their own file
        made = reports.build_report(table_path, out, heldout, heldout_journal)
    summary = made.summary
    headline = Table(show_header=False, title=f"report on {table_path}")
    headline.add_column("", no_wrap=True)
    headline.add_column("", overflow="fold")
    for label, value in reports.headline_rows(summary):
        headline.add_row(label, value)
    console.print(headline)
    policies = Table(title="speedup of the table's pick (worst case: the largest)")
    _columns(policies, reports.POLICY_COLUMNS, ("served", "wins", "geomean speedup",
                                                "worst case"))
    for row in reports.policy_rows(summary):
        policies.add_row(*row)
    console.print(policies)
    for note in summary.notes:
        err_console.print(f"[yellow]note:[/] {note}", soft_wrap=True, highlight=False)
    console.print(f"[green]wrote[/] {made.html} and {len(made.images)} PNGs in {out}",
                  soft_wrap=True)
