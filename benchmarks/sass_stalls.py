"""Stall samples of one kernel per partition and kind, from ``profile_sass.sh``'s CSV.

    python benchmarks/sass_stalls.py benchmarks/results/h200-s10-call6-20261201/sass-seesaw.csv.gz

The rows are Nsight Compute's per-SASS-instruction counters. A warp-specialized Gluon kernel
starts with a branch that sends the default partition (warps 0-3: the loader here) to its
code; the rows from that branch's target on are the loader's, the rows before it the worker
partitions'. Each instruction's samples are put in one kind: an mbarrier wait (the try-wait
and the branch that retries it), a warpgroup MMA issue or wait, a CTA barrier (bar.sync,
and the NOPs ptxas puts beside them), a shared memory load or store, a local-memory (spill)
load or store, or other (math, issue).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_rows(path: str) -> list[dict[str, str]]:
    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines()
    header = next(k for k, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[header:]))))


def kind(sources: list[str], k: int) -> str:
    op = sources[k].removeprefix("@").split()
    op = (op[1] if sources[k].startswith("@") and len(op) > 1 else op[0]) if op else ""
    if "TRYWAIT" in sources[k] or (k > 0 and "TRYWAIT" in sources[k - 1]):
        return "mbarrier wait"
    if op.startswith(("HGMMA", "WARPGROUP")):
        return "wgmma issue/wait"
    if op.startswith("BAR") or op == "NOP":
        return "bar.sync"
    if op.startswith(("LDL", "STL")):
        return "spill"
    if op.startswith(("LDS", "STS", "LDSM", "STSM")):
        return "shared ld/st"
    return "other"


def loader_start(rows: list[dict[str, str]], sources: list[str]) -> int:
    """The row the default partition's first branch jumps to (the end if there is none)."""
    addresses = [int(r["Address"], 16) for r in rows]
    for source in sources[:16]:
        jump = re.search(r"BRA (0x[0-9a-f]+)", source)
        if jump:
            target = int(jump.group(1), 16)
            if target not in addresses:
                raise SystemExit(f"the first branch jumps to {target:#x}, not a row of the CSV")
            return addresses.index(target)
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="profile_sass.sh outputs (.csv.gz)")
    for path in parser.parse_args().csv:
        rows = read_rows(path)
        sources = [r["Source"].strip() for r in rows]
        samples = [int(r[SAMPLES] or 0) for r in rows]
        total = sum(samples)
        split = loader_start(rows, sources)
        for part, span in (("loader", range(split, len(rows))), ("workers", range(split))):
            kinds = collections.Counter()
            for k in span:
                kinds[kind(sources, k)] += samples[k]
            share = sum(kinds.values())
            shares = ", ".join(f"{name} {n / share:.1%}" for name, n in kinds.most_common())
            print(f"{path} {part}: {share / total:.1%} of {total} samples: {shares}")


if __name__ == "__main__":
    main()
