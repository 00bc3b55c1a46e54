"""Where the fp8-MMA decode's LSE error comes from, on a GPU (numbers only):

    python benchmarks/fp8_lse_probe.py

- transposed/gluon over an fp8 cache (the tile widened to q's bf16, 16-bit MMAs) and
  transposed-mma8/gluon (fp8 MMAs, q as two e4m3 terms), 16 heads of a bf16 q: output
  rel_l2 and LSE error against the fp64 reference, q's heads scaled 2^-g..2^g (g = 0, 3, 6)
  with the softmax scale kept, so the scores grow with the gain;
- the fp8 tensor cores' accumulation: ``torch._scaled_mm`` of e4m3 operands (576-long dots)
  with and without fast accumulation, against fp64.
"""

from __future__ import annotations

import dataclasses

import torch

from mlatune import routes
from mlatune.check import reference
from mlatune.check.inputs import make_decode_inputs
from mlatune.problem import MLAProblem

SETS = (("transposed/gluon", {"num_splits": 4, "form": "mma16"}),
        ("transposed-mma8/gluon", {"num_splits": 4, "form": "mma8"}))


def decode_errors(gain_exponent: int) -> None:
    problem = MLAProblem(num_heads=16, batch=4, kv_len=3000, q_dtype="bf16",
                         kv_dtype="fp8_e4m3fn", page_size=64)
    base = make_decode_inputs(problem, seed=41, device="cuda", ragged=True)
    gains = 2.0 ** torch.linspace(-gain_exponent, gain_exponent, problem.num_heads,
                                  device="cuda")
    q = (base.q.float() * gains[None, :, None]).to(base.q.dtype)
    inputs = dataclasses.replace(base, q=q)
    want_out, want_lse = reference.decode_shard(inputs, inputs.shards[0], torch.float64)
    for route_id, params in SETS:
        prepared = routes.get(route_id).prepare(problem, inputs, params=params)
        prepared.run()
        torch.cuda.synchronize()
        rel = (prepared.out.float() - want_out.float()).norm() / want_out.float().norm()
        lse_err = (prepared.lse.float() - want_lse.float()).abs()
        per_head = [round(x, 3) for x in lse_err.amax(0).tolist()]
        print(f"gain 2^{gain_exponent} {route_id} {params['form']}: rel_l2 {rel.item():.4f} "
              f"lse max {lse_err.max().item():.4f} |lse| max {want_lse.abs().max().item():.1f}; "
              f"per head {per_head}")


def accumulation_errors() -> None:
    torch.manual_seed(0)
    a = (torch.randn(64, 576, device="cuda") * 100).to(torch.float8_e4m3fn)
    b = torch.randn(576, 256, device="cuda").to(torch.float8_e4m3fn)
    exact = a.double() @ b.double()
    one = torch.ones((), device="cuda")
    for fast in (True, False):
        got = torch._scaled_mm(a, b.t().contiguous().t(), scale_a=one, scale_b=one,
                               out_dtype=torch.float32, use_fast_accum=fast)
        err = (got.double() - exact).abs()
        print(f"scaled_mm fast_accum={fast}: max |err| / max |S| "
              f"{(err.max() / exact.abs().max()).item():.3g}, rms err / rms S "
              f"{(err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item():.3g}")


if __name__ == "__main__":
    for g in (0, 3, 6):
        decode_errors(g)
    accumulation_errors()
