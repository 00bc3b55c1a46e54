"""The `mlatune` command line."""

from __future__ import annotations

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

    def started(self, total: int, already_done: int) -> None:
        self.task = self.progress.add_task("sweep", total=total, completed=already_done,
                                           failures=0)

    def finished(self, record: dict) -> None:
        if record["status"] not in ("ok", "unsupported"):
            self.failures += 1
        self.progress.update(self.task, advance=1, failures=self.failures)


@app.command()
def sweep(
    spec_path: str = typer.Argument(None, metavar="[SPEC]",
                                    help="Sweep spec (TOML); default: the bundled smoke.toml."),
    arch: str = typer.Option(None, help="The arch this sweep is for (e.g. sm_90, gfx950); "
                                        "stops if the device differs."),
    out: str = typer.Option(None, help="Table path (.parquet; a .csv is written beside it). "
                                       "Default: runs/<spec>-<arch>.parquet"),
    resume: bool = typer.Option(False, help="Continue the sweep recorded in the journal."),
    gpus: int = typer.Option(1, min=1, help="Worker processes, one per GPU."),
    timeout: float = typer.Option(300.0, min=0.1, help="Seconds one candidate may take."),
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
    if only:
        from mlatune.routes import get
        for r in only:
            try:
                get(r)
            except KeyError as exc:
                _fail(str(exc.args[0]))
    table_path = Path(out) if out else Path("runs") / f"{spec.name}-{device.arch}.parquet"
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
                                timeout_s=timeout, only=only, observer=_SweepProgress(progress))
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
    console.print(f"table: {table_path} (and {table_path.with_suffix('.csv')}); "
                  f"journal: {journal_path}")


def _write_table(rows: list[dict], spec, path) -> None:
    from mlatune import table
    from mlatune.schema import Provenance

    table.write(table.build(rows, Provenance.here(spec.sha256)), path)


def _fail(message: str) -> None:
    console.print(f"[red]error:[/] {message}", soft_wrap=True)
    raise typer.Exit(1)


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
