"""Stall samples and shared-memory wavefronts of one kernel per partition, from
``profile_sass.sh``'s CSV.

    python benchmarks/sass_stalls.py --tiles 65536 \
        benchmarks/results/h200-s19-call7-20261202/sass-fp8-stacked.csv.gz

The rows are Nsight Compute's per-SASS-instruction counters. A warp-specialized Gluon kernel
starts with branches that send each partition to its code: the default partition (warps
0-3: the loader here) first, then each worker partition; the rows between two such targets
are one partition's (``partitions``). Each instruction's samples are put in one kind: an
mbarrier wait (the try-wait and the branch that retries it), a warpgroup MMA issue or wait,
a CTA barrier (bar.sync, and the NOPs ptxas puts beside them), a shared memory load or
store, a local-memory (spill) load or store, or other (math, issue). Per partition it also
prints its instructions a warp executes per tile (``--tiles``: the warp-tiles of the run)
and its shared-memory wavefronts against Nsight's conflict-free count.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import itertools
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
DISPATCH_ROWS = 40  # the partitions' branches come before this row


def read_rows(path: str) -> list[dict[str, str]]:
    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines()
    header = next(k for k, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[header:]))))


def number(row: dict[str, str], column: str) -> int:
    return int((row.get(column) or "0").replace(",", ""))


def opcode(source: str) -> str:
    words = source.removeprefix("@").split()
    return (words[1] if source.startswith("@") and len(words) > 1 else words[0]) if words else ""


def retries_a_wait(sources: list[str], k: int) -> bool:
    """A predicated branch on the predicate a try-wait a few rows up set (its retry)."""
    branch = re.match(r"@!?(P\d)\s+BRA", sources[k])
    return bool(branch) and any(f"TRYWAIT {branch.group(1)}," in sources[j]
                                for j in range(max(0, k - 8), k))


def kind(sources: list[str], k: int) -> str:
    op = opcode(sources[k])
    if "TRYWAIT" in sources[k] or retries_a_wait(sources, k):
        return "mbarrier wait"
    if op.startswith(("HGMMA", "QGMMA", "WARPGROUP")):
        return "wgmma issue/wait"
    if op.startswith("BAR") or op == "NOP":
        return "bar.sync"
    if op.startswith(("LDL", "STL")):
        return "spill"
    if op.startswith(("LDS", "STS", "LDSM", "STSM")):
        return "shared ld/st"
    return "other"


def partitions(rows: list[dict[str, str]], sources: list[str]) -> list[range]:
    """Row ranges of the kernel's partitions: split at the targets of the branches among its
    first ``DISPATCH_ROWS`` rows (the first range also holds the shared prologue)."""
    addresses = [int(r["Address"], 16) for r in rows]
    starts = {0}
    for source in sources[:DISPATCH_ROWS]:
        jump = re.search(r"BRA (0x[0-9a-f]+)", source)
        if jump and int(jump.group(1), 16) in addresses:
            starts.add(addresses.index(int(jump.group(1), 16)))
    bounds = [*sorted(starts), len(rows)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def describe(rows: list[dict[str, str]], span: range, total: int, tiles: int) -> str:
    sources = [r["Source"].strip() for r in rows]
    kinds: collections.Counter = collections.Counter()
    for k in span:
        kinds[kind(sources, k)] += number(rows[k], SAMPLES)
    share = sum(kinds.values()) or 1
    shares = ", ".join(f"{name} {n / share:.1%}" for name, n in kinds.most_common())
    executed = sum(number(rows[k], "Instructions Executed") for k in span)
    waves = sum(number(rows[k], "L1 Wavefronts Shared") for k in span)
    ideal = sum(number(rows[k], "L1 Wavefronts Shared Ideal") for k in span)
    return (f"{share / total:.1%} of samples: {shares}; {executed / tiles:.0f} instructions "
            f"and {waves / tiles:.0f} shared wavefronts (conflict-free {ideal / tiles:.0f}) "
            f"a warp-tile")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="profile_sass.sh outputs (.csv.gz)")
    parser.add_argument("--tiles", type=int, default=1,
                        help="warp-tiles of the run (warps a partition x programs x tiles)")
    args = parser.parse_args()
    for path in args.csv:
        rows = read_rows(path)
        total = sum(number(r, SAMPLES) for r in rows) or 1
        for i, span in enumerate(partitions(rows, [r["Source"].strip() for r in rows])):
            print(f"{path} partition {i} (rows {span.start}-{span.stop - 1}): "
                  f"{describe(rows, span, total, args.tiles)}")


if __name__ == "__main__":
    main()
