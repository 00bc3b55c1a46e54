"""How the dispatcher's cost laws in device terms answer another GPU model and buckets a
table never measured, judged against measured tables, on the CPU.

    python benchmarks/transfer_regret.py [--h100 T] [--h200 T] [--crossed-h100 T]
                                         [--crossed-h200 T] [--show N]
                                         [--accuracy strict]
                                         [--trust X | --choose-trust | --buckets |
                                          --ratios [ROUTE...]]

- transfer: one GPU's table alone (its times rescaled by ``laws.transfer_times`` to the
  other model's datasheet figures, ``--trust`` of the laws' movement) answers the other
  GPU's measured problems; against today's behaviour, the same table's picks used as they
  are. ``--choose-trust`` judges it at each trust of 0, 1/8, ..., 1 and says which each
  half of the problems chooses (how ``laws.TRUST`` was chosen);
- buckets (``--buckets``): each decode bucket of each table answered by the laws fitted
  without it, against its measured rows (halves: a hash of the problem's key);
- ratios (``--ratios``): each route's time on the H200 over its time on the H100 at the
  same decode problem (16-bit caches, both ok), by the kernel's length on the H100: where
  the two GPUs differ beyond what the datasheets say;
- crossed: the dispatcher loaded from each GPU's table answers the crossed-category problems
  of that GPU's held-out sweep (heads, page size, qlen and cache dtype combined as the grid
  did not), and the unmeasured head counts (12, 24, 48, 96).

Regret = the step cost of the pick's route as measured in the target table (its best
parameter set there) over the best step cost measured there, both among the rows the
accuracy policy admits, minus 1: geometric mean and worst, decode and prefill apart, on all
problems and on each half of them (a hash of the problem's key: ``half``), then per band
(heads x batch). A pick whose route the target did not time there (pruned, failed, held
back by the policy) is counted apart ("untimed"). A target problem where a route its
table's REBUILD.md lists under "Stale" has a row is left out (its truth is not one), and so
is one where a route ran in one table and a capability rule refused it in the other (the
tables were swept by different code), each with the reason printed. The worst decode cases
show each competing route's time in the source table, carried to the target and measured
there. Numbers only.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import re
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mlatune import table
from mlatune.dispatch import Choice, Dispatcher, device_for_arch
from mlatune.dispatch.laws import TRUST, Laws, transfer_times
from mlatune.dispatch.loading import registered_routes
from mlatune.hardware import Hardware
from mlatune.hardware import described as table_hardware
from mlatune.problem import MLAProblem
from mlatune.report.metrics import one_device
from mlatune.table.frame import assign_ranks, key_strings

ROOT = Path(__file__).resolve().parent.parent
H100 = ROOT / "tables/sm_90-h100.parquet"
H200 = ROOT / "tables/sm_90-h200.parquet"
CROSSED = {gpu: ROOT / f"tables/journals/sm_90-{gpu.lower()}/heldout/sm_90-crossed.parquet"
           for gpu in ("H100", "H200")}
NEW_HEADS = (12, 24, 48, 96)
SHOWN_ROUTES = 3  # the source's and the target's fastest routes shown at a worst case
FIGURES = ("bandwidth_gbs", "tensor_tflops", "sm_count", "sm_clock_mhz")  # what laws read
DIRECTIONS = (("H200", "H100"), ("H100", "H200"))
TRUSTS = tuple(i / 8 for i in range(9))


class Judged(NamedTuple):
    problem: MLAProblem
    choice: Choice
    regret: float  # NaN: the target did not time the pick's route there
    best: Choice  # the target's fastest route there


def load(path: Path, accuracy: str, device: tuple | None = None) -> Dispatcher:
    arch, name, cus = device or one_device(table.read(path), path)
    return Dispatcher.load(path, device_for_arch(arch, name, cus), allow_arch=arch,
                           accuracy=accuracy)


def transferred(path: Path, target: Path, out: Path, trust: float, say: bool = True) -> Path:
    """``path``'s table with its times rescaled to ``target``'s GPU model."""
    frame = table.read(path)
    source = table_hardware(*_device(frame))
    goal = table_hardware(*_device(table.read(target)))
    if say:
        print(f"{source.name} -> {goal.name}: " + ", ".join(
            f"{what} {getattr(source, what)} -> {getattr(goal, what)}" for what in FIGURES)
            + f"; trust {trust}")
    frame = frame.assign(time_us=transfer_times(frame, registered_routes(), source, goal,
                                                trust))
    table.write(assign_ranks(frame), out)
    return out


def admissible(source: Hardware, target: Hardware) -> tuple[float, float]:
    """The least and most a step's time can be multiplied by from ``source`` to ``target``
    by the figures the laws read: each term moves by its figure's ratio (bytes by the
    bandwidth, FLOPs by the tensor throughput, fixed work by the clock, the walk by the SMs
    and the clock), a step by some mix of them."""
    moves = [getattr(source, f) / getattr(target, f) for f in FIGURES
             if getattr(source, f) and getattr(target, f)]
    return min(1.0, *moves), max(1.0, *moves)


def bound(source: Dispatcher, target: Dispatcher, problems: Iterable[MLAProblem],
          span: tuple[float, float]) -> list[Judged]:
    """The best a transfer by the figures can do: each route both tables timed carried by
    its measured ratio clipped to ``span``, the least carried time picked."""
    out = []
    for problem in problems:
        ranked = target._ranked(problem.key)
        there = {c.route_id: c.time_us for c in ranked}
        here = {c.route_id: c for c in reversed(source._ranked(problem.key))}
        both = [c for r, c in here.items() if r in there]
        if not both:
            continue
        pick = min(both, key=lambda c: c.time_us * min(max(there[c.route_id] / c.time_us,
                                                           span[0]), span[1]))
        out.append(Judged(problem, pick, there[pick.route_id] / ranked[0].time_us - 1,
                          ranked[0]))
    return out


def carried(tables: dict[str, Path], loaded: dict[str, Dispatcher], src: str, dst: str,
            trust: float, tmp: str, say: bool = True) -> Dispatcher:
    """The ``src`` table carried to ``dst``'s model, answering as if loaded on ``src``'s."""
    moved = transferred(tables[src], tables[dst], Path(tmp) / f"{src}-as-{dst}.parquet",
                        trust, say)
    return load(moved, loaded[src].accuracy.name, loaded[src].table_device)


def _device(frame) -> tuple[str, str, int]:
    arch, name, cus = frame[["arch", "device_name", "cu_count"]].iloc[0].tolist()
    return str(name), str(arch), int(cus)


def half(problem: MLAProblem) -> int:
    """Which half of the problems ``problem`` falls in (a hash of its key: 0 or 1)."""
    return hashlib.sha256(problem.key.encode()).digest()[0] & 1


def stale(path: Path) -> tuple[frozenset[str], str]:
    """The routes a table's REBUILD.md (``tables/journals/<table name>/REBUILD.md``) lists
    under a heading beginning "Stale", and that section's first sentence."""
    notes = path.parent / "journals" / path.stem / "REBUILD.md"
    if not notes.is_file():
        return frozenset(), ""
    section = re.search(r"^##\s*Stale\b[^\n]*\n(.*?)(?=^## |\Z)", notes.read_text(),
                        re.S | re.M)
    if section is None:
        return frozenset(), ""
    text = " ".join(section.group(1).split())
    named = set(re.findall(r"`([\w.-]+/[\w.-]+)`", text)) & set(registered_routes())
    return frozenset(named), text.split(". ")[0]


def ruled_apart(a: Path, b: Path) -> frozenset[str]:
    """The problem keys where a route ran ok in one table and was refused by a capability
    rule in the other: the two were swept under different rules (different code), so neither
    is the other's truth there."""
    def statuses(path: Path) -> dict[tuple[str, str], str]:
        frame = table.read(path)
        return dict(zip(zip(key_strings(frame), frame["route"], strict=True), frame["status"],
                        strict=True))
    first, second = statuses(a), statuses(b)
    return frozenset(key for (key, route), status in first.items()
                     if {status, second.get((key, route))} == {"ok", "unsupported"})


def truthful(target: Dispatcher, path: Path, label: str, source: Path | None = None
             ) -> list[MLAProblem]:
    """The target's measured problems less those where a stale route has a row, and (with
    the ``source`` table) those the two tables' rules set apart (``ruled_apart``); printed."""
    routes, why = stale(path)
    problems = [MLAProblem.from_key(k) for k in target._winner]
    kept = [p for p in problems
            if not routes & {c.route_id for c in target._ranked(p.key)}]
    if len(kept) < len(problems):
        phases = Counter(p.phase for p in problems if p not in kept)
        print(f"{label}: {len(problems) - len(kept)} problems left out ({dict(phases)}): "
              f"{', '.join(sorted(routes))} rows there are stale ({path.name}'s REBUILD.md: "
              f"{why})")
    apart = ruled_apart(source, path) if source is not None else frozenset()
    rest = [p for p in kept if p.key not in apart]
    if len(rest) < len(kept):
        print(f"{label}: {len(kept) - len(rest)} problems left out: a route ran there in one "
              f"table and a capability rule refused it in the other (swept before a kernel "
              f"read those problems)")
    return rest


def judge(picker: Dispatcher, target: Dispatcher, problems: Iterable[MLAProblem]
          ) -> list[Judged]:
    out = []
    for problem in problems:
        ranked = target._ranked(problem.key)
        if not ranked:
            continue
        choice = picker.select(problem)
        timed = {c.route_id: c.time_us for c in ranked}
        pick = timed.get(choice.route_id, math.nan)
        out.append(Judged(problem, choice, pick / ranked[0].time_us - 1, ranked[0]))
    return out


def figures(judged: list[Judged]) -> str:
    regrets = np.array([j.regret for j in judged])
    timed = regrets[~np.isnan(regrets)]
    if not len(timed):
        return f"{len(judged)} problems, none timed"
    return (f"{len(judged)} problems, {len(timed)} timed; geomean "
            f"+{100 * math.expm1(np.log1p(timed).mean()):.2f}%, worst +{100 * timed.max():.1f}%, "
            f"over 10%: {int((timed > 0.1).sum())}; untimed picks {len(regrets) - len(timed)}")


def summary(label: str, judged: list[Judged]) -> None:
    """Per phase: all problems, then each half."""
    for phase in ("decode", "prefill"):
        mine = [j for j in judged if j.problem.phase == phase]
        if not mine:
            continue
        sources = Counter(j.choice.source for j in mine)
        print(f"{label}, {phase}: {figures(mine)}; answered by {dict(sources)}")
        for h in (0, 1):
            print(f"    half {h}: {figures([j for j in mine if half(j.problem) == h])}")


def band(problem: MLAProblem) -> str:
    size = "b1-4" if problem.batch <= 4 else "b8-32" if problem.batch <= 32 else "b64+"
    return f"{problem.phase[:3]} h{problem.num_heads} {size}"


def by_band(judged: list[Judged]) -> None:
    groups: dict[str, list[float]] = defaultdict(list)
    for j in judged:
        if not math.isnan(j.regret):
            groups[band(j.problem)].append(j.regret)
    for name, values in sorted(groups.items(), key=lambda g: _band_order(g[0])):
        v = np.array(values)
        print(f"    {name:16s} n={len(v):4d} geomean +{100 * math.expm1(np.log1p(v).mean()):6.2f}%"
              f" worst +{100 * v.max():6.1f}%")


def _band_order(name: str) -> tuple:
    phase, heads, size = name.split()
    return phase, int(heads[1:]), ["b1-4", "b8-32", "b64+"].index(size)


Times = Callable[[MLAProblem], list[tuple[str, float]]]  # (route, us), fastest first


def measured(dispatcher: Dispatcher) -> Times:
    return lambda p: [(c.route_id, c.time_us) for c in dispatcher._ranked(p.key)]


def estimated(dispatcher: Dispatcher) -> Times:
    return lambda p: [(c.route_id, c.time_us) for c in dispatcher.estimates(p)]


def worst(judged: list[Judged], count: int, sides: dict[str, Times] | None = None) -> None:
    """The ``count`` worst decode picks, then untimed ones; with ``sides`` (name -> each
    route's time: in the source, carried, in the target) each competing route's times."""
    decode = [j for j in judged if j.problem.phase == "decode"]
    timed = sorted((j for j in decode if not math.isnan(j.regret)), key=lambda j: -j.regret)
    untimed = [j for j in decode if math.isnan(j.regret)]
    for j in timed[:count] + untimed[:count]:
        shown = "untimed" if math.isnan(j.regret) else f"+{100 * j.regret:.1f}%"
        print(f"    {j.problem.label:50s} pick {j.choice.route_id:17s} ({j.choice.source}) "
              f"{shown:>8s}  best {j.best.route_id} {j.best.time_us:.4g} us")
        if sides:
            competing(j, sides)


def competing(j: Judged, sides: dict[str, Times]) -> None:
    """The pick's, the best's and each side's fastest routes' times (us) at ``j``, and the
    last side's over the first's."""
    ranked = {name: times(j.problem) for name, times in sides.items()}
    routes = [j.choice.route_id, j.best.route_id]
    for found in ranked.values():
        routes += [r for r, _ in found[:SHOWN_ROUTES]]
    times = {name: dict(reversed(found)) for name, found in ranked.items()}  # each's fastest
    first, last = next(iter(sides)), list(sides)[-1]
    for route_id in dict.fromkeys(routes):
        cells = "  ".join(f"{name} {times[name].get(route_id, math.nan):8.4g}"
                          for name in sides)
        ratio = times[last].get(route_id, math.nan) / times[first].get(route_id, math.nan)
        print(f"        {route_id:22s} {cells}  {last}/{first} {ratio:5.3f}")


def report(label: str, judged: list[Judged], show: int,
           sides: dict[str, Times] | None = None) -> None:
    summary(label, judged)
    by_band(judged)
    if show:
        print("  worst decode:")
        worst(judged, show, sides)


def transfer(tables: dict[str, Path], loaded: dict[str, Dispatcher], args) -> None:
    """Each table answering the other GPU, carried by the laws and as it is."""
    with tempfile.TemporaryDirectory() as tmp:
        for src, dst in DIRECTIONS:
            picker = carried(tables, loaded, src, dst, args.trust, tmp)
            problems = truthful(loaded[dst], tables[dst], f"{src} -> {dst}", tables[src])
            sides = {src: measured(loaded[src]), "carried": measured(picker),
                     dst: measured(loaded[dst])}
            report(f"{src} table transferred -> {dst}", judge(picker, loaded[dst], problems),
                   args.show, sides)
            report(f"{src} table as it is on {dst} (today)",
                   judge(loaded[src], loaded[dst], problems), args.show, sides)
            span = admissible(loaded[src].hardware, loaded[dst].hardware)
            report(f"{src} table -> {dst}, the bound: each route's measured ratio clipped to "
                   f"[{span[0]:.3f}, {span[1]:.3f}], what the figures allow",
                   bound(loaded[src], loaded[dst], problems, span), min(args.show, 5), sides)


def choose_trust(tables: dict[str, Path], loaded: dict[str, Dispatcher]) -> None:
    """Per trust of ``TRUSTS``, each half's decode regret geomean summed over both
    directions; the trust half 0 chooses (the least sum, the smaller trust on a tie)."""
    problems = {dst: [p for p in truthful(loaded[dst], tables[dst], f"{src} -> {dst}",
                                          tables[src])
                      if p.phase == "decode"] for src, dst in DIRECTIONS}
    sums = {}
    with tempfile.TemporaryDirectory() as tmp:
        for trust in TRUSTS:
            sums[trust] = [0.0, 0.0]
            for src, dst in DIRECTIONS:
                picker = carried(tables, loaded, src, dst, trust, tmp, say=False)
                judged = judge(picker, loaded[dst], problems[dst])
                for h, regret in enumerate(_halves(judged)):
                    sums[trust][h] += regret
            print(f"trust {trust:5.3f}: decode geomean regret summed over both directions, "
                  f"half 0 {sums[trust][0]:.4f}%, half 1 {sums[trust][1]:.4f}%")
    for h in (0, 1):
        print(f"half {h} chooses trust {min(TRUSTS, key=lambda t: (sums[t][h], t))}")


def _halves(judged: list[Judged]) -> list[float]:
    """Each half's geomean regret (%) over its timed picks."""
    out = []
    for h in (0, 1):
        r = np.array([j.regret for j in judged if half(j.problem) == h])
        out.append(100 * math.expm1(np.log1p(r[~np.isnan(r)]).mean()))
    return out


def crossed(gpu: str, dispatcher: Dispatcher, path: Path, args) -> None:
    """A GPU's table answering its held-out sweep's problems it never measured."""
    truth = load(path, args.accuracy)
    problems = [MLAProblem.from_key(k) for k in truth._winner]
    judged = judge(dispatcher, truth, problems)
    sides = {"estimated": estimated(dispatcher), "truth": measured(truth)}
    report(f"crossed categories ({gpu} table -> held-out {gpu} sweep)",
           [j for j in judged if j.problem.num_heads not in NEW_HEADS], args.show, sides)
    report(f"unmeasured head counts 12/24/48/96 ({gpu} table -> held-out {gpu} sweep)",
           [j for j in judged if j.problem.num_heads in NEW_HEADS], args.show, sides)


def buckets_left_out(dispatcher: Dispatcher) -> list[Judged]:
    """Each decode bucket of the table answered by the laws fitted without it (what a bucket
    the table never measured gets), against its measured rows."""
    rows = list(dispatcher._measured_rows())
    failed = list(dispatcher._failed_rows())
    buckets = sorted({r[0].bucket for r in rows if r[0].phase == "decode"}, key=str)
    out = []
    for bucket in buckets:
        dispatcher._laws = Laws.fit([r for r in rows if r[0].bucket != bucket],
                                    dispatcher.routes, dispatcher.hardware,
                                    [f for f in failed if f[0].bucket != bucket])
        asked = {r[0].key: r[0] for r in rows if r[0].bucket == bucket}
        for key, problem in asked.items():
            ranked = dispatcher._ranked(key)
            choice = dispatcher._law_choice(problem, frozenset(), None)
            if choice is None:
                continue
            timed = {c.route_id: c.time_us for c in ranked}
            out.append(Judged(problem, choice, timed.get(choice.route_id, math.nan)
                              / ranked[0].time_us - 1, ranked[0]))
    dispatcher._laws = None
    return out


def _timed(dispatcher: Dispatcher, j: Judged) -> float:
    """The pick's measured step cost at its problem (NaN: its route not timed there)."""
    return next((c.time_us for c in dispatcher._ranked(j.problem.key)
                 if c.route_id == j.choice.route_id), math.nan)


LENGTHS_US = (0, 30, 100, 300, 1000, 3000, 10000, math.inf)


def ratios(tables: dict[str, Path], routes: Iterable[str]) -> None:
    """The H200's time over the H100's, route by route at each decode problem both timed
    ok over a 16-bit cache, by the H100 kernel's length: quartiles and the largest."""
    frames = {gpu: table.read(path) for gpu, path in tables.items()}
    key = [c for c in frames["H100"].columns if c in MLAProblem().key_dict()] + ["route"]
    ok = {gpu: f[(f.status == "ok") & (f.phase == "decode") & f.kv_dtype.isin(["bf16", "fp16"])]
          for gpu, f in frames.items()}
    both = ok["H100"].merge(ok["H200"], on=key, suffixes=("_h100", "_h200"))
    both = both[both.route.isin(list(routes))]
    both = both.assign(ratio=both.time_us_h200 / both.time_us_h100)
    for route, rows in both.groupby("route"):
        for lo, hi in itertools.pairwise(LENGTHS_US):
            band = rows[(rows.time_us_h100 >= lo) & (rows.time_us_h100 < hi)]
            if band.empty:
                continue
            q = band.ratio.quantile([0.25, 0.5, 0.75])
            print(f"{route:18s} H100 {lo:>5g}-{hi:<5g} us: {len(band):4d} problems, H200/H100 "
                  f"p25 {q[0.25]:.3f} median {q[0.5]:.3f} p75 {q[0.75]:.3f}, "
                  f"largest {band.ratio.max():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--h100", type=Path, default=H100)
    parser.add_argument("--h200", type=Path, default=H200)
    parser.add_argument("--crossed-h100", type=Path, default=CROSSED["H100"])
    parser.add_argument("--crossed-h200", type=Path, default=CROSSED["H200"])
    parser.add_argument("--accuracy", default="strict")
    parser.add_argument("--show", type=int, default=15)
    parser.add_argument("--trust", type=float, default=TRUST,
                        help="the share of the laws' movement a transfer applies")
    parser.add_argument("--choose-trust", action="store_true",
                        help="judge the transfer at each trust of 0, 1/8, ..., 1 by halves")
    parser.add_argument("--buckets", action="store_true",
                        help="each table's buckets answered by the laws fitted without them")
    parser.add_argument("--ratios", nargs="*", metavar="ROUTE", default=None,
                        help="each route's H200/H100 time by kernel length (default: "
                             "FlashMLA, fa3, the seesaw)")
    args = parser.parse_args()
    tables = {"H100": args.h100, "H200": args.h200}
    if args.ratios is not None:
        ratios(tables, args.ratios or ("dense/flashmla", "fa3/flashinfer", "seesaw/gluon"))
        return
    loaded = {k: load(p, args.accuracy) for k, p in tables.items()}
    if args.choose_trust:
        choose_trust(tables, loaded)
        return
    if args.buckets:
        for name, dispatcher in loaded.items():
            judged = buckets_left_out(dispatcher)
            report(f"{name} table, each bucket by the laws fitted without it", judged, 0)
            errors = [abs(math.log(j.choice.time_us / t)) for j in judged
                      for t in [_timed(dispatcher, j)] if t > 0]
            print(f"    the pick's predicted time against its measured: median |log ratio| "
                  f"{np.median(errors):.3f} over {len(errors)} picks")
        return
    transfer(tables, loaded, args)
    for gpu in ("H100", "H200"):
        crossed(gpu, loaded[gpu], getattr(args, f"crossed_{gpu.lower()}"), args)
    print(f"repro: python benchmarks/transfer_regret.py --h100 {args.h100} --h200 {args.h200} "
          f"--crossed-h100 {args.crossed_h100} --crossed-h200 {args.crossed_h200} "
          f"--accuracy {args.accuracy} --show {args.show} --trust {args.trust}")


if __name__ == "__main__":
    main()
