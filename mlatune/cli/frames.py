"""Tables as the commands print them: devices, problem labels, grouped rows, cells."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from mlatune.cli.app import note, plain

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pandas as pd

Device = tuple[str, str, int]  # (arch, device_name, cu_count), as tables key them


def read_table(path: Path) -> pd.DataFrame:
    """A table as the dispatcher reads it: checked, older schemas upgraded (rows stored
    without a step kind take the one their route declares here)."""
    from mlatune import table
    from mlatune.routes import FACTS

    return table.read(path, facts=FACTS)


def for_policy(frame: pd.DataFrame, name: str | None) -> pd.DataFrame:
    """A table's rows that accuracy policy ``name`` serves (None: ``MLATUNE_ACCURACY``'s,
    else strict), ranked again, and every row that is not ok (``admission.admitted_table``)."""
    from mlatune.check.policy import policy_named
    from mlatune.dispatch.admission import admitted_table
    from mlatune.dispatch.dispatcher import registered_routes

    return admitted_table(frame, policy_named(name), registered_routes())


def unregistered(frame: pd.DataFrame) -> list[str]:
    """Routes a table names that are not registered here (the dispatcher skips their rows)."""
    from mlatune.routes import all_routes

    return sorted(set(frame["route"].tolist()) - {r.id for r in all_routes()})


def warn_unregistered(frame: pd.DataFrame) -> None:
    missing = unregistered(frame)
    if missing:
        note(f"routes not registered here (the dispatcher skips their rows): "
             f"{', '.join(missing)}")


def devices(frame: pd.DataFrame) -> list[Device]:
    from mlatune.table.schema import DEVICE_COLUMNS

    found = frame[list(DEVICE_COLUMNS)].drop_duplicates()
    return sorted((str(a), str(n), int(c)) for a, n, c in found.itertuples(index=False))


def devices_title(frame: pd.DataFrame) -> tuple[str, bool]:
    """The device of a table's title, or how many; True where there are several."""
    names = {(a, n) for a, n, _ in devices(frame)}
    if len(names) == 1:
        return " ".join(next(iter(names))), False
    return f"{len(names)} devices", True


def device_text(device: Device) -> str:
    from mlatune.arch import units_text

    return f"{device[0]} {device[1]} ({units_text(device[0], device[2])})"


def problem_count(frame: pd.DataFrame) -> int:
    from mlatune.table.schema import KEY_COLUMNS

    return len(frame[list(KEY_COLUMNS)].drop_duplicates())


def row_problem(row: pd.Series) -> dict[str, Any]:
    from mlatune.problem import KEY_FIELDS

    return {name: plain(row[name]) for name in KEY_FIELDS}


def problem_text(row: pd.Series) -> str:
    """A row's bucket in a few words (``MLAProblem.bucket_label``)."""
    from mlatune.problem import MLAProblem  # torch: only once a table is shown

    return MLAProblem.from_key_dict(row).bucket_label


def grouped(rows: pd.DataFrame, several_devices: bool
            ) -> Iterator[tuple[str, pd.Series, bool]]:
    """Rows with their problem label, given on the first row of each bucket only
    (batch and kv_len have their own columns); True where a new bucket starts."""
    previous = None
    for _, row in rows.iterrows():
        label = problem_text(row)
        if several_devices:
            label = f"{row['arch']} {row['device_name']} {label}"
        yield ("" if label == previous else label), row, label != previous
        previous = label


def columns(out: Table, names: tuple[str, ...], numeric: tuple[str, ...]) -> None:
    # Fold rather than elide: a narrow terminal wraps a cell, it never hides a value.
    for name in names:
        out.add_column(name, justify="right" if name in numeric else "left", overflow="fold",
                       min_width=12 if name == "problem" else None)


def us(value: float) -> str:
    return "-" if value != value else f"{value:.4g}"  # NaN -> "-"
