"""Where a sweep's worker time went, from its journal.

    python benchmarks/sweep_cost.py runs/h200/sm_90-h200.journal.jsonl [--by num_heads]

Sums, per value of a problem field (or per route), the seconds each candidate's
worker spent on setup (inputs and references), the first check (with kernel
compiles), the second check, timing, and the rest of its elapsed time; and the
kernel time inside timing (median x repetitions). Journals written before these
fields existed have only the kernel time.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from mlatune.journal import JournalError, read
from mlatune.runner import COST_PARTS as PARTS


def _add(row: dict[str, float], r: dict) -> None:
    row["candidates"] += 1
    row["raced"] += bool(r.get("raced"))
    for part in PARTS:
        row[part] += r.get(part, 0.0)
    row["other_s"] += max(0.0, r.get("elapsed_s", 0.0) - sum(r.get(p, 0.0) for p in PARTS))
    if r["status"] == "ok":
        row["kernel_s"] += r["time_us"] * 1e-6 * r["reps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("journal", type=Path)
    parser.add_argument("--by", default="num_heads",
                        help="a problem field (num_heads, batch, kv_len, ...) or 'route'")
    args = parser.parse_args()
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    try:
        records = read(args.journal)[1]  # a torn last line is dropped
    except (OSError, JournalError) as exc:
        sys.exit(f"error: {args.journal}: {exc}")
    for r in records:
        if r["status"] != "unsupported":
            _add(rows[str(r["route"] if args.by == "route" else r["key"][args.by])], r)
    if not rows:
        sys.exit(f"{args.journal}: no candidate has run yet")
    columns = ("candidates", "raced", *PARTS, "other_s", "kernel_s")
    width = max(12, *(len(g) for g in rows))
    print(f"{args.by:>{width}} " + " ".join(f"{c:>13}" for c in columns))
    total: dict[str, float] = defaultdict(float)
    for group in sorted(rows, key=lambda g: (len(g), g)):
        print(f"{group:>{width}} " + " ".join(f"{rows[group][c]:13.1f}" for c in columns))
        for c in columns:
            total[c] += rows[group][c]
    print(f"{'total':>{width}} " + " ".join(f"{total[c]:13.1f}" for c in columns))


if __name__ == "__main__":
    main()
