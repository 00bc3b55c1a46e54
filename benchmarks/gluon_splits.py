"""Time a Gluon decode kernel over split counts at a few points (CUDA-graph replay, cold L2).

    python3 benchmarks/gluon_splits.py [--kernel gluon_transposed] [--splits 1,2,4,...]
        [--widen 64,128,256] [--points fp8] [--pdl] [--point B,H,KV,QLEN,DTYPE ...]
        [--options JSON]

Prints one line per (point, split count): the time, and whether the output matched the
reference at that split count; the kernel's own pick is marked. Over an fp8 cache, the
transposed kernel is also timed at its own split pick for each ``--widen`` step (columns
of the tile widened to 16 bits at a time). ``--point`` (repeatable) replaces the points;
``--options`` are passed to the kernel's launcher (the fp8-MMA kernel's forms; its P
rounded to fp8 is then checked with that tolerance). Needs an sm_90 GPU and
triton 3.6.x. What the split rule (``gluon_hopper_plan.pick_splits``) should choose is
read from these lines.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POINTS = [(1, 16, 4096, 1, "bf16"), (1, 16, 32768, 1, "bf16"), (8, 16, 4096, 1, "bf16"),
          (1, 16, 4096, 1, "fp8"), (128, 16, 8192, 1, "fp8"), (64, 16, 4096, 1, "fp8")]


def main() -> int:
    from benchmarks.gluon_check import check_run, problem_of
    from mlatune.check import reference
    from mlatune.check.inputs import make_decode_inputs
    from mlatune.sweep.bench import Budget, measure

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="gluon_transposed")
    ap.add_argument("--splits", default="1,2,4,8,16,24,32,48,64,96,128")
    ap.add_argument("--widen", default="", help="fp8: widening steps to time (columns)")
    ap.add_argument("--points", default="", help="only the points of this kv dtype")
    ap.add_argument("--pdl", action="store_true",
                    help="also time the kernel's own split pick with pdl=True (the reduce "
                         "kernel as a programmatic dependent launch), forcing the reduce "
                         "kernel (merge='reduce') for both")
    ap.add_argument("--point", action="append", default=[],
                    help="B,H,KV,QLEN,DTYPE (repeatable): these points instead of POINTS")
    ap.add_argument("--options", default="{}", help="the launcher's options, JSON")
    args = ap.parse_args()
    kernel = importlib.import_module(f"mlatune.kernels.{args.kernel}")
    options = json.loads(args.options)
    fp8_mma = args.kernel == "gluon_transposed_fp8"
    one_term = options.get("q_terms") == 1
    rounding = dict(q_quantized=fp8_mma and one_term, p_rounded=fp8_mma and not one_term)
    points = [(*map(int, p.split(",")[:4]), p.split(",")[4]) for p in args.point] or POINTS
    budget = Budget(warmup=2, min_reps=20, max_reps=100, max_seconds=0.3, race_ratio=0.0)
    for point in points:
        if args.points and point[4] != args.points:
            continue
        problem = problem_of(*point)
        inputs = make_decode_inputs(problem, seed=2, device="cuda", ragged=False)
        ref = reference.decode_shard(inputs, inputs.shards[0])
        shard = inputs.shards[0]
        extra = {"kv_scale": inputs.kv_scale} if point[4] == "fp8" else {}
        tiles = -(-problem.kv_len // 64)
        runs = [(s, {}) for s in [None] + [int(s) for s in args.splits.split(",") if s
                                           and int(s) <= tiles]]
        if extra:
            runs += [(None, {"widen_cols": int(w)}) for w in args.widen.split(",") if w]
        if args.pdl:
            runs += [(None, {"merge": "reduce", "pdl": flag}) for flag in (False, True, False,
                                                                           True)]
        for splits, option in runs:
            launch, out, lse = kernel.decode_launcher(
                inputs.q, shard.kv_cache, shard.block_table, shard.seq_lens, qlen=problem.qlen,
                sm_scale=inputs.softmax_scale, causal=problem.causal, num_splits=splits,
                max_seq_len=problem.kv_len, **extra, **options, **option)
            ok = check_run(launch, out, lse, problem, ref, rounding)["ok"]
            t = measure(launch, "cuda", budget)
            label = ("pick" if splits is None else f"{splits:4d}") + \
                "".join(f" {k}={v}" for k, v in option.items())
            print(f"{point} splits {label}: {t.median_us:8.1f} us  "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
