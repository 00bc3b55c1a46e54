"""SM clock, memory clock, power and throttle reasons over each point's last timed seconds,
from `benchmarks/clock_probe.sh`'s files: python benchmarks/clock_summary.py DIR TAG"""

import csv
import statistics
import sys
from datetime import datetime, timezone


def samples(path: str) -> tuple[list[str], list[tuple[float, dict[str, str]]]]:
    with open(path) as f:
        reader = csv.reader(f)
        head = [h.strip() for h in next(reader)]
        rows = []
        for line in reader:
            if len(line) == len(head):
                row = dict(zip(head, (x.strip() for x in line), strict=True))
                when = datetime.strptime(row["timestamp"], "%Y/%m/%d %H:%M:%S.%f")
                rows.append((when.replace(tzinfo=timezone.utc).timestamp(), row))
    return head, rows


def _number(text: str) -> float:
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return float("nan")


def main(folder: str, tag: str) -> None:
    head, rows = samples(f"{folder}/{tag}-smi.csv")
    column = {k: next(h for h in head if h.startswith(k)) for k in (
        "clocks.current.sm", "clocks.current.memory", "power.draw", "temperature.gpu",
        "clocks_event_reasons.active")}
    with open(f"{folder}/{tag}-points.txt") as f:
        lines = f.read().splitlines()
    for line in lines:
        words = line.split()
        if line.startswith("POINT"):
            print(line.strip())
        if not words or words[0] != "END":
            continue
        end = float(words[3])
        last = [row for when, row in rows if end - 2.0 <= when <= end - 0.2]
        if not last:
            print(f"  {words[1]} {words[2]}: no samples")
            continue

        def median(key: str, rows: list = last) -> float:
            return statistics.median(_number(r[column[key]]) for r in rows)

        reasons = sorted({r[column["clocks_event_reasons.active"]] for r in last})
        print(f"  {words[1]} {words[2]}: {len(last)} samples; SM {median('clocks.current.sm'):.0f}"
              f" MHz, memory {median('clocks.current.memory'):.0f} MHz, "
              f"{median('power.draw'):.0f} W, {median('temperature.gpu'):.0f} C, "
              f"reasons {reasons}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
