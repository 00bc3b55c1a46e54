"""benchmarks/sass_stalls.py on a made-up Nsight Compute SASS listing (CPU)."""

from __future__ import annotations

import csv
import gzip
import io

import pytest

from benchmarks import sass_stalls as s

pytestmark = pytest.mark.kernels

LISTING = [  # (address, source, samples, executed, wavefronts, ideal)
    (0x00, "S2R R0, SR_TID.X", 1, 8, 0, 0),
    (0x10, "@!P0  BRA 0x70", 0, 8, 0, 0),  # the loader
    (0x20, "@P0   BRA 0x50", 0, 8, 0, 0),  # the second worker
    (0x30, "QGMMA.64x32x32.F32.E4M3.E4M3 R24, gdesc[UR32], R24", 10, 4, 0, 0),
    (0x40, "FMNMX R1, R2, R3, !PT", 30, 4, 0, 0),
    (0x50, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R11+UR5], R10", 5, 4, 0, 0),
    (0x60, "LDS.128 R16, [R57]", 15, 4, 16, 4),
    (0x70, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR19+0x34550], R4", 1, 4, 0, 0),
    (0x80, "IMAD.U32 R4, RZ, RZ, UR8", 0, 4, 0, 0),
    (0x90, "@!P1  BRA 0x200", 38, 4, 0, 0),  # retries the wait two rows up
]


def _csv(tmp_path):
    out = io.StringIO()
    out.write("==PROF== a preamble line\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(["Address", "Source", s.SAMPLES, "Instructions Executed",
                     "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"])
    for address, *rest in LISTING:
        writer.writerow([f"0x{address:x}", *rest])
    path = tmp_path / "sass.csv.gz"
    path.write_bytes(gzip.compress(out.getvalue().encode()))
    return str(path)


def test_partitions_split_at_the_dispatch_branches_and_waits_include_their_retries(tmp_path):
    rows = s.read_rows(_csv(tmp_path))
    sources = [r["Source"].strip() for r in rows]
    assert s.partitions(rows, sources) == [range(0, 5), range(5, 7), range(7, 10)]
    assert [s.kind(sources, k) for k in (3, 4, 5, 6, 9)] == [
        "wgmma issue/wait", "other", "mbarrier wait", "shared ld/st", "mbarrier wait"]
    assert s.kind(sources, 1) == "other"  # a dispatch branch, no wait above it
    loader = s.describe(rows, range(7, 10), total=100, tiles=4)
    assert loader.startswith("39.0% of samples: mbarrier wait 100.0%, other 0.0%; 3 instructions")
    worker = s.describe(rows, range(5, 7), total=100, tiles=4)
    assert "2 instructions and 4 shared wavefronts (conflict-free 1)" in worker
