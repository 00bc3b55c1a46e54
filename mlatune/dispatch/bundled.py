"""Which bundled table serves a GPU: files named ``<arch>.<ext>`` or ``<arch>-<model>.<ext>``
in the package's tables folder, the GPU's own model first, else the nearest measured model by
datasheet (``mlatune.hardware``), else the arch's generic file (``table_choice``)."""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from mlatune import hardware


def bundled_tables_dir() -> Any:
    """The tables shipped in the package (mlatune/tables links to the repository's tables/)."""
    return resources.files("mlatune").joinpath("tables")


_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class TableChoice:
    """The bundled table a GPU loads and why: ``match`` "model" (measured on its GPU model),
    "nearest" (the measured model closest in bandwidth, SMs and tensor throughput: served as
    the loader's ``other_gpu`` says), or "arch" (the only or first table of the arch: no model
    of it could be told)."""

    path: Any
    model: str  # the model a file name gives (sm_90-h100.parquet: "h100"); "" for none
    match: str
    why: str


def find_table(directory: Path | Any, arch: str, device_name: str = "") -> Any:
    """The table for ``arch`` in a directory (``table_choice``'s path); None without one."""
    choice = table_choice(directory, arch, device_name)
    return None if choice is None else choice.path


def table_choice(directory: Path | Any, arch: str, device_name: str = "") -> TableChoice | None:
    """The table for ``arch`` in a directory: files named ``<arch>.<ext>`` or
    ``<arch>-<model>.<ext>``. The GPU's own model first (the file's model's words are the
    device name's, "h100" in "NVIDIA H100 80GB HBM3", and no datasheet tells them apart), else
    the nearest measured model by datasheet (``mlatune.hardware``), else the arch's generic
    file, then by name; within a model by format (.parquet, then the winners map's .json and
    .json.gz, then .csv; without pandas and pyarrow, as the runtime install has them, only
    winners maps)."""
    if directory is None or not directory.is_dir():
        return None
    formats = (".parquet", ".json", ".json.gz", ".csv") if reads_frames() else \
        (".json", ".json.gz")  # Parquet and CSV need pandas and pyarrow
    found = [(f, _format_rank(f.name, formats)) for f in directory.iterdir() if f.is_file()]
    found = [(f, r, _model_of(f.name, arch, formats[r])) for f, r in found if r is not None
             and (f.name.lower().startswith((arch + ".", arch + "-")))]
    if not found:
        return None
    words = set(_WORD.findall(device_name.lower()))
    sheet = hardware.datasheet(device_name)  # "h100" names the SXM, not the PCIe card
    mine = [x for x in found if x[2] and set(_WORD.findall(x[2])) <= words
            and (sheet is None or hardware.datasheet(x[2]) in (None, sheet))]
    if mine:
        f, _, model = min(mine, key=lambda x: (x[1], x[0].name))
        return TableChoice(f, model, "model", f"measured on this GPU model ({model})")
    near = _nearest_model(device_name, sorted({x[2] for x in found if x[2]}))
    if near is not None:
        model, why = near
        f, _, _ = min((x for x in found if x[2] == model), key=lambda x: (x[1], x[0].name))
        return TableChoice(f, model, "nearest", why)
    f, _, model = min(found, key=lambda x: (x[2] != "", x[1], x[0].name))
    return TableChoice(f, model, "arch", f"no table names {device_name or 'this GPU'}'s "
                                         f"model; the arch's {'first' if model else 'own'} "
                                         f"table")


def table_models(directory: Path | Any, arch: str) -> list[str]:
    """The GPU models the tables for ``arch`` in a directory name ("" for ``<arch>.<ext>``)."""
    if directory is None or not directory.is_dir():
        return []
    formats = (".parquet", ".json", ".json.gz", ".csv")
    found = {_model_of(f.name, arch, formats[r]) for f in directory.iterdir()
             if (r := _format_rank(f.name, formats)) is not None
             and f.name.lower().startswith((arch + ".", arch + "-"))}
    return sorted(found)


def _model_of(name: str, arch: str, ext: str) -> str:
    """The model a table file names: "sm_90-h100.parquet" -> "h100"; "sm_90.parquet" -> ""."""
    stem = name.lower()[len(arch):-len(ext)]
    return stem.lstrip("-.")


def _nearest_model(device_name: str, models: list[str]) -> tuple[str, str] | None:
    """The measured model whose datasheet is nearest the device's (log distance over
    bandwidth, SMs and tensor throughput), with why; None where either is not known."""
    mine = hardware.datasheet(device_name)
    sheets = {m: hardware.datasheet(m) for m in models}
    known = {m: d for m, d in sheets.items() if d is not None}
    if mine is None or not known:
        return None

    def distance(d: hardware.Datasheet) -> float:
        return sum(abs(math.log(a / b)) for a, b in
                   ((mine.bandwidth_gbs, d.bandwidth_gbs), (mine.sm_count, d.sm_count),
                    (mine.tensor_tflops, d.tensor_tflops)))

    model = min(known, key=lambda m: (distance(known[m]), m))
    return model, (f"no table measured on {device_name}; the nearest measured model by "
                   f"bandwidth, SMs and tensor throughput is {model}")


def _format_rank(name: str, formats: tuple[str, ...]) -> int | None:
    """Where a file name's format stands in ``formats`` (None: not among them)."""
    name = name.lower()
    return next((i for i, ext in enumerate(formats) if name.endswith(ext)), None)


def reads_frames() -> bool:
    """Whether Parquet and CSV tables can be read here (pandas and pyarrow installed)."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("pandas", "pyarrow"))
    except (ImportError, ValueError):  # a module set to None in sys.modules: not usable
        return False
