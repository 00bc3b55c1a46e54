"""How the dispatcher's cost laws in device terms answer another GPU model and buckets a
table never measured, judged against measured tables, on the CPU.

    python benchmarks/transfer_regret.py [--h100 T] [--h200 T] [--crossed T] [--show N]
                                         [--accuracy strict]

- transfer: one GPU's table alone (its times rescaled by ``laws.transfer_times`` to the
  other model's datasheet figures) answers the other GPU's measured problems; against
  today's behaviour, the same table's picks used as they are;
- crossed: the dispatcher loaded from the H100 table answers the crossed-category problems
  of the held-out H100 sweep (heads, page size, qlen and cache dtype combined as the grid
  did not), and the unmeasured head counts (12, 24, 48, 96).

Regret = the step cost of the pick's route as measured in the target table (its best
parameter set there) over the best step cost measured there, both among the rows the
accuracy policy admits, minus 1: geometric mean and worst per band (heads x batch). A pick
whose route the target did not time there (pruned, failed, held back by the policy) is
counted apart ("untimed"). Numbers only.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from mlatune import table
from mlatune.dispatch import Dispatcher, device_for_arch
from mlatune.dispatch.laws import transfer_times
from mlatune.dispatch.loading import registered_routes
from mlatune.hardware import described as table_hardware
from mlatune.problem import MLAProblem
from mlatune.report.metrics import one_device
from mlatune.table.frame import assign_ranks

ROOT = Path(__file__).resolve().parent.parent
H100 = ROOT / "tables/sm_90-h100.parquet"
H200 = ROOT / "tables/sm_90-h200.parquet"
CROSSED = ROOT / "tables/journals/sm_90-h100/heldout/sm_90-crossed.parquet"
NEW_HEADS = (12, 24, 48, 96)


def load(path: Path, accuracy: str, device: tuple | None = None) -> Dispatcher:
    arch, name, cus = device or one_device(table.read(path), path)
    return Dispatcher.load(path, device_for_arch(arch, name, cus), allow_arch=arch,
                           accuracy=accuracy)


def transferred(path: Path, target: Path, out: Path) -> Path:
    """``path``'s table with its times rescaled to ``target``'s GPU model."""
    frame = table.read(path)
    source = table_hardware(*_device(frame))
    goal = table_hardware(*_device(table.read(target)))
    frame = frame.assign(time_us=transfer_times(frame, registered_routes(), source, goal))
    table.write(assign_ranks(frame), out)
    return out


def _device(frame) -> tuple[str, str, int]:
    arch, name, cus = frame[["arch", "device_name", "cu_count"]].iloc[0].tolist()
    return str(name), str(arch), int(cus)


def band(problem: MLAProblem) -> str:
    size = "b1-4" if problem.batch <= 4 else "b8-32" if problem.batch <= 32 else "b64+"
    return f"{problem.phase[:3]} h{problem.num_heads} {size}"


def judge(picker: Dispatcher, target: Dispatcher, problems) -> list[tuple]:
    """Per problem (problem, pick, its source, regret or NaN, best route, best time)."""
    out = []
    for problem in problems:
        ranked = target._ranked(problem.key)
        if not ranked:
            continue
        choice = picker.select(problem)
        timed = {c.route_id: c.time_us for c in ranked}
        pick = timed.get(choice.route_id, math.nan)
        out.append((problem, choice, pick / ranked[0].time_us - 1, ranked[0]))
    return out


def summary(label: str, judged: list[tuple]) -> None:
    regrets = np.array([j[2] for j in judged])
    timed = regrets[~np.isnan(regrets)]
    sources = Counter(j[1].source for j in judged)
    print(f"{label}: {len(judged)} problems, {len(timed)} timed; geomean "
          f"+{100 * math.expm1(np.log1p(timed).mean()):.2f}%, worst +{100 * timed.max():.1f}%, "
          f"over 10%: {int((timed > 0.1).sum())}; untimed picks {len(regrets) - len(timed)}; "
          f"answered by {dict(sources)}")


def by_band(judged: list[tuple]) -> None:
    groups: dict[str, list[float]] = defaultdict(list)
    for problem, _, regret, _ in judged:
        if not math.isnan(regret):
            groups[band(problem)].append(regret)
    for name, values in sorted(groups.items(), key=lambda g: _band_order(g[0])):
        v = np.array(values)
        print(f"    {name:16s} n={len(v):4d} geomean +{100 * math.expm1(np.log1p(v).mean()):6.2f}%"
              f" worst +{100 * v.max():6.1f}%")


def _band_order(name: str) -> tuple:
    phase, heads, size = name.split()
    return phase, int(heads[1:]), ["b1-4", "b8-32", "b64+"].index(size)


def worst(judged: list[tuple], count: int) -> None:
    timed = sorted((j for j in judged if not math.isnan(j[2])), key=lambda j: -j[2])
    untimed = [j for j in judged if math.isnan(j[2])]
    for problem, choice, regret, best in timed[:count] + untimed[:count]:
        shown = "untimed" if math.isnan(regret) else f"+{100 * regret:.1f}%"
        print(f"    {problem.label:50s} pick {choice.route_id:17s} ({choice.source}) "
              f"{shown:>8s}  best {best.route_id} {best.time_us:.4g} us")


def report(label: str, judged: list[tuple], show: int) -> None:
    summary(label, judged)
    by_band(judged)
    if show:
        print("  worst:")
        worst(judged, show)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--h100", type=Path, default=H100)
    parser.add_argument("--h200", type=Path, default=H200)
    parser.add_argument("--crossed", type=Path, default=CROSSED)
    parser.add_argument("--accuracy", default="strict")
    parser.add_argument("--show", type=int, default=8)
    args = parser.parse_args()
    tables = {"H100": args.h100, "H200": args.h200}
    loaded = {k: load(p, args.accuracy) for k, p in tables.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for src, dst in (("H200", "H100"), ("H100", "H200")):
            moved = transferred(tables[src], tables[dst], Path(tmp) / f"{src}-as-{dst}.parquet")
            # the rescaled table answers as if loaded on the target's model
            picker = load(moved, args.accuracy, loaded[src].table_device)
            problems = [MLAProblem.from_key(k) for k in loaded[dst]._winner]
            report(f"{src} table transferred -> {dst}", judge(picker, loaded[dst], problems),
                   args.show)
            report(f"{src} table as it is on {dst} (today)",
                   judge(loaded[src], loaded[dst], problems), args.show)
    crossed = load(args.crossed, args.accuracy)
    problems = [MLAProblem.from_key(k) for k in crossed._winner]
    judged = judge(loaded["H100"], crossed, problems)
    report("crossed categories (H100 table -> held-out H100 sweep)",
           [j for j in judged if j[0].num_heads not in NEW_HEADS], args.show)
    report("unmeasured head counts 12/24/48/96 (H100 table -> held-out H100 sweep)",
           [j for j in judged if j[0].num_heads in NEW_HEADS], args.show)
    print(f"repro: python benchmarks/transfer_regret.py --h100 {args.h100} --h200 {args.h200} "
          f"--crossed {args.crossed} --accuracy {args.accuracy}")


if __name__ == "__main__":
    main()
