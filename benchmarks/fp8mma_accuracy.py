"""rel_l2 of transposed/gluon over an fp8 cache, per param set, on the GPU tests' inputs
(``tests/test_gluon_gpu.py``'s FP8 problems, their seeds), beside an fp32 emulation of
quantizing q per row (what the fp8-MMA sets do before any MMA): how much of a set's error
the quantized q explains.

    PYTHONPATH=$PWD python3 benchmarks/fp8mma_accuracy.py
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from mlatune import routes
from mlatune.arch import current_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs, poison_
from tests.test_gluon_gpu import FP8
from tests.test_triton_decode_gpu import _label


def quantized_q_rel_l2(inputs, want_out) -> float:
    """The reference over q quantized to e4m3 per row (amax / 448), against ``want_out``."""
    q = inputs.q.float()
    amax = q.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q8 = (q / scale).to(torch.float8_e4m3fn).float() * scale
    out, _ = reference.decode_shard(dataclasses.replace(inputs, q=q8), inputs.shards[0])
    return float((out.float() - want_out.float()).norm() / want_out.float().norm())


def main() -> None:
    device = current_device()
    for item in FP8:
        route_id, problem = item
        route = routes.get(route_id)
        inputs = make_decode_inputs(problem, seed=zlib.crc32(_label(item).encode()) % 10_000,
                                    device="cuda", ragged=True)
        want_out, want_lse = reference.decode_shard(inputs, inputs.shards[0])
        print(f"{_label(item)}: q quantized per row alone: rel_l2 "
              f"{quantized_q_rel_l2(inputs, want_out):.4f}")
        for params in route.param_space(problem, device):
            prepared = route.prepare(problem, inputs, params=params)
            poison_(prepared.out, prepared.lse)
            prepared.run()
            torch.cuda.synchronize()
            acc = check(problem, prepared.out, want_out, prepared.lse, want_lse,
                        **routes.rounding(route, problem, params))
            print(f"  {params}: {'ok' if acc.ok else 'FAIL'} {acc.summary}")


if __name__ == "__main__":
    main()
