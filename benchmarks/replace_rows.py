"""A measured table with some of its rows replaced by a newer sweep's.

    python benchmarks/replace_rows.py TABLE NEW OUT [--where QUERY]

NEW's rows (those matching the pandas ``--where`` query, e.g. ``"num_heads * qlen <= 16"``)
replace TABLE's rows of the same (device, problem, route); TABLE's other rows stay. Unlike
``mlatune merge`` alone, which keeps the faster of two rows, the newer row is kept whatever
its time: a route whose param sets changed is judged by what it runs now, not by the best of
two runs. The join itself is ``mlatune merge --allow-different-specs`` (a sweep of one route
often runs a cut of the table's spec), so mixed environments are refused as there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from mlatune import table
from mlatune.table.schema import DEVICE_COLUMNS


def row_keys(frame: pd.DataFrame) -> list[tuple]:
    """(device, problem key, route) of every row."""
    devices = frame[list(DEVICE_COLUMNS)].itertuples(index=False, name=None)
    return list(zip(devices, table.key_strings(frame), frame["route"], strict=True))


def rows_kept(old: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """``old``'s rows whose (device, problem, route) ``new`` does not hold."""
    taken = set(row_keys(new))
    return old[[key not in taken for key in row_keys(old)]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--where", default=None,
                        help="a pandas query on NEW's columns: only its matching rows replace")
    args = parser.parse_args(argv)
    old, new = table.read(args.table), table.read(args.new)
    if args.where:
        new = new.query(args.where)
    if new.empty:
        print(f"no rows of {args.new} to replace with{' (--where matched none)' * bool(args.where)}"
              f": nothing written", file=sys.stderr)
        return 1
    kept = rows_kept(old, new)
    print(f"{len(old) - len(kept)} of {len(old)} rows replaced by {len(new)} rows of {args.new}")
    with tempfile.TemporaryDirectory() as tmp:
        # Each part is written as a valid table (ranks recounted over the rows it keeps); a
        # table every row of which is replaced leaves no part to write.
        parts = [table.write(table.assign_ranks(part), Path(tmp) / f"{name}.parquet")
                 for name, part in (("kept", kept), ("new", new)) if not part.empty]
        return subprocess.run([sys.executable, "-m", "mlatune", "merge", str(args.out),
                               *map(str, parts), "--allow-different-specs"]).returncode


if __name__ == "__main__":
    sys.exit(main())
