"""Run one decode route on one problem a few times, for a profiler to look at.

    ncu --clock-control none --kernel-name regex:split_kv --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python3 benchmarks/profile_decode.py --batch 128 --heads 128 --kv-len 4096 \\
        --params '{"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 1, "num_splits": 1}'
"""

from __future__ import annotations

import argparse
import json

import torch

from mlatune import routes
from mlatune.check.inputs import make_decode_inputs
from mlatune.problem import MLAProblem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", default="padded/triton")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--kv-len", type=int, default=4096)
    parser.add_argument("--qlen", type=int, default=1)
    parser.add_argument("--kv-dtype", default="bf16")
    parser.add_argument("--params", default="{}", help="route parameters as JSON")
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    problem = MLAProblem(num_heads=args.heads, qlen=args.qlen, batch=args.batch,
                         kv_len=args.kv_len, kv_dtype=args.kv_dtype)
    inputs = make_decode_inputs(problem, seed=0, device="cuda")
    prepared = routes.get(args.route).prepare(problem, inputs, params=json.loads(args.params),
                                              want_lse=False)
    for _ in range(args.runs):
        prepared.run()
    torch.cuda.synchronize()
    print(f"ran {args.route} {prepared.params} on {problem.key} x{args.runs}")


if __name__ == "__main__":
    main()
