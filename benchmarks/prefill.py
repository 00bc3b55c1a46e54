"""Time the prefill routes on a GPU: FP8 persistent prefill against the bf16 routes.

For each (batch x tokens per request) and head count, every viable route runs
every parameter set of its space on the same problem in its dtype (fp8 for
``fp8-ps/triton``, bf16 for the others): accuracy against the fp32 reference
first, then the median of CUDA-graph replays (mlatune.sweep.bench: cold L2, median of
settled repetitions). TFLOP/s counts the causal lower triangle on the real
(unpadded) heads, so padding shows up as lost throughput.

    PYTHONPATH=$PWD python benchmarks/prefill.py --out benchmarks/results

writes prefill-<arch>.csv (every candidate) and prefill-<arch>.md (the best
parameters per route, the fp8-vs-bf16 comparison, device, date and command).
``--out`` defaults to $OUT when set. fp8-ps also times its comparison configs (the
kernel before v was transposed, and a spilling q.k-ahead variant) unless
``--no-fp8-comparison``; each shape ends with a line per fp8-ps candidate giving its
speed-up over the fastest bf16 route (issue 19's target: 1.3x at 128 heads x 4096).
For issue 19 alone: ``--sizes 1x4096 --heads 128``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from mlatune import routes
from mlatune.arch import DeviceInfo, current_device, library_versions
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_prefill_inputs, poison_
from mlatune.problem import MLAProblem
from mlatune.routes.prefill_triton import FP8_COMPARISON_CONFIGS, config_params
from mlatune.sweep import bench

SIZES = ((1, 4096), (8, 2048), (32, 512))
HEADS = (16, 128)
ROUTE_DTYPES = {"fp8-ps/triton": "fp8", "bf16-ps/triton": "bf16", "sdpa/torch": "bf16"}
BF16_ROUTES = ("bf16-ps/triton", "sdpa/torch")
TARGET_OVER_BF16 = 1.3  # issue 19: fp8-ps at least 1.3x faster than the fastest bf16 route
COLUMNS = ("batch", "tokens", "heads", "route", "dtype", "params", "status", "time_us",
           "p20_us", "p80_us", "tflops", "rel_l2", "lse_err", "timer", "reason")


def fp8_dtype(device: DeviceInfo) -> str:
    return "fp8_e4m3fnuz" if device.arch.startswith("gfx94") else "fp8_e4m3fn"


def sync(device: DeviceInfo) -> None:
    if device.is_gpu:
        torch.cuda.synchronize()


def keep_every(params: dict) -> bool:
    return True


def candidates(route_id: str, problem: MLAProblem, device: DeviceInfo,
               comparison: bool, keep: Callable[[dict], bool] = keep_every) -> list[dict]:
    """The route's parameter sets that ``keep`` keeps, and for fp8-ps on a GPU its comparison
    configs (the kernel as it was, a spilling variant) unless ``comparison`` is off."""
    space = [p for p in routes.get(route_id).param_space(problem, device) if keep(p)]
    if comparison and route_id == "fp8-ps/triton" and device.is_gpu:
        space += [config_params(c) for c in FP8_COMPARISON_CONFIGS]
    return space


def measure_route(route_id: str, problem: MLAProblem, inputs, ref, device: DeviceInfo,
                  budget: bench.Budget, comparison: bool = True,
                  keep: Callable[[dict], bool] = keep_every) -> list[dict]:
    """Every parameter set of one route on one problem: check, then time."""
    route = routes.get(route_id)
    verdict = route.supports(problem, device)
    if not verdict:
        return [{"route": route_id, "status": "unsupported", "reason": verdict.reason}]
    rows = []
    for params in candidates(route_id, problem, device, comparison, keep):
        row = {"route": route_id, "params": json.dumps(params)}
        try:
            prepared = route.prepare(problem, inputs, params=params)
            row["params"] = json.dumps(prepared.params or params)
            poison_(prepared.out, prepared.lse)
            prepared.run()
            sync(device)
            acc = check(problem, prepared.out, ref[0], prepared.lse,
                        ref[1] if prepared.lse is not None else None)
            row.update(rel_l2=f"{acc.rel_l2:.3g}", lse_err=f"{acc.lse_max_abs:.3g}")
            if not acc.ok:
                rows.append({**row, "status": "rejected_accuracy", "reason": acc.reason})
                continue
            timing = bench.measure(prepared.run, device.torch_device, budget,
                                   graph_safe=prepared.graph_safe)
            del prepared
        except Exception as exc:  # a candidate that fails is recorded, not fatal
            traceback.print_exc(limit=3)
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            rows.append({**row, "status": "error", "reason": reason})
            continue
        tflops = problem.flops() / (timing.median_us * 1e-6) / 1e12
        rows.append({**row, "status": "ok", "time_us": f"{timing.median_us:.1f}",
                     "p20_us": f"{timing.p20_us:.1f}", "p80_us": f"{timing.p80_us:.1f}",
                     "tflops": f"{tflops:.1f}", "timer": timing.timer, "reason": ""})
        print(f"  {route_id:15s} {timing.median_us:10.1f} us {tflops:7.1f} TFLOP/s  "
              f"rel_l2 {acc.rel_l2:.3g}  {row['params']}", flush=True)
    return rows


def run(sizes, heads_list, route_ids, budget: bench.Budget, seed: int,
        device: DeviceInfo, comparison: bool = True,
        keep: Callable[[dict], bool] = keep_every) -> list[dict]:
    rows = []
    for batch, tokens in sizes:
        for heads in heads_list:
            shape_rows = []
            for dtype in sorted({ROUTE_DTYPES[r] for r in route_ids}):
                name = fp8_dtype(device) if dtype == "fp8" else dtype
                problem = MLAProblem(phase="prefill", num_heads=heads, batch=batch, qlen=tokens,
                                     kv_len=tokens, q_dtype=name, kv_dtype=name)
                print(f"{batch} x {tokens} tokens, {heads} heads, {name}", flush=True)
                inputs = make_prefill_inputs(problem, seed, device.torch_device)
                ref = reference.prefill(inputs)
                for route_id in route_ids:
                    if ROUTE_DTYPES[route_id] == dtype:
                        shape = {"batch": batch, "tokens": tokens, "heads": heads, "dtype": name}
                        shape_rows += [{**shape, **r} for r in measure_route(
                            route_id, problem, inputs, ref, device, budget, comparison,
                            keep)]
                del inputs, ref
                if device.is_gpu:
                    torch.cuda.empty_cache()
            print(fp8_summary(shape_rows), flush=True)
            rows += shape_rows
    return rows


def fp8_over_bf16(rows: list[dict]) -> tuple[float | None, str | None]:
    """Time of the fastest ok bf16 candidate among ``rows`` (one shape), and its route."""
    bf16 = [r for r in rows if r.get("status") == "ok" and r["route"] in BF16_ROUTES]
    if not bf16:
        return None, None
    best = min(bf16, key=lambda r: float(r["time_us"]))
    return float(best["time_us"]), best["route"]


def fp8_summary(rows: list[dict]) -> str:
    """One line per fp8-ps candidate of one shape: its speed-up over the fastest bf16."""
    bf16_us, bf16_route = fp8_over_bf16(rows)
    lines = []
    for r in rows:
        if r["route"] == "fp8-ps/triton" and r.get("status") == "ok":
            ratio = f"{bf16_us / float(r['time_us']):.2f}x" if bf16_us else "-"
            lines.append(f"  fp8-ps {r['time_us']} us {r['tflops']} TFLOP/s: {ratio} the "
                         f"fastest bf16 ({bf16_route} {bf16_us} us; target "
                         f"{TARGET_OVER_BF16}x)  {r['params']}")
    return "\n".join(lines)


def best_per_route(rows: list[dict]) -> dict[tuple, dict]:
    best: dict[tuple, dict] = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        key = (r["batch"], r["tokens"], r["heads"], r["route"])
        if key not in best or float(r["time_us"]) < float(best[key]["time_us"]):
            best[key] = r
    return best


def markdown(rows: list[dict], device: DeviceInfo, command: str, seconds: float) -> str:
    versions = library_versions()
    best = best_per_route(rows)
    lines = [
        f"# Prefill routes on {device.name} ({device.arch}, {device.cu_count} SMs)",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `{command}`",
        f"- torch {versions['torch']}, triton {versions['triton']}, "
        f"mlatune {versions['mlatune']}; {seconds:.0f} s wall",
        "- causal, no prefix, every request the same length; time is the median of "
        "repetitions with a cold L2, replayed from a CUDA graph where the route can be "
        "captured (timer column); TFLOP/s counts the causal triangle on the real heads",
        "",
        "## Best parameters per route",
        "",
        "| batch x tokens | heads | route | dtype | time (us) | TFLOP/s | rel_l2 | timer "
        "| params |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for (batch, tokens, heads, route_id), r in sorted(best.items()):
        lines.append(f"| {batch} x {tokens} | {heads} | {route_id} | {r['dtype']} | "
                     f"{r['time_us']} | {r['tflops']} | {r['rel_l2']} | {r['timer']} | "
                     f"`{r['params']}` |")
    lines += ["", "## FP8 persistent prefill against its bf16 twin and SDPA", "",
              "| batch x tokens | heads | fp8-ps (us) | bf16-ps (us) | sdpa (us) | "
              "fp8-ps speed-up over bf16-ps | over sdpa | over the fastest bf16 "
              f"(target {TARGET_OVER_BF16}x) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for shape in sorted({k[:3] for k in best}):
        times = {rid: float(best[(*shape, rid)]["time_us"]) if (*shape, rid) in best else None
                 for rid in ROUTE_DTYPES}
        fp8 = times["fp8-ps/triton"]
        cells = [f"{t:.1f}" if t else "-" for t in times.values()]
        bf16_times = [times[rid] for rid in BF16_ROUTES if times[rid]]
        ratios = [f"{t / fp8:.2f}x" if fp8 and t else "-"
                  for t in (times["bf16-ps/triton"], times["sdpa/torch"],
                            min(bf16_times, default=None))]
        lines.append(f"| {shape[0]} x {shape[1]} | {shape[2]} | " + " | ".join(cells + ratios)
                     + " |")
    lines += ["", "## Every fp8-ps candidate against the fastest bf16 route", "",
              "| batch x tokens | heads | params | time (us) | TFLOP/s | speed-up |",
              "| --- | --- | --- | ---: | ---: | ---: |"]
    for shape in sorted({k[:3] for k in best}):
        shape_rows = [r for r in rows if (r.get("batch"), r.get("tokens"), r.get("heads"))
                      == shape]
        bf16_us, _ = fp8_over_bf16(shape_rows)
        for r in shape_rows:
            if r["route"] == "fp8-ps/triton" and r.get("status") == "ok":
                ratio = f"{bf16_us / float(r['time_us']):.2f}x" if bf16_us else "-"
                lines.append(f"| {shape[0]} x {shape[1]} | {shape[2]} | `{r['params']}` | "
                             f"{r['time_us']} | {r['tflops']} | {ratio} |")
    failed = [r for r in rows if r.get("status") not in ("ok", None)]
    if failed:
        lines += ["", "## Candidates that did not run or were rejected", ""]
        lines += [f"- {r.get('batch')} x {r.get('tokens')}, {r.get('heads')} heads, "
                  f"{r['route']} `{r.get('params', '')}`: {r['status']}: {r['reason']}"
                  for r in failed]
    return "\n".join(lines) + "\n"


def gluon_filter(gluon: bool, without: list[str]) -> Callable[[dict], bool]:
    """Which param sets to time: none of the Gluon kernel's unless ``gluon``, and none that
    set a flag in ``without``."""
    def keep(params: dict) -> bool:
        if params.get("kernel") != "gluon":
            return True
        return gluon and not any(params.get(flag) for flag in without)
    return keep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                        help="directory for the CSV and markdown (default: $OUT)")
    parser.add_argument("--sizes", nargs="+", default=[f"{b}x{t}" for b, t in SIZES],
                        help="batch x tokens per request, e.g. 1x4096")
    parser.add_argument("--heads", nargs="+", type=int, default=list(HEADS))
    parser.add_argument("--routes", nargs="+", default=list(ROUTE_DTYPES),
                        choices=list(ROUTE_DTYPES))
    parser.add_argument("--seconds", type=float, default=0.3,
                        help="timed repetitions per candidate stop after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fp8-comparison", dest="comparison", action="store_false",
                        help="time only fp8-ps's parameter space, not its comparison configs "
                        "(the kernel as it was, a spilling variant)")
    parser.add_argument("--no-gluon", dest="gluon", action="store_false",
                        help="leave out fp8-ps's Gluon kernel (where a GPU smoke of it failed)")
    parser.add_argument("--gluon-without", nargs="+", default=[], metavar="FLAG",
                        help="leave out the Gluon kernel's param sets that set one of these "
                        "flags (a form whose GPU tests failed), e.g. pingpong")
    args = parser.parse_args(argv)
    device = current_device()
    if not device.is_gpu:
        print("no GPU: timing with a wall clock on the CPU (Triton routes need "
              "TRITON_INTERPRET=1); these numbers mean nothing", file=sys.stderr)
    sizes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sizes]
    budget = bench.Budget(warmup=3, min_reps=10, max_reps=200, max_seconds=args.seconds)
    start = time.perf_counter()
    rows = run(sizes, args.heads, args.routes, budget, args.seed, device, args.comparison,
               gluon_filter(args.gluon, args.gluon_without))
    seconds = time.perf_counter() - start
    command = "PYTHONPATH=$PWD python " + shlex.join(["benchmarks/prefill.py", *sys.argv[1:]])
    report = markdown(rows, device, command, seconds)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"prefill-{device.arch}"
        with stem.with_suffix(".csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows({c: r.get(c, "") for c in COLUMNS} for r in rows)
        stem.with_suffix(".md").write_text(report)
        print(f"wrote {stem}.csv and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
