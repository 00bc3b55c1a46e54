"""A real DCP step across GPUs against the sweep's one-GPU simulation of it (issue 18).

    torchrun --nproc_per_node 2 benchmarks/dcp_step.py [--out FILE.jsonl]
        [--points B,H,KV,QLEN ...] [--route padded/triton] [--schemes ag_rs,a2a]
    torchrun --nproc_per_node 2 benchmarks/dcp_step.py --graph  # also from a CUDA graph
    torchrun --nproc_per_node 2 benchmarks/dcp_step.py --cpu   # gloo, tiny, to try it

One process per GPU (NCCL; keep the machine's NCCL_NVLS_ENABLE=0): every rank builds the
same seeded inputs and keeps its own heads' queries and its round-robin KV shard. Per
point and scheme: the step (``mlatune.dcp``) is checked against the unsharded reference
for each rank's heads, then timed (``mlatune.dcp.time_slowest``): CUDA events around each
call after a barrier, on a cold L2, the slowest rank's median (all-reduce MAX). Beside it,
on the same ranks and inputs: the attention alone and the sweep's simulation (rank 0's
attention plus the merge of every rank's partials, no collectives). With ``--graph`` (NCCL
only; gloo cannot capture collectives) the whole step is also captured in a CUDA graph
(``mlatune.sweep.dcp_graph``), its replay checked against the reference and timed
(``graph_ok``, ``graph_us``).
Numbers only; rank 0 prints and writes them.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from mlatune import routes
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs
from mlatune.dcp import SCHEMES, local_heads, merge_ranks_into, prepare_dcp_step, time_slowest
from mlatune.problem import MLAProblem
from mlatune.sweep import dcp_graph

POINTS = [(8, 16, 4096, 1), (128, 16, 8192, 1), (64, 16, 16384, 1), (32, 64, 8192, 1)]
CPU_POINTS = [(2, 2, 64, 1)]


def _point(point, route_id: str, schemes, device, reps: int, rank: int, world: int,
           graph: bool = False) -> list:
    batch, heads, kv_len, qlen = point
    dtype = "bf16" if device.type == "cuda" else "fp16"
    problem = MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen,
                         dcp_size=world, q_dtype=dtype, kv_dtype=dtype, page_size=64
                         if device.type == "cuda" else 8)
    inputs = make_decode_inputs(problem, seed=3, device=device, ragged=False)
    mine = local_heads(rank, heads)
    q_local = inputs.q[:, mine].contiguous()
    want_out, want_lse = reference.run(inputs)
    route = routes.get(route_id)
    results = []
    for scheme in schemes:
        step = prepare_dcp_step(route, problem, q_local, inputs.shards[rank], inputs.seq_lens,
                                scheme=scheme)
        out, lse = step()
        accuracy = check(problem, out, want_out[:, mine], lse, want_lse[:, mine])
        results.append({"scheme": scheme, "ok": accuracy.ok, "reason": accuracy.reason,
                        "step_us": time_slowest(step, device, reps),
                        "attention_us": time_slowest(step.prepared.step, device, reps),
                        **(_graphed(step, problem, want_out[:, mine], want_lse[:, mine],
                                    device, reps) if graph else {})})
    # The sweep's simulation: rank 0's attention, then the merge of every rank's partials.
    first = route.prepare(problem, inputs, rank=0, want_lse=True)
    first.step()
    outs = torch.stack([first.out.float()] * world)
    lses = torch.stack([first.lse] * world)
    merged_out, merged_lse = torch.empty_like(outs[0]), torch.empty_like(lses[0])

    def simulated() -> None:
        first.step()
        outs[0].copy_(first.out)
        lses[0].copy_(first.lse)
        merge_ranks_into(outs, lses, merged_out, merged_lse)

    simulated_us = time_slowest(simulated, device, reps)
    return [{"point": list(point), "world": world, "route": route_id, **r,
             "simulated_us": simulated_us} for r in results]


def _graphed(step, problem: MLAProblem, want_out, want_lse, device, reps: int) -> dict:
    """The step without its plan captured in a CUDA graph: the replay checked against the
    reference (outputs poisoned first), then timed."""
    graph = dcp_graph.capture(lambda: step(plan=False))
    step.out.fill_(float("nan"))
    step.lse.fill_(float("nan"))
    graph.replay()
    accuracy = check(problem, step.out, want_out, step.lse, want_lse)
    return {"graph_ok": accuracy.ok, "graph_reason": accuracy.reason,
            "graph_us": dcp_graph.time_replay(graph, device, reps, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--points", nargs="*", default=None, help="B,H,KV,QLEN ...")
    parser.add_argument("--route", default="padded/triton")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, tiny sizes")
    parser.add_argument("--graph", action="store_true",
                        help="also time the step from a CUDA graph (NCCL only)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if args.graph and dcp_graph.refusal(torch.device("cuda" if cuda else "cpu"),
                                        "nccl" if cuda else "gloo"):
        parser.error(dcp_graph.REFUSAL)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    points = [tuple(int(v) for v in p.split(",")) for p in args.points] if args.points \
        else (POINTS if cuda else CPU_POINTS)
    route = args.route if cuda else "reference/torch"
    rows = []
    try:
        for point in points:
            for row in _point(point, route, args.schemes.split(","), device, args.reps,
                              rank, world, args.graph):
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0 and args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
