"""Append-only sweep journal: one JSON line per finished candidate.

A line is written and flushed as soon as its candidate finishes, so a killed
sweep loses only what was in flight (lines reach the disk itself at most a
second later); a torn last line (killed mid-write) is ignored on reading. The
first line is a header naming the spec, the device and, for a sweep of one
share of a spec (``--shard I/N``), the share as ``"shard": "I/N"``; resuming
refuses a journal written for another spec, device or share.

Damage: every line but a torn last one must be a JSON object, and the fields a
sweep reads must have their types (``key`` an object, ``route`` text, times
numbers, ...); a resumed journal's results must also have an ``id`` and a
``status``. Anything else is a JournalError naming the file and the line: a
damaged line in the middle is not what a kill leaves, so it is not skipped
silently (its candidate would vanish from the table).

One sweep at a time: a sweep holds ``<journal>.lock`` (a ``filelock.FileLock``: an
``flock`` on Unix) while it appends; a second sweep on the same journal is refused at
once, not kept waiting. The lock file stays beside the journal: the kernel drops the
lock of a finished or killed sweep, so it never blocks a resume. The journal itself is
created with O_EXCL under that lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from filelock import FileLock, Timeout

from mlatune.errors import JournalError, OutputError
from mlatune.measure.journal import (
    _RESUME_FIELDS,
    JournalHeader,
    _damaged,
    _header,
    _read_numbered,
    _typed,
    _typed_header,
    _why,
    read,
    read_records,
)
from mlatune.measure.records import Record, Status, as_record, killed_from_outside

__all__ = ["FSYNC_INTERVAL_S", "Journal", "JournalError", "JournalHeader", "lock_path",
           "locked", "read", "read_records"]

FSYNC_INTERVAL_S = 1.0



class Journal:
    def __init__(self, path: Path, header: JournalHeader | Mapping[str, Any], resume: bool):
        self.path = Path(path)
        self.header = _header(header)
        self.records: list[Record] = []
        self._synced = -FSYNC_INTERVAL_S
        self._broken = False
        self._lock = _lock(self.path)  # first: creating and resuming must not race
        try:
            self._file = self._open(self.header, resume)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, header: JournalHeader, resume: bool) -> IO[str]:
        if self.path.exists():
            if not resume:
                raise JournalError(f"{self.path} exists: pass --resume to continue that sweep, "
                                   "or delete it to start over")
            found = self._resume()
            if not found and not self.records:  # killed before its header reached the disk
                self._file = self._opened(lambda: self.path.open("a", encoding="utf-8"))
                self._write(header.to_json())
                return self._file
            mismatch = "has no header line (not a sweep's journal, or its first line lost)" \
                if found is None else found.mismatch(header)
            if mismatch:
                raise JournalError(f"{self.path} {mismatch}; use another --out or delete the "
                                   f"journal")
            return self._opened(lambda: self.path.open("a", encoding="utf-8"))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        handle = self._opened(lambda: os.fdopen(os.open(self.path, flags, 0o666), "w",
                                                encoding="utf-8"))
        self._file = handle
        try:
            self._write(header.to_json())
        except OutputError:  # a journal without its header could never be resumed
            with contextlib.suppress(OSError):
                handle.close()
            self.path.unlink(missing_ok=True)
            raise
        return handle

    def _resume(self) -> JournalHeader | None:
        """The header of the journal on disk (None: it has none); its results into
        ``records``."""
        try:
            _drop_torn_tail(self.path)
        except OSError as exc:
            raise JournalError(f"{self.path}: cannot resume ({_why(exc)})") from None
        found, numbered = _read_numbered(self.path)
        for line, record in numbered:
            missing = [f for f in _RESUME_FIELDS if f not in record]
            if missing:
                raise _damaged(self.path, line, f"a result without {', '.join(missing)}")
        self.records = [_typed(self.path, line, record) for line, record in numbered]
        return _typed_header(self.path, found) if found else None

    def _opened(self, open_it) -> IO[str]:
        try:
            return open_it()
        except FileExistsError:  # only a writer that ignores the lock gets here
            raise JournalError(f"{self.path} was created by someone else meanwhile; "
                               f"rerun with --resume") from None
        except OSError as exc:
            raise OutputError(f"cannot write journal {self.path}: {_why(exc)}") from None

    @property
    def done_ids(self) -> set[str]:
        """The candidates a resumed sweep does not run again: all that have a result, but
        one whose only result is a kill from outside (``records.killed_from_outside``),
        which runs once more, and one a prior table pruned (the rerun's prior decides)."""
        runs = Counter(r.id for r in self.records)
        return {r.id for r in self.records if r.status is not Status.PRUNED
                and (runs[r.id] > 1 or not killed_from_outside(r))}

    def append(self, record: Record | dict) -> None:
        self.extend([record])

    def extend(self, records: list[Record] | list[dict]) -> None:
        """Append several records with one flush to disk (a sweep's thousands of
        ``unsupported`` verdicts arrive together)."""
        typed = [as_record(r) for r in records]
        self._write(*({"kind": "result", **r.to_json()} for r in typed))
        self.records.extend(typed)

    def _write(self, *objs: dict) -> None:
        if self._broken:  # a line after a half-written one would damage the middle
            raise OutputError(f"cannot write journal {self.path}: an earlier write failed")
        text = "".join(json.dumps(o, sort_keys=True, allow_nan=True) + "\n" for o in objs)
        try:
            self._file.write(text)
            # Flushed at once: a killed sweep loses nothing written. Synced to the disk
            # at most once a second: fsync only guards against the machine going down,
            # and one per candidate would keep the GPUs waiting on the disk.
            self._file.flush()
            now = time.monotonic()
            if now - self._synced >= FSYNC_INTERVAL_S:
                os.fsync(self._file.fileno())
                self._synced = now
        except OSError as exc:  # a full disk: what was written stays, as a torn last line
            self._broken = True
            raise OutputError(f"cannot write journal {self.path}: {_why(exc)}") from exc

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise OutputError(f"cannot write journal {self.path}: {_why(exc)}") from exc
        finally:
            with contextlib.suppress(OSError):  # a failed flush: the torn tail stays
                self._file.close()
            self._lock.release()


def lock_path(journal: Path) -> Path:
    """The lock file a sweep holds while it appends to ``journal``."""
    journal = Path(journal)
    return journal.with_name(journal.name + ".lock")


@contextlib.contextmanager
def locked(journal: Path) -> Iterator[None]:
    """Hold the journal's lock as a sweep does, without opening it (``--fresh`` moves an
    earlier run aside under it); JournalError while another sweep holds it."""
    lock = _lock(Path(journal))
    try:
        yield
    finally:
        lock.release()


def _lock(journal: Path) -> FileLock:
    """The journal's lock, held: taken at once or refused (JournalError), never waited
    for. It belongs to the journal, not to a thread."""
    try:
        journal.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot write journal {journal}: {_why(exc)}") from None
    lock = FileLock(lock_path(journal), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise JournalError(f"journal {journal} is in use by another sweep") from None
    except NotImplementedError as exc:  # a file system without flock (filelock 3)
        raise JournalError(f"cannot lock journal {journal}: {exc}") from None
    except OSError as exc:  # a read-only folder
        raise OutputError(f"cannot lock journal {journal}: {_why(exc)}") from None
    return lock


def _drop_torn_tail(path: Path) -> None:
    """Cut a half-written last line (a kill mid-write), so appends start on a fresh line."""
    with path.open("rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)


