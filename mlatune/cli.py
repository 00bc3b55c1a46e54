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
