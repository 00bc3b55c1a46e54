"""Where a sweep's worker time went, from its journal.

    python benchmarks/sweep_cost.py runs/h200/sm_90-h200.journal.jsonl [--by num_heads]

Sums, per value of a problem field (or per route), the seconds each candidate's
worker spent on setup (inputs and references), the first check (with kernel
compiles), the second check, timing, and the rest of its elapsed time; and the
kernel time inside timing (median x repetitions); then, per device, how busy
its worker was: the candidates' elapsed time over the time the device was in use
(from its first candidate's start to its last one's end, less pauses over a
minute, such as those between resumed calls). Journals written before these
fields existed have only the kernel time.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from mlatune.sweep.journal import JournalError, read
from mlatune.sweep.runner import COST_PARTS as PARTS


def _add(row: dict[str, float], r: dict) -> None:
    row["candidates"] += 1
    row["raced"] += bool(r.get("raced"))
    for part in PARTS:
        row[part] += r.get(part, 0.0)
    row["other_s"] += max(0.0, r.get("elapsed_s", 0.0) - sum(r.get(p, 0.0) for p in PARTS))
    if r["status"] == "ok":
        row["kernel_s"] += r["time_us"] * 1e-6 * r["reps"]


_PAUSE_S = 60.0  # a gap this long between a device's candidates is a pause


def busy(records: list[dict]) -> dict[str, tuple[int, float, float]]:
    """Per device: (candidates, seconds they took, seconds the device was in use)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if "finished_at" in r:
            spans[r["device"]].append((r["finished_at"] - r["elapsed_s"], r["finished_at"]))
    out = {}
    for device, runs in spans.items():
        runs.sort()
        in_use, (start, end) = 0.0, runs[0]
        for s, e in runs[1:]:
            if s > end + _PAUSE_S:  # between resumed calls, say: not counted
                in_use, start = in_use + end - start, s
            end = max(end, e)
        out[device] = (len(runs), sum(e - s for s, e in runs), in_use + end - start)
    return out


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
    for device, (n, worked, in_use) in sorted(busy(records).items()):
        print(f"{device}: {n} candidates, {worked:.1f} s of work in {in_use:.1f} s in use "
              f"({worked / in_use:.0%} busy)" if in_use > 0 else f"{device}: {n} candidates")


if __name__ == "__main__":
    main()
