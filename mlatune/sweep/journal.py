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

One sweep at a time: a sweep holds an exclusive ``flock`` on ``<journal>.lock``
while it appends (the lock file holds its pid, and is removed when it closes);
a second sweep on the same journal is refused, naming that pid. The kernel drops
the lock of a killed sweep, so a stale lock file never blocks a resume. The
journal itself is created with O_EXCL under that lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from mlatune.arch import DeviceInfo
from mlatune.errors import JournalError, OutputError
from mlatune.sweep.records import Record, as_record, present, split_line

__all__ = ["FSYNC_INTERVAL_S", "Journal", "JournalError", "JournalHeader", "lock_path",
           "locked", "read", "read_records"]

FSYNC_INTERVAL_S = 1.0
# Result fields a sweep reads, with their JSON types, checked where present.
_TEXT_FIELDS = ("kind", "id", "status", "route", "route_params", "reason", "timer", "plan_on",
                "dcp_timing", "dcp_scheme")
_NUMBER_FIELDS = ("time_us", "time_us_p20", "time_us_p80", "rel_err", "max_abs_err",
                  "tb_per_s", "tflops", "plan_us", "plan_host_us", "launch_host_us",
                  "comm_us", "simulated_us")
_RESUME_FIELDS = ("id", "status")  # what the journal itself needs to resume


@dataclass(frozen=True, kw_only=True)
class JournalHeader:
    """A journal's first line: the spec (its path and ``spec_sha256``), the device
    (``DeviceInfo``'s fields, and ``device_name``) and, for one share of a spec, the
    ``shard`` ("I/N"). Read (``from_json``: fields a header lacks stay None, unknown ones
    are kept in ``extra``) and written (``to_json``) here only, the same line back."""

    spec_sha256: str | None = None
    spec: str | None = None
    arch: str | None = None
    name: str | None = None
    vendor: str | None = None
    cu_count: int | None = None
    memory_bytes: int | None = None
    index: int | None = None
    device_name: str | None = None
    shard: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # fields this code does not know

    @classmethod
    def of(cls, spec_sha256: str, spec: str, device: DeviceInfo, shard: str | None = None
           ) -> JournalHeader:
        """The header of a sweep of ``spec`` on ``device`` (one ``shard`` of it, or all)."""
        return cls(spec_sha256=spec_sha256, spec=spec, **device.as_dict(),
                   device_name=device.name, shard=shard)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JournalHeader:
        """A header line (its ``kind`` left out); an empty one where a journal has none."""
        known, extra = split_line(data, _HEADER_FIELDS)
        return cls(**known, extra=extra)

    def to_json(self) -> dict[str, Any]:
        """The header line: its fields (not None), the unknown ones it came with."""
        return {"kind": "header", **present(self, _HEADER_FIELDS), **self.extra}

    @property
    def device(self) -> DeviceInfo:
        """The device the journal was written on (TypeError where the header lacks it)."""
        return DeviceInfo(**{f.name: getattr(self, f.name) for f in fields(DeviceInfo)})

    def mismatch(self, sweep: JournalHeader) -> str:
        """Why a journal with this header cannot be resumed by ``sweep``; "" when it can."""
        for name in ("spec_sha256", "arch", "device_name"):
            if getattr(self, name) != getattr(sweep, name):
                return f"was written for {name}={getattr(self, name)!r}, this sweep has " \
                       f"{getattr(sweep, name)!r}"
        if self.shard != sweep.shard:  # None: the whole spec
            return f"was written for {_share(self.shard)}, this sweep runs {_share(sweep.shard)}"
        return ""


_HEADER_FIELDS = tuple(f.name for f in fields(JournalHeader) if f.name != "extra")


def _header(header: JournalHeader | Mapping[str, Any]) -> JournalHeader:
    return header if isinstance(header, JournalHeader) else JournalHeader.from_json(header)


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
            _unlock(self._lock, self.path)
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
            mismatch = (found or JournalHeader()).mismatch(header)
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
        return {r.id for r in self.records}

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
            _unlock(self._lock, self.path)


def _share(shard: str | None) -> str:
    return f"shard {shard}" if shard else "the whole spec (no --shard)"


def lock_path(journal: Path) -> Path:
    """The lock file a sweep holds while it appends to ``journal``."""
    journal = Path(journal)
    return journal.with_name(journal.name + ".lock")


@contextlib.contextmanager
def locked(journal: Path) -> Iterator[None]:
    """Hold the journal's lock as a sweep does, without opening it (``--fresh`` moves an
    earlier run aside under it); JournalError while another sweep holds it."""
    handle = _lock(Path(journal))
    try:
        yield
    finally:
        _unlock(handle, Path(journal))


def _lock(journal: Path) -> IO[bytes]:
    """An exclusive, non-blocking flock on the journal's lock file, with our pid in it."""
    path = lock_path(journal)
    try:
        journal.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot write journal {journal}: {_why(exc)}") from None
    while True:
        try:
            handle = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "r+b")
        except OSError as exc:
            raise OutputError(f"cannot lock journal {journal}: {_why(exc)}") from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = handle.read(32).decode("ascii", "replace").strip()
            handle.close()
            pid = holder if holder.isdigit() else "unknown"
            raise JournalError(f"journal {journal} is in use by another sweep (pid {pid})"
                               ) from None
        except OSError as exc:  # a file system without flock
            handle.close()
            raise JournalError(f"cannot lock journal {journal}: {_why(exc)}") from None
        if _still_at(handle, path):
            break
        handle.close()  # its holder removed it after we opened it: lock the new one
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n".encode())
    handle.flush()
    return handle


def _still_at(handle: IO[bytes], path: Path) -> bool:
    try:
        here, there = os.fstat(handle.fileno()), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _unlock(handle: IO[bytes], journal: Path) -> None:
    # Removed while still held: a sweep that opened it meanwhile sees it gone and retries.
    with contextlib.suppress(OSError):
        os.unlink(lock_path(journal))
    handle.close()


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _damaged(path: Path, line: int, what: str) -> JournalError:
    return JournalError(f"{path}: line {line} is damaged ({what}); a damaged line that is not "
                        f"the last one is not what a kill leaves: repair or delete the journal")


def _drop_torn_tail(path: Path) -> None:
    """Cut a half-written last line (a kill mid-write), so appends start on a fresh line."""
    with path.open("rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)


def read(path: Path) -> tuple[dict, list[dict]]:
    """(header, result lines as raw dicts); a torn final line is dropped. Reads gzipped
    journals (``.gz``, as results are committed) too. Raises JournalError, naming the
    file and line, for anything else that is damaged."""
    header, numbered = _read_numbered(Path(path))
    return header, [record for _, record in numbered]


def read_records(path: Path) -> tuple[JournalHeader, list[Record]]:
    """``read``, typed: the header a ``JournalHeader`` (an empty one where the journal has
    none), each result a ``Record``; JournalError for a line no Record holds (a result
    without a status, or with one no one knows)."""
    header, numbered = _read_numbered(Path(path))
    return _typed_header(Path(path), header), [_typed(Path(path), line, record)
                                                for line, record in numbered]


def _typed_header(path: Path, header: dict) -> JournalHeader:
    try:
        return JournalHeader.from_json(header)
    except TypeError as exc:
        raise JournalError(f"{path}: its header is damaged ({exc}): repair or delete the "
                           f"journal") from None


def _typed(path: Path, line: int, record: dict) -> Record:
    try:
        return Record.from_json(record)
    except (KeyError, ValueError, TypeError) as exc:
        raise _damaged(path, line, f"not a result record ({type(exc).__name__}: {exc})"
                       ) from None


def _read_numbered(path: Path) -> tuple[dict, list[tuple[int, dict]]]:
    """(header, [(line number, result record)])."""
    lines = _raw_lines(path)
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    header: dict = {}
    records: list[tuple[int, dict]] = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # bad JSON or UTF-8; deep nesting
            if i == last:  # the last line, torn by a kill
                break
            raise _damaged(path, i + 1, "not JSON") from None
        problem = _shape_problem(obj)
        if problem:
            raise _damaged(path, i + 1, problem)
        if obj.get("kind") == "header":
            header = obj
        else:
            records.append((i + 1, obj))
    return header, records


def _raw_lines(path: Path) -> list[bytes]:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # a cut or damaged .gz
        raise JournalError(f"{path}: not a readable gzip journal ({exc})") from None
    except OSError as exc:
        raise JournalError(f"{path}: cannot read ({_why(exc)})") from None
    return data.split(b"\n")


def _shape_problem(obj: Any) -> str:
    """What is wrong with a journal line's JSON, or "" when nothing is."""
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    for name in _TEXT_FIELDS:
        if name in obj and not isinstance(obj[name], str):
            return f"{name} is not text"
    for name in _NUMBER_FIELDS:
        value = obj.get(name)
        if value is None and name != "time_us":  # null: not measured (NaN also is)
            continue
        if name in obj and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return f"{name} is not a number"
    if "capturable" in obj and not isinstance(obj["capturable"], bool):
        return "capturable is not true or false"
    key = obj.get("key")
    if "key" in obj and not (isinstance(key, dict) and all(
            isinstance(v, (int, float, str, bool)) for v in key.values())):
        return "key is not an object of numbers, text and booleans"
    return ""
