"""The user table that tuning at model load writes into (``MLATUNE_USER_TABLE``, which the
dispatcher overlays on the bundled table problem by problem), and the journals that make a
crash lose nothing.

``merge_into`` is a read-modify-write under ``<table>.lock`` (``mlatune.table.user.update``,
which first-sight timing takes too), the new file written beside the old one and renamed
over it (``table.write``): two processes merging at once both keep their rows, and a reader sees
the old table or the new one, never half of one. A row of the same (device, problem,
route) is replaced by the newer one; every other row stays (``table.merge`` re-ranks).

Each tuning process journals into its own file in ``journals_dir(table)``, a folder beside
the table. A journal whose lock no live process holds is an orphan (its process crashed, or
its budget ran out mid-problem): the next tuning process adopts its results for the
problems the table still does not measure, and deletes it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

from mlatune import routes, table
from mlatune.arch import DeviceInfo
from mlatune.errors import JournalError
from mlatune.measure.records import Record, table_rows
from mlatune.problem import MLAProblem
from mlatune.sweep import journal as journals
from mlatune.sweep.journal import Journal, JournalHeader
from mlatune.table import user
from mlatune.table.schema import Provenance

AT_LOAD_SPEC = "at-load"  # the spec_sha256 its journals and rows carry: not from a sweep spec


def default_path() -> Path:
    """Where the user table lives when none is named: the per-user cache folder."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "mlatune" / "user-table.parquet"


def journals_dir(path: Path) -> Path:
    """The folder of the tuning journals of the user table at ``path``."""
    return path.with_name(f".{path.name}.journals")


def check_path(path: Path) -> None:
    """TableError, before anything is timed, for a user table path no merge could write: not
    .parquet or .csv, or a folder."""
    from mlatune.errors import TableError
    from mlatune.table.files import format_of

    format_of(path)
    if path.is_dir():
        raise TableError(f"{path}: a folder, not a table file")


def merge_into(path: Path, records: Iterable[Record], device: DeviceInfo) -> int:
    """Fold ``records`` (a sweep's, of whole problems) into the table at ``path`` (created
    when absent; .parquet or .csv), atomically; the number of rows they make. TableError
    for a user table that cannot be read (it is left as it is), OutputError for one that
    cannot be written."""
    sharing = routes.plan_sharing()
    new = table.build(table_rows(records, device), Provenance.here(AT_LOAD_SPEC),
                      facts=routes.FACTS, sharing=sharing)
    if new.empty:
        return 0
    user.merge(path, new, routes.FACTS, sharing)
    return len(new)


def open_journal(path: Path, device: DeviceInfo,
                 measured: Callable[[MLAProblem], bool]) -> Journal:
    """This process's journal for the user table at ``path``, holding first what orphaned
    journals of the same device recorded for problems ``measured`` still says no to."""
    folder = journals_dir(path)
    folder.mkdir(parents=True, exist_ok=True)
    header = JournalHeader.of(AT_LOAD_SPEC, AT_LOAD_SPEC, device)
    name = f"{os.getpid()}-{secrets.token_hex(4)}.jsonl"
    journal = Journal(folder / name, header, resume=False)
    try:
        for orphan in sorted(folder.glob("*.jsonl")):
            if orphan != journal.path:
                _adopt(orphan, journal, device, measured)
    except BaseException:
        journal.close()
        raise
    return journal


def _adopt(orphan: Path, journal: Journal, device: DeviceInfo,
           measured: Callable[[MLAProblem], bool]) -> None:
    """An orphaned journal's results for problems not measured yet into ``journal``, then
    the orphan deleted (after: a failed write loses nothing); one a live process holds, or
    of another device, left alone."""
    try:
        with journals.locked(orphan):
            if not orphan.exists():  # adopted by another process meanwhile
                return
            header, records = journals.read_records(orphan)
            if (header.arch, header.device_name) != (device.arch, device.name):
                return
            journal.extend([r for r in records if r.key and not measured(r.problem)])
            orphan.unlink()
            with contextlib.suppress(OSError):
                journals.lock_path(orphan).unlink()
    except (JournalError, OSError):  # in use, damaged or gone: not ours to take
        return


def close_journal(journal: Journal, keep: bool) -> Path | None:
    """Close this process's journal; delete it unless it must be ``keep``t (it holds
    results of problems not written to the table). The path kept, or None."""
    journal.close()
    if keep:
        return journal.path
    journal.path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        journals.lock_path(journal.path).unlink()
    return None
