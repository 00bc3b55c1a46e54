"""Time the split reduce (``kernels/reduce.reduce_launcher``) over its program block shapes.

    python3 benchmarks/reduce_blocks.py [--blocks 2x64,8x256,...] [--out DIR]

For each shape (groups, tokens a group, heads, slots a group; the split-KV decodes' shapes at
issue 19's points and around them) the reduce runs with each (rows, value dims) block a
program, checked against a torch merge of the same partials (fresh random outputs and LSEs,
some slots empty), and timed by the sweep's timer (CUDA-graph replay, L2 flushed). One line
per (shape, block); the launcher's own choice is marked, and timed again as ``uniform`` (every
group's slot count known: no indptr read, up to 16 slots in one pass). What
``reduce_launcher``'s size rule should pick is read from these lines. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (groups, tokens a group, heads, slots a group): seesaw at (8, 128, 32768, 1) with 8 splits,
# (64, 64, 4096, 1) with 2, transposed at (1, 16, 4096, 1) with 32 and (64, 16, 4096, 1)
# with 2, and a few between.
SHAPES = [(8, 1, 128, 8), (4, 1, 128, 16), (64, 1, 64, 2), (1, 1, 16, 32), (64, 1, 16, 2),
          (16, 1, 16, 8), (1, 1, 128, 32), (32, 2, 16, 4), (128, 1, 16, 2)]
BLOCKS = [(2, 64), (4, 64), (2, 128), (4, 128), (8, 128), (4, 256), (8, 256), (16, 64),
          (1, 512), (2, 512)]
D_V = 512


def merged(part_out: torch.Tensor, part_lse: torch.Tensor, groups: int, slots: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference merge (``check.reference.merge_partials``) of each group's slots, the
    partials' base-2 LSEs taken to natural logs."""
    from mlatune.check.reference import merge_partials

    outs = part_out.view(groups, slots, -1, D_V).unbind(1)
    lses = (part_lse.view(groups, slots, -1) * math.log(2.0)).unbind(1)
    return merge_partials(list(outs), list(lses))


def main() -> int:
    from mlatune.kernels.reduce import reduce_launcher
    from mlatune.sweep.bench import Budget, measure

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default=None, help="rowsxdims, comma separated")
    parser.add_argument("--out", type=Path, default=None, help="write reduce_blocks.json here")
    args = parser.parse_args()
    blocks = BLOCKS if args.blocks is None else [
        tuple(int(x) for x in b.split("x")) for b in args.blocks.split(",")]
    if not torch.cuda.is_available():
        print("no GPU: nothing to do")
        return 0
    budget = Budget(warmup=3, min_reps=20, max_reps=100, max_seconds=0.5, race_ratio=0.0)
    results: list[dict] = []
    for groups, tokens, heads, slots in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        rows = tokens * heads
        part_out = torch.randn(groups * slots, rows, D_V, device="cuda", generator=gen)
        part_lse = torch.randn(groups * slots, rows, device="cuda", generator=gen) * 4
        part_lse[::3, : rows // 2] = float("-inf")  # slots without keys for half the rows
        indptr = torch.arange(0, groups * slots + 1, slots, dtype=torch.int32, device="cuda")
        want_out, want_lse = merged(part_out, part_lse, groups, slots)
        line = []
        for block, uniform in [(None, False), (None, True), *((b, False) for b in blocks)]:
            out = torch.full((groups * tokens, heads, D_V), float("nan"), device="cuda",
                             dtype=torch.bfloat16)
            lse = torch.full((groups * tokens, heads), float("nan"), device="cuda")
            run = reduce_launcher(part_out, part_lse, None, indptr, out, lse,
                                  tokens_per_group=tokens, q_heads=heads, row_heads=heads,
                                  head_rep=1, max_slots=slots, blocks=block, uniform=uniform)
            run()
            torch.cuda.synchronize()
            err = ((out.float().view(groups, rows, D_V) - want_out).norm()
                   / want_out.norm()).item()
            lse_err = (lse.view(groups, rows) - want_lse).abs().max().item()
            ok = err < 1e-2 and lse_err < 1e-3
            us = measure(run, "cuda", budget).median_us
            name = ("default" if block is None else f"{block[0]}x{block[1]}") \
                + (" uniform" if uniform else "")
            results.append(dict(shape=[groups, tokens, heads, slots], block=name, us=us,
                                rel_err=err, lse_err=lse_err, ok=ok))
            line.append(f"{name} {us:.1f}{'' if ok else ' WRONG'}")
        print(f"{(groups, tokens, heads, slots)}: " + "; ".join(line), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "reduce_blocks.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1  # a wrong block fails the run


if __name__ == "__main__":
    raise SystemExit(main())
