"""A whole sweep as ``mlatune sweep`` runs it (``run_sweep``), stage after stage: the
spec's share (``--shard``), the journal (resumed, or the earlier run moved aside), the
one-device pass (``runner``: compiling ahead, the worker pool, reference fallbacks), the
DCP steps measured across processes (``dcp_stage``, with two or more GPUs), then the
table folded from the journal. The CLI parses and prints; everything that can stop a
sweep reaches it as one ``SweepError`` line that says how to go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlatune import hardware, routes, table
from mlatune.arch import DeviceInfo
from mlatune.errors import JournalError, TableError
from mlatune.hardware import Hardware
from mlatune.measure.records import table_rows
from mlatune.sweep import dcp_stage, runner
from mlatune.sweep import journal as journals
from mlatune.sweep import refine as refinement
from mlatune.sweep.candidates import Prior, Shard
from mlatune.sweep.journal import Journal, JournalHeader
from mlatune.sweep.progress import Observer
from mlatune.sweep.runner import SweepResult
from mlatune.sweep.spec import SweepSpec
from mlatune.table.schema import Provenance

Say = Callable[[str], None]


class SweepError(ValueError):
    """What stopped a sweep, in one line, with how to go on (rerun, --fresh, ...)."""


@dataclass(frozen=True)
class SweepSettings:
    """One sweep: the spec (already refined, not yet cut to its share), this machine's
    device, where the table goes (``.parquet``; the CSV and journal beside it), the
    command line's choices, and the device's hardware figures (``mlatune.hardware``; None:
    measured here when the journal opens)."""

    spec: SweepSpec
    spec_path: Path
    device: DeviceInfo
    table_path: Path
    gpus: int = 1
    timeout_s: float = 300.0
    only: tuple[str, ...] | None = None  # --routes
    compile_workers: int | None = None
    dcp_top_k: int | None = None  # None: the spec's
    dcp_graph: bool = False
    shard: Shard | None = None
    fresh: bool = False
    prior: Prior | None = None  # --prune-from
    figures: Hardware | None = None  # given where the GPU is not this process's (Ray)


    @property
    def journal_path(self) -> Path:
        return journal_path(self.table_path)

    @property
    def csv_path(self) -> Path:
        return self.table_path.with_suffix(".csv")

    def header(self) -> JournalHeader:
        """The journal's header: what a resumed journal must have been written for, and the
        hardware figures of the device (unless given, a GPU's with its bandwidth measured
        now)."""
        figures = self.figures
        if figures is None and self.device.is_gpu:
            figures = hardware.of_device(self.device, hardware.measure_bandwidth(self.device))
        return JournalHeader.of(self.spec.sha256, str(self.spec_path), self.device,
                                str(self.shard) if self.shard else None, figures)


@dataclass(frozen=True)
class SweepSummary:
    spec: SweepSpec  # the share that ran
    result: SweepResult
    wall_s: float  # from the journal's opening to its closing
    table_path: Path
    journal_path: Path


def default_table_path(spec: SweepSpec, device: DeviceInfo, shard: Shard | None) -> Path:
    tag = f".{shard.tag}" if shard else ""
    return Path("runs") / f"{spec.name}-{device.arch}{tag}.parquet"


def journal_path(table_path: Path) -> Path:
    return table_path.with_suffix(".journal.jsonl")


def run_sweep(settings: SweepSettings, observer: Observer | None = None,
              say: Say = lambda text: None) -> SweepSummary:
    """Run (or continue) the sweep and write its table; SweepError when it stops first
    (interrupted, a worker that would not start, a disk full or gone): every finished
    candidate is then in the journal, and the same command continues."""
    spec = share_of(settings, say)
    journal = open_journal(settings, say)
    t0 = time.monotonic()
    rerun = f"finished candidates are in {settings.journal_path}: rerun to continue"
    failure = ""  # raised once the journal is closed: one line, whatever failed
    try:
        result = _passes(settings, spec, journal, observer)
    except KeyboardInterrupt:
        failure = (f"interrupted; finished candidates are in {settings.journal_path}: rerun "
                   f"with --resume (or the same command without --fresh) to continue")
    except (OSError, JournalError) as exc:  # the journal's disk full or gone
        failure = f"{exc}; {rerun}"
    except RuntimeError as exc:  # a sweep worker that would not start
        failure = f"{exc}; {rerun}"
    finally:
        try:
            journal.close()
        except OSError as exc:  # its last flush: a full disk (an OutputError)
            failure = failure or f"{exc}; {rerun}"
    if not failure and not settings.journal_path.is_file():  # its folder deleted meanwhile
        failure = (f"the journal {settings.journal_path} was removed during the sweep, its "
                   f"results with it; no table is written: rerun to measure again")
    if failure:
        raise SweepError(failure)
    wall = time.monotonic() - t0
    write_table(result, spec, settings, journal.header.hardware or "")
    return SweepSummary(spec, result, wall, settings.table_path, settings.journal_path)


def _passes(settings: SweepSettings, spec: SweepSpec, journal: Journal,
            observer: Observer | None) -> SweepResult:
    """The one-device pass, then, with two or more GPUs, DCP steps across them."""
    device = settings.device
    result = runner.run(spec, device, journal, workers=settings.gpus if device.is_gpu else 1,
                        timeout_s=settings.timeout_s, only=settings.only, observer=observer,
                        compile_workers=settings.compile_workers, prior=settings.prior)
    if settings.gpus > 1:
        top_k = spec.dcp_top_k if settings.dcp_top_k is None else settings.dcp_top_k
        result.measured_dcp = dcp_stage.run(spec, journal, settings.gpus, gpu=device.is_gpu,
                                            timeout_s=settings.timeout_s, top_k=top_k,
                                            observer=observer, graph=settings.dcp_graph)
    return result


def share_of(settings: SweepSettings, say: Say) -> SweepSpec:
    """The spec's problems this sweep runs: all, or those of its ``--shard``."""
    spec, share = settings.spec, settings.shard
    if share is None:
        return spec
    whole = len(spec.problems)
    spec = share.of(spec)
    if not spec.problems:
        raise SweepError(f"shard {share} holds none of the spec's {whole} problems: use "
                         f"fewer shares")
    say(f"shard {share}: {len(spec.problems)} of the {whole} problems")
    return spec


def open_journal(settings: SweepSettings, say: Say) -> Journal:
    """The sweep's journal, saying what became of an earlier one: resumed (Journal checks
    it was written for this spec and device) or, with ``fresh``, moved aside."""
    path = settings.journal_path
    moved = moved_aside(settings.table_path, path) if settings.fresh else []
    if not settings.fresh:
        refuse_overwriting(settings.table_path, path)
    existed = path.exists()
    try:
        journal = Journal(path, settings.header(), resume=True)
    except JournalError as exc:
        hint = "" if "in use by another sweep" in str(exc) else \
            " (--fresh starts over, moving the earlier journal and table aside)"
        raise SweepError(f"{exc}{hint}") from None
    except OSError as exc:  # its folder cannot be made or written (an OutputError)
        raise SweepError(f"cannot write journal {path}: {exc.strerror}" if exc.strerror
                         else str(exc)) from None
    if moved:
        say("starting over; the earlier run moved to " + ", ".join(map(str, moved)))
    elif existed:
        say(f"resuming {path}: {len(journal.records)} results recorded before "
            f"(--fresh starts over)")
    else:
        say(f"new journal {path}")
    return journal


def refuse_overwriting(table_path: Path, journal_path: Path) -> None:
    """A table at ``--out`` that its journal does not hold (no journal, or one of no result)
    is someone's earlier work, which the sweep would overwrite: a SweepError unless the
    journal has results to rebuild it from (a resumed sweep) or is damaged (that error is
    the journal's to report)."""
    tables = [p for p in (table_path, table_path.with_suffix(".csv")) if p.exists()]
    if not tables:
        return
    try:
        if journal_path.exists() and journals.read(journal_path)[1]:
            return
    except JournalError:
        return
    raise SweepError(f"{tables[0]} exists and no journal of its results is beside it "
                     f"({journal_path}): this sweep would overwrite it; --fresh moves it "
                     f"aside, or name another --out")


def moved_aside(table_path: Path, journal_path: Path) -> list[Path]:
    """--fresh: the earlier run moved aside while holding the journal's lock, so no sweep
    can start on (or be running with) the files being moved. The lock is journal.py's
    flock, taken and given back as a Journal does; refused (one line) while another
    sweep holds it."""
    try:
        with journals.locked(journal_path):
            return move_aside(table_path, journal_path)
    except JournalError as exc:
        raise SweepError(f"{exc}: --fresh would move its files from under it") from None
    except OSError as exc:  # the lock file cannot be made, or a rename failed
        raise SweepError(f"--fresh could not move the earlier run aside: "
                         f"{exc.strerror or exc}"
                         + (f" ({exc.filename})" if exc.filename else "")) from None


def move_aside(table_path: Path, journal_path: Path) -> list[Path]:
    """An earlier run's table (.parquet, .csv) and journal, renamed with the UTC time
    after the table's stem: still a table and journal pair (`--out` the moved .parquet
    resumes it), and nothing is deleted."""
    stem = table_path.with_suffix("")
    olds = [p for p in (table_path, table_path.with_suffix(".csv"), journal_path) if p.exists()]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    n = 0
    while True:  # two --fresh runs within a second must not overwrite the first
        tag = stamp if n == 0 else f"{stamp}-{n}"
        news = [p.with_name(f"{stem.name}.{tag}{p.name[len(stem.name):]}") for p in olds]
        if not any(p.exists() for p in news):
            break
        n += 1
    for old, new in zip(olds, news, strict=True):
        old.rename(new)
    return news


def write_table(result: SweepResult, spec: SweepSpec, settings: SweepSettings,
                figures: str = "") -> None:
    """The journal's records folded into the table, written as Parquet and CSV; ``figures``:
    the device's ``mlatune.hardware`` record (JSON) the journal's header holds."""

    known = {r.id for r in routes.all_routes()}
    unknown = sorted({r.route for r in result.records} - known)
    if unknown:  # a damaged line, or a plugin's route this process did not load
        raise SweepError(f"{settings.journal_path} holds results of {', '.join(map(repr, unknown))}"
                         f", not a registered route here (a plugin's? MLATUNE_PLUGINS loads "
                         f"it); no table written")
    provenance = Provenance.here(spec.sha256, figures)
    made = _made_utc(settings.table_path) if result.ran == 0 else None
    if made is not None:  # a rerun that measured nothing: the rows' time is the earlier run's
        provenance = replace(provenance, created_utc=made)
    try:
        frame = table.build(table_rows(result.records, settings.device), provenance,
                            facts=routes.FACTS,
                            sharing=routes.plan_sharing())
        table.write(frame, settings.table_path)
        table.write(frame, settings.csv_path)
    except (OSError, TableError) as exc:  # OutputError: the disk; TableError: a bad row
        raise SweepError(f"{exc}; every result is in {settings.journal_path}: rerun to "
                         f"write the table") from None


def _made_utc(path: Path) -> str | None:
    """When the table at ``path`` was made (its rows' latest ``created_utc``); None where
    there is none to read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        times = [t for t in pq.read_table(path, columns=["created_utc"]).column(0).to_pylist()
                 if t]
    except (OSError, KeyError, pa.ArrowException):
        return None
    return max(times, default=None)


def refined(spec: SweepSpec, table_path: Path, dispatcher_for: Callable[[Path], Any],
            budget_s: float) -> tuple[SweepSpec, list[Any]]:
    """--refine: the spec whose problems are the points between the measured grid's that
    ``mlatune.sweep.refine`` proposes within ``budget_s`` worker seconds, and those
    proposals (``refine.Refinement``, the least certain first). ``dispatcher_for`` loads the
    table into the dispatcher whose predictions the proposals rest on."""

    path = journal_path(table_path)
    if not (table_path.exists() and path.exists()):
        raise SweepError(f"--refine adds points to a measured grid: {table_path} and its "
                         f"journal do not exist yet (run the sweep without --refine first)")
    try:
        records = journals.read_records(path)[1]
        dispatcher = dispatcher_for(table_path)
    except (JournalError, TableError, OSError) as exc:
        raise SweepError(str(exc)) from None
    measured = {r.problem_key: r.problem for r in records if r.ok}
    chosen = refinement.propose(dispatcher, measured.values(), records, budget_s)
    return replace(spec, problems=tuple(r.problem for r in chosen)), chosen
