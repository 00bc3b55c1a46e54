"""How well ``gluon_hopper_plan.pick_splits``'s cost ranks the split sets the sweeps timed, on
the CPU, from the shipped tables' journals.

    python benchmarks/split_pick.py [JOURNAL ...] [--program-tiles A --merge-tiles M
                                                  --merge-tiles-a-split S
                                                  --reduce-tiles-a-program R]

For each (problem, route) of the Gluon decodes' split forms (``seesaw/gluon`` pairs,
``wgmma/gluon``, ``transposed/gluon`` mma16; one rank, decode) with two or more split counts
timed ok, the set ``split_cost`` ranks first among those timed, against the fastest of
them: regret = its time over the fastest's, minus 1, geometric mean and worst, per route and
per journal directory (one GPU model each). The cost's constants default to the shipped ones;
the flags try others. Numbers only.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from mlatune import routes
from mlatune.kernels import gluon_hopper_plan as plan
from mlatune.measure.journal import read_records
from mlatune.measure.records import Status
from mlatune.problem import MLAProblem

ROOT = Path(__file__).resolve().parent.parent
JOURNALS = sorted((ROOT / "tables" / "journals").glob("sm_90-*/*.journal.jsonl.gz"))
# Each route's split form.
SPLIT_FORMS = {"seesaw/gluon": "pairs", "wgmma/gluon": None, "transposed/gluon": "mma16"}

Times = dict[int, float]


def split_times(journals: Iterable[Path]) -> dict[tuple[str, str, str], Times]:
    """(journal directory, route, problem key) -> {splits: least time (us)} of the split
    forms' ok rows."""
    found: dict[tuple[str, str, str], Times] = defaultdict(dict)
    for path in journals:
        _, records = read_records(path)
        for rec in records:
            if rec.route not in SPLIT_FORMS or rec.status is not Status.OK \
                    or rec.time_us is None or rec.key.get("phase") != "decode" \
                    or rec.key.get("dcp_size") != 1:
                continue
            # a set as stored then, in today's spelling (None: a deleted form)
            params = routes.get(rec.route).upgrade_params(json.loads(rec.route_params)) or {}
            if "num_splits" not in params or params.get("form") != SPLIT_FORMS[rec.route]:
                continue
            key = (path.parent.name, rec.route, json.dumps(rec.key, sort_keys=True))
            s = params["num_splits"]
            found[key][s] = min(rec.time_us, found[key].get(s, math.inf))
    return {k: v for k, v in found.items() if len(v) >= 2}


def pick_regret(route: str, key: dict, times: Times) -> float:
    """The time of the set ``split_cost`` ranks first among ``times``, over the fastest's."""
    problem = MLAProblem.from_key_dict(key)
    gluon = routes.get(route)
    row_blocks, step = gluon.row_blocks(problem), gluon.tile_step(problem)

    def cost(s: int) -> float:
        return plan.split_cost(problem.batch, row_blocks, problem.shard_len, s, plan.H200_SMS,
                               gluon.program_cost, step, gluon.by_reduce)

    return times[min(times, key=cost)] / min(times.values())


def summary(regrets: list[float]) -> str:
    mean = math.exp(sum(math.log(r) for r in regrets) / len(regrets)) - 1
    return f"n={len(regrets):5d} geomean +{100 * mean:.2f}% worst +{100 * (max(regrets) - 1):.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("journals", nargs="*", type=Path, default=JOURNALS)
    parser.add_argument("--program-tiles", type=float, default=plan.PROGRAM_TILES)
    parser.add_argument("--merge-tiles", type=float, default=plan.MERGE_TILES)
    parser.add_argument("--merge-tiles-a-split", type=float, default=plan.MERGE_TILES_A_SPLIT)
    parser.add_argument("--reduce-tiles-a-program", type=float,
                        default=plan.REDUCE_TILES_A_PROGRAM)
    args = parser.parse_args()
    plan.PROGRAM_TILES = args.program_tiles
    plan.MERGE_TILES = args.merge_tiles
    plan.MERGE_TILES_A_SPLIT = args.merge_tiles_a_split
    plan.REDUCE_TILES_A_PROGRAM = args.reduce_tiles_a_program
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (where, route, key), times in sorted(split_times(args.journals).items()):
        regret = pick_regret(route, json.loads(key), times)
        groups[(where, route)].append(regret)
        groups[(where, "all")].append(regret)
    print(f"split_cost: program {plan.PROGRAM_TILES} tiles, merge {plan.MERGE_TILES} + "
          f"{plan.MERGE_TILES_A_SPLIT} a split (merged in the kernel) or "
          f"{plan.REDUCE_TILES_A_PROGRAM} a program (by the reduce kernel)")
    for (where, route), regrets in sorted(groups.items()):
        print(f"{where:12s} {route:18s} {summary(regrets)}")


if __name__ == "__main__":
    main()
