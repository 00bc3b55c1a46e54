"""`mlatune plan` and `mlatune coverage`: what a spec's problems would run, and how the
dispatcher answers them.

``plan --json``: ``spec``, ``device``, ``problems``, ``probe_applied`` (false: rules only),
``routes``: [{"route", "viable", "refused", "top_refusal": {"reason", "count"} or null}],
``groups``: problems differing only in batch and kv_len with the same verdicts,
[{"problem" (bucket fields), "batches", "kv_lens", "viable": [route], "refused": {route:
reason}}].

``coverage --json``: ``spec``, ``table`` (null: rules only), ``require``, ``problems``,
``answered``: {source: {"problems", "routes": {route: count}}} for table, predicted,
nearest and rule; ``below_require``: [{"key", "source", "route"}]; ``uncertain``: [{"key",
"route", "uncertainty"}]; ``ok``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from mlatune.cli.app import (
    JsonFlag,
    app,
    check_outputs,
    console,
    counted,
    emit_json,
    err_console,
    fail,
    one_line_errors,
    say,
    usage_error,
)
from mlatune.cli.inputs import (
    SOURCES,
    TABLE_DEFAULT_HELP,
    AccuracyOption,
    Arch,
    ArchOption,
    Source,
    check_route_ids,
    load_dispatcher,
    load_spec,
    spec_path,
    value,
)

if TYPE_CHECKING:
    from mlatune.arch import DeviceInfo
    from mlatune.dispatch import Choice, Dispatcher
    from mlatune.problem import MLAProblem
    from mlatune.sweep.planning import PlanRow
    from mlatune.sweep.spec import SweepSpec

UNCERTAIN = 0.10  # a predicted answer's expected error past which coverage lists it
# Off a terminal, a plan this slow says how far it has come, then again every so often.
PROGRESS_AFTER_S = 5.0
PROGRESS_EVERY_S = 15.0


@app.command()
def plan(
    spec_name: Annotated[str, typer.Argument(
        metavar="SPEC", help="Sweep spec: a TOML file or a bundled spec's name.")],
    arch: Annotated[Arch, typer.Option(help="The arch to plan for. Its GPU need not be here.")],
    out: Annotated[Path | None, typer.Option(
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
    path = spec_path(spec_name)
    if out:
        if out.suffix.lower() != ".csv":
            usage_error(f"{out}: the plan is written as CSV; name it .csv", "--out")
        check_outputs(out, make_parents=False)
    spec = load_spec(path, gpu=True)
    check_route_ids((*spec.routes, *spec.max_params), named_in=path)
    try:
        with _progress(len(spec.problems)) as progress:
            rows = planning.plan_rows(spec, device, progress)
    except KeyError as exc:  # a route id in the spec that is not registered
        fail(f"{path}: {exc.args[0]}")
    if out:
        try:
            planning.write_csv(rows, device, out)
        except OSError as exc:  # OutputError: one line naming the file
            fail(str(exc))
    if json_out:
        emit_json("plan", planning.as_json(rows, device, spec))
        return
    _print_plan(arch.value, device, path, spec, rows, detail)
    if out:
        console().print(f"plan table: {out} ({len(rows)} rows)", highlight=False)


@contextmanager
def _progress(total: int) -> Iterator[Callable[[int], None]]:
    """A progress callback for ``plan_rows`` that writes to stderr only (stdout, --json's
    too, stays the plan): a transient bar on a terminal; elsewhere, once planning has
    taken ``PROGRESS_AFTER_S``, a line every ``PROGRESS_EVERY_S``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    shown = err_console()
    if shown.is_terminal:
        with Progress("planning", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=shown, transient=True) as bar:
            task = bar.add_task("planning", total=total)
            yield lambda done: bar.update(task, completed=done)
        return
    start = last = time.monotonic()

    def report(done: int) -> None:
        nonlocal last
        now = time.monotonic()
        due = now - last >= PROGRESS_EVERY_S or last == start or done == total
        if now - start >= PROGRESS_AFTER_S and due:  # (the last count once any was said)
            last = now
            say(f"planning: {done:,} of {total:,} problems ({now - start:.0f} s)", stderr=True)

    yield report


def _print_plan(arch: str, device: DeviceInfo, path: Path, spec: SweepSpec,
                rows: list[PlanRow], detail: bool) -> None:
    from mlatune.arch import units_text
    from mlatune.sweep import planning

    cus = units_text(device.arch, device.cu_count) if device.cu_count else "unit count unknown"
    console().print(f"plan for {arch} ({device.name}, {cus}): "
                    f"{counted(len(spec.problems), 'problem')} from {path} "
                    f"({counted(len(spec.skipped), 'invalid combination')} skipped), "
                    f"{counted(len({r.route for r in rows}), 'route')}", highlight=False)
    console().print("[yellow]capability rules only[/]: the probe of the installed libraries "
                    "(AITER's entry points, kernel manifest and native 24-head build; "
                    "FlashMLA, FlashInfer, Triton) was not applied; `mlatune doctor` and a "
                    "sweep on the target machine apply it.", soft_wrap=True)
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
        console().print(table)
    summary = Table(title=f"per route on {arch}")
    for col in ("route", "viable", "refused", "most frequent refusal"):
        summary.add_column(col)
    for s in planning.route_summary(rows):
        summary.add_row(s.route, str(s.viable), str(s.refused), s.top_text)
    console().print(summary)
    if not detail:
        console().print(f"per problem ({len(groups)} groups): --detail prints them, --out "
                        f"FILE writes one CSV row per problem and route", highlight=False)


@app.command()
def coverage(
    inputs: Annotated[list[str], typer.Argument(
        metavar="[TABLE] SPEC",
        help="TABLE: a Parquet, CSV or JSON winners table. " + TABLE_DEFAULT_HELP + " SPEC: "
             "the sweep spec whose problems to answer, a TOML file or a bundled spec's name.",
        show_default=False)],
    arch: ArchOption = None,
    accuracy: AccuracyOption = None,
    require: Annotated[Source, typer.Option(
        help="Exit 1 unless every problem is answered this well: table (measured), "
             "predicted, nearest, law or rule.")] = Source.rule,
    json_out: JsonFlag = False,
    old_table: Annotated[Path | None, typer.Option("--table", hidden=True)] = None,
) -> None:
    """How the dispatcher answers every problem of a spec: measured, predicted from the
    measured points of its bucket, nearest point or rule; and which predictions are
    uncertain (expected error above 10%: far from measured points, or neighbours that
    disagree), where measuring more would pay (`mlatune sweep` of those shapes).

    Exit status: 0 every problem is answered at least as well as --require; 1 some problem
    is not, or the spec or table cannot be used; 2 a usage error.
    """
    from collections import Counter

    from mlatune.arch import current_device

    table_path, path = _coverage_inputs(inputs, old_table)
    # The spec's CPU grid for --arch cpu, and without --arch on a machine without a GPU.
    spec = load_spec(path, gpu=(value(arch) or current_device().arch) != "cpu")
    check_route_ids((*spec.routes, *spec.max_params), named_in=path)
    with one_line_errors(str(table_path or path)):
        dispatcher = load_dispatcher(table_path, value(arch), value(accuracy))
        choices = [(p, dispatcher.select(p)) for p in spec.problems]
    by_route = Counter((c.source, c.route_id) for _, c in choices)
    answered = {s: dict(sorted((r, n) for (s2, r), n in by_route.items() if s2 == s))
                for s in SOURCES}
    worse = [(p, c) for p, c in choices
             if SOURCES.index(c.source) > SOURCES.index(require.value)]
    uncertain = sorted(((p, c) for p, c in choices if c.uncertainty > UNCERTAIN),
                       key=lambda pc: -pc[1].uncertainty)
    if json_out:
        emit_json("coverage", {
            "spec": str(path), "table": dispatcher.source or None, "require": require.value,
            "problems": len(choices), "skipped_combinations": len(spec.skipped),
            "answered": {s: {"problems": sum(routes.values()), "routes": routes}
                         for s, routes in answered.items()},
            "below_require": [{"key": p.key, "source": c.source, "route": c.route_id}
                              for p, c in worse],
            "uncertain": [{"key": p.key, "route": c.route_id, "uncertainty": c.uncertainty}
                          for p, c in uncertain],
            "ok": not worse})
    else:
        _print_coverage(path, dispatcher, spec, answered, worse, uncertain)
    if worse:
        fail(f"{len(worse)} problem(s) answered by worse than --require {require.value}"
             + (" (first 20 above)" if len(worse) > 20 and not json_out else ""))


def _coverage_inputs(inputs: list[str], old_table: Path | None) -> tuple[Path | None, Path]:
    """[TABLE] SPEC as given: the table (None: the default) and the spec's file."""
    if old_table is not None:
        usage_error("coverage takes the table as its first argument: "
                    "mlatune coverage TABLE SPEC", "--table")
    if len(inputs) > 2:
        usage_error(f"at most two arguments, TABLE and SPEC; got {len(inputs)}", "[TABLE] SPEC")
    table_path = Path(inputs[0]) if len(inputs) == 2 else None
    if table_path is not None and not table_path.exists():
        usage_error(f"Path '{table_path}' does not exist.", "TABLE")
    return table_path, spec_path(inputs[-1])


def _print_coverage(path: Path, dispatcher: Dispatcher, spec: SweepSpec,
                    answered: dict[str, dict[str, int]],
                    worse: list[tuple[MLAProblem, Choice]],
                    uncertain: list[tuple[MLAProblem, Choice]]) -> None:
    console().print(f"table: {dispatcher.source or 'none (every answer by rule)'}",
                    highlight=False)
    out = Table(title=f"{counted(len(spec.problems), 'problem')} of {path} "
                      f"({counted(len(spec.skipped), 'invalid combination')} skipped)")
    out.add_column("answered by")
    out.add_column("problems", justify="right")
    out.add_column("routes")
    for source, routes in answered.items():
        out.add_row(source, str(sum(routes.values())),
                    ", ".join(f"{r} ({k})" for r, k in routes.items()))
    console().print(out)
    if uncertain:
        console().print(f"{len(uncertain)} predicted answer(s) uncertain (expected error over "
                        f"{UNCERTAIN:.0%}); the most uncertain:", highlight=False)
        for p, c in uncertain[:10]:
            console().print(f"  +-{c.uncertainty:.0%}: {p.key} -> {c.route_id}",
                            highlight=False)
    for p, c in worse[:20]:
        console().print(f"  {c.source}: {p.key} -> {c.route_id}", highlight=False)
