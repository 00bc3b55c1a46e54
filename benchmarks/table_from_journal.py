"""A sweep's table rebuilt from its journal, off the machine that measured it.

    python benchmarks/table_from_journal.py JOURNAL OUT.parquet --env-from TABLE

For a journal that grew after its table was written, for example by the DCP stage
run by hand (``torchrun -m mlatune.sweep.dcp_group --journal ...``) on a GPU machine
whose table could not come back. ``mlatune sweep`` refuses to run off its device, and a
table written here must not carry this machine's environment: the measuring
environment is taken from ``--env-from`` (a table of the same run), the creation time
from the journal's last record, the GPU's figures (``mlatune.hardware``) from the journal's
header where it records them.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from mlatune import routes, table
from mlatune.arch import DeviceInfo
from mlatune.measure.journal import read
from mlatune.measure.records import table_rows
from mlatune.table.schema import SCHEMA_VERSION, Provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("journal", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--env-from", type=Path, required=True,
                        help="a table measured in the journal's environment")
    args = parser.parse_args()
    header, records = read(args.journal)
    device = DeviceInfo(**{k: header[k] for k in ("arch", "name", "vendor", "cu_count",
                                                  "memory_bytes", "index")})
    (env,) = table.provenances(table.read(args.env_from))
    if env["spec_sha256"] != header["spec_sha256"]:
        raise SystemExit(f"{args.env_from} measured another spec than {args.journal}")
    last = max(r.get("finished_at", 0.0) for r in records)
    provenance = replace(Provenance(**env), schema_version=SCHEMA_VERSION, converted_from="",
                         created_utc=datetime.fromtimestamp(last, timezone.utc)
                         .strftime("%Y-%m-%dT%H:%M:%SZ"),
                         hardware=header.get("hardware") or env.get("hardware") or "")
    frame = table.build(table_rows(records, device), provenance, facts=routes.FACTS,
                        sharing=routes.plan_sharing())
    table.write(frame, args.out)
    print(f"wrote {args.out}: {len(frame)} rows from {len(records)} records")


if __name__ == "__main__":
    main()
