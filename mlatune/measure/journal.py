"""Reading a sweep journal: one JSON line per finished candidate, after a header line.

A torn last line (a sweep killed mid-write) is dropped; any other damaged line is a
JournalError naming the file and the line (a damaged line in the middle is not what a kill
leaves, so its candidate must not vanish silently). Gzipped journals (``.gz``) read too.
The journal is written by ``mlatune.sweep.journal``; the predictor and the report read it.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mlatune.arch import DeviceInfo
from mlatune.errors import JournalError
from mlatune.hardware import Hardware
from mlatune.measure.records import Record, present, split_line

__all__ = ["JournalHeader", "read", "read_records"]

# Result fields a sweep reads, with their JSON types, checked where present.
_TEXT_FIELDS = ("kind", "id", "status", "route", "route_params", "reason", "timer", "plan_on",
                "dcp_timing", "dcp_scheme")
_NUMBER_FIELDS = ("time_us", "time_us_p20", "time_us_p80", "rel_err", "max_abs_err",
                  "lse_err", "tb_per_s", "tflops", "plan_us", "plan_host_us", "launch_host_us",
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
    hardware: str | None = None  # the device's ``mlatune.hardware.Hardware``, as JSON
    extra: dict[str, Any] = field(default_factory=dict)  # fields this code does not know

    @classmethod
    def of(cls, spec_sha256: str, spec: str, device: DeviceInfo, shard: str | None = None,
           figures: Hardware | None = None) -> JournalHeader:
        """The header of a sweep of ``spec`` on ``device`` (one ``shard`` of it, or all)."""
        return cls(spec_sha256=spec_sha256, spec=spec, **device.as_dict(),
                   device_name=device.name, shard=shard,
                   hardware=figures.as_json() if figures is not None else None)

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


def _share(shard: str | None) -> str:
    return f"shard {shard}" if shard else "the whole spec (no --shard)"


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _damaged(path: Path, line: int, what: str) -> JournalError:
    return JournalError(f"{path}: line {line} is damaged ({what}); a kill leaves at most a "
                        f"torn last line, and this is not one: repair or delete the journal")


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
        typed = Record.from_json(record)
        if typed.key:
            typed.problem  # noqa: B018 - a key must name a valid problem
        return typed
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
