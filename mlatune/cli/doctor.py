"""`mlatune doctor`: what this machine has.

``--json``: ``libraries`` ({name: version or null}), ``gpu_driver``, ``gpus`` ([{"index",
"arch", "name", "cu_count", "memory_bytes"}]), ``dispatch_table`` ({"path", "error",
"measured_on", "why" (why this GPU loads that bundled table; null for MLATUNE_TABLE or
none), "other_gpu" (how a table of another GPU model serves: transfer, use or refuse, and
null where it was measured on this one), "differences", "accuracy"}), ``bundled_tables``:
one per bundled table file, {"arch", "table", "model" (the GPU model its name gives, "" for
none), "devices", "error"}, and {"arch", "table": null, ...} for an arch none serves,
``backends``: [{"backend", "importable", "detail", "routes"}].
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
    import os

    from mlatune.arch import current_device
    from mlatune.dispatch import Dispatcher, bundled, loading

    try:
        d = Dispatcher.from_bundled()
    except (ValueError, OSError) as exc:  # MLATUNE_TABLE names an unusable table
        return {"path": None, "error": str(exc), "measured_on": None, "why": None,
                "other_gpu": None, "differences": [], "accuracy": None}
    device = current_device()
    choice = None if os.environ.get(loading.TABLE_ENV) else \
        bundled.table_choice(bundled.bundled_tables_dir(), device.arch, device.name)
    other = d.table_device is not None and device.is_gpu and d.table_device[1] != device.name
    return {"path": d.source or None, "error": None,
            "measured_on": device_json(*d.table_device) if d.table_device else None,
            "why": choice.why if choice and d.source else None,
            "other_gpu": loading.other_gpu_setting() if other else None,
            "differences": list(d.environment_differences), "accuracy": d.accuracy.name}


def bundled_tables() -> list[dict[str, Any]]:
    """Each bundled table a GPU may load, per arch the capability rules know or a table
    names (MLATUNE_TABLE overrides them): the model its name gives (a GPU of that model
    loads it; ``bundled.table_choice``) and the devices it holds; an arch without one, once."""
    from mlatune.capability import ARCHS
    from mlatune.dispatch import bundled  # its bundled_tables_dir is patched in tests
    from mlatune.errors import TableError

    folder = bundled.bundled_tables_dir()
    # table_choice's naming: <arch>.<ext> or <arch>-<model>.<ext>, one entry per model
    named = {f.name.split("-")[0].split(".")[0] for f in folder.iterdir()
             if f.name.lower().endswith((".parquet", ".json", ".json.gz", ".csv"))}
    found = []
    for arch in sorted({*ARCHS, *named}):
        for model in bundled.table_models(folder, arch) or [None]:
            chosen = None if model is None else bundled.find_table(folder, arch, model)
            entry = {"arch": arch, "table": chosen.name if chosen else None, "model": model,
                     "devices": [], "error": None}
            found.append(_read_devices(entry, chosen, TableError))
    return found


def _read_devices(entry: dict[str, Any], chosen: Any, table_error: type) -> dict[str, Any]:
    """``entry`` with the devices the table holds, or the error reading it gave."""
    if chosen is None:
        return entry
    try:
        entry["devices"] = _devices_in(chosen)
    except table_error as exc:  # doctor reports a damaged bundled table, never dies
        entry["error"] = str(exc)
    except Exception as exc:  # whatever else: still reported, one line
        entry["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return entry


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
    out = Table(title="bundled tables: what a GPU of each arch and model loads (MLATUNE_TABLE "
                      "overrides; another model loads the nearest, MLATUNE_OTHER_GPU says how)")
    for col in ("arch", "model", "table", "devices in it"):
        out.add_column(col)
    for e in entries:
        devices = (f"[red]unusable[/]: {e['error']}" if e["error"] else ", ".join(
            device_text((d["arch"], d["device_name"], d["cu_count"])) for d in e["devices"]))
        out.add_row(e["arch"], e["model"] or "", e["table"] or "none: the dispatcher answers "
                    "by rule", devices)
    console().print(out)


def _backends() -> list[dict[str, Any]]:
    from mlatune.routes import all_routes, backend_status
    from mlatune.routes.registry import BACKEND_MODULES

    routes = all_routes()
    found = []
    plugins = sorted({r.id.split("/", 1)[1] for r in routes} - set(BACKEND_MODULES))
    for name in (*BACKEND_MODULES, *plugins):
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
        from mlatune.arch import units_text

        console().print(f"  measured on {m['arch']} {m['device_name']} "
                        f"({units_text(m['arch'], m['cu_count'])}){why}; accuracy policy "
                        f"{here['accuracy']}", highlight=False)
    if here.get("why"):
        console().print(f"  chosen: {here['why']}", highlight=False)
    if here.get("other_gpu"):
        how = {"transfer": "its times carried to this GPU by the cost laws",
               "use": "served as measured", "refuse": "refused"}[here["other_gpu"]]
        console().print(f"  another GPU model's table: {how} (MLATUNE_OTHER_GPU="
                        f"{here['other_gpu']})", highlight=False)
