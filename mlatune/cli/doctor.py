"""`mlatune doctor`: what this machine has.

``--json``: ``libraries`` ({name: version or null}), ``gpu_driver``, ``gpus`` ([{"index",
"arch", "name", "cu_count", "memory_bytes"}]), ``dispatch_table`` ({"path", "error"}: what
the dispatcher loads here), ``bundled_tables``: per arch, {"arch", "table" (the file a GPU of
that arch loads, or null), "devices", "error"}, ``backends``: [{"backend", "importable",
"detail", "routes"}].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from mlatune.cli.app import JsonFlag, app, console, device_json, emit_json
from mlatune.cli.frames import device_text
from mlatune.cli.frames import devices as table_devices

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


@app.command()
def doctor(json_out: JsonFlag = False) -> None:
    """Say what this machine has: library versions, GPUs, the dispatch table here and the
    bundled ones, and which route backends import."""
    from mlatune.arch import driver_version, gpu_devices, library_versions

    facts = {"libraries": library_versions(), "gpu_driver": driver_version(),
             "gpus": [{"index": g.index, "arch": g.arch, "name": g.name,
                       "cu_count": g.cu_count, "memory_bytes": g.memory_bytes}
                      for g in gpu_devices()],
             "dispatch_table": _table_here(), "bundled_tables": bundled_tables(),
             "backends": _backends()}
    if json_out:
        emit_json("doctor", facts)
        return
    versions = Table(title="libraries", show_header=False)
    for name, version in facts["libraries"].items():
        versions.add_row(name, version or "[yellow]not installed[/]")
    versions.add_row("gpu driver", facts["gpu_driver"])
    console().print(versions)
    _print_gpus(facts["gpus"])
    _print_table_here(facts["dispatch_table"])
    _print_bundled(facts["bundled_tables"])
    _print_backends(facts["backends"])


def _print_gpus(gpus: list[dict[str, Any]]) -> None:
    if not gpus:
        console().print("[yellow]no GPU found[/]: only CPU-capable routes can run here "
                        "(`mlatune plan` needs no GPU).")
        return
    table = Table(title="GPUs")
    for col in ("index", "arch", "name", "SMs/CUs", "memory"):
        table.add_column(col)
    for g in gpus:
        table.add_row(str(g["index"]), g["arch"], g["name"], str(g["cu_count"]),
                      f"{g['memory_bytes'] / 2**30:.0f} GiB")
    console().print(table)


def _table_here() -> dict[str, Any]:
    """The table the dispatcher loads on this machine, why it serves here (the GPU it was
    measured on, and what differs from this machine), and the accuracy policy it serves."""
    from mlatune.dispatch import Dispatcher

    try:
        d = Dispatcher.from_bundled()
    except (ValueError, OSError) as exc:  # MLATUNE_TABLE names an unusable table
        return {"path": None, "error": str(exc), "measured_on": None, "differences": [],
                "accuracy": None}
    return {"path": d.source or None, "error": None,
            "measured_on": device_json(*d.table_device) if d.table_device else None,
            "differences": list(d.environment_differences), "accuracy": d.accuracy.name}


def bundled_tables() -> list[dict[str, Any]]:
    """Per arch the capability rules know, or a bundled table names: the bundled table a
    GPU of that arch loads (find_table's choice; MLATUNE_TABLE overrides it) and the
    devices it holds."""
    from mlatune.capability import ARCHS
    from mlatune.dispatch import sources  # its bundled_tables_dir is patched in tests
    from mlatune.errors import TableError

    folder = sources.bundled_tables_dir()
    # find_table's naming: <arch>.<ext> or <arch>-<anything>.<ext>
    named = {f.name.split("-")[0].split(".")[0] for f in folder.iterdir()
             if f.name.lower().endswith((".parquet", ".json", ".json.gz", ".csv"))}
    found = []
    for arch in sorted({*ARCHS, *named}):
        chosen = sources.find_table(folder, arch)
        entry = {"arch": arch, "table": chosen.name if chosen else None, "devices": [],
                 "error": None}
        if chosen is not None:
            try:
                entry["devices"] = _devices_in(chosen)
            except TableError as exc:  # doctor reports a damaged bundled table, never dies
                entry["error"] = str(exc)
            except Exception as exc:  # whatever else: still reported, one line
                entry["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        found.append(entry)
    return found


def _devices_in(chosen: Traversable) -> list[dict[str, Any]]:
    """The devices a table file holds, read (and checked) as the dispatcher reads it: a
    damaged file is a TableError naming it, one line."""
    from importlib import resources

    from mlatune import table
    from mlatune.routes import FACTS
    from mlatune.table import winners_map

    with resources.as_file(chosen) as path:
        if winners_map.is_winners_map(path):
            return [device_json(d["arch"], d["device_name"], d["cu_count"])
                    for d in winners_map.read(path, FACTS).document["devices"]]
        return [device_json(*d) for d in table_devices(table.read(
            path, facts=FACTS))]


def _print_bundled(entries: list[dict[str, Any]]) -> None:
    out = Table(title="bundled tables: what a GPU of each arch loads (MLATUNE_TABLE overrides)")
    for col in ("arch", "table", "devices in it"):
        out.add_column(col)
    for e in entries:
        devices = (f"[red]unusable[/]: {e['error']}" if e["error"] else ", ".join(
            device_text((d["arch"], d["device_name"], d["cu_count"])) for d in e["devices"]))
        out.add_row(e["arch"], e["table"] or "none: the dispatcher answers by rule", devices)
    console().print(out)


def _backends() -> list[dict[str, Any]]:
    from mlatune.routes import all_routes, backend_status

    routes = all_routes()
    found = []
    for name in ("torch", "triton", "aiter", "flashmla", "flashinfer"):
        ok, detail = backend_status(name)
        found.append({"backend": name, "importable": ok, "detail": detail,
                      "routes": [r.id for r in routes if r.id.endswith("/" + name)]})
    return found


def _print_backends(backends: list[dict[str, Any]]) -> None:
    out = Table(title="route backends")
    for col in ("backend", "importable", "detail", "routes"):
        out.add_column(col)
    for b in backends:
        out.add_row(b["backend"], "[green]yes[/]" if b["importable"] else "[red]no[/]",
                    b["detail"], ", ".join(b["routes"]) or "-")
    console().print(out)


def _print_table_here(here: dict[str, Any]) -> None:
    text = (f"[red]unusable[/]: {here['error']}" if here["error"]
            else here["path"] or "none (the dispatcher answers by rule)")
    console().print(f"dispatch table here: {text}", highlight=False)
    if here["measured_on"]:
        m = here["measured_on"]
        why = ("; here: " + "; ".join(here["differences"]) + " (its picks may not be the "
               "fastest here)") if here["differences"] else ""
        console().print(f"  measured on {m['arch']} {m['device_name']} ({m['cu_count']} SMs/CUs)"
                        f"{why}; accuracy policy {here['accuracy']}", highlight=False)
