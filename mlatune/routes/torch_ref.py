"""``reference/torch``: the reference itself as a route.

Eager torch, fp32 arithmetic, any problem on any device. Slow, but always
available and always right: the fallback of last resort.
"""

from __future__ import annotations

import torch

from mlatune.arch import DeviceInfo
from mlatune.check import reference
from mlatune.check.inputs import DecodeInputs, PrefillInputs
from mlatune.problem import DTYPES, MLAProblem
from mlatune.routes.base import YES, Params, Prepared, Route, StepKind, Verdict

REFERENCE_ID = reference.ROUTE_ID


class TorchReferenceRoute(Route):
    id = REFERENCE_ID

    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        return YES

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        return [{}]

    def step_kind(self, params: Params) -> StepKind:
        return StepKind("none", False)  # reads the lengths at run time, on the host

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True) -> Prepared:
        if isinstance(inputs, DecodeInputs):
            shard = inputs.shards[rank]

            def compute():
                return reference.decode_shard(inputs, shard)
        else:
            def compute():
                return reference.prefill(inputs)

        rows, heads = inputs.q.shape[:2]
        out = torch.empty(rows, heads, problem.d_v, dtype=DTYPES[problem.out_dtype],
                          device=inputs.q.device)
        lse = torch.empty(rows, heads, dtype=torch.float32, device=inputs.q.device) \
            if want_lse else None

        def run() -> None:
            o, s = compute()
            out.copy_(o)
            if lse is not None:
                lse.copy_(s)

        # Host-side loops and .tolist() syncs: not capturable in a CUDA graph.
        return Prepared(run, out, lse, graph_safe=False)
