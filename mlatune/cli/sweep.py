"""`mlatune sweep`: measure every viable route per problem of a spec and write the table.

``--json``: progress and notes go to stderr; stdout holds ``spec``, ``spec_name``,
``device``, ``table``, ``csv``, ``journal``, ``candidates`` (planned), ``ran`` (now),
``resumed`` (found in the journal), ``refused`` (by a rule, not run), ``pruned`` (by
--prune-from's table, not run), ``fallbacks``,
``measured_dcp``, ``statuses`` ({status: candidates}, refusals apart), ``wall_s``,
``worker_s`` ({part: seconds}) and ``refine`` ({"points", "worker_s"} with --refine, else
null). With --refine and nothing to measure: ``spec``, ``table`` and ``refine`` only. With
--ray over several GPU models: ``sweeps``, one such object a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from mlatune.cli.app import (
    JsonFlag,
    app,
    check_outputs,
    console,
    counted,
    device_json,
    emit_json,
    err_console,
    fail,
    usage_error,
)
from mlatune.cli.inputs import (
    DeviceArch,
    check_route_ids,
    interpret_triton_on,
    load_spec,
    spec_path,
)

if TYPE_CHECKING:
    from rich.progress import ProgressColumn

    from mlatune.arch import DeviceInfo
    from mlatune.hardware import Hardware
    from mlatune.measure.records import Record
    from mlatune.sweep.candidates import Shard
    from mlatune.sweep.spec import SweepSpec
    from mlatune.sweep.stages import SweepSettings, SweepSummary

SpecArgument = Annotated[str | None, typer.Argument(
    metavar="SPEC", help="Sweep spec: a TOML file, or a bundled spec's name (smoke, h200, "
                         "deepseek-v3-tp8, ...). Default: smoke.")]
ArchOption = Annotated[DeviceArch | None, typer.Option(
    help="The arch this sweep is for; stops if this machine's device differs.")]
OutOption = Annotated[Path | None, typer.Option(
    help="Table path, .parquet or .csv (both are written, with the journal beside them). "
         "Default: runs/<spec>-<arch>.parquet")]
ResumeFlag = Annotated[bool, typer.Option(
    "--resume", help="Continue the sweep in the journal. Without --fresh a rerun does so "
                     "anyway (refusing a journal of another spec or device); kept for "
                     "scripts.")]
FreshFlag = Annotated[bool, typer.Option(
    "--fresh", help="Start over. The earlier table and journal are moved aside, not "
                    "deleted: <out>.<UTC time>.parquet, .csv and .journal.jsonl.")]
GpusOption = Annotated[int, typer.Option(
    min=1, metavar="N", help="Worker processes, one per GPU. With 2 or more, DCP problems of "
                             "a size up to it are then also measured for real, across that "
                             "many GPUs (gloo processes without a GPU).")]
DcpTopKOption = Annotated[int | None, typer.Option(
    min=0, metavar="K", help="With --gpus N >= 2: the routes per DCP problem measured across "
                             "GPUs, the fastest in the one-GPU pass (default: the spec's "
                             "dcp_top_k, else 3; 0: none).")]
DcpGraphFlag = Annotated[bool, typer.Option(
    "--dcp-graph", help="With --gpus N >= 2 on GPUs: time each DCP step across GPUs from a "
                        "CUDA graph of the whole step (NCCL collectives captured), not "
                        "eagerly; the table's timer says which.")]
TimeoutOption = Annotated[float, typer.Option(
    min=0.1, max=86400.0, metavar="SECONDS", help="Seconds one candidate may take (at most "
                                                  "a day).")]
CompileWorkersOption = Annotated[int | None, typer.Option(
    min=0, metavar="N", help="Processes per GPU that compile kernels before timing starts "
                             "(default: the spare CPU cores, at most 8; 0: none).")]
RoutesOption = Annotated[str | None, typer.Option(
    metavar="ROUTE[,ROUTE]", help="Route ids to run (default: every viable).")]
ShardOption = Annotated[str | None, typer.Option(
    metavar="I/N",
    help="Run share I of N (0 <= I < N, as SLURM_ARRAY_TASK_ID under --array=0-(N-1)): the "
         "problems whose key hashes to I mod N. One share per machine, then `mlatune merge` "
         "joins the tables. Default --out: runs/<spec>-<arch>.shard-I-of-N.parquet")]
RefineOption = Annotated[float | None, typer.Option(
    metavar="SECONDS", min=0.0,
    help="After the grid: measure the points between its grid points whose answer the "
         "dispatcher is least sure of (predicted far from measured points, neighbours "
         "disagreeing), until their estimated worker time reaches SECONDS; the table grows "
         "to hold them.")]
PruneFromOption = Annotated[Path | None, typer.Option(
    metavar="TABLE",
    help="A measured table (another GPU's, an older sweep's) that prunes this one: among the "
         "routes this sweep runs at a problem, one whose step there cost over --prune-ratio "
         "times the cheapest of its numeric class is recorded 'pruned' and not run; a route "
         "that runs, runs its first set of each class and the set that won there. Problems "
         "and routes it did not measure run.")]
PruneRatioOption = Annotated[float, typer.Option(
    metavar="R", min=1.0, help="With --prune-from: how far behind the best a route is pruned.")]
RayFlag = Annotated[bool, typer.Option(
    "--ray", help="Run the candidates on the GPUs of a Ray cluster, one worker a GPU: the "
                  "cluster at --ray-address, else at RAY_ADDRESS, else the Ray instance "
                  "this machine runs, else one started here. Needs mlatune[ray] "
                  "(docs/cluster.md).")]
RayAddressOption = Annotated[str | None, typer.Option(
    metavar="ADDRESS", help="The Ray cluster to run on (host:port, ray://host:port or "
                            "auto); implies --ray.")]
GpuModelOption = Annotated[str | None, typer.Option(
    metavar="MODEL[,MODEL]",
    help="The GPU models of the Ray cluster to sweep (Ray's accelerator types: H100, "
         "H200, ...), one table each (<table>-<model>.parquet); implies --ray. Default: "
         "every GPU of a cluster of one model.")]


@app.command()
def sweep(spec_name: SpecArgument = None, arch: ArchOption = None, out: OutOption = None,
          resume: ResumeFlag = False, fresh: FreshFlag = False, gpus: GpusOption = 1,
          dcp_top_k: DcpTopKOption = None, dcp_graph: DcpGraphFlag = False,
          timeout: TimeoutOption = 300.0, compile_workers: CompileWorkersOption = None,
          routes: RoutesOption = None, shard: ShardOption = None,
          refine: RefineOption = None, prune_from: PruneFromOption = None,
          prune_ratio: PruneRatioOption = 1.5, ray: RayFlag = False,
          ray_address: RayAddressOption = None, gpu_model: GpuModelOption = None,
          json_out: JsonFlag = False) -> None:
    """Measure every viable route for each problem of a spec and write a dispatch table.

    A rerun continues where the last one stopped (a kill or Ctrl-C loses only what was in
    flight); --fresh starts over. It prints which it did. With --shard I/N only one share
    of the spec's problems runs; `mlatune merge TABLE... --out OUT` joins the shares' tables.
    With --ray the candidates run on a Ray cluster's GPUs.
    """
    share = _share(shard, resume, fresh, refine)
    if out is not None and out.suffix.lower() not in (".parquet", ".csv"):
        usage_error(f"{out}: name the table .parquet or .csv (both are written)", "--out")
    only = [r.strip() for r in routes.split(",") if r.strip()] if routes is not None else None
    if only == []:
        usage_error("name at least one route id (leave --routes out for every route)",
                    "--routes")
    check_route_ids(only)
    path = spec_path(spec_name)
    choices = {"gpus": gpus, "timeout_s": timeout, "only": tuple(only) if only else None,
               "compile_workers": compile_workers, "dcp_top_k": dcp_top_k,
               "dcp_graph": dcp_graph, "shard": share, "fresh": fresh,
               "prior": _prior(prune_from, prune_ratio)}
    if ray or ray_address is not None or gpu_model is not None:
        _sweep_on_ray(path, arch, out, refine, choices, ray_address, gpu_model, json_out)
        return
    device = _device(arch, gpus, dcp_graph)
    summary, chosen = _sweep_on(path, device, out, refine, choices, json_out)
    if json_out:
        emit_json("sweep", _sweep_json(summary, path, device, chosen))
        return
    _print_summary(summary)


def _sweep_on(path: Path, device: DeviceInfo, out: Path | None, refine: float | None,
              choices: dict[str, Any], json_out: bool, tag: str | None = None,
              figures: Hardware | None = None) -> tuple[SweepSummary, list[Any] | None]:
    """The sweep of the spec at ``path`` on ``device``; ``tag`` names its table apart (a GPU
    model's), ``figures`` are its device's as measured by a Ray worker."""
    from mlatune.sweep import stages

    interpret_triton_on(device)
    spec = load_spec(path, gpu=device.is_gpu)
    check_route_ids((*spec.routes, *spec.max_params), named_in=path)
    table_path = (out or stages.default_table_path(spec, device, choices["shard"])
                  ).with_suffix(".parquet")
    if tag:
        table_path = table_path.with_name(f"{table_path.stem}-{tag}.parquet")
    check_outputs(table_path, table_path.with_suffix(".csv"), stages.journal_path(table_path))
    shown = err_console() if json_out else console()
    chosen = None
    if refine is not None:
        spec, chosen = _refined(spec, table_path, device, refine, shown)
        if not chosen:
            _nothing_to_refine(path, table_path, json_out)
    _say_start(path, spec, device, shown)
    settings = stages.SweepSettings(spec, path, device, table_path, **choices, figures=figures)
    return _run(settings, shown), chosen


def _sweep_on_ray(path: Path, arch: DeviceArch | None, out: Path | None,
                  refine: float | None, choices: dict[str, Any], address: str | None,
                  models: str | None, json_out: bool) -> None:
    """--ray: the sweep on a Ray cluster's GPUs, one after another per GPU model, each
    model's rows in its own table."""
    from mlatune.sweep import ray_pool

    if choices["gpus"] != 1 or choices["dcp_graph"]:
        usage_error("--gpus and --dcp-graph are this machine's GPUs; --ray runs one worker "
                    "on every GPU of the cluster", "--ray")
    named = [m.strip() for m in (models or "").split(",") if m.strip()]
    try:
        ray_pool.connect(address)
        targets = ray_pool.targets(named)
    except ray_pool.RayUnavailable as exc:
        fail(str(exc))
    for target in targets:
        if arch is not None and arch.value != target.device.arch:
            fail(f"--arch {arch.value} but the Ray workers' GPUs are {target.device.arch} "
                 f"({target.device.name})")
    shown = err_console() if json_out else console()
    documents = []
    for target in targets:
        of_model = f" of model {target.model}" if target.model else ""
        shown.print(f"Ray: {target.gpus} GPU(s){of_model}, one worker each", highlight=False)
        tag = target.model.lower() if target.model and (out is None or len(targets) > 1) \
            else None
        with ray_pool.serving(target):
            summary, chosen = _sweep_on(path, target.device, out, refine, choices, json_out,
                                        tag, target.figures)
        if json_out:
            documents.append(_sweep_json(summary, path, target.device, chosen))
        else:
            _print_summary(summary)
    if json_out:
        emit_json("sweep", documents[0] if len(documents) == 1 else {"sweeps": documents})


def _prior(path: Path | None, ratio: float):
    """--prune-from's table as a sweep's ``Prior``; a table that cannot be read stops here."""
    if path is None:
        return None
    from mlatune.errors import TableError
    from mlatune.sweep.candidates import Prior

    try:
        return Prior.read(str(path), ratio)
    except (TableError, OSError) as exc:
        usage_error(f"{path}: {exc}", "--prune-from")


def _share(shard: str | None, resume: bool, fresh: bool, refine: float | None
           ) -> Shard | None:
    """The share --shard names; flags that exclude each other are a usage error."""
    from mlatune.sweep.candidates import Shard

    if resume and fresh:
        usage_error("--resume and --fresh exclude each other", "--fresh")
    if refine is not None and (fresh or shard is not None):
        usage_error("it adds points to a measured grid: not with --fresh or --shard",
                    "--refine")
    if shard is None:
        return None
    try:
        return Shard.parse(shard)
    except ValueError as exc:
        usage_error(str(exc), "--shard")


def _device(arch: DeviceArch | None, gpus: int, dcp_graph: bool) -> DeviceInfo:
    """This machine's device, when it can run what was asked (exit 1 otherwise)."""
    from mlatune.arch import current_device, gpu_devices
    from mlatune.sweep.dcp_graph import REFUSAL

    device = current_device()
    if arch is not None and arch.value != device.arch:
        fail(f"--arch {arch.value} but this machine's device is {device.arch} ({device.name}). "
             f"To see which routes {arch.value} would run without its GPU: "
             f"mlatune plan SPEC --arch {arch.value}")
    if device.is_gpu and gpus > len(gpu_devices()):
        fail(f"--gpus {gpus} but only {len(gpu_devices())} GPU(s) are visible")
    if dcp_graph and not device.is_gpu:
        fail(f"--dcp-graph: {REFUSAL}")
    return device


def _refined(spec: SweepSpec, table_path: Path, device: DeviceInfo, budget_s: float,
             shown: Console) -> tuple[SweepSpec, list[Any]]:
    """The spec with, for problems, the points ``mlatune.sweep.refine`` proposes."""
    from mlatune.dispatch import Dispatcher
    from mlatune.sweep import refine as refinement
    from mlatune.sweep import stages

    try:
        spec, chosen = stages.refined(
            spec, table_path, lambda path: Dispatcher.load(path, device=device), budget_s)
    except stages.SweepError as exc:
        fail(str(exc))
    seconds = sum(r.seconds for r in chosen)
    shown.print(f"refine: {len(chosen)} point(s) between the grid's, about {seconds:.0f} s "
                f"of worker time (budget {budget_s:g} s); the least certain first:",
                highlight=False)
    for r in chosen[:10]:
        sure = "no prediction" if r.uncertainty >= refinement.UNPREDICTED \
            else f"+-{r.uncertainty:.0%}"
        shown.print(f"  {sure}: {r.problem.key} (now {r.route_id})", highlight=False)
    return spec, chosen


def _nothing_to_refine(path: Path, table_path: Path, json_out: bool) -> None:
    if json_out:
        emit_json("sweep", {"spec": str(path), "table": str(table_path),
                            "refine": {"points": 0, "worker_s": 0.0}})
    else:
        console().print("nothing to measure within the budget")
    raise typer.Exit(0)


def _say_start(path: Path, spec: SweepSpec, device: DeviceInfo, shown: Console) -> None:
    if not device.is_gpu:
        shown.print("[yellow]no GPU[/]: running the CPU-capable routes on the spec's CPU "
                    "grid; wall-clock timings, not for dispatch.")
    shown.print(f"spec {path} ({counted(len(spec.problems), 'problem')}, "
                f"{counted(len(spec.skipped), 'invalid combination')} skipped) on "
                f"{device.arch} ({device.name})", highlight=False)


def _run(settings: SweepSettings, shown: Console) -> SweepSummary:
    """The sweep under a progress bar on ``shown``; its stop (SweepError) is one line."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from mlatune.sweep import stages

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               rate_eta_column(), TextColumn("[red]{task.fields[failures]} failed"),
               TimeElapsedColumn())
    try:
        with Progress(*columns, console=shown) as progress:
            return stages.run_sweep(settings, _SweepProgress(progress),
                                    lambda text: shown.print(text, highlight=False))
    except stages.SweepError as exc:
        fail(str(exc))


def rate_eta_column() -> ProgressColumn:
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


def _statuses(summary: SweepSummary) -> dict[str, int]:
    """Candidates per status, refusals apart (they ran nothing)."""
    from mlatune.table.schema import Status

    return {s.value: n for s, n in summary.result.counts.items()
            if s is not Status.UNSUPPORTED}


def _sweep_json(summary: SweepSummary, path: Path, device: DeviceInfo,
                chosen: list[Any] | None) -> dict[str, Any]:
    result = summary.result
    return {"spec": str(path), "spec_name": summary.spec.name,
            "device": device_json(device.arch, device.name, device.cu_count),
            "table": str(summary.table_path),
            "csv": str(summary.table_path.with_suffix(".csv")),
            "journal": str(summary.journal_path), "candidates": result.planned,
            "ran": result.ran, "resumed": result.resumed, "refused": result.refused,
            "pruned": result.pruned,
            "fallbacks": result.fallbacks, "measured_dcp": result.measured_dcp,
            "statuses": dict(sorted(_statuses(summary).items())), "wall_s": summary.wall_s,
            "worker_s": dict(result.seconds),
            "refine": None if chosen is None else
            {"points": len(chosen), "worker_s": sum(r.seconds for r in chosen)}}


def _print_summary(summary: SweepSummary) -> None:
    """The bar's numbers again: candidates run now and found in the journal; statuses of
    the candidates (refusals apart: they ran nothing); where the workers' time went."""
    result, wall = summary.result, summary.wall_s
    fallbacks = f" + {result.fallbacks} reference fallbacks" if result.fallbacks else ""
    rate = result.ran / wall if wall else 0
    say = console().print
    say(f"sweep {summary.spec.name}: {result.planned} candidates{fallbacks}; "
        f"{result.ran} run now in {wall:.1f}s ({rate:.2f}/s), "
        f"{result.resumed} found in the journal", highlight=False)
    if result.measured_dcp:
        say(f"DCP steps measured across processes now: {result.measured_dcp} "
            f"(route and scheme per problem; in the table as dcp_timing 'measured')",
            highlight=False)
    counts = Table()
    counts.add_column("status")
    counts.add_column("candidates", justify="right")
    for status, n in sorted(_statuses(summary).items()):
        counts.add_row(status, str(n))
    if result.refused:
        counts.add_section()
        counts.add_row("refused by a rule (not run)", str(result.refused))
    say(counts)
    if result.ran:
        _print_worker_time(dict(result.seconds))
    say(f"table: {summary.table_path} (and {summary.table_path.with_suffix('.csv')}); "
        f"journal: {summary.journal_path}", highlight=False)


def _print_worker_time(cost: dict[str, float]) -> None:
    ahead = cost.pop("compile_ahead_wall_s", None)
    if ahead is not None:
        console().print(f"compiled ahead in {ahead:.1f}s (wall)", highlight=False)
    console().print("worker time: " + ", ".join(
        f"{part.removesuffix('_s')} {cost[part]:.1f}s" for part in cost)
        + " (setup: inputs and references; first_check: the first accuracy run, "
          "with kernel compiles; check: the second; bench: timing)", highlight=False)
