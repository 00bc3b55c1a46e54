"""Append-only sweep journal: one JSON line per finished candidate.

A line is written and flushed as soon as its candidate finishes, so a killed
sweep loses only what was in flight (lines reach the disk itself at most a
second later); a torn last line (killed mid-write) is ignored on reading. The
first line is a header naming the spec and the device; resuming refuses a
journal written for another spec or device.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

FSYNC_INTERVAL_S = 1.0


class JournalError(ValueError):
    pass


class Journal:
    def __init__(self, path: Path, header: dict, resume: bool):
        self.path = Path(path)
        self.records: list[dict] = []
        self._synced = -FSYNC_INTERVAL_S
        if self.path.exists():
            if not resume:
                raise JournalError(f"{self.path} exists: pass --resume to continue that sweep, "
                                   "or delete it to start over")
            _drop_torn_tail(self.path)
            found, self.records = read(self.path)
            for field in ("spec_sha256", "arch", "device_name"):
                if found.get(field) != header.get(field):
                    raise JournalError(
                        f"{self.path} was written for {field}={found.get(field)!r}, this sweep "
                        f"has {header.get(field)!r}; use another --out or delete the journal")
            self._file = self.path.open("a", encoding="utf-8")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
            self._write({"kind": "header", **header})

    @property
    def done_ids(self) -> set[str]:
        return {r["id"] for r in self.records}

    def append(self, record: dict) -> None:
        self.extend([record])

    def extend(self, records: list[dict]) -> None:
        """Append several records with one flush to disk (a sweep's thousands of
        ``unsupported`` verdicts arrive together)."""
        records = [{"kind": "result", **r} for r in records]
        self._write(*records)
        self.records.extend(records)

    def _write(self, *objs: dict) -> None:
        self._file.write("".join(json.dumps(o, sort_keys=True, allow_nan=True) + "\n"
                                 for o in objs))
        # Flushed at once: a killed sweep loses nothing written. Synced to the disk
        # at most once a second: fsync only guards against the machine going down,
        # and one per candidate would keep the GPUs waiting on the disk.
        self._file.flush()
        now = time.monotonic()
        if now - self._synced >= FSYNC_INTERVAL_S:
            os.fsync(self._file.fileno())
            self._synced = now

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def _drop_torn_tail(path: Path) -> None:
    """Cut a half-written last line (a kill mid-write), so appends start on a fresh line."""
    with path.open("rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)


def read(path: Path) -> tuple[dict, list[dict]]:
    """(header, result records); a torn final line is dropped. Reads gzipped
    journals (``.gz``, as results are committed) too."""
    header: dict = {}
    records: list[dict] = []
    path = Path(path)
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz"
          else path.open(encoding="utf-8")) as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # the last line, torn by a kill
                break
            raise JournalError(f"{path}: line {i + 1} is not JSON") from None
        if obj.get("kind") == "header":
            header = obj
        else:
            records.append(obj)
    return header, records
