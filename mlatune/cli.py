"""The `mlatune` command line.

Output: rich tables on a terminal; piped or in CI, the same lines unwrapped and uncut,
so a log or a grep sees whole paths, route ids and numbers.

``--json`` (show, lookup, coverage, diff, plan, merge, doctor) prints one JSON document on
stdout and nothing else there (notes and errors go to stderr; the exit status is the
same as without it). Every document is an object with ``"schema": "mlatune.<command>"``
and ``"version": 1`` (JSON_VERSION: raised only when a field changes meaning or goes
away; new fields may appear). A device is ``{"arch", "device_name", "cu_count"}``, a
problem its key fields (``MLAProblem.key_dict``), a time in microseconds or null where
not measured. The rest, per command:

- show: ``table``, ``devices``, ``rows`` (the table's), ``problems``: every problem
  (``--limit`` shapes the printed table only) as ``{"device", "problem", "winner",
  "winner_params", "winner_us", "runner_up", "runner_up_us", "margin", "routes",
  "ok_routes"}``; margin = runner-up time / winner time - 1; no ok row: winner null.
- lookup: ``table``, ``table_device``, ``problem``, ``key``, ``route``, ``params``,
  ``source`` (table, nearest or rule), ``measured_key`` (null for a rule), ``time_us``,
  ``why`` (lines), ``skipped_routes`` ({route: rows}).
- coverage: ``spec``, ``table`` (null: rules only), ``require``, ``problems``,
  ``answered``: {source: {"problems", "routes": {route: count}}} for table, nearest and
  rule; ``below_require``: [{"key", "source", "route"}]; ``ok``.
- diff: ``a``, ``b``, ``devices``: {"a", "b", "common"}, ``comparable`` (a device in
  common), ``counts``: {"same", "changed", "only_a", "only_b"}, ``changed``: every
  changed winner as {"device", "problem", "a", "b", "change"}, with "a" and "b"
  {"route", "params", "time_us"} and change = B's time / A's - 1.
- plan: ``spec``, ``device``, ``problems``, ``probe_applied`` (false: rules only),
  ``routes``: [{"route", "viable", "refused", "top_refusal": {"reason", "count"} or
  null}], ``groups``: problems differing only in batch and kv_len with the same
  verdicts, [{"problem" (bucket fields), "batches", "kv_lens", "viable": [route],
  "refused": {route: reason}}].
- merge: ``out``, ``rows``, ``problems`` and ``devices`` of the joined table,
  ``spec_sha256`` (the specs joined, sorted), ``tables``: every input as {"path",
  "rows", "problems", "devices", "spec_sha256" (list), "shard" ("I/N" from the journal
  beside it, or null)}; ``missing_shards``: per sharded sweep with shares not given,
  {"spec_sha256", "count", "missing": [I]}.
- doctor: ``libraries`` ({name: version or null}), ``gpu_driver``, ``gpus``
  ([{"index", "arch", "name", "cu_count", "memory_bytes"}]), ``dispatch_table``
  ({"path", "error"}: what the dispatcher loads here), ``bundled_tables``: per arch,
  {"arch", "table" (the file a GPU of that arch loads, or null), "devices", "error"},
  ``backends``: [{"backend", "importable", "detail", "routes"}].

Exit status: 0 ok; 1 a check failed (coverage --require unmet, diff of tables that share
no device) or an error (one red line on stderr); 2 a usage error typer refuses.

Every file a command writes (sweep: the table, its .csv and the journal; export, upgrade,
merge, plan --out; report --out's folder) is checked before any work: a directory in the way, a
parent that is not a writable directory or a read-only file system is refused at once
(exit 1), not after an hour of sweeping. Every error of mlatune.errors (SpecError,
JournalError, TableError, OutputError) ends as one line and exit 1, never a traceback.
"""

from __future__ import annotations

import json
import math
import re
import sys
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

import mlatune

if TYPE_CHECKING:  # the commands import these where they run: --help stays light
    from importlib.resources.abc import Traversable

    import pandas as pd
    from rich.progress import ProgressColumn

    from mlatune.arch import DeviceInfo
    from mlatune.dispatch import Choice, Dispatcher
    from mlatune.problem import MLAProblem
    from mlatune.sweep.planning import PlanRow
    from mlatune.sweep.records import Record
    from mlatune.sweep.spec import SweepSpec
    from mlatune.sweep.stages import SweepSummary

Device = tuple[str, str, int]  # (arch, device_name, cu_count), as tables key them


class _OneLineErrors(typer.core.TyperGroup):
    """The last net under every command: an error of mlatune.errors (a bad spec, a
    damaged journal or table, an output that cannot be written) that a command did not
    turn into its own line still ends as one line on stderr and exit 1, never a
    traceback. Commands catch what they can say more about (and a hint) first."""

    def invoke(self, ctx):
        from mlatune.errors import JournalError, OutputError, SpecError, TableError

        try:
            return super().invoke(ctx)
        except (SpecError, JournalError, TableError, OutputError) as exc:
            _fail(str(exc))


app = typer.Typer(
    cls=_OneLineErrors,
    help="Autotune MLA attention routes per shape and ship the winners as a dispatch table. "
         "Exit status: 0 ok; 1 a check failed or an error (one line on stderr); 2 a usage "
         "error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: a flag shows no type tag (rich mode tags even --help "<bool>"), fixed
    # value sets show as <a|b|c>, and a CI log gets no box drawing.
    rich_markup_mode=None,
)

# Piped or in CI no line is wrapped or cut: wider than any line we print.
UNWRAPPED_WIDTH = 100_000
JSON_VERSION = 1


def _console(stderr: bool = False) -> Console:
    """Rich as usual on a terminal; otherwise lines as long as their content. Decided by
    the stream itself: FORCE_COLOR makes rich call a CI log a terminal, 80 columns wide."""
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: not a terminal
        tty = False
    if tty:
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=UNWRAPPED_WIDTH, soft_wrap=True)


console = _console()
err_console = _console(stderr=True)


def _use_consoles() -> None:
    """Fit both consoles to where output goes now (tests run many invocations, each
    with its own captured streams)."""
    global console, err_console
    console, err_console = _console(), _console(stderr=True)


# Fixed value sets: --help lists them and typer refuses others (exit 2). Spelled out here
# because --help must stay fast and their owners import torch (1.4 s);
# tests/test_cli_usability.py pins each to its owner (capability.ARCHS and arch.CPU_ARCH,
# problem.DTYPES, problem.Phase, table.FORMATS).
def _choices(name: str, values: tuple[str, ...]) -> Any:
    return Enum(name, [(v, v) for v in values], type=str)


ARCH_NAMES = ("gfx942", "gfx950", "gfx1250", "sm_90", "sm_100")
Arch = _choices("Arch", ARCH_NAMES)
DeviceArch = _choices("DeviceArch", (*ARCH_NAMES, "cpu"))  # a sweep's, so a table's too
Dtype = _choices("Dtype", ("bf16", "fp16", "fp8_e4m3fn", "fp8_e4m3fnuz"))
Phase = _choices("Phase", ("decode", "prefill"))
SOURCES = ("table", "predicted", "nearest", "rule")  # how the dispatcher answers, best first
UNCERTAIN = 0.10  # a predicted answer's expected error past which coverage lists it
Source = _choices("Source", SOURCES)
Format = _choices("Format", ("parquet", "csv", "json"))


def _value(choice: Enum | None) -> str | None:
    return None if choice is None else choice.value


JsonFlag = Annotated[bool, typer.Option(
    "--json", help='Print one JSON document on stdout instead: {"schema": '
                   '"mlatune.<command>", "version": 1, ...} (shapes in mlatune/cli.py).')]


def _emit_json(command: str, body: dict[str, Any]) -> None:
    document = {"schema": f"mlatune.{command}", "version": JSON_VERSION, **body}
    sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")


def _num(value: Any) -> float | None:
    """A number for JSON: NaN (not measured) becomes null."""
    return None if value is None or (isinstance(value, float) and math.isnan(value)) \
        else float(value)


def _plain(value: Any) -> Any:
    """numpy and pandas scalars as the Python values JSON knows."""
    return value.item() if hasattr(value, "item") else value


def _device(arch: str, device_name: str, cu_count: int) -> dict[str, Any]:
    return {"arch": str(arch), "device_name": str(device_name), "cu_count": int(cu_count)}


def _version(value: bool) -> None:
    if value:
        console.print(f"mlatune {mlatune.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """mlatune: measure every MLA route per shape; ship the winners as a table."""
    _use_consoles()


# Specs: a file, or a bundled spec by name --------------------------------------

def _bundled_specs() -> list[str]:
    from mlatune.sweep import spec as specs

    folder = specs.bundled_spec_path().parent
    return sorted(p.stem for p in folder.glob("*.toml"))


def _spec_path(name: str | None) -> Path:
    """SPEC as given: a file; a bare name (no folder, no suffix but .toml) not found as a
    file is a bundled spec, `sweeps/<name>.toml` in the package."""
    from mlatune.sweep import spec as specs

    if name is None:
        return specs.bundled_spec_path()
    path = Path(name)
    if path.exists():
        return path
    bundled = _bundled_specs()
    if path.parent == Path(".") and path.suffix in ("", ".toml") and path.stem in bundled:
        return specs.bundled_spec_path(f"{path.stem}.toml")
    _fail(f"{name}: no such spec file, nor a bundled spec of that name "
          f"(bundled: {', '.join(bundled)})")


def _load_spec(name: str | None, gpu: bool) -> tuple[Path, SweepSpec]:
    from mlatune.sweep import spec as specs

    path = _spec_path(name)
    try:
        return path, specs.load(path, gpu=gpu)
    except specs.SpecError as exc:
        _fail(str(exc))


# doctor ---------------------------------------------------------------------------

@app.command()
def doctor(json_out: JsonFlag = False) -> None:
    """Say what this machine has: library versions, GPUs, the dispatch table here and the
    bundled ones, and which route backends import."""
    from mlatune.arch import driver_version, gpu_devices, library_versions

    facts = {"libraries": library_versions(), "gpu_driver": driver_version(),
             "gpus": [{"index": g.index, "arch": g.arch, "name": g.name,
                       "cu_count": g.cu_count, "memory_bytes": g.memory_bytes}
                      for g in gpu_devices()],
             "dispatch_table": _table_here(), "bundled_tables": _bundled_tables(),
             "backends": _backends()}
    if json_out:
        _emit_json("doctor", facts)
        return
    versions = Table(title="libraries", show_header=False)
    for name, version in facts["libraries"].items():
        versions.add_row(name, version or "[yellow]not installed[/]")
    versions.add_row("gpu driver", facts["gpu_driver"])
    console.print(versions)
    _print_gpus(facts["gpus"])
    here = facts["dispatch_table"]
    text = (f"[red]unusable[/]: {here['error']}" if here["error"]
            else here["path"] or "none (the dispatcher answers by rule)")
    console.print(f"dispatch table here: {text}", highlight=False)
    _print_bundled(facts["bundled_tables"])
    backends = Table(title="route backends")
    for col in ("backend", "importable", "detail", "routes"):
        backends.add_column(col)
    for b in facts["backends"]:
        backends.add_row(b["backend"], "[green]yes[/]" if b["importable"] else "[red]no[/]",
                         b["detail"], ", ".join(b["routes"]) or "-")
    console.print(backends)


def _print_gpus(gpus: list[dict[str, Any]]) -> None:
    if not gpus:
        console.print("[yellow]no GPU found[/]: only CPU-capable routes can run here "
                      "(`mlatune plan` needs no GPU).")
        return
    table = Table(title="GPUs")
    for col in ("index", "arch", "name", "SMs/CUs", "memory"):
        table.add_column(col)
    for g in gpus:
        table.add_row(str(g["index"]), g["arch"], g["name"], str(g["cu_count"]),
                      f"{g['memory_bytes'] / 2**30:.0f} GiB")
    console.print(table)


def _table_here() -> dict[str, str | None]:
    from mlatune.dispatch import Dispatcher

    try:
        return {"path": Dispatcher.from_bundled().source or None, "error": None}
    except (ValueError, OSError) as exc:  # MLATUNE_TABLE names an unusable table
        return {"path": None, "error": str(exc)}


def _bundled_tables() -> list[dict[str, Any]]:
    """Per arch the capability rules know, or a bundled table names: the bundled table a
    GPU of that arch loads (find_table's choice; MLATUNE_TABLE overrides it) and the
    devices it holds."""
    from mlatune.capability import ARCHS
    from mlatune.dispatch.dispatcher import bundled_tables_dir, find_table  # patched there in tests
    from mlatune.errors import TableError

    folder = bundled_tables_dir()
    # find_table's naming: <arch>.<ext> or <arch>-<anything>.<ext>
    named = {Path(f.name).stem.split("-")[0] for f in folder.iterdir()
             if Path(f.name).suffix.lower() in (".parquet", ".json", ".csv")}
    found = []
    for arch in sorted({*ARCHS, *named}):
        chosen = find_table(folder, arch)
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
    from mlatune.table import winners_map

    with resources.as_file(chosen) as path:
        if path.suffix.lower() == ".json":
            return [_device(d["arch"], d["device_name"], d["cu_count"])
                    for d in winners_map.read(path).document["devices"]]
        return [_device(*d) for d in _devices(table.read(path))]


def _print_bundled(entries: list[dict[str, Any]]) -> None:
    out = Table(title="bundled tables: what a GPU of each arch loads (MLATUNE_TABLE overrides)")
    for col in ("arch", "table", "devices in it"):
        out.add_column(col)
    for e in entries:
        devices = (f"[red]unusable[/]: {e['error']}" if e["error"] else ", ".join(
            _device_text((d["arch"], d["device_name"], d["cu_count"])) for d in e["devices"]))
        out.add_row(e["arch"], e["table"] or "none: the dispatcher answers by rule", devices)
    console.print(out)


def _backends() -> list[dict[str, Any]]:
    from mlatune.routes import all_routes, backend_status

    routes = all_routes()
    found = []
    for name in ("torch", "triton", "aiter", "flashmla", "flashinfer"):
        ok, detail = backend_status(name)
        found.append({"backend": name, "importable": ok, "detail": detail,
                      "routes": [r.id for r in routes if r.id.endswith("/" + name)]})
    return found


# sweep ----------------------------------------------------------------------------

def _rate_eta_column() -> ProgressColumn:
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateEta(ProgressColumn):
        """This invocation's mean rate (candidates finished here over the time since the
        bar started) and the time left at it: steady where candidates take minutes, when
        rich's 30 s window would often hold no sample at all."""

        def render(self, task) -> Text:
            ran = task.fields.get("ran", 0)
            elapsed = task.finished_time or task.elapsed or 0.0
            if not ran or not elapsed:
                return Text("- cand/s, ETA -")
            rate = ran / elapsed
            return Text(f"{rate:.2f} cand/s, ETA {_clock(task.remaining / rate)}")

    return RateEta()


def _clock(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


class _SweepProgress:
    """Rich progress for a sweep: candidates that run (refusals are said once, apart),
    failures so far, rate and ETA."""

    def __init__(self, progress):
        self.progress = progress
        self.task = None
        self.failures = 0
        self.ran = 0

    def refused(self, count: int) -> None:
        if count:
            self.progress.console.print(
                f"{count} (problem, route) pairs refused by a rule: recorded, not run",
                highlight=False)

    def started(self, total: int, already_done: int, what: str = "sweep") -> None:
        self.failures = self.ran = 0
        self.task = self.progress.add_task(what, total=total, completed=already_done,
                                           failures=0, ran=0)

    def finished(self, record: Record) -> None:
        from mlatune.table.schema import Status

        if record.status not in (Status.OK, Status.UNSUPPORTED, Status.CHECKED):
            self.failures += 1
        self.ran += 1
        self.progress.update(self.task, advance=1, failures=self.failures, ran=self.ran)


@app.command()
def sweep(
    spec_name: Annotated[str | None, typer.Argument(
        metavar="SPEC", help="Sweep spec: a TOML file, or a bundled spec's name "
                               "(smoke, h200, deepseek-v3-tp8, ...). Default: smoke.")] = None,
    arch: Annotated[DeviceArch | None, typer.Option(
        help="The arch this sweep is for; stops if this machine's device differs.")] = None,
    out: Annotated[str | None, typer.Option(
        help="Table path, .parquet or .csv (both are written, with the journal beside "
             "them). Default: runs/<spec>-<arch>.parquet")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue the sweep in the journal. Without --fresh a rerun does "
                         "so anyway (refusing a journal of another spec or device); kept "
                         "for scripts.")] = False,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Start over. The earlier table and journal are moved aside, not "
                        "deleted: <out>.<UTC time>.parquet, .csv and .journal.jsonl.")] = False,
    gpus: Annotated[int, typer.Option(
        min=1, help="Worker processes, one per GPU. With 2 or more, DCP problems of a size up "
                    "to it are then also measured for real, across that many GPUs (gloo "
                    "processes without a GPU).")] = 1,
    dcp_top_k: Annotated[int | None, typer.Option(
        min=0, help="With --gpus N >= 2: the routes per DCP problem measured across GPUs, "
                    "the fastest in the one-GPU pass (default: the spec's dcp_top_k, else "
                    "3; 0: none).")] = None,
    dcp_graph: Annotated[bool, typer.Option(
        "--dcp-graph", help="With --gpus N >= 2 on GPUs: time each DCP step across GPUs "
                            "from a CUDA graph of the whole step (NCCL collectives "
                            "captured), not eagerly; the table's timer says which.")] = False,
    timeout: Annotated[float, typer.Option(
        min=0.1, help="Seconds one candidate may take.")] = 300.0,
    compile_workers: Annotated[int | None, typer.Option(
        min=0, help="Processes per GPU that compile kernels before timing starts (default: "
                    "the spare CPU cores, at most 8; 0: none).")] = None,
    routes: Annotated[str | None, typer.Option(
        help="Comma-separated route ids (default: every viable).")] = None,
    shard: Annotated[str | None, typer.Option(
        metavar="I/N",
        help="Run share I of N (0 <= I < N, as SLURM_ARRAY_TASK_ID under --array=0-(N-1)): "
             "the problems whose key hashes to I mod N. One share per machine, then "
             "`mlatune merge` joins the tables. Default --out: "
             "runs/<spec>-<arch>.shard-I-of-N.parquet")] = None,
    refine: Annotated[float | None, typer.Option(
        metavar="SECONDS", min=0.0,
        help="After the grid: measure the points between its grid points whose answer the "
             "dispatcher is least sure of (predicted far from measured points, neighbours "
             "disagreeing), until their estimated worker time reaches SECONDS; the table "
             "grows to hold them.")] = None,
) -> None:
    """Measure every viable route for each problem of a spec and write a dispatch table.

    A rerun continues where the last one stopped (a kill or Ctrl-C loses only what was in
    flight); --fresh starts over. It prints which it did. With --shard I/N only one share
    of the spec's problems runs; `mlatune merge OUT TABLE...` joins the shares' tables.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from mlatune.arch import current_device, gpu_devices
    from mlatune.sweep import stages
    from mlatune.sweep.candidates import Shard
    from mlatune.sweep.dcp_graph import REFUSAL

    if resume and fresh:
        raise typer.BadParameter("--resume and --fresh exclude each other",
                                 param_hint="'--fresh'")
    share = None
    if shard is not None:
        try:
            share = Shard.parse(shard)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--shard'") from None
    device = current_device()
    if arch is not None and arch.value != device.arch:
        _fail(f"--arch {arch.value} but this machine's device is {device.arch} ({device.name}). "
              f"To see which routes {arch.value} would run without its GPU: "
              f"mlatune plan SPEC --arch {arch.value}")
    if device.is_gpu and gpus > len(gpu_devices()):
        _fail(f"--gpus {gpus} but only {len(gpu_devices())} GPU(s) are visible")
    if dcp_graph and not device.is_gpu:
        _fail(f"--dcp-graph: {REFUSAL}")
    path, spec = _load_spec(spec_name, gpu=device.is_gpu)
    only = [r.strip() for r in routes.split(",") if r.strip()] if routes else None
    _check_routes(only, (*spec.routes, *spec.max_params), path)
    table_path = Path(out) if out else stages.default_table_path(spec, device, share)
    if table_path.suffix not in (".parquet", ".csv"):
        _fail(f"--out {out}: name the table .parquet or .csv (both are written)")
    table_path = table_path.with_suffix(".parquet")
    _check_outputs(table_path, table_path.with_suffix(".csv"), stages.journal_path(table_path))
    if refine is not None:
        if fresh or share:
            _fail("--refine adds points to a measured grid: not with --fresh or --shard")
        spec = _refined(spec, table_path, device, refine)
    if not device.is_gpu:
        console.print("[yellow]no GPU[/]: running the CPU-capable routes on the spec's CPU "
                      "grid; wall-clock timings, not for dispatch.")
    console.print(f"spec {path} ({len(spec.problems)} problems, "
                  f"{len(spec.skipped)} invalid combinations skipped) on {device.arch} "
                  f"({device.name})", highlight=False)
    settings = stages.SweepSettings(
        spec, path, device, table_path, gpus=gpus, timeout_s=timeout,
        only=tuple(only) if only else None, compile_workers=compile_workers,
        dcp_top_k=dcp_top_k, dcp_graph=dcp_graph, shard=share, fresh=fresh)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               _rate_eta_column(), TextColumn("[red]{task.fields[failures]} failed"),
               TimeElapsedColumn())
    try:
        with Progress(*columns, console=console) as progress:
            summary = stages.run_sweep(settings, _SweepProgress(progress), _say)
    except stages.SweepError as exc:
        _fail(str(exc))
    _print_sweep_summary(summary)
    console.print(f"table: {summary.table_path} (and {summary.table_path.with_suffix('.csv')}); "
                  f"journal: {summary.journal_path}", highlight=False)


def _say(text: str) -> None:
    console.print(text, highlight=False)


def _refined(spec: SweepSpec, table_path: Path, device: DeviceInfo, budget_s: float
             ) -> SweepSpec:
    """The spec with, for problems, the points ``mlatune.sweep.refine`` proposes."""
    from mlatune.sweep import refine as refinement
    from mlatune.sweep import stages

    try:
        spec, chosen = stages.refined(spec, table_path, device, budget_s)
    except stages.SweepError as exc:
        _fail(str(exc))
    seconds = sum(r.seconds for r in chosen)
    console.print(f"refine: {len(chosen)} point(s) between the grid's, about {seconds:.0f} s "
                  f"of worker time (budget {budget_s:g} s); the least certain first:",
                  highlight=False)
    for r in chosen[:10]:
        sure = "no prediction" if r.uncertainty >= refinement.UNPREDICTED \
            else f"+-{r.uncertainty:.0%}"
        console.print(f"  {sure}: {r.problem.key} (now {r.route_id})", highlight=False)
    if not chosen:
        console.print("nothing to measure within the budget")
        raise typer.Exit(0)
    return spec


def _check_routes(only: list[str] | None, named: tuple[str, ...], spec_path: Path) -> None:
    """Every route named on the command line or in the spec exists, before anything is
    written."""
    from mlatune.routes import get

    for r in [*(only or []), *named]:
        try:
            get(r)
        except KeyError as exc:
            _fail(f"{exc.args[0]}" + ("" if only and r in only else f" (named in {spec_path})"))


def _print_sweep_summary(summary: SweepSummary) -> None:
    """The bar's numbers again: candidates run now and found in the journal; statuses of
    the candidates (refusals apart: they ran nothing); where the workers' time went."""
    from mlatune.table.schema import Status

    result, wall = summary.result, summary.wall_s
    statuses = {s.value: n for s, n in result.counts.items() if s is not Status.UNSUPPORTED}
    fallbacks = f" + {result.fallbacks} reference fallbacks" if result.fallbacks else ""
    rate = result.ran / wall if wall else 0
    console.print(f"sweep {summary.spec.name}: {result.planned} candidates{fallbacks}; "
                  f"{result.ran} run now in {wall:.1f}s ({rate:.2f}/s), "
                  f"{result.resumed} found in the journal", highlight=False)
    if result.measured_dcp:
        console.print(f"DCP steps measured across processes now: {result.measured_dcp} "
                      f"(route and scheme per problem; in the table as dcp_timing 'measured')",
                      highlight=False)
    counts = Table()
    counts.add_column("status")
    counts.add_column("candidates", justify="right")
    for status, n in sorted(statuses.items()):
        counts.add_row(status, str(n))
    if result.refused:
        counts.add_section()
        counts.add_row("refused by a rule (not run)", str(result.refused))
    console.print(counts)
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


# plan -----------------------------------------------------------------------------

@app.command()
def plan(
    spec_name: Annotated[str, typer.Argument(
        metavar="SPEC", help="Sweep spec: a TOML file or a bundled spec's name.")],
    arch: Annotated[Arch, typer.Option(
        help="The arch to plan for. Its GPU need not be here.")],
    out: Annotated[str | None, typer.Option(
        help="Also write the plan as CSV: one row per problem and route, with its status "
             "and reason.")] = None,
    detail: Annotated[bool, typer.Option(
        "--detail", help="Also print the verdicts per problem (problems differing only in "
                         "batch and kv_len share a row).")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Which routes a sweep would run on ARCH, and why the others would not: a summary per
    route; the verdicts per problem with --detail or in the --out CSV."""
    from mlatune import capability
    from mlatune.sweep import planning

    device = capability.device_for_arch(arch.value)
    if out:
        _check_outputs(Path(out), make_parents=False)
    path, spec = _load_spec(spec_name, gpu=True)
    try:
        rows = planning.plan_rows(spec, device)
    except KeyError as exc:  # a route id in the spec that is not registered
        _fail(f"{path}: {exc.args[0]}")
    if out:
        try:
            planning.write_csv(rows, device, Path(out))
        except OSError as exc:  # OutputError: one line naming the file
            _fail(str(exc))
    if json_out:
        _emit_json("plan", planning.as_json(rows, device, spec))
        return
    _print_plan(arch.value, device, path, spec, rows, detail)
    if out:
        console.print(f"plan table: {out} ({len(rows)} rows)", highlight=False)


def _print_plan(arch: str, device: DeviceInfo, path: Path, spec: SweepSpec,
                rows: list[PlanRow], detail: bool) -> None:
    from mlatune.sweep import planning

    cus = f"{device.cu_count} CUs" if device.cu_count else "CU count unknown"
    console.print(f"plan for {arch} ({device.name}, {cus}): {len(spec.problems)} problems from "
                  f"{path}, {len({r.route for r in rows})} routes", highlight=False)
    console.print("[yellow]capability rules only[/]: the probe of the installed libraries "
                  "(AITER's entry points, kernel manifest and native 24-head build; FlashMLA, "
                  "FlashInfer, Triton) was not applied; `mlatune doctor` and a sweep on the "
                  "target machine apply it.", soft_wrap=True)
    groups = planning.grouped(rows)
    if detail:
        table = Table(title="routes per problem (problems differing only in batch/kv_len "
                            "share a row)")
        for col in ("problem", "batch x kv_len", "viable", "refused: why"):
            table.add_column(col)
        for group in groups:
            table.add_row(
                planning.describe(group.problem),
                f"{sorted(group.batches)} x {sorted(group.kv_lens)}",
                "\n".join(r.route for r in group.rows if r.viable) or "[red]none[/]",
                planning.refusals_text(group.rows))
        console.print(table)
    summary = Table(title=f"per route on {arch}")
    for col in ("route", "viable", "refused", "most frequent refusal"):
        summary.add_column(col)
    for s in planning.route_summary(rows):
        summary.add_row(s.route, str(s.viable), str(s.refused), s.top_text)
    console.print(summary)
    if not detail:
        console.print(f"per problem ({len(groups)} groups): --detail prints them, --out FILE "
                      f"writes one CSV row per problem and route", highlight=False)


# Tables: show, lookup, coverage, export, validate, upgrade, diff, report -----------
# Every failure here is one red line on stderr and exit code 1, never a traceback:
# these commands read files from elsewhere, and a damaged file is an input error.

# The dispatcher's refusal of a table for another arch suggests its Python argument too;
# on the command line only the option means anything.
_PYTHON_ARCH_HINT = re.compile(r"pass allow_arch=(['\"])([^'\"]+)\1 \(CLI: --arch [^)]*\)")


def _fail(message: str) -> NoReturn:
    from rich.markup import escape

    message = _PYTHON_ARCH_HINT.sub(r"pass --arch \2", " ".join(message.split()))
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
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


def _check_outputs(*paths: Path, make_parents: bool = True) -> None:
    """Refuse, before any work, an output that could not be written at the end: one line
    (OutputError's) and exit 1. ``make_parents``: the writer makes missing folders (a
    sweep, export, upgrade); otherwise the folder must exist (plan --out)."""
    from mlatune.errors import OutputError
    from mlatune.table.outputs import check_writable_output

    for path in paths:
        try:
            if not make_parents and not path.parent.is_dir():
                why = "not a directory" if path.parent.exists() else "no such directory"
                raise OutputError(f"cannot write {path}: {path.parent}: {why}")
            check_writable_output(path)
        except OutputError as exc:
            _fail(str(exc))


def _check_output_dir(folder: Path, inside: str) -> None:
    """``_check_outputs`` for a folder of outputs (made when missing): ``folder`` is or
    can become a directory this process writes ``inside`` (one of its files) in."""
    if folder.exists() and not folder.is_dir():
        _fail(f"{folder}: not a directory; name a directory to write {inside} and the rest in")
    _check_outputs(folder / inside)


def _note(text: str) -> None:
    err_console.print(f"[yellow]note:[/] {text}", soft_wrap=True, highlight=False)


def _read_table(path: Path):
    from mlatune import table

    return table.read(path)


def _warn_unregistered(frame) -> None:
    from mlatune.routes import all_routes

    known = {r.id for r in all_routes()}
    missing = sorted(set(frame["route"].tolist()) - known)
    if missing:
        _note(f"routes not registered here (the dispatcher skips their rows): "
              f"{', '.join(missing)}")


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


def _devices(frame: pd.DataFrame) -> list[Device]:
    from mlatune.table.schema import DEVICE_COLUMNS

    found = frame[list(DEVICE_COLUMNS)].drop_duplicates()
    return sorted((str(a), str(n), int(c)) for a, n, c in found.itertuples(index=False))


def _devices_title(frame: pd.DataFrame) -> tuple[str, bool]:
    devices = {(a, n) for a, n, _ in _devices(frame)}
    if len(devices) == 1:
        return " ".join(next(iter(devices))), False
    return f"{len(devices)} devices", True


def _device_text(device: Device) -> str:
    return f"{device[0]} {device[1]} ({device[2]} SMs/CUs)"


def _row_problem(row: pd.Series) -> dict[str, Any]:
    from mlatune.problem import KEY_FIELDS

    return {name: _plain(row[name]) for name in KEY_FIELDS}


def _columns(out: Table, names: tuple[str, ...], numeric: tuple[str, ...]) -> None:
    # Fold rather than elide: a narrow terminal wraps a cell, it never hides a value.
    for name in names:
        out.add_column(name, justify="right" if name in numeric else "left", overflow="fold",
                       min_width=12 if name == "problem" else None)


def _us(value: float) -> str:
    return "-" if value != value else f"{value:.4g}"  # NaN -> "-"


LimitOption = Annotated[int, typer.Option(
    help="Rows to print (0: all); --json holds every one.")]


@app.command()
def show(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE", help="Parquet or CSV table.")],
    limit: LimitOption = 50,
    json_out: JsonFlag = False,
) -> None:
    """Per problem: the winning route, the runner-up and the margin between them."""
    from mlatune import table

    with _one_line_errors(str(table_path)):
        frame = _read_table(table_path)
        rows = table.summary(frame)
    if json_out:
        _emit_json("show", {"table": str(table_path),
                            "devices": [_device(*d) for d in _devices(frame)],
                            "rows": len(frame),
                            "problems": [_show_entry(r) for _, r in rows.iterrows()]})
        _warn_unregistered(frame)
        return
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


def _show_entry(row: pd.Series) -> dict[str, Any]:
    """One problem of `show --json`: margin is the runner-up's time / the winner's - 1."""
    return {"device": _device(row["arch"], row["device_name"], row["cu_count"]),
            "problem": _row_problem(row),
            "winner": row["winner"] or None,
            "winner_params": json.loads(row["winner_params"]) if row["winner"] else None,
            "winner_us": _num(_plain(row["winner_us"])),
            "runner_up": row["runner_up"] or None,
            "runner_up_us": _num(_plain(row["runner_up_us"])),
            "margin": _num(_plain(row["margin"])),
            "routes": int(row["routes"]), "ok_routes": int(row["ok_routes"])}


ArchOption = Annotated[DeviceArch | None, typer.Option(
    help="Plan for this arch (the table's) instead of this machine's.")]


@app.command()
def lookup(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE",
                                               help="Parquet, CSV or JSON winners table.")],
    heads: Annotated[int, typer.Option(help="Query heads per rank.")],
    batch: Annotated[int, typer.Option(help="Requests in the batch.")],
    kv_len: Annotated[int, typer.Option(help="KV tokens per request.")],
    qlen: Annotated[int, typer.Option(help="Query tokens per request (1: decode).")] = 1,
    kv_dtype: Annotated[Dtype, typer.Option(help="KV cache dtype.")] = Dtype.bf16,
    q_dtype: Annotated[Dtype | None, typer.Option(
        help="Query dtype (default: bf16 for an fp8 cache, else the cache's).")] = None,
    dcp: Annotated[int, typer.Option(help="Decode-context-parallel size.")] = 1,
    page_size: Annotated[int, typer.Option(help="KV cache page size.")] = 64,
    causal: Annotated[bool, typer.Option("--causal/--no-causal")] = True,
    phase: Annotated[Phase, typer.Option(help="The attention phase.")] = Phase.decode,
    arch: ArchOption = None,
    explain: Annotated[bool, typer.Option(
        "--explain", help="List every route's prediction behind a predicted answer (by "
                          "default the three fastest).")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Which route the dispatcher picks for one problem, and why."""
    from mlatune.dispatch import Dispatcher
    from mlatune.problem import FP8_DTYPES, MLAProblem

    kv = kv_dtype.value
    q = _value(q_dtype) or ("bf16" if kv in FP8_DTYPES else kv)
    with _one_line_errors(str(table_path)):
        problem = MLAProblem(phase=phase.value, num_heads=heads, qlen=qlen, q_dtype=q,
                             kv_dtype=kv, batch=batch, kv_len=kv_len, dcp_size=dcp,
                             page_size=page_size, causal=causal)
        dispatcher = Dispatcher.load(table_path, allow_arch=_value(arch))
        choice, notes = dispatcher.explain(problem, predictions=None if explain else 3)
    if dispatcher.skipped_routes:
        _note("skipped rows of routes not registered here: " + ", ".join(
            f"{r} ({n})" for r, n in sorted(dispatcher.skipped_routes.items())))
    if json_out:
        _emit_json("lookup", _lookup_json(table_path, dispatcher, problem, choice, notes))
        return
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


def _lookup_json(table_path: Path, dispatcher: Dispatcher, problem: MLAProblem,
                 choice: Choice, notes: list[str]) -> dict[str, Any]:
    return {"table": str(table_path),
            "table_device": _device(*dispatcher.table_device) if dispatcher.table_device
            else None,
            "problem": problem.key_dict(), "key": problem.key,
            "route": choice.route_id, "params": dict(choice.params), "source": choice.source,
            "measured_key": choice.key or None, "time_us": _num(choice.time_us),
            "why": list(notes), "skipped_routes": dict(dispatcher.skipped_routes)}


@app.command()
def coverage(
    spec_name: Annotated[str, typer.Argument(
        metavar="SPEC", help="Sweep spec whose problems to answer: a TOML file or a bundled "
                             "spec's name.")],
    table_path: Annotated[Path | None, typer.Option(
        "--table", help="Parquet, CSV or JSON winners table. Default: the one the dispatcher "
                        "loads here (bundled for this device, or MLATUNE_TABLE).")] = None,
    arch: ArchOption = None,
    require: Annotated[Source, typer.Option(
        help="Exit 1 unless every problem is answered this well: table (measured), "
             "predicted, nearest or rule.")] = Source.rule,
    json_out: JsonFlag = False,
) -> None:
    """How the dispatcher answers every problem of a spec: measured, predicted from the
    measured points of its bucket, nearest point or rule; and which predictions are
    uncertain (expected error above 10%: far from measured points, or neighbours that
    disagree), where measuring more would pay (`mlatune sweep` of those shapes).

    Exit status: 0 every problem is answered at least as well as --require; 1 some problem
    is not, or the spec or table cannot be used; 2 a usage error.
    """
    from collections import Counter

    from mlatune.dispatch import Dispatcher, device_for_arch

    require = require.value
    path, spec = _load_spec(spec_name, gpu=True)
    with _one_line_errors(str(table_path or path)):
        if table_path is not None:
            dispatcher = Dispatcher.load(table_path, allow_arch=_value(arch))
        else:
            dispatcher = Dispatcher.from_bundled(device_for_arch(arch.value) if arch else None)
        choices = [(p, dispatcher.select(p)) for p in spec.problems]
    by_route = Counter((c.source, c.route_id) for _, c in choices)
    answered = {s: dict(sorted((r, n) for (s2, r), n in by_route.items() if s2 == s))
                for s in SOURCES}
    worse = [(p, c) for p, c in choices if SOURCES.index(c.source) > SOURCES.index(require)]
    uncertain = sorted(((p, c) for p, c in choices if c.uncertainty > UNCERTAIN),
                       key=lambda pc: -pc[1].uncertainty)
    if json_out:
        _emit_json("coverage", {
            "spec": str(path), "table": dispatcher.source or None, "require": require,
            "problems": len(choices),
            "answered": {s: {"problems": sum(routes.values()), "routes": routes}
                         for s, routes in answered.items()},
            "below_require": [{"key": p.key, "source": c.source, "route": c.route_id}
                              for p, c in worse],
            "uncertain": [{"key": p.key, "route": c.route_id, "uncertainty": c.uncertainty}
                          for p, c in uncertain],
            "ok": not worse})
    else:
        _print_coverage(path, dispatcher, len(choices), answered, worse, uncertain)
    if worse:
        _fail(f"{len(worse)} problem(s) answered by worse than --require {require}"
              + (" (first 20 above)" if len(worse) > 20 and not json_out else ""))


def _print_coverage(path: Path, dispatcher: Dispatcher, n: int,
                    answered: dict[str, dict[str, int]],
                    worse: list[tuple[MLAProblem, Choice]],
                    uncertain: list[tuple[MLAProblem, Choice]]) -> None:
    console.print(f"table: {dispatcher.source or 'none (every answer by rule)'}",
                  highlight=False)
    out = Table(title=f"{n} problems of {path}")
    out.add_column("answered by")
    out.add_column("problems", justify="right")
    out.add_column("routes")
    for source, routes in answered.items():
        out.add_row(source, str(sum(routes.values())),
                    ", ".join(f"{r} ({k})" for r, k in routes.items()))
    console.print(out)
    if uncertain:
        console.print(f"{len(uncertain)} predicted answer(s) uncertain (expected error over "
                      f"{UNCERTAIN:.0%}); the most uncertain:", highlight=False)
        for p, c in uncertain[:10]:
            console.print(f"  +-{c.uncertainty:.0%}: {p.key} -> {c.route_id}", highlight=False)
    for p, c in worse[:20]:
        console.print(f"  {c.source}: {p.key} -> {c.route_id}", highlight=False)


@app.command()
def export(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE", help="Parquet or CSV table.")],
    fmt: Annotated[Format, typer.Option("--format", help="A table, or a JSON winners map.")],
    out: Annotated[Path, typer.Option(
        "--out", help="Where to write (suffix must match; .csv.gz for gzipped CSV).")],
    winners_only: Annotated[bool, typer.Option(
        "--winners-only", help="Only each problem's winner (json: no alternatives).")] = False,
) -> None:
    """Write a table for deployment: Parquet, CSV, or a JSON winners map for engines."""
    from mlatune import table

    fmt = fmt.value
    gzipped_csv = fmt == "csv" and out.name.lower().endswith(".csv.gz")
    if out.suffix.lower() != f".{fmt}" and not gzipped_csv:
        _fail(f"--out {out} must end in .{fmt}{' or .csv.gz' if fmt == 'csv' else ''} "
              f"for --format {fmt}")
    _check_outputs(out)
    with _one_line_errors(str(table_path)):
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
    """Check a table against the current schema (an older table as upgraded on reading);
    every problem is reported at once."""
    with _one_line_errors(str(table_path)):
        if table_path.suffix.lower() == ".json":
            from mlatune.table import winners_map

            document = winners_map.read(table_path).document
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
    """Rewrite an older table (schema v1 or v2) as the current schema: from v1, step kinds
    as the routes declare them and per-step costs not measured (empty); DCP rows timed
    "simulated"; provenance converted_from "v1" or "v2"."""
    from mlatune import table
    from mlatune.table.schema import SCHEMA_VERSION

    target = out or table_path
    if target.suffix.lower() not in (".parquet", ".csv"):
        _fail(f"--out {target}: name the table .parquet or .csv (both are written)")
    targets = [target.with_suffix(s) for s in (".parquet", ".csv")]
    if out is not None:  # a named destination is checked before anything is read
        _check_outputs(*targets)
    with _one_line_errors(str(table_path)):
        frame, stored = table.read_versioned(table_path)
    if stored == SCHEMA_VERSION:  # over TABLE, a current table needs no writable folder
        console.print(f"{table_path}: already v{SCHEMA_VERSION}; nothing written",
                      soft_wrap=True, highlight=False)
        return
    if out is None:
        _check_outputs(*targets)
    with _one_line_errors(str(table_path)):
        # Both formats, as a sweep writes them; each write is atomic (the old file or
        # the new one, never half of either).
        written = [table.write(frame, t) for t in targets]
    kinds = frame.groupby(["plan_on", "capturable"], sort=True).size()
    filled = "DCP rows timed 'simulated'"
    if stored == 1:
        filled = ("step kinds as the routes here declare them ("
                  + ", ".join(f"{plan_on}{' capturable' if cap else ''}: {n}"
                              for (plan_on, cap), n in kinds.items())
                  + f"), per-step costs not measured (empty), {filled}")
    console.print(f"[green]upgraded[/] {table_path} from schema v{stored} to "
                  f"v{SCHEMA_VERSION}: wrote {written[0]} and {written[1]} ({len(frame)} rows); "
                  + filled, soft_wrap=True, highlight=False)
    _warn_unregistered(frame)


# merge ----------------------------------------------------------------------------

@app.command()
def merge(
    out: Annotated[Path, typer.Argument(
        metavar="OUT", help="The joined table, .parquet or .csv.")],
    tables: Annotated[list[Path], typer.Argument(
        metavar="TABLE", help="Parquet or CSV tables: the shares of a sweep run with "
                                 "--shard, or runs on other devices.")],
    allow_different_specs: Annotated[bool, typer.Option(
        "--allow-different-specs", help="Join tables of different specs (spec_sha256) "
                                        "too.")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Join tables into one: per (device, problem, route) the best row (an ok row before
    any other, then the fastest), re-ranked.

    Refused: tables measured on one device under different environments (torch, triton,
    driver, library versions), shares of one sharded sweep from different devices or
    environments, and tables of different specs unless --allow-different-specs. A share
    (read from the sweep's journal beside its table) missing from a sharded sweep is
    warned about: the joined table lacks its problems.
    """
    from mlatune import table

    if out.suffix.lower() not in (".parquet", ".csv"):
        _fail(f"{out}: name the joined table .parquet or .csv (`mlatune export` then writes "
              f"a JSON winners map)")
    _check_outputs(out)
    inputs = []
    for path in tables:
        with _one_line_errors(str(path)):
            frame = _read_table(path)
        inputs.append(_MergeInput(path, frame))
    _refuse_mixed_environments(inputs)
    specs = sorted({sha for i in inputs for sha in i.specs})
    if len(specs) > 1 and not allow_different_specs:
        a = inputs[0]
        b = next(i for i in inputs if i.specs != a.specs)
        _fail(f"{a.path} and {b.path} come from different specs (spec_sha256 "
              f"{_specs_text(a.specs)} and {_specs_text(b.specs)}); "
              f"--allow-different-specs joins them anyway")
    missing = _missing_shards(inputs)
    with _one_line_errors("merge"):
        merged = table.merge([i.frame for i in inputs])
    with _one_line_errors(str(out)):
        table.write(merged, out)
    for m in missing:
        shares = ", ".join(f"{i}/{m['count']}" for i in m["missing"])
        _note(f"spec {m['spec_sha256'][:12]}: shard{'s' if len(m['missing']) > 1 else ''} "
              f"{shares} not given (as the journals beside the tables say): the joined "
              f"table lacks their problems")
    devices = _devices(merged)
    if json_out:
        _emit_json("merge", {
            "out": str(out), "rows": len(merged), "problems": _problem_count(merged),
            "devices": [_device(*d) for d in devices], "spec_sha256": specs,
            "tables": [i.as_json() for i in inputs], "missing_shards": missing})
        return
    console.print(f"[green]joined[/] {len(inputs)} table{'s' if len(inputs) > 1 else ''} "
                  f"into {out}: {len(merged)} rows, {_problem_count(merged)} problems, "
                  f"devices: {', '.join(map(_device_text, devices))}",
                  soft_wrap=True, highlight=False)
    for i in inputs:
        share = f", shard {i.shard}" if i.shard else ""
        console.print(f"  {i.path}: {len(i.frame)} rows, {_problem_count(i.frame)} problems, "
                      f"{', '.join(map(_device_text, i.devices))}{share}",
                      soft_wrap=True, highlight=False)


class _MergeInput:
    """One table given to merge: its devices, each device's environment (the provenance
    fields that must not differ on one device), its specs and, when the sweep's journal
    lies beside it, the share of the spec it ran."""

    def __init__(self, path: Path, frame: pd.DataFrame):
        from mlatune.table.frame import ENVIRONMENT_FIELDS
        from mlatune.table.schema import DEVICE_COLUMNS

        self.path, self.frame = path, frame
        self.devices = _devices(frame)
        found = frame[[*DEVICE_COLUMNS, *ENVIRONMENT_FIELDS]].drop_duplicates()
        self.environments: dict[Device, dict[str, Any]] = {
            (str(a), str(n), int(c)): {f: _plain(v) for f, v in
                                       zip(ENVIRONMENT_FIELDS, rest, strict=True)}
            for a, n, c, *rest in found.itertuples(index=False, name=None)}
        self.specs = frozenset(str(v) for v in frame["spec_sha256"].unique())
        self.shard = _shard_beside(path, self.specs)

    def as_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "rows": len(self.frame),
                "problems": _problem_count(self.frame),
                "devices": [_device(*d) for d in self.devices],
                "spec_sha256": sorted(self.specs),
                "shard": None if self.shard is None else str(self.shard)}


def _problem_count(frame: pd.DataFrame) -> int:
    from mlatune.table.schema import KEY_COLUMNS

    return len(frame[list(KEY_COLUMNS)].drop_duplicates())


def _specs_text(specs: frozenset[str]) -> str:
    return "+".join(sha[:12] or '""' for sha in sorted(specs))


def _shard_beside(path: Path, specs: frozenset[str]):
    """The share a sweep ran (runner.Shard), from the header of the journal beside its
    table (``<table>.journal.jsonl``, or gzipped); None where there is none, or it is
    another spec's (the table was moved or renamed)."""
    import gzip

    from mlatune.sweep.runner import Shard

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
                _fail(f"{first.path} and {i.path} were measured on {_device_text(device)} "
                      f"under different environments "
                      f"({_environment_clash(first.environments[device], env)}): timings "
                      f"from different environments do not rank against each other")
    sweeps: dict[tuple[frozenset[str], int], _MergeInput] = {}
    for i in inputs:
        if i.shard is None:
            continue
        first = sweeps.setdefault((i.specs, i.shard.count), i)
        if first.environments != i.environments:
            a, b = first.environments, i.environments
            if set(a) != set(b):
                why = (f"{', '.join(map(_device_text, a))} and "
                       f"{', '.join(map(_device_text, b))}")
            else:
                device = next(d for d in a if a[d] != b[d])
                why = f"on {_device_text(device)}: {_environment_clash(a[device], b[device])}"
            _fail(f"{first.path} (shard {first.shard}) and {i.path} (shard {i.shard}) are "
                  f"shares of one sweep measured in different environments ({why}): run "
                  f"every share on the same kind of machine and software")


def _missing_shards(inputs: list[_MergeInput]) -> list[dict[str, Any]]:
    """Per sharded sweep among the inputs (spec and N), the shares not given."""
    given: dict[tuple[str, int], set[int]] = {}
    for i in inputs:
        if i.shard is not None:
            given.setdefault((next(iter(i.specs)), i.shard.count), set()).add(i.shard.index)
    return [{"spec_sha256": sha, "count": count,
             "missing": sorted(set(range(count)) - indices)}
            for (sha, count), indices in sorted(given.items())
            if len(indices) < count]


@app.command()
def diff(
    a_path: Annotated[Path, typer.Argument(metavar="A", help="The old table.")],
    b_path: Annotated[Path, typer.Argument(metavar="B", help="The new table.")],
    limit: LimitOption = 50,
    json_out: JsonFlag = False,
) -> None:
    """Winners that changed between two tables, and by how much (per device: a problem is
    compared only with the same problem on the same device).

    Exit status: 0 the tables were compared, whether or not winners changed; 1 they share no
    device, so nothing could be compared, or a table cannot be read; 2 a usage error.
    """
    import pandas as pd

    from mlatune import table

    with _one_line_errors(str(a_path)):
        a = _read_table(a_path)
    with _one_line_errors(str(b_path)):
        b = _read_table(b_path)
    changed, counts = table.diff(a, b)
    devices_a, devices_b = _devices(a), _devices(b)
    common = sorted(set(devices_a) & set(devices_b))
    if json_out:
        _emit_json("diff", {
            "a": str(a_path), "b": str(b_path),
            "devices": {"a": [_device(*d) for d in devices_a],
                        "b": [_device(*d) for d in devices_b],
                        "common": [_device(*d) for d in common]},
            "comparable": bool(common), "counts": counts,
            "changed": [_diff_entry(row) for _, row in changed.iterrows()]})
    else:
        console.print(f"{counts['same']} winners unchanged, {counts['changed']} changed, "
                      f"{counts['only_a']} problems only in A, {counts['only_b']} only in B",
                      soft_wrap=True)
    _say_device_mismatch(devices_a, devices_b, common)
    if json_out or changed.empty:
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


def _say_device_mismatch(devices_a: list[Device], devices_b: list[Device],
                         common: list[Device]) -> None:
    """No device in common: nothing was compared, an error (exit 1). Some: a note naming
    the devices whose problems count as only in A or only in B."""
    if not common:
        _fail(f"A and B share no device (A: {'; '.join(map(_device_text, devices_a))}; "
              f"B: {'; '.join(map(_device_text, devices_b))}): winners are compared per "
              f"device, so nothing was compared")
    only = [(side, sorted(set(mine) - set(common))) for side, mine in
            (("A", devices_a), ("B", devices_b))]
    for side, devices in only:
        if devices:
            _note(f"only {side} holds {'; '.join(map(_device_text, devices))}: its problems "
                  f"count as only in {side}")


def _diff_entry(row: pd.Series) -> dict[str, Any]:
    """One changed winner of `diff --json`: change is B's winner time / A's - 1."""
    def side(s: str) -> dict[str, Any]:
        return {"route": row[f"route_{s}"], "params": json.loads(row[f"route_params_{s}"]),
                "time_us": _num(_plain(row[f"time_us_{s}"]))}

    return {"device": _device(row["arch"], row["device_name"], row["cu_count"]),
            "problem": _row_problem(row), "a": side("a"), "b": side("b"),
            "change": _num(_plain(row["change"]))}


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

    _check_output_dir(out, reports.HTML_NAME)
    with _one_line_errors(str(table_path)):  # table errors name their own file
        made = reports.build_report(table_path, out, heldout, heldout_journal)
    summary = made.summary
    headline = Table(show_header=False, title=f"report on {table_path}")
    headline.add_column("", no_wrap=True)
    headline.add_column("", overflow="fold")
    for label, value in reports.headline_rows(summary):
        headline.add_row(label, value)
    console.print(headline)
    policies = Table(
        title="speedup of the table's pick over fixed routes and the rule fallback")
    _columns(policies, reports.POLICY_COLUMNS, ("served", "wins", "geomean speedup",
                                                "largest speedup"))
    for row in reports.policy_rows(summary):
        policies.add_row(*row)
    console.print(policies)
    dcp_rows = reports.dcp_rows(summary)
    if dcp_rows:
        dcp = Table(title="DCP measured across processes against its one-GPU simulation")
        _columns(dcp, reports.DCP_COLUMNS, reports.DCP_COLUMNS[4:])
        for row in dcp_rows:
            dcp.add_row(*row)
        console.print(dcp)
    for note in summary.notes:
        err_console.print(f"[yellow]note:[/] {note}", soft_wrap=True, highlight=False)
    console.print(f"[green]wrote[/] {made.html} and {len(made.images)} PNGs in {out}",
                  soft_wrap=True)
