"""What one ``attention.decode`` step costs an engine: host time per eager call and
device time per step, eager and replayed from a CUDA graph.

    python benchmarks/step_cost.py [--out FILE.jsonl] [--points B,H,KV,QLEN ...]

For each point (default: the four of the engine-runtime issue) and each route
setting (the bundled table's pick, then ``padded/triton`` with split-KV and with
its device-planned persistent schedule, forced through one-problem tables):

- ``host_reused_us``: host wall time of one eager call whose step is cached (from
  the second call on, a capturable step is replayed from its private graph), mean
  of many calls, the GPU left to run asynchronously (synchronised outside the
  timing); ``host_held_step_us``: the same for a step the caller holds
  (``attention.prepare_decode``), which skips the lookup; ``host_graph_replay_us``:
  ``CUDAGraph.replay`` alone, the floor of both;
- ``host_replanned_us``: the same with the cache emptied before every call, so
  the route is chosen and prepared again (what every call cost before steps
  were cached or when a host-planned route prepares each step);
- ``eager_us``: device time of one eager call (plan + launch) between events;
- ``graph_us``: one replay of the step captured in a CUDA graph, cold L2
  (``bench.measure``), ``plan_us`` the device plan alone;
- ``layer_host_us`` and ``layer_graph_us``: the same two for a second layer (its own q
  and out) that reads the first layer's plan (``reuse_plan=True``): what each of an
  engine's other layers pays.
Needs a GPU. Prints a table and writes one JSON object per row.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from mlatune import attention, routes, table
from mlatune.arch import current_device
from mlatune.check.inputs import make_decode_inputs
from mlatune.dispatch import Dispatcher
from mlatune.problem import MLAProblem
from mlatune.sweep import bench
from mlatune.table.schema import Provenance, device_key

POINTS = ((1, 16, 4096, 1), (64, 16, 4096, 1), (128, 128, 4096, 1), (32, 16, 8192, 3))


def _forced(problem: MLAProblem, route_id: str, params: dict, folder: Path) -> Dispatcher:
    """A dispatcher whose one-row table makes ``route_id`` with ``params`` win."""
    device = current_device()
    row = {**device_key(device), **problem.key_dict(), "route": route_id,
           "route_params": json.dumps(params, sort_keys=True), "status": "ok", "reason": "",
           "time_us": 1.0, "time_us_p20": 1.0, "time_us_p80": 1.0, "timer": "cuda_graph",
           "rel_err": 0.0, "max_abs_err": 0.0, "tb_per_s": 1.0, "tflops": 1.0}
    path = table.write(table.build([row], Provenance.here()), folder / f"{route_id[:6]}.parquet")
    return Dispatcher.load(path, device=device)


def _host_us(call, calls: int = 200) -> float:
    """Mean host time of ``call``, synchronising every 20 calls outside the timing."""
    spent = 0.0
    for start in range(0, calls, 20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(min(20, calls - start)):
            call()
        spent += time.perf_counter() - t0
    torch.cuda.synchronize()
    return spent / calls * 1e6


def _eager_device_us(call, reps: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def measure_point(problem: MLAProblem, dispatcher: Dispatcher, label: str) -> dict:
    inputs = make_decode_inputs(problem, seed=1, device="cuda", ragged=True)
    shard = inputs.shards[0]
    out = torch.empty(inputs.q.shape[0], problem.num_heads, problem.d_v, dtype=inputs.q.dtype,
                      device="cuda")

    def call() -> None:
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=problem.num_heads, qlen=problem.qlen, out=out,
                         max_kv_len=problem.kv_len, capturable=True, dispatcher=dispatcher)

    call()
    call()  # the second eager call captures the step's private graph
    reused = _host_us(call)
    (cached,) = attention.plans_of(dispatcher).values()
    replay = _host_us(cached.graph.replay) if cached.graph is not None else float("nan")
    step = attention.prepare_decode(
        inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
        num_heads=problem.num_heads, qlen=problem.qlen, out=out, max_kv_len=problem.kv_len,
        capturable=True, dispatcher=dispatcher)
    step()
    step()
    held = _host_us(step)

    def replanned() -> None:
        attention.plans_of(dispatcher).clear()
        call()

    again = _host_us(replanned, calls=40)
    call()
    (plan,) = attention.plans_of(dispatcher).values()
    prepared = plan.prepared
    plan_us = bench.measure(prepared.plan, "cuda").median_us if prepared.plan else 0.0
    graph = bench.measure(call, "cuda")
    q2, out2 = inputs.q.clone(), torch.empty_like(out)

    def layer() -> None:  # another layer of the same step: the first one's plan
        attention.decode(q2, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         num_heads=problem.num_heads, qlen=problem.qlen, out=out2,
                         max_kv_len=problem.kv_len, capturable=True, reuse_plan=True,
                         dispatcher=dispatcher)

    call()
    layer()
    layer()
    layer_host = _host_us(layer)
    layer_graph = bench.measure(layer, "cuda").median_us
    return {"point": label, "route": plan.choice.route_id, "source": plan.choice.source,
            "params": dict(plan.choice.params), "step_kind": prepared.step_kind.plan_on,
            "host_reused_us": reused, "host_held_step_us": held,
            "host_graph_replay_us": replay, "host_replanned_us": again,
            "eager_us": _eager_device_us(call), "graph_us": graph.median_us,
            "timer": graph.timer, "plan_us": plan_us, "layer_host_us": layer_host,
            "layer_graph_us": layer_graph}


def _settings(problem: MLAProblem) -> list[tuple[str, str, dict | None]]:
    space = routes.get("padded/triton").param_space(problem, current_device())
    split = next(p for p in space if not p.get("persistent"))
    persistent = next(p for p in space if p.get("persistent"))
    return [("bundled", "", None), ("split", "padded/triton", split),
            ("persistent", "padded/triton", persistent)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--points", nargs="*", default=[",".join(map(str, p)) for p in POINTS])
    args = parser.parse_args()
    bundled = Dispatcher.from_bundled()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for text in args.points:
            batch, heads, kv_len, qlen = map(int, text.split(","))
            problem = MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen)
            for name, route_id, params in _settings(problem):
                dispatcher = bundled if params is None else \
                    _forced(problem, route_id, params, Path(folder))
                attention.plans_of(dispatcher).clear()
                row = measure_point(problem, dispatcher, f"{text}")
                row["setting"] = name
                rows.append(row)
                print(f"({text}) {name:10s} {row['route']:16s} {row['step_kind']:6s} "
                      f"host {row['host_reused_us']:6.1f} us reused, "
                      f"{row['host_held_step_us']:5.1f} us held step "
                      f"({row['host_graph_replay_us']:4.1f} us of it graph.replay), "
                      f"{row['host_replanned_us']:8.1f} us replanned; device eager "
                      f"{row['eager_us']:8.1f} us, graph {row['graph_us']:8.1f} us "
                      f"(plan {row['plan_us']:.1f} us); another layer on its plan: host "
                      f"{row['layer_host_us']:5.1f} us, graph {row['layer_graph_us']:8.1f} us",
                      flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))


if __name__ == "__main__":
    main()
