"""Dispatch tables (schema v3): build, write, read (upgrading v1 and v2), validate, merge.

A table is a DataFrame with exactly the columns of ``schema.COLUMN_TYPES``,
one row per (device, problem, route). It is stored as Parquet (provenance also
in the file metadata, JSON under the ``mlatune`` key) or CSV (provenance only
in its columns), so either file stands alone. Writes go to a fresh temporary
file in the same directory and are renamed into place (``outputs.atomic_write``),
so a reader never sees half a table and a planted symlink is never followed; a
write that fails (a full disk, a read-only file system, a directory in the way)
is an OutputError, one line. Reading is data only: pyarrow for Parquet, pandas'
CSV parser for CSV; nothing is ever unpickled or evaluated, and whatever a
damaged file makes them raise is a TableError naming the file.

CSV text cells that start like a spreadsheet formula (``=``, ``+``, ``-``, ``@``,
tab, carriage return) are written with a ``'`` in front, as OWASP advises
against CSV injection; so is a cell that starts with ``'``, and reading removes
one leading ``'`` from every text cell, so any text round-trips. Only free text
(``reason``, ``device_name``, ``driver``, the version strings) can start so:
route ids, statuses, dtypes and JSON params never do, and numbers are never
touched.

Provenance rules: a table may hold several devices (a merge of runs on several
GPUs) and several runs per device, but all rows of one device must come from
one software environment (every provenance field but the ``RUN_FIELDS`` equal),
because timings taken under different torch or driver versions do not rank
against each other.

A schema v1 or v2 table is upgraded as it is read (``upgrade``; what that fills in
is in ``mlatune.table.schema``), so the rest of mlatune sees only v3; a table newer
than this mlatune is refused. ``read_versioned`` also says which version the
file held (``mlatune upgrade`` writes an older table back as v3).
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mlatune.errors import TableError
from mlatune.problem import BUCKET_FIELDS, KEY_FIELDS, MLAProblem
from mlatune.steps import PLAN_PLACES, StepKinds
from mlatune.table import winners_map
from mlatune.table.cost import DEFAULT_CALLER, Caller, caller_cost
from mlatune.table.outputs import FORMULA_STARTS, atomic_write
from mlatune.table.schema import (
    COLUMN_TYPES,
    COLUMNS,
    DCP_COLUMNS,
    DCP_MEASURED,
    DCP_SCHEMES,
    DCP_TIMINGS,
    DEVICE_COLUMNS,
    KEY_COLUMNS,
    PROVENANCE_TYPES,
    ROW_KEY,
    SCHEMA_VERSION,
    STATUSES,
    STEP_COST_COLUMNS,
    STEP_KIND_COLUMNS,
    UNKNOWN_STEP_KIND,
    Provenance,
    competing,
    default_dcp_timing,
    upgraded_provenance,
)

FORMATS = ("parquet", "csv")
METADATA_KEY = b"mlatune"
# Provenance fields that may differ between runs on one device; the rest must not.
RUN_FIELDS = ("created_utc", "spec_sha256", "converted_from")
ENVIRONMENT_FIELDS = tuple(f for f in PROVENANCE_TYPES if f not in RUN_FIELDS)
_ROUTE_ID = re.compile(r"^[a-z0-9][a-z0-9-]*/[a-z0-9][a-z0-9-]*$")
_EXAMPLES = 3  # values quoted per problem: enough to find them, short enough for one line


def _dtype(name: str):
    return pd.api.types.pandas_dtype(name)


def _has_type(series: pd.Series, name: str) -> bool:
    """Whether a column holds the schema type (any pandas string storage counts as string)."""
    if name == "string":
        return isinstance(series.dtype, pd.StringDtype)
    return series.dtype == _dtype(name)


def _gzipped(path: str | os.PathLike) -> bool:
    """A ``.csv.gz`` table: CSV, gzip-compressed (how a large table ships in the repo)."""
    return Path(path).name.lower().endswith(".csv.gz")


def format_of(path: str | os.PathLike) -> str:
    suffix = "csv" if _gzipped(path) else Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise TableError(f"{path}: unknown table format {Path(path).suffix or '(no suffix)'!r}; "
                         f"expected .parquet, .csv or .csv.gz")
    return suffix


# Building ------------------------------------------------------------------

_STEP_COLUMNS = (*STEP_KIND_COLUMNS, *STEP_COST_COLUMNS)


def build(rows: Iterable[Mapping[str, Any]], provenance: Provenance,
          step_kinds: StepKinds | None = None, sharing: Collection[str] = ()) -> pd.DataFrame:
    """A table from result rows (KEY_COLUMNS + RESULT_COLUMNS but ``rank``), ranked for the
    default caller (``sharing``: the routes whose host plan one step's calls share).

    The step and DCP columns are optional: a row without plan_on or capturable gets
    the route's declaration, one without a cost NaN (not measured), one without DCP
    columns was not measured across processes.
    """
    optional = (*_STEP_COLUMNS, *DCP_COLUMNS)
    required = [c for c in COLUMNS if c != "rank" and c not in PROVENANCE_TYPES
                and c not in optional]
    records = []
    for i, row in enumerate(rows):
        missing = [c for c in required if c not in row]
        if missing:
            raise ValueError(f"result row {i} lacks {', '.join(missing)}")
        records.append({c: row[c] for c in (*required, *optional) if c in row})
    frame = pd.DataFrame.from_records(records, columns=[*required, *optional])
    frame = _fill_dcp_columns(_fill_step_kinds(frame, step_kinds))
    for name, value in provenance.as_dict().items():
        frame[name] = value
    frame["rank"] = 0
    frame = coerce(frame[list(COLUMNS)])
    return assign_ranks(frame, DEFAULT_CALLER, sharing)


def _declared_step_kinds(frame: pd.DataFrame, step_kinds: StepKinds | None
                         ) -> tuple[pd.Series, pd.Series]:
    """(plan_on, capturable) the routes declare for each row's params, asked once per
    distinct (route, params); UNKNOWN_STEP_KIND where either column is missing."""
    if "route" not in frame or "route_params" not in frame or frame.empty:
        return (pd.Series(UNKNOWN_STEP_KIND[0], index=frame.index, dtype=object),
                pd.Series(UNKNOWN_STEP_KIND[1], index=frame.index, dtype=object))
    pair_id = frame.groupby(["route", "route_params"], sort=False,
                            dropna=False).ngroup().to_numpy()
    firsts = np.unique(pair_id, return_index=True)[1]
    declared = step_kinds or (lambda route, params: UNKNOWN_STEP_KIND)
    kinds = [declared(str(route), str(params)) for route, params in
             zip(frame["route"].iloc[firsts], frame["route_params"].iloc[firsts], strict=True)]
    plan_on = np.array([k[0] for k in kinds], dtype=object)
    capturable = np.array([k[1] for k in kinds], dtype=object)
    return (pd.Series(plan_on[pair_id], index=frame.index),
            pd.Series(capturable[pair_id], index=frame.index))


def _fill_step_kinds(frame: pd.DataFrame, step_kinds: StepKinds | None) -> pd.DataFrame:
    """plan_on and capturable from the routes' declarations where a row has none."""
    out = frame.copy()
    unset = out["plan_on"].isna() | out["capturable"].isna()
    if unset.any():
        plan_on, capturable = _declared_step_kinds(out[unset], step_kinds)
        out["plan_on"] = out["plan_on"].astype(object)
        out["capturable"] = out["capturable"].astype(object)
        out.loc[unset & out["plan_on"].isna(), "plan_on"] = plan_on
        out.loc[unset & out["capturable"].isna(), "capturable"] = capturable
    return out


def _fill_dcp_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """Where a row has no DCP timing, it was not measured across processes."""
    out = frame.copy()
    unset = out["dcp_timing"].isna()
    if unset.any():
        out["dcp_timing"] = out["dcp_timing"].astype(object)
        out.loc[unset, "dcp_timing"] = [default_dcp_timing(int(d))
                                        for d in out.loc[unset, "dcp_size"]]
    out["dcp_scheme"] = out["dcp_scheme"].astype(object).where(out["dcp_scheme"].notna(), "")
    return out


def upgrade(frame: pd.DataFrame, version: int = 1, step_kinds: StepKinds | None = None
            ) -> pd.DataFrame:
    """An older table as the current schema (see mlatune.table.schema): v1's step kinds from
    ``step_kinds`` and costs NaN; v1 and v2's DCP rows simulated; every one ranked again by
    step cost; provenance ``schema_version`` current and ``converted_from`` the version a
    row was measured as."""
    out = frame.copy() if version < 3 else _ranked_again(frame)
    if version == 3:
        return out
    changed = list(DCP_COLUMNS)
    if version == 1:
        out["plan_on"], out["capturable"] = _declared_step_kinds(out, step_kinds)
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
    ordered = [c for c in COLUMNS if c in out] + [c for c in out if c not in COLUMN_TYPES]
    return _ranked_again(out[ordered])


def _ranked_again(frame: pd.DataFrame) -> pd.DataFrame:
    """A v3 table's rows ranked by step cost, its provenance v4 (``converted_from`` kept where
    a row was converted before, else "v3"); a damaged one as found, for validate."""
    try:
        out = frame.copy()
        converted = out["converted_from"].astype(str)
        out["converted_from"] = converted.where(converted != "", "v3")
        out["schema_version"] = np.int64(SCHEMA_VERSION)
        ranked = assign_ranks(out)
    except Exception:
        return frame
    return ranked.astype({c: frame[c].dtype for c in ("converted_from", "schema_version")})


def coerce(frame: pd.DataFrame) -> pd.DataFrame:
    """Cast known columns to their schema types (for tables built in memory)."""
    out = frame.copy()
    for name, kind in COLUMN_TYPES.items():
        if name in out:
            out[name] = out[name].astype(_dtype(kind))
    return out


def _simulated_tier(frame: pd.DataFrame) -> pd.Series:
    """0 for a row measured across processes, 1 otherwise: measured rows rank first."""
    return (frame["dcp_timing"] != DCP_MEASURED).astype("int64")


def competing_rows(frame: pd.DataFrame, by: Sequence[str] = KEY_COLUMNS) -> pd.Series:
    """``schema.competing`` over a frame: True for the rows that compete within their group
    of ``by`` (a problem by default; a bucket for what a predictor learns from). Only an
    ``ok`` measured row counts: a group whose measured runs all failed keeps its simulated
    rows, as the dispatcher (which reads ok rows alone) does."""
    measured = frame["dcp_timing"] == DCP_MEASURED
    if "status" in frame.columns:
        measured &= frame["status"] == "ok"
    if not measured.any():
        return pd.Series(True, index=frame.index)
    groups = frame.groupby(list(by), sort=False, dropna=False).ngroup()
    return pd.Series(competing(groups.tolist(), measured.tolist()), index=frame.index)


def step_costs(frame: pd.DataFrame, caller: Caller = DEFAULT_CALLER,
               sharing: Collection[str] = ()) -> np.ndarray:
    """Each row's ``cost.step_cost`` for ``caller``; ``sharing``: the routes whose host plan
    the calls of one step share."""
    return caller_cost(caller, frame["time_us"].to_numpy(dtype=float),
                       frame["plan_on"].to_numpy(dtype=object),
                       frame["plan_us"].to_numpy(dtype=float),
                       frame["plan_host_us"].to_numpy(dtype=float),
                       frame["route"].isin(list(sharing)).to_numpy())


def assign_ranks(frame: pd.DataFrame, caller: Caller = DEFAULT_CALLER,
                 sharing: Collection[str] = ()) -> pd.DataFrame:
    """rank 1, 2, ... among the ``ok`` rows of each key that ``caller`` can call (a capturable
    caller: steps a graph replays): measured DCP rows first, then by what a step costs
    ``caller`` (``cost.step_cost``; ties by route id); 0 otherwise."""
    out = frame.reset_index(drop=True)
    ok = out[(out["status"] == "ok") & (out["capturable"].astype(bool) | (not caller.capturable))]
    ok = ok.assign(_tier=_simulated_tier(ok), _cost=step_costs(ok, caller, sharing))
    ok = ok.sort_values(["_tier", "_cost", "route"], kind="stable")
    ranks = ok.groupby(list(KEY_COLUMNS), sort=False, dropna=False).cumcount() + 1
    out["rank"] = np.zeros(len(out), dtype="int64")
    out.loc[ranks.index, "rank"] = ranks.astype("int64")
    out["rank"] = out["rank"].astype("int64")
    return out.sort_values([*KEY_COLUMNS, "route"], kind="stable").reset_index(drop=True)


def key_strings(frame: pd.DataFrame) -> list[str]:
    """``MLAProblem.key`` of every row, built column-wise (tested against the class)."""
    parts: list[Any] = []
    for i, name in enumerate(KEY_FIELDS):
        column = frame[name]
        if name == "causal":
            column = column.astype("int64")  # the key spells a bool as 1 or 0
        parts += [f"{'|' if i else ''}{name}=", pa.Array.from_pandas(column).cast(pa.string())]
    return pc.binary_join_element_wise(*parts, "").to_pylist()


def provenances(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The distinct provenance records of a table, sorted, as plain dicts."""
    cols = list(PROVENANCE_TYPES)
    if frame.empty or any(c not in frame or not _has_type(frame[c], PROVENANCE_TYPES[c])
                          or frame[c].isna().any() for c in cols):
        return []
    if all(frame[c].nunique() == 1 for c in cols):  # the common case, and cheap to see
        distinct = frame[cols].iloc[:1]
    else:
        distinct = frame[cols].drop_duplicates().sort_values(cols)
    return [{c: (int(v) if c == "schema_version" else str(v)) for c, v in zip(cols, row,
                                                                           strict=True)}
            for row in distinct.itertuples(index=False, name=None)]


# Writing -------------------------------------------------------------------

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


# Reading -------------------------------------------------------------------

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


def read(path: str | os.PathLike, check: bool = True, step_kinds: StepKinds | None = None
         ) -> pd.DataFrame:
    """Read a Parquet or CSV table, an older one upgraded to the current schema (a v1 one's
    step kinds from ``step_kinds``, else unknown); with ``check``, refuse (TableError) any
    invalid one."""
    return read_versioned(path, check, step_kinds)[0]


def read_versioned(path: str | os.PathLike, check: bool = True,
                   step_kinds: StepKinds | None = None) -> tuple[pd.DataFrame, int]:
    """``read``, and the schema version the file holds (1: upgraded as it was read;
    0 when the file does not say one version, which ``check`` refuses).

    Whatever a damaged file makes the readers or checks raise (Arrow errors,
    OverflowError, RecursionError, ...) is a TableError naming the file, one line."""
    try:
        return _read_versioned(Path(path), check, step_kinds)
    except TableError as exc:
        if "\n" in str(exc):  # a value quoted from the file: the message stays one line
            raise TableError(str(exc).replace("\n", " ")) from None
        raise
    except Exception as exc:  # a damage no check foresaw: still the file's fault
        raise TableError(f"{path}: unreadable table ({_one_line(exc)})") from exc


def _read_versioned(path: Path, check: bool, step_kinds: StepKinds | None
                    ) -> tuple[pd.DataFrame, int]:
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
        frame = upgrade(frame, stored, step_kinds)
        if isinstance(recorded, list):
            recorded = [upgraded_provenance(p, stored) if isinstance(p, dict) else p
                        for p in recorded]
    if recorded is not None:
        problems += _metadata_problems(recorded, frame)
    if check:
        problems += _validate(frame, unparsed)
        if problems:
            raise TableError(f"{path}: invalid table ({len(problems)} problem"
                             f"{'s' if len(problems) > 1 else ''}): " + "; ".join(problems))
    return frame, stored


def _stored_version(frame: pd.DataFrame, unparsed: set[str]) -> int:
    """The one schema_version every row of a file gives; 0 when it does not give one."""
    if "schema_version" not in frame or "schema_version" in unparsed:
        return 0
    column = frame["schema_version"]
    if not pd.api.types.is_integer_dtype(column.dtype) or len(column) == 0:
        return 0
    versions = pd.unique(column)
    return int(versions[0]) if len(versions) == 1 else 0


# Validation ----------------------------------------------------------------

def _examples(values: pd.Series | Sequence) -> str:
    shown = list(dict.fromkeys(map(repr, list(values))))
    more = f", ... ({len(shown)} distinct)" if len(shown) > _EXAMPLES else ""
    return ", ".join(shown[:_EXAMPLES]) + more


def validate(frame: pd.DataFrame) -> list[str]:
    """Every problem with a table, each one line; empty when the table is valid."""
    return _validate(frame, set())


def _validate(frame: pd.DataFrame, unparsed: set[str]) -> list[str]:
    problems: list[str] = []
    missing = [c for c in COLUMNS if c not in frame.columns]
    extra = [str(c) for c in frame.columns if c not in COLUMN_TYPES]
    if missing:
        problems.append(f"missing columns: {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected columns: {', '.join(extra)}")
    if frame.columns.duplicated().any():
        problems.append("duplicate column names")
        return problems
    if len(frame) == 0:
        problems.append("the table has no rows")
        return problems

    good = set()  # columns present, of the right type and without missing values
    for name, kind in COLUMN_TYPES.items():
        if name not in frame or name in unparsed:
            continue
        if not _has_type(frame[name], kind):
            problems.append(f"column {name} has dtype {frame[name].dtype}, expected {kind}")
            continue
        if kind != "float64":  # NaN is how a float says "not measured"
            nulls = int(frame[name].isna().sum())
            if nulls:
                problems.append(f"column {name} has {nulls} missing values")
                continue
        good.add(name)

    def have(*names: str) -> bool:
        return all(n in good for n in names)

    if have("schema_version"):
        versions = sorted(set(frame["schema_version"].tolist()))
        future = [v for v in versions if v > SCHEMA_VERSION]
        if future:
            problems.append(f"schema_version {future[-1]} is newer than this mlatune reads "
                            f"({SCHEMA_VERSION}); upgrade mlatune")
        if any(v < 1 for v in versions):
            problems.append(f"schema_version must be >= 1, got {versions[0]}")
        elif any(v < SCHEMA_VERSION for v in versions):
            # A file of one older version is upgraded as it is read; this is a mix.
            problems.append(f"schema_version {versions[0]} rows in a schema v{SCHEMA_VERSION} "
                            f"table (only a whole older table is upgraded)")
    if have("status"):
        unknown = ~frame["status"].isin(STATUSES)
        if unknown.any():
            problems.append(f"unknown status {_examples(frame['status'][unknown])} "
                            f"(expected one of {', '.join(STATUSES)})")
    if have("route"):
        routes = pd.unique(frame["route"])
        bad = [r for r in routes if not _ROUTE_ID.match(r)]
        if bad:
            problems.append(f"route ids not shaped '<family>/<backend>': {_examples(bad)}")
    if have("route_params"):
        bad = [p for p in pd.unique(frame["route_params"]) if not _is_json_object(p)]
        if bad:
            problems.append(f"route_params that are not JSON objects: {_examples(bad)}")
    # One dense id per (device, problem), shared by the row-level checks below.
    key_id = frame.groupby(list(KEY_COLUMNS), sort=False).ngroup().to_numpy() \
        if have(*KEY_COLUMNS) else None
    if key_id is not None and have("route"):
        route_code = pd.factorize(frame["route"])[0]
        dup = pd.Series(key_id * (route_code.max() + 1) + route_code).duplicated(keep=False)
        if dup.any():
            first = frame[dup.to_numpy()].iloc[0]
            problems.append(f"{int(dup.sum())} rows repeat a (device, problem, route) key, "
                            f"e.g. route {first['route']} at {first['arch']} "
                            f"{_row_key_text(first)}")
    if have("status", "time_us"):
        ok = frame["status"] == "ok"
        times = frame["time_us"]
        bad_time = ok & ~(np.isfinite(times) & (times > 0))
        if bad_time.any():
            problems.append(f"{int(bad_time.sum())} ok rows lack a positive finite time_us")
    if key_id is not None and have("status", "rank", "time_us", "route", "dcp_timing"):
        problems += _rank_problems(frame, key_id)
    problems += _step_problems(frame, have)
    problems += _dcp_problems(frame, have)
    if have(*PROVENANCE_TYPES, *DEVICE_COLUMNS):
        problems += _provenance_problems(frame)
    if key_id is not None:
        problems += _problem_problems(frame, key_id)
    return problems


def _step_problems(frame: pd.DataFrame, have: Callable[..., bool]) -> list[str]:
    """The step kind is one StepKind allows; costs are durations, or NaN (not measured)."""
    problems = []
    if have("plan_on"):
        unknown = ~frame["plan_on"].isin(PLAN_PLACES)
        if unknown.any():
            problems.append(f"unknown plan_on {_examples(frame['plan_on'][unknown])} "
                            f"(expected one of {', '.join(PLAN_PLACES)})")
    if have("plan_on", "capturable"):
        host_captured = (frame["plan_on"] == "host") & frame["capturable"]
        if host_captured.any():
            problems.append(f"{int(host_captured.sum())} rows planned on the host are "
                            f"capturable (a host plan cannot be captured)")
    if have("status", "plan_on", "plan_us"):
        plan_us = frame["plan_us"]
        planless = (frame["status"] == "ok") & (frame["plan_on"] == "none") \
            & plan_us.notna() & (plan_us != 0)
        if planless.any():
            problems.append(f"{int(planless.sum())} ok rows with plan_on 'none' have a "
                            f"plan_us other than 0, e.g. {_examples(plan_us[planless])}")
    for name in STEP_COST_COLUMNS:
        if have(name):
            cost = frame[name]
            bad = cost.notna() & ~(np.isfinite(cost) & (cost >= 0))
            if bad.any():
                problems.append(f"column {name} has {int(bad.sum())} values that are not a "
                                f"finite duration >= 0 or NaN, e.g. {_examples(cost[bad])}")
    return problems


def _dcp_problems(frame: pd.DataFrame, have: Callable[..., bool]) -> list[str]:
    """dcp_timing says how a DCP row was timed, and only a DCP row has one; only a
    measured row has a scheme."""

    problems = []
    if have("dcp_timing"):
        unknown = ~frame["dcp_timing"].isin(DCP_TIMINGS)
        if unknown.any():
            problems.append(f"unknown dcp_timing {_examples(frame['dcp_timing'][unknown])} "
                            f"(expected one of {', '.join(map(repr, DCP_TIMINGS))})")
        elif have("dcp_size"):
            wrong = (frame["dcp_timing"] == "") != (frame["dcp_size"] == 1)
            if wrong.any():
                problems.append(f"{int(wrong.sum())} rows have a dcp_timing that does not fit "
                                f"their dcp_size ('' exactly where dcp_size is 1)")
    if have("dcp_timing", "dcp_scheme"):
        measured = frame["dcp_timing"] == DCP_MEASURED
        bad = measured & ~frame["dcp_scheme"].isin(DCP_SCHEMES) \
            | ~measured & (frame["dcp_scheme"] != "")
        if bad.any():
            problems.append(f"{int(bad.sum())} rows have a dcp_scheme that does not fit their "
                            f"dcp_timing (one of {', '.join(DCP_SCHEMES)} exactly where measured), "
                            f"e.g. {_examples(frame['dcp_scheme'][bad])}")
    return problems


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _row_key_text(row: Mapping[str, Any]) -> str:
    return " ".join(f"{f}={row[f]}" for f in KEY_FIELDS)


def _rank_problems(frame: pd.DataFrame, key_id: np.ndarray) -> list[str]:
    problems = []
    ok = (frame["status"] == "ok").to_numpy()
    rank = frame["rank"].to_numpy()
    not_ok_winners = (rank == 1) & ~ok
    if not_ok_winners.any():
        row = frame[not_ok_winners].iloc[0]
        problems.append(f"{int(not_ok_winners.sum())} winners (rank 1) are not ok, e.g. "
                        f"{row['route']} with status {row['status']}")
    ranked_not_ok = ~ok & (rank != 0) & (rank != 1)
    if ranked_not_ok.any():
        problems.append(f"{int(ranked_not_ok.sum())} rows that are not ok have a rank other "
                        f"than 0")
    if (ok & (rank < 1)).any():
        problems.append(f"{int((ok & (rank < 1)).sum())} ok rows have no rank (rank < 1)")
    # Among the ok rows of a key, ranks are 1..n, measured DCP rows first, then by the default
    # caller's step cost. Which routes share a host plan is the routes' to say, so a rank is
    # refused only where no sharing could explain it: its least cost (host plan shared) above
    # the next row's most (not shared).
    keys, ranks = key_id[ok], rank[ok]
    rows = frame[ok]
    costed = all(c in frame for c in ("plan_on", "plan_us", "plan_host_us"))
    least = step_costs(rows, DEFAULT_CALLER, set(rows["route"])) if costed else None
    most = step_costs(rows, DEFAULT_CALLER, ()) if costed else None
    tiers = _simulated_tier(frame).to_numpy()[ok]
    order = np.lexsort((ranks, keys))
    keys, ranks, tiers = keys[order], ranks[order], tiers[order]
    starts = np.r_[True, keys[1:] != keys[:-1]]
    position = np.arange(len(keys))
    expected = position - np.maximum.accumulate(np.where(starts, position, 0)) + 1
    if (ranks != expected).any():
        problems.append("ranks of the ok rows of some keys are not 1, 2, ... n")
    else:
        same_tier = tiers[1:] == tiers[:-1]
        dearer = ~starts[1:] & same_tier & (most[order][1:] < least[order][:-1]) \
            if costed else np.zeros(len(same_tier), dtype=bool)
        if dearer.any():
            problems.append(f"{int(dearer.sum())} ranks contradict the step costs (a higher "
                            f"rank is cheaper)")
        measured_later = ~starts[1:] & (tiers[1:] < tiers[:-1])
        if measured_later.any():
            problems.append(f"{int(measured_later.sum())} measured DCP rows rank after "
                            f"simulated ones of their problem")
    return problems


def _provenance_problems(frame: pd.DataFrame) -> list[str]:
    if all(frame[f].nunique() == 1 for f in ENVIRONMENT_FIELDS):
        return []  # one environment for the whole table: nothing can be mixed
    problems = []
    per_device = frame.groupby(list(DEVICE_COLUMNS), sort=True)[list(ENVIRONMENT_FIELDS)]
    for device, row in per_device.nunique().iterrows():
        mixed = [f for f in ENVIRONMENT_FIELDS if row[f] > 1]
        if mixed:
            values = pd.unique(frame.loc[(frame["arch"] == device[0])
                                         & (frame["device_name"] == device[1])
                                         & (frame["cu_count"] == device[2]), mixed[0]])
            problems.append(f"mixed provenance for {device[0]} {device[1]}: "
                            f"{', '.join(mixed)} differ ({mixed[0]}: {_examples(values)})")
    return problems


def _problem_problems(frame: pd.DataFrame, key_id: np.ndarray) -> list[str]:
    """Rows whose key is not a valid MLAProblem.

    Speed matters (a dispatcher validates at model load), so each distinct
    bucket is checked once by MLAProblem itself, and the two continuous axes
    column-wise: batch and kv_len positive and qlen <= kv_len are the only
    rules that involve them (a test holds this equal to MLAProblem's own).
    """
    problems = []
    first = np.unique(key_id, return_index=True)[1]  # one row per problem
    keys = frame[list(KEY_FIELDS)].iloc[first]
    batch, kv_len, qlen = keys["batch"], keys["kv_len"], keys["qlen"]
    for name, column in (("batch", batch), ("kv_len", kv_len)):
        bad = column <= 0
        if bad.any():
            problems.append(f"invalid problem in {int(bad.sum())} keys: {name} must be a "
                            f"positive integer, got {_examples(column[bad])}")
    too_long = (qlen > kv_len) & (kv_len > 0)
    if too_long.any():
        row = keys[too_long].iloc[0]
        problems.append(f"invalid problem in {int(too_long.sum())} keys: qlen must not exceed "
                        f"kv_len, e.g. qlen={row['qlen']} kv_len={row['kv_len']}")
    buckets = keys[list(BUCKET_FIELDS)].drop_duplicates()
    for values in buckets.itertuples(index=False, name=None):
        row = dict(zip(BUCKET_FIELDS, values, strict=True))
        try:
            MLAProblem.from_key_dict({**row, "batch": 1, "kv_len": max(int(row["qlen"]), 1)})
        except (ValueError, TypeError) as exc:
            where = " ".join(f"{k}={v}" for k, v in row.items())
            problems.append(f"invalid problem at {where}: {exc}".replace("\n", " "))
    return problems


# Combining and summarising ---------------------------------------------------

def merge(tables: Sequence[pd.DataFrame], sharing: Collection[str] = ()) -> pd.DataFrame:
    """One table from several (runs, GPUs): per (device, problem, route) the best row
    (a DCP row measured across processes before a simulated one, whatever its status: it
    says what the real step does; then an ok row before any other, then the cheapest step
    for the default caller (``cost``); otherwise the newest), re-ranked. ``sharing``: the
    routes whose host plan the calls of one step share."""
    if not tables:
        raise TableError("merge needs at least one table")
    for i, table in enumerate(tables):
        problems = validate(table)
        if problems:
            raise TableError(f"table {i} is invalid: " + "; ".join(problems))
    both = pd.concat([t[list(COLUMNS)] for t in tables], ignore_index=True)
    both["_not_ok"] = both["status"] != "ok"
    both["_tier"] = _simulated_tier(both)
    both["_cost"] = step_costs(both, DEFAULT_CALLER, sharing)
    both = both.sort_values(["_tier", "_not_ok", "_cost", "created_utc"],
                            ascending=[True, True, True, False], kind="stable",
                            na_position="last")
    best = both.drop_duplicates(list(ROW_KEY), keep="first")
    merged = assign_ranks(best[list(COLUMNS)], DEFAULT_CALLER, sharing)
    problems = validate(merged)
    if problems:
        raise TableError("the merged table would be invalid: " + "; ".join(problems))
    return merged


def winners(frame: pd.DataFrame, caller: Caller = DEFAULT_CALLER,
            sharing: Collection[str] = ()) -> pd.DataFrame:
    """Each key's cheapest ok row for ``caller`` (``assign_ranks``)."""
    ranked = assign_ranks(frame, caller, sharing)
    return ranked[ranked["rank"] == 1].reset_index(drop=True)


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (device, problem): winner, runner-up, and the margin between them.

    ``margin`` is runner-up time / winner time - 1 (0.25: the runner-up is 25%
    slower); NaN without a runner-up. Keys with no ok row have winner "".
    """
    keys = frame[list(KEY_COLUMNS)].drop_duplicates()
    # A measured winner's runner-up is measured too: a simulated one is no comparison.
    ranked = frame.loc[frame["rank"].isin([1, 2]) & competing_rows(frame),
                       [*KEY_COLUMNS, "rank", "route", "time_us", "route_params"]]
    first = ranked[ranked["rank"] == 1].drop(columns="rank").rename(
        columns={"route": "winner", "time_us": "winner_us", "route_params": "winner_params"})
    second = ranked[ranked["rank"] == 2].drop(columns=["rank", "route_params"]).rename(
        columns={"route": "runner_up", "time_us": "runner_up_us"})
    counts = frame.groupby(list(KEY_COLUMNS), sort=False).agg(
        routes=("route", "size"), ok_routes=("status", lambda s: int((s == "ok").sum())))
    out = keys.merge(first, on=list(KEY_COLUMNS), how="left").merge(
        second, on=list(KEY_COLUMNS), how="left").merge(
        counts.reset_index(), on=list(KEY_COLUMNS), how="left")
    for name in ("winner", "runner_up", "winner_params"):
        out[name] = out[name].astype(_dtype("string")).fillna("")
    out["margin"] = out["runner_up_us"] / out["winner_us"] - 1.0
    return out.sort_values(list(KEY_COLUMNS), kind="stable").reset_index(drop=True)


def diff(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int]]:
    """Winners that differ between two tables, and counts of what matched.

    Per (device, problem) in both: A's and B's winner and time, and
    ``change`` = B's winner time / A's winner time - 1 (negative: B is faster).
    A key differs when its winning route or its params changed.
    """
    cols = [*KEY_COLUMNS, "route", "route_params", "time_us"]
    wa, wb = winners(a)[cols], winners(b)[cols]
    joined = wa.merge(wb, on=list(KEY_COLUMNS), how="outer", suffixes=("_a", "_b"),
                      indicator=True)
    both = joined[joined["_merge"] == "both"]
    changed = both[(both["route_a"] != both["route_b"])
                   | (both["route_params_a"] != both["route_params_b"])].copy()
    changed["change"] = changed["time_us_b"] / changed["time_us_a"] - 1.0
    counts = {
        "same": int(len(both) - len(changed)),
        "changed": len(changed),
        "only_a": int((joined["_merge"] == "left_only").sum()),
        "only_b": int((joined["_merge"] == "right_only").sum()),
    }
    changed = changed.drop(columns="_merge").sort_values(list(KEY_COLUMNS), kind="stable")
    return changed.reset_index(drop=True), counts


# JSON winners map (format in mlatune.table.winners_map) ------------------------

def winners_json(frame: pd.DataFrame, winners_only: bool = False) -> dict[str, Any]:
    """The winners map of a valid table (see mlatune.table.winners_map for the format): per device
    each key's ok routes that compete (``competing_rows``) and, kept even with
    ``winners_only``, the routes that failed."""
    frame = frame[competing_rows(frame) | (frame["status"] != "ok")]
    frame = frame.sort_values([*KEY_COLUMNS, "rank", "route"], kind="stable")
    devices = []
    for device, rows in frame.groupby(list(DEVICE_COLUMNS), sort=True):
        entries, all_failed = _device_winners(rows, winners_only)
        devices.append({
            "arch": str(device[0]), "device_name": str(device[1]), "cu_count": int(device[2]),
            "provenance": provenances(rows), "winners": entries, "all_failed": all_failed})
    return {"format": winners_map.FORMAT, "schema_version": SCHEMA_VERSION,
            "key_fields": list(KEY_FIELDS), "devices": devices}


def _device_winners(rows: pd.DataFrame, winners_only: bool
                    ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, list[str]]]]:
    """One device's winner entries (key order, winner first) and its keys with no ok row."""
    ok = rows["status"] == "ok"
    chosen = rows[ok & (rows["rank"] == 1)] if winners_only else rows[ok]
    entries: dict[str, dict[str, Any]] = {}
    for key, option in zip(key_strings(chosen), _options(chosen), strict=True):
        if key not in entries:
            entries[key] = option if winners_only else {**option, "alternatives": []}
        else:
            entries[key]["alternatives"].append(option)
    failed: dict[str, list[tuple[str, str]]] = {}
    bad = rows[~ok]
    for key, route, status in zip(key_strings(bad), bad["route"].tolist(),
                                  bad["status"].tolist(), strict=True):
        failed.setdefault(key, []).append((str(route), str(status)))
    all_failed = {}
    for key, pairs in failed.items():
        target = entries.get(key)
        if target is None:
            all_failed[key] = winners_map.failed_object(pairs)
        else:
            target["failed"] = winners_map.failed_object(pairs)
    return entries, all_failed


def _options(rows: pd.DataFrame) -> Iterable[dict[str, Any]]:
    """Each row as a winners-map option; a cost not measured (NaN) as null."""
    columns = ["route", "route_params", "time_us", "dcp_timing", *_STEP_COLUMNS]
    for route, params, time_us, timing, plan_on, capturable, *costs in rows[columns].itertuples(
            index=False, name=None):
        yield {"route": str(route), "params": json.loads(params), "time_us": float(time_us),
               "plan_on": str(plan_on), "capturable": bool(capturable),
               **{name: None if math.isnan(c) else float(c)
                  for name, c in zip(STEP_COST_COLUMNS, costs, strict=True)},
               **({"dcp_timing": DCP_MEASURED} if timing == DCP_MEASURED else {})}


def write_json(document: Mapping[str, Any], path: str | os.PathLike) -> Path:
    path = Path(path)
    text = json.dumps(document, separators=(",", ":"), sort_keys=False, allow_nan=False)
    atomic_write(path, lambda h: h.write(text.encode() + b"\n"))
    return path
