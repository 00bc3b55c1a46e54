"""The user's table: where it is named (``USER_TABLE_ENV``) and how a process changes it
(``update``: under a lock file beside it, read, changed and written back atomically;
``merge``: new rows in, each replacing the row of its device, problem and route), so that
processes tuning or timing at first sight into one table at once lose no rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# A Parquet or CSV table of the user's own measurements that overlays the bundled one problem
# by problem (MIOpen's user find-db over its system db); the dispatcher reads it at load,
# tuning at load and first-sight timing write it.
USER_TABLE_ENV = "MLATUNE_USER_TABLE"
LOCK_WAIT_S = 120.0  # another process's update takes a second or two; past this, it hangs


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def update(path: Path, change: Callable[[Any], Any], facts: Any = None) -> Any:
    """``change(rows)`` written over the table at ``path`` under its lock (``rows`` the table
    as read, None where there is none yet); the table written. TableError for a table that
    cannot be read (left as it is), OutputError for one that cannot be written."""
    from filelock import FileLock  # the cli extra's: tuning and first sight need pandas too

    from mlatune.table.files import read, write  # pandas: not for the runtime's name alone

    path = path.resolve()  # through a link: one lock, and the file itself rewritten
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path(path)), timeout=LOCK_WAIT_S):
        rows = change(read(path, facts=facts) if path.exists() else None)
        write(rows, path)
    return rows


def merge(path: Path, new: Any, facts: Any = None, sharing: Any = ()) -> Any:
    """``new``'s rows into the table at ``path`` (``update``): each replaces the row of its
    (device, problem, route); every other row stays, except the rows of a new row's device
    measured in another environment (torch, Triton, mlatune or driver, before an upgrade):
    a table holds one environment a device, and those rows no longer time this one."""
    from mlatune.table.combine import merge as merged_tables

    def merged(old: Any) -> Any:
        if old is None:
            return new
        kept = old[~_row_keys(old).isin(set(_row_keys(new))) & ~_outdated(old, new)]
        return merged_tables([kept, new], sharing=sharing) if len(kept) else new

    return update(path, merged, facts)


def _outdated(old: Any, new: Any) -> Any:
    """Which of ``old``'s rows share a device with ``new``'s but not their environment."""
    from mlatune.table.checks import ENVIRONMENT_FIELDS
    from mlatune.table.schema import DEVICE_COLUMNS

    fields = [*DEVICE_COLUMNS, *ENVIRONMENT_FIELDS]
    ours = new[fields].drop_duplicates()
    devices = old[list(DEVICE_COLUMNS)].merge(ours[list(DEVICE_COLUMNS)].drop_duplicates(),
                                              how="left", indicator=True)["_merge"]
    same = old[fields].merge(ours, how="left", indicator=True)["_merge"]
    return ((devices == "both") & (same != "both")).to_numpy()


def _row_keys(frame: Any) -> Any:
    """Each row's (device, problem, route) as one string."""
    import pandas as pd

    from mlatune.table.frame import key_strings
    from mlatune.table.schema import DEVICE_COLUMNS

    keys = pd.Series(key_strings(frame), index=frame.index)
    for column in (*DEVICE_COLUMNS, "route"):
        keys = keys + "|" + frame[column].astype(str)
    return keys
