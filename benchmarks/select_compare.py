"""Record ``select``'s answers over the shipped table on seeded random problems; compare two.

    python benchmarks/select_compare.py record OUT.jsonl.gz [--count 100000] [--seed 0]
    python benchmarks/select_compare.py compare BEFORE.jsonl.gz AFTER.jsonl.gz

``record`` draws ``--count`` problems (a third on the table's measured keys, a third in its
measured buckets at batches and KV lengths it never measured, a third off its grid: heads,
query lengths, pages and DCP sizes it never combined), asks
five dispatchers over the bundled H200 table (eager, CUDA-graph capturable, one plan a
call, nearest point for unmeasured shapes, planning for the H200 from this machine) for
each, and writes one JSON line per answer.
``compare`` prints how many answers differ and the first ten, and exits 1 when any does: a
restructure that claims to keep behaviour runs ``record`` before and after, then ``compare``.
Parameters are compared in the routes' current spelling (``Route.upgrade_params``), so a
kernel form renamed without a change of kernel compares equal.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import sys
from pathlib import Path

PROFILES = {"eager": {}, "capturable": {"capturable": True}, "per-call": {"plan_calls": 1},
            "nearest": {"unmeasured": "nearest"},
            # Support as the capability rules say it, whatever this machine's libraries: the
            # Gluon and vendor routes answer too.
            "planning": {"allow_arch": "sm_90"}}
HEADS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PAGES = (1, 16, 32, 64, 128)
KV_DTYPES = ("bf16", "fp8_e4m3fn")


def table_path() -> Path:
    from mlatune.dispatch.dispatcher import bundled_tables_dir

    return Path(str(bundled_tables_dir())) / "sm_90-h200.parquet"


def _off_grid(rng: random.Random):
    from mlatune.problem import MLAProblem

    kv_dtype = rng.choice(KV_DTYPES)
    q_dtype = "bf16" if kv_dtype == "bf16" else rng.choice(("bf16", "fp8_e4m3fn"))
    qlen = rng.choice((1, 1, 1, 2, 3, 4, 5, 8))
    kv_len = max(qlen, int(2 ** rng.uniform(0, 17.5)))
    return MLAProblem(num_heads=rng.choice(HEADS), qlen=qlen, q_dtype=q_dtype,
                      kv_dtype=kv_dtype, batch=max(1, int(2 ** rng.uniform(0, 9.2))),
                      kv_len=kv_len, dcp_size=rng.choice((1, 1, 2, 4, 8)),
                      page_size=rng.choice(PAGES))


def problems(count: int, seed: int) -> list:
    """``count`` problems: measured keys (drawn with repeats), their buckets at new batches and
    KV lengths, and problems off the grid, in turn."""
    import pandas as pd

    from mlatune.problem import KEY_FIELDS, MLAProblem

    frame = pd.read_parquet(table_path())
    keys = frame[list(KEY_FIELDS)].drop_duplicates().to_dict("records")
    rng = random.Random(seed)
    drawn = []
    for i in range(count):
        if i % 3 < 2:
            k = dict(rng.choice(keys))
            if i % 3 == 1:
                k["batch"] = max(1, int(2 ** rng.uniform(0, 9.2)))
                k["kv_len"] = max(int(k["qlen"]), int(2 ** rng.uniform(6, 17.5)))
            d_qk, d_v = k.pop("d_qk"), k.pop("d_v")
            if k["phase"] == "decode":
                k.update(kv_lora_rank=d_v, rope_dim=d_qk - d_v)
            else:
                k.update(qk_head_dim=d_qk, v_head_dim=d_v)
            drawn.append(MLAProblem(**{n: (v.item() if hasattr(v, "item") else v)
                                       for n, v in k.items()}))
        else:
            drawn.append(_off_grid(rng))
    return drawn


def record(out: Path, count: int, seed: int) -> None:
    from mlatune.dispatch import Dispatcher, device_for_arch

    device = device_for_arch("sm_90", "NVIDIA H200", 132)
    asked = problems(count, seed)
    digest = hashlib.sha256()
    with gzip.open(out, "wt") as f:
        for profile, kwargs in PROFILES.items():
            dispatcher = Dispatcher.load(table_path(), device=device, **kwargs)
            for i, problem in enumerate(asked):
                c = dispatcher.select(problem)
                line = json.dumps([profile, i, c.route_id, dict(sorted(c.params.items())),
                                   c.source, c.key, round(c.time_us, 6)], default=str)
                digest.update(line.encode())
                f.write(line + "\n")
    print(f"{out}: {len(PROFILES) * count} answers ({count} problems x {len(PROFILES)} profiles), "
          f"sha256 {digest.hexdigest()}")


def _current(line: str) -> list:
    """An answer with its parameters in the route's current spelling."""
    from mlatune.routes import FACTS

    answer = json.loads(line)
    params = FACTS.upgrade_params(answer[2], answer[3])
    answer[3] = answer[3] if params is None else dict(sorted(params.items()))
    return answer


def compare(before: Path, after: Path) -> int:
    with gzip.open(before, "rt") as a, gzip.open(after, "rt") as b:
        pairs = list(zip(a, b, strict=True))
    differ = [(x, y) for x, y in pairs if x != y and _current(x) != _current(y)]
    print(f"{len(pairs)} answers, {len(differ)} differ")
    for x, y in differ[:10]:
        print(f"- {x.strip()}\n+ {y.strip()}")
    return 1 if differ else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    rec = verbs.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--count", type=int, default=100_000)
    rec.add_argument("--seed", type=int, default=0)
    cmp_ = verbs.add_parser("compare")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.verb == "record":
        record(args.out, args.count, args.seed)
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
