"""Two sweeps of the same spec side by side: repeatability of the winners, and cost.

    python benchmarks/compare_runs.py A B [--only C]

A and B are tables (.parquet, .csv) or journals (.jsonl, .jsonl.gz). Over the
problems both measured (and, with ``--only``, that C measured too): how many pick
the same winning route, how many also the same parameters, and how far apart the
winners' times are (median, 90th percentile, max of |t_B / t_A - 1|). With two
journals, also the worker seconds of the candidates both ran, per cost part.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mlatune import table
from mlatune.problem import MLAProblem
from mlatune.sweep.journal import read
from mlatune.sweep.runner import COST_PARTS


def _is_journal(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def winners(path: Path) -> dict[str, tuple[str, str, float]]:
    """Problem key -> (route, parameters, time_us) of its fastest ok row or candidate."""
    if _is_journal(path):
        rows = [(MLAProblem.from_key_dict(r["key"]).key, r["route"], r["route_params"],
                 r["time_us"]) for r in read(path)[1] if r["status"] == "ok"]
    else:
        frame = table.read(path)
        ok = frame[frame["status"] == "ok"]
        rows = list(zip(table.key_strings(ok), ok["route"], ok["route_params"], ok["time_us"],
                        strict=True))
    best: dict[str, tuple[str, str, float]] = {}
    for key, route, params, time_us in rows:
        if key not in best or time_us < best[key][2]:
            best[key] = (str(route), json.dumps(json.loads(params), sort_keys=True),
                         float(time_us))
    return best


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--only", type=Path, help="compare only the problems this run measured")
    args = parser.parse_args()
    a, b = winners(args.a), winners(args.b)
    keys = a.keys() & b.keys()
    if args.only:
        keys &= winners(args.only).keys()
    if not keys:
        raise SystemExit("no problem measured by both")
    same_route = [k for k in keys if a[k][0] == b[k][0]]
    same_params = [k for k in same_route if a[k][1] == b[k][1]]
    apart = [abs(b[k][2] / a[k][2] - 1) for k in keys]
    n = len(keys)
    print(f"{n} problems: same route {len(same_route)} ({len(same_route) / n:.1%}), "
          f"same route and parameters {len(same_params)} ({len(same_params) / n:.1%})")
    print(f"winners' times apart: median {statistics.median(apart):.2%}, "
          f"p90 {_quantile(apart, 0.9):.2%}, max {max(apart):.2%}")
    if _is_journal(args.a) and _is_journal(args.b):
        ran_a = {r["id"]: r for r in read(args.a)[1] if r["status"] != "unsupported"}
        ran_b = {r["id"]: r for r in read(args.b)[1] if r["status"] != "unsupported"}
        both = ran_a.keys() & ran_b.keys()
        print(f"{len(both)} candidates run by both; worker seconds A / B:")
        for part in (*COST_PARTS, "elapsed_s"):
            print(f"  {part:14} {sum(ran_a[i].get(part, 0.0) for i in both):9.1f} "
                  f"{sum(ran_b[i].get(part, 0.0) for i in both):9.1f}")
        for name, ran in (("A", ran_a), ("B", ran_b)):
            ok = [ran[i] for i in both if ran[i]["status"] == "ok"]
            kernel = sum(r["time_us"] * r["reps"] for r in ok) * 1e-6
            reps = statistics.mean(r["reps"] for r in ok) if ok else 0.0
            print(f"  {name}: kernel time in timing {kernel:.1f} s, mean repetitions {reps:.1f}")


if __name__ == "__main__":
    main()
