"""Tables on disk: Parquet (provenance also in the file metadata, JSON under the ``mlatune``
key) or CSV (provenance only in its columns), so either file stands alone.

Writes go to a fresh temporary file in the same directory and are renamed into place
(``outputs.atomic_write``), so a reader never sees half a table and a planted symlink is
never followed; a write that fails is an OutputError, one line. Reading is data only:
pyarrow for Parquet, pandas' CSV parser for CSV; nothing is ever unpickled or evaluated,
and whatever a damaged file makes them raise is a TableError naming the file.

CSV text cells that start like a spreadsheet formula (``=``, ``+``, ``-``, ``@``, tab,
carriage return) are written with a ``'`` in front, as OWASP advises against CSV
injection; so is a cell that starts with ``'``, and reading removes one leading ``'`` from
every text cell, so any text round-trips.

An older table is upgraded as it is read (``upgrade``; what that fills in is in
``mlatune.table.schema``); a table newer than this mlatune is refused. ``read_versioned``
also says which version the file held (``mlatune upgrade`` writes it back as current).
"""

from __future__ import annotations

import csv
import gzip
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from mlatune.errors import TableError
from mlatune.steps import RouteFacts
from mlatune.table.checks import _examples, _validate, param_problems, validate
from mlatune.table.frame import (
    _STEP_COLUMNS,
    _declared_step_kinds,
    _dtype,
    assign_ranks,
    provenances,
)
from mlatune.table.outputs import FORMULA_STARTS, atomic_write
from mlatune.table.schema import (
    COLUMN_TYPES,
    COLUMNS,
    DCP_COLUMNS,
    SCHEMA_VERSION,
    STEP_COST_COLUMNS,
    Status,
    default_dcp_timing,
    upgraded_provenance,
)

FORMATS = ("parquet", "csv")
METADATA_KEY = b"mlatune"



def _csv_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with every text cell as ``outputs.csv_text_cell`` writes it: a cell
    that starts like a spreadsheet formula (``=``, ``+``, ``-``, ``@``, tab, CR) or with
    ``'`` gets a ``'`` in front, which reading removes (``_parse_csv_column``). Numbers
    stay numbers; of the text columns only free text (``reason``, ``device_name``,
    ``driver``, versions) can start so: route ids, statuses, dtypes and JSON params
    cannot."""
    out = frame.copy()
    for name, kind in COLUMN_TYPES.items():
        if kind == "string" and name in out:
            text = out[name]
            marked = text.str.startswith((*FORMULA_STARTS, "'")).fillna(False).astype(bool)
            if marked.any():
                out[name] = text.where(~marked, "'" + text)
    return out



def write(frame: pd.DataFrame, path: str | os.PathLike, fmt: str | None = None) -> Path:
    """Write a valid table atomically as Parquet or CSV (by suffix unless ``fmt``).

    Raises TableError for an invalid table, OutputError (one line) when the file
    cannot be written (a directory in the way, a full disk, a read-only file system)."""
    path = Path(path)
    fmt = fmt or format_of(path)
    problems = validate(frame)
    if problems:
        raise TableError(f"refusing to write an invalid table to {path}: " + "; ".join(problems))
    frame = frame[list(COLUMNS)].reset_index(drop=True)
    if fmt == "parquet":
        table = pa.Table.from_pandas(frame, preserve_index=False)
        meta = {"schema_version": SCHEMA_VERSION, "provenance": provenances(frame)}
        table = table.replace_schema_metadata(
            {**(table.schema.metadata or {}), METADATA_KEY: json.dumps(meta).encode()})
        atomic_write(path, lambda h: pq.write_table(table, h))
    elif fmt == "csv":
        # Floats print in their shortest round-trip form; NaN as an empty field. Every
        # field is quoted, so a stray carriage return in a reason cannot end a row.
        text = _csv_safe(frame).to_csv(index=False, na_rep="", lineterminator="\n",
                                       quoting=csv.QUOTE_ALL)
        data = text.encode()
        if _gzipped(path):
            data = gzip.compress(data, mtime=0)  # mtime 0: the same table, the same bytes
        atomic_write(path, lambda h: h.write(data))
    else:
        raise TableError(f"{path}: unknown table format {fmt!r}; expected one of {FORMATS}")
    return path



def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")



def _read_parquet(path: Path) -> tuple[pd.DataFrame, list[str], Any]:
    """The frame, its problems so far, and the provenance the file metadata records
    (None when missing or damaged: that is among the problems)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise TableError(f"{path}: not a readable Parquet table ({_one_line(exc)})") from None
    problems = []
    recorded = None
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    frame = table.to_pandas()
    for name, kind in COLUMN_TYPES.items():
        # Only stored text is normalised; any other stored type is kept so validate sees it.
        if kind == "string" and name in frame:
            stored = table.schema.field(name).type
            if pa.types.is_string(stored) or pa.types.is_large_string(stored):
                frame[name] = frame[name].astype(_dtype("string"))
    if raw is None:
        problems.append("Parquet file metadata has no 'mlatune' provenance")
    else:
        try:
            recorded = json.loads(raw)["provenance"]
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"Parquet 'mlatune' metadata is damaged ({_one_line(exc)})")
    return frame, problems, recorded



def _metadata_problems(recorded: Any, frame: pd.DataFrame) -> list[str]:
    found = provenances(frame)  # empty when the columns are damaged (reported later)
    if found and recorded != found:
        return ["Parquet 'mlatune' metadata provenance does not match the provenance columns"]
    return []



def _parse_csv_column(text: pd.Series, kind: str) -> pd.Series | None:
    """A CSV text column as its schema type, or None when some value does not parse."""
    if kind == "string":  # a leading ' was added by _csv_safe
        return text.where(~text.str.startswith("'"), text.str[1:]).astype(_dtype("string"))
    if kind == "int64":
        if not text.str.fullmatch(r"-?\d+").all():
            return None
        return text.astype("int64")
    if kind == "float64":
        numbers = pd.to_numeric(text.where(text != "", None), errors="coerce")
        if (numbers.isna() & (text != "") & (text.str.lower() != "nan")).any():
            return None
        return numbers.astype("float64")
    if kind == "bool":
        lowered = text.str.lower()
        if not lowered.isin(["true", "false", "1", "0"]).all():
            return None
        return lowered.isin(["true", "1"]).astype("bool")
    raise AssertionError(kind)



def _read_csv(path: Path) -> tuple[pd.DataFrame, list[str], set[str]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TableError(f"{path}: cannot read ({_one_line(exc)})") from None
    if not data:
        raise TableError(f"{path}: empty file")
    if _gzipped(path):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise TableError(f"{path}: not a readable gzip file ({_one_line(exc)})") from None
    # The writer ends every row with a newline: a file that does not end with
    # one was cut short (a cut exactly at a row boundary cannot be detected).
    if not data.endswith(b"\n"):
        raise TableError(f"{path}: truncated CSV (the last row has no line end)")
    try:
        import io

        frame = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False,
                            na_filter=False, encoding="utf-8")
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise TableError(f"{path}: not a readable CSV table ({_one_line(exc)})") from None
    problems, unparsed = [], set()
    for name, kind in COLUMN_TYPES.items():
        if name not in frame:
            continue
        parsed = _parse_csv_column(frame[name].astype(str), kind)
        if parsed is None:
            bad = frame[name].astype(str)
            problems.append(f"column {name} has values that are not {kind} "
                            f"(e.g. {_examples(bad[_unparsable(bad, kind)])})")
            unparsed.add(name)
        else:
            frame[name] = parsed
    return frame, problems, unparsed



def _unparsable(text: pd.Series, kind: str) -> pd.Series:
    if kind == "int64":
        return ~text.str.fullmatch(r"-?\d+")
    if kind == "bool":
        return ~text.str.lower().isin(["true", "false", "1", "0"])
    numbers = pd.to_numeric(text.where(text != "", None), errors="coerce")
    return numbers.isna() & (text != "") & (text.str.lower() != "nan")



def read(path: str | os.PathLike, check: bool = True, facts: RouteFacts | None = None
         ) -> pd.DataFrame:
    """Read a Parquet or CSV table, an older one upgraded to the current schema (a v1 one's
    step kinds from ``facts``, else unknown); with ``check``, refuse (TableError) any
    invalid one."""
    return read_versioned(path, check, facts)[0]



def read_versioned(path: str | os.PathLike, check: bool = True,
                   facts: RouteFacts | None = None) -> tuple[pd.DataFrame, int]:
    """``read``, and the schema version the file holds (1: upgraded as it was read;
    0 when the file does not say one version, which ``check`` refuses).

    Whatever a damaged file makes the readers or checks raise (Arrow errors,
    OverflowError, RecursionError, ...) is a TableError naming the file, one line."""
    try:
        return _read_versioned(Path(path), check, facts)
    except TableError as exc:
        if "\n" in str(exc):  # a value quoted from the file: the message stays one line
            raise TableError(str(exc).replace("\n", " ")) from None
        raise
    except Exception as exc:  # a damage no check foresaw: still the file's fault
        raise TableError(f"{path}: unreadable table ({_one_line(exc)})") from exc



def _read_versioned(path: Path, check: bool, facts: RouteFacts | None
                    ) -> tuple[pd.DataFrame, int]:
    if path.is_dir():
        raise TableError(f"{path}: a directory, not a table file (.parquet, .csv or .csv.gz)")
    fmt = format_of(path)
    if not path.is_file():
        raise TableError(f"{path}: no such file")
    unparsed: set[str] = set()
    recorded = None
    if fmt == "parquet":
        frame, problems, recorded = _read_parquet(path)
    else:
        frame, problems, unparsed = _read_csv(path)
    stored = _stored_version(frame, unparsed)
    if 1 <= stored < SCHEMA_VERSION:
        frame = upgrade(frame, stored, facts)
        if isinstance(recorded, list):
            recorded = [upgraded_provenance(p, stored) if isinstance(p, dict) else p
                        for p in recorded]
    if facts is not None:
        frame = current_params(frame, facts)
    if recorded is not None:
        problems += _metadata_problems(recorded, frame)
    if check:
        problems += _validate(frame, unparsed)
        if facts is not None:
            problems += param_problems(frame, facts)
        if problems:
            raise TableError(f"{path}: invalid table ({len(problems)} problem"
                             f"{'s' if len(problems) > 1 else ''}): " + "; ".join(problems))
    return frame, stored



def current_params(frame: pd.DataFrame, facts: RouteFacts) -> pd.DataFrame:
    """Each row under the route its parameters belong to (``RouteFacts.route_of``: a kernel
    form that became a route of its own) and in that route's current spelling
    (``RouteFacts.upgrade_params``), asked once per distinct pair; a row whose set names a
    deleted kernel form is stale (rank 0, the rest ranked again); a damaged table as found,
    for validate."""
    if frame.empty or not {"route", "route_params", "status", "rank"} <= set(frame.columns):
        return frame
    pair_id = frame.groupby(["route", "route_params"], sort=False).ngroup().to_numpy()
    firsts = np.unique(pair_id, return_index=True)[1]
    stored = list(zip(frame["route"].iloc[firsts], frame["route_params"].iloc[firsts],
                      strict=True))
    routes, texts, stale = [], [], []
    for route, text in stored:
        home, current = _current(facts, str(route), text)
        routes.append(route if home == str(route) else home)
        texts.append(text if current is None else current)
        stale.append(current is None)
    if not any(stale) and list(zip(routes, texts, strict=True)) == stored:
        return frame
    out = frame.copy()
    for column, values in (("route", routes), ("route_params", texts)):
        out[column] = pd.Series(np.array(values, dtype=object)[pair_id], index=out.index,
                                dtype=frame[column].dtype)
    gone = np.array(stale)[pair_id]
    if gone.any():
        out.loc[gone, "status"] = Status.STALE.value
        out.loc[gone, "rank"] = 0
        out = assign_ranks(out, sharing=facts.plan_sharing())
    return out


def _current(facts: RouteFacts, route: str, text: str) -> tuple[str, str | None]:
    """A stored (route, params text) as the routes read it now: the route the set belongs to
    and the text in its spelling (None: a deleted form); a text that is no JSON object as
    found, for validate."""
    try:
        params = json.loads(text)
    except (TypeError, ValueError):  # not JSON: validate names it
        return route, text
    if not isinstance(params, dict):
        return route, text
    home = facts.route_of(route, params)
    current = facts.upgrade_params(home, params)
    if current is None:
        return home, None
    return home, text if dict(current) == params else json.dumps(dict(current), sort_keys=True)


def _stored_version(frame: pd.DataFrame, unparsed: set[str]) -> int:
    """The one schema_version every row of a file gives; 0 when it does not give one."""
    if "schema_version" not in frame or "schema_version" in unparsed:
        return 0
    column = frame["schema_version"]
    if not pd.api.types.is_integer_dtype(column.dtype) or len(column) == 0:
        return 0
    versions = pd.unique(column)
    return int(versions[0]) if len(versions) == 1 else 0



def upgrade(frame: pd.DataFrame, version: int = 1, facts: RouteFacts | None = None
            ) -> pd.DataFrame:
    """An older table as the current schema (see mlatune.table.schema): v1's step kinds from
    ``facts`` and costs NaN; v1 and v2's DCP rows simulated; v1-v4's ``lse_err`` NaN; v1-v5's
    ``hardware`` ""; v1-v3
    ranked again by step cost (v4 already is); provenance ``schema_version`` current and
    ``converted_from`` the version a row was measured as."""
    out = _stepped_and_timed(frame, version, facts) if version < 3 else frame.copy()
    if "lse_err" not in out:  # never measured before v5
        out["lse_err"] = pd.Series(np.nan, index=out.index, dtype=_dtype("float64"))
    if "hardware" not in out:  # never recorded before v6
        out["hardware"] = pd.Series("", index=out.index, dtype=_dtype("string"))
    out = _marked_current(out[[c for c in COLUMNS if c in out]
                              + [c for c in out if c not in COLUMN_TYPES]], version)
    return out if version >= 4 else _ranked_again(out, facts)



def _stepped_and_timed(frame: pd.DataFrame, version: int, facts: RouteFacts | None
                       ) -> pd.DataFrame:
    """A v1 or v2 table with v2's step columns (v1: declared by ``facts``, costs NaN) and
    v3's DCP columns (simulated where dcp_size > 1), its provenance upgraded."""
    out = frame.copy()
    changed = list(DCP_COLUMNS)
    if version == 1:
        out["plan_on"], out["capturable"] = _declared_step_kinds(out, facts)
        for name in STEP_COST_COLUMNS:
            out[name] = np.nan
        changed += _STEP_COLUMNS
    out["dcp_timing"] = [default_dcp_timing(int(d)) if str(d).lstrip("-").isdigit() else ""
                         for d in out["dcp_size"]] if "dcp_size" in out else ""
    out["dcp_scheme"] = ""
    out["comm_us"] = out["simulated_us"] = np.nan
    # The provenance columns as upgraded_provenance spells them, so they stay constant.
    provenance = upgraded_provenance({}, version)
    for name, value in provenance.items():
        out[name] = value
    # Only the columns set here are cast: a damaged old column stays as found, for validate.
    for name in (*changed, *provenance):
        out[name] = out[name].astype(_dtype(COLUMN_TYPES[name]))
    return out



def _marked_current(frame: pd.DataFrame, version: int) -> pd.DataFrame:
    """The table's provenance current: ``schema_version`` this schema's, ``converted_from``
    kept where a row was converted before, else ``version``'s; a damaged one as found, for
    validate."""
    try:
        out = frame.copy()
        converted = out["converted_from"].astype(str)
        out["converted_from"] = converted.where(converted != "", f"v{version}")
        out["schema_version"] = np.int64(SCHEMA_VERSION)
        return out.astype({c: frame[c].dtype for c in ("converted_from", "schema_version")})
    except Exception:
        return frame



def _ranked_again(frame: pd.DataFrame, facts: RouteFacts | None) -> pd.DataFrame:
    """A v1-v3 table's rows ranked by step cost; a damaged one as found, for validate."""
    try:
        return assign_ranks(frame, sharing=facts.plan_sharing() if facts else ())
    except Exception:
        return frame



def format_of(path: str | os.PathLike) -> str:
    suffix = "csv" if _gzipped(path) else Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        suffixes = "".join(Path(path).suffixes) or "(no suffix)"
        raise TableError(f"{path}: unknown table format {suffixes!r}; expected .parquet, .csv "
                         f"or .csv.gz")
    return suffix



def _gzipped(path: str | os.PathLike) -> bool:
    """A ``.csv.gz`` table: CSV, gzip-compressed (how a large table ships in the repo)."""
    return Path(path).name.lower().endswith(".csv.gz")
