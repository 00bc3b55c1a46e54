"""Decode benchmark of mlatune's own routes beside the vendor routes on a GPU.

Routes: mlatune's Triton and Gluon decode families and, where their libraries are installed,
FlashMLA (``dense/flashmla``) and FlashInfer (``fa3/flashinfer``, ``fa2/flashinfer``),
all on the same inputs in one run (issue 5's points, issue 15's vendors, issue 19's targets).

For each point (batch, heads, kv_len, qlen) and KV dtype (bf16; fp8 e4m3fn with
a bf16 q), every viable own route runs with each parameter set of its
param_space: first checked against the fp32 torch reference (a wrong result is
reported and not timed), then timed by CUDA-graph replay. Small problems
rotate over several input copies inside one graph so that the KV is read from
HBM, not the 60 MB L2. Reported: median time per call (us), TB/s
(problem.min_bytes() / t) and TFLOP/s (problem.flops() / t), best parameters
per route, and issue 19's targets for mlatune's own best route (against FlashMLA's).

    PYTHONPATH=$PWD python benchmarks/decode.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mlatune import routes
from mlatune.arch import current_device, library_versions
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs
from mlatune.problem import MLAProblem

POINTS = [(1, 16, 4096, 1), (16, 16, 4096, 1), (64, 16, 4096, 1), (128, 16, 8192, 1),
          (128, 16, 4096, 4), (64, 8, 4096, 1), (64, 64, 4096, 1), (128, 128, 4096, 1),
          (8, 128, 32768, 1), (128, 16, 4096, 2)]
# Issue 19's targets for mlatune's own best route at a point (bf16): (metric, bound, sense);
# "vs_flashmla" is its time over FlashMLA's best in the same run.
TARGETS = {(1, 16, 4096, 1): ("time_us", 15.0, "<="), (128, 16, 8192, 1): ("tb_s", 4.0, ">="),
           (64, 16, 4096, 1): ("vs_flashmla", 1.00, "<="),
           **dict.fromkeys([(128, 128, 4096, 1), (64, 64, 4096, 1), (8, 128, 32768, 1),
                            (128, 16, 4096, 2), (128, 16, 4096, 4)], ("vs_flashmla", 1.10, "<="))}
# ... and over an fp8 cache at this point: at most 0.6x the own bf16 time and at most
# FlashMLA's fp8 time.
FP8_TARGET_POINT = (128, 16, 8192, 1)
VENDOR_BACKENDS = ("/flashmla", "/flashinfer")
BENCHED_BACKENDS = ("/triton", "/gluon", *VENDOR_BACKENDS)
KV_DTYPES = {"bf16": ("bf16", "bf16"), "fp8": ("bf16", "fp8_e4m3fn")}
ROTATE_BYTES = 4 * 60e6  # rotate copies until the KV read per replay is 4x the H200's L2
MAX_COPIES = 32


@dataclass
class Result:
    point: tuple[int, int, int, int]
    kv: str
    route: str
    params: dict
    status: str
    time_us: float = math.nan
    p20_us: float = math.nan
    p80_us: float = math.nan
    tb_s: float = math.nan
    tflops: float = math.nan
    rel_l2: float = math.nan
    base: dict | None = None  # with --forms: the set a form was laid over, and the form
    form: dict | None = None


def time_calls(prepared: list, reps: int) -> tuple[float, float, float]:
    """Median, p20 and p80 time (us) of one call, by replaying a graph of all copies' calls."""
    for p in prepared:
        p.run()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for p in prepared:
            p.run()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(prepared))
    times.sort()
    return statistics.median(times), times[len(times) // 5], times[(4 * len(times)) // 5]


@dataclass(frozen=True)
class Selection:
    """Which (route, parameter set) pairs a run times: the first ``max_params`` sets of each
    route (all when None), plus every set with one of the ``also`` parameters true (the
    new paths, e.g. ``fold``); ``routes``: these route ids only (all when empty);
    ``forms``: route id -> kernel options laid over each of its sets in turn (an A/B of a
    kernel's forms in one run; ``{}`` keeps the set as it is)."""

    max_params: int | None = None
    also: tuple[str, ...] = ()
    routes: tuple[str, ...] = ()
    forms: tuple[tuple[str, tuple[tuple[tuple[str, object], ...], ...]], ...] = ()

    def wants_route(self, route_id: str) -> bool:
        return route_id.endswith(BENCHED_BACKENDS) and (not self.routes
                                                        or route_id in self.routes)

    def params(self, space: list[dict], route_id: str = "") -> list[dict]:
        return [{**base, **(form or {})} for base, form in self.sets(space, route_id)]

    def sets(self, space: list[dict], route_id: str = "") -> list[tuple[dict, dict | None]]:
        """(set, form laid over it) pairs to run; the form None without ``--forms``."""
        first = space[:self.max_params]
        chosen = first + [p for p in space[len(first):] if any(p.get(k) for k in self.also)]
        forms = dict(self.forms).get(route_id)
        if forms is None:
            return [(p, None) for p in chosen]
        return [(p, dict(form)) for p in chosen for form in forms]


def parse_forms(text: str) -> tuple:
    """``--forms``' JSON (route id -> list of option objects) as ``Selection.forms``."""
    if not text:
        return ()
    given = json.loads(text)
    if not isinstance(given, dict) or not all(
            isinstance(v, list) and all(isinstance(f, dict) for f in v) for v in given.values()):
        raise SystemExit('--forms: a JSON object of route id -> list of option objects, '
                         'e.g. {"seesaw/gluon": [{}, {"lone_bars": false}]}')
    for route_id, forms in given.items():
        # An option the route does not pass to its kernel would be dropped in silence and
        # its "form" would time the set as it is.
        try:
            options = getattr(routes.get(route_id), "kernel_options", {})
        except KeyError as exc:
            raise SystemExit(f"--forms: {exc.args[0]}") from None
        unknown = sorted({k for form in forms for k in form} - set(options))
        if unknown:
            raise SystemExit(f"--forms: {route_id} has no kernel option {', '.join(unknown)} "
                             f"(it has: {', '.join(options) or 'none'})")
    return tuple((route, tuple(tuple(sorted(f.items())) for f in forms))
                 for route, forms in given.items())


def bench_point(point, kv_name: str, device, reps: int, pick: Selection,
                dcp: int = 1) -> list[Result]:
    """Every selected set at one point; with ``dcp`` > 1, rank 0's step of the DCP problem."""
    batch, heads, kv_len, qlen = point
    q_dtype, kv_dtype = KV_DTYPES[kv_name]
    problem = MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen, q_dtype=q_dtype,
                         kv_dtype=kv_dtype, page_size=64, dcp_size=dcp)
    kv_bytes = problem.min_bytes()
    copies = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / kv_bytes)))
    inputs = [make_decode_inputs(problem, seed=s, device="cuda") for s in range(copies)]
    want_out, want_lse = reference.decode_shard(inputs[0], inputs[0].shards[0])
    results = []
    for route in routes.viable(problem, device):
        if not pick.wants_route(route.id):
            continue
        for base, form in pick.sets(route.param_space(problem, device), route.id):
            params = {**base, **(form or {})}
            res = Result(point, kv_name, route.id, params, "ok", base=base, form=form)
            prepared = []
            try:
                prepared = [route.prepare(problem, x, params=params) for x in inputs]
                prepared[0].run()
                torch.cuda.synchronize()
                acc = check(problem, prepared[0].out, want_out, prepared[0].lse, want_lse,
                            **routes.rounding(route, problem, params))
                res.rel_l2 = acc.rel_l2
                if not acc.ok:
                    res.status = f"rejected_accuracy: {acc.reason}"
                else:
                    res.time_us, res.p20_us, res.p80_us = time_calls(prepared, reps)
                    res.tb_s = problem.min_bytes() / res.time_us / 1e6
                    res.tflops = problem.flops() / res.time_us / 1e6
            except Exception as exc:  # a config that fails to compile or launch is a result too
                res.status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            del prepared
            results.append(res)
            print(f"  {route.id:18s} {json.dumps(params):95s} {_fmt(res)}", flush=True)
    del inputs
    torch.cuda.empty_cache()
    return results


def _fmt(r: Result) -> str:
    if r.status != "ok":
        return r.status
    return (f"{r.time_us:9.1f} us  {r.tb_s:5.2f} TB/s  {r.tflops:6.1f} TFLOP/s  "
            f"(p20 {r.p20_us:.1f}, p80 {r.p80_us:.1f}, rel_l2 {r.rel_l2:.2g})")


def form_lines(results: list[Result]) -> list[str]:
    """The --forms A/B: per point, dtype, route and set, each distinct form's times in run
    order and its median over the first form's (the set as it is, when ``{}`` comes first)."""
    lines = []
    groups: dict[tuple, dict[str, list[float]]] = {}
    for r in results:
        if r.form is None:
            continue
        key = (r.point, r.kv, r.route, json.dumps(r.base))
        times = groups.setdefault(key, {}).setdefault(json.dumps(r.form), [])
        times.append(r.time_us if r.status == "ok" else math.nan)
    for (point, kv, route, base), by_form in groups.items():
        first = _median_ok(next(iter(by_form.values())))
        parts = [f"{form} {', '.join(f'{t:.1f}' if t == t else 'failed' for t in times)} "
                 f"({_median_ok(times) / first:.3f}x)" for form, times in by_form.items()]
        lines.append(f"{point} {kv} {route} {base}: " + "; ".join(parts))
    return lines


def _median_ok(times: list[float]) -> float:
    """The median of the times that ran (NaN: a failed run), NaN if none did."""
    ran = [t for t in times if t == t]
    return statistics.median(ran) if ran else math.nan


def best_per_route(results: list[Result]) -> dict[str, Result]:
    best: dict[str, Result] = {}
    for r in results:
        if r.status == "ok" and (r.route not in best or r.time_us < best[r.route].time_us):
            best[r.route] = r
    return best


def own_and_flashmla(best: dict[str, Result]) -> tuple[Result | None, Result | None]:
    """The fastest of mlatune's own routes and FlashMLA's best, from the best per route."""
    own = [r for route, r in best.items() if not route.endswith(VENDOR_BACKENDS)]
    return min(own, key=lambda r: r.time_us, default=None), best.get("dense/flashmla")


def target_note(point, best: dict[str, Result]) -> str:
    """Issue 19's target at a bf16 point, judged on mlatune's own best route."""
    if point not in TARGETS:
        return ""
    metric, bound, sense = TARGETS[point]
    own, flashmla = own_and_flashmla(best)
    if own is None or (metric == "vs_flashmla" and flashmla is None):
        return f"target {metric} {sense} {bound}: not measured (a route did not run)"
    value = own.time_us / flashmla.time_us if metric == "vs_flashmla" else getattr(own, metric)
    met = value <= bound if sense == "<=" else value >= bound
    return (f"target {metric} {sense} {bound}: {own.route} {value:.2f} "
            f"{'met' if met else 'MISSED'}")


def fp8_target_note(results: list[Result]) -> str:
    """The fp8 target: own fp8 time <= 0.6x own bf16 time and <= FlashMLA's fp8 time."""
    def best_at(kv):
        return own_and_flashmla(best_per_route(
            [r for r in results if r.point == FP8_TARGET_POINT and r.kv == kv]))
    (own8, flashmla8), (own16, _) = best_at("fp8"), best_at("bf16")
    if own8 is None or own16 is None or flashmla8 is None:
        return ""
    met = own8.time_us <= 0.6 * own16.time_us and own8.time_us <= flashmla8.time_us
    return (f"target fp8 at {FP8_TARGET_POINT}: {own8.route} {own8.time_us:.1f} us, "
            f"{own8.time_us / own16.time_us:.2f}x own bf16 (<= 0.6), "
            f"{own8.time_us / flashmla8.time_us:.2f}x FlashMLA fp8 (<= 1): "
            f"{'met' if met else 'MISSED'}")


def write_outputs(out_dir: Path, results: list[Result], header: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = header["date"].replace(":", "").replace("-", "")[:15]
    csv_path = out_dir / f"decode-{stamp}.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["batch", "heads", "kv_len", "qlen", "kv", "route", "params", "status",
                     "time_us", "p20_us", "p80_us", "tb_s", "tflops", "rel_l2"])
        for r in results:
            w.writerow([*r.point, r.kv, r.route, json.dumps(r.params), r.status,
                        f"{r.time_us:.2f}", f"{r.p20_us:.2f}", f"{r.p80_us:.2f}",
                        f"{r.tb_s:.3f}", f"{r.tflops:.2f}", f"{r.rel_l2:.3g}"])
    lines = [f"# Decode benchmark: {header['device']}", "",
             *(f"- {k}: {v}" for k, v in header.items()), "",
             "Best parameters per route (median of CUDA-graph replays; page size 64; "
             "fp8 = e4m3fn KV with a bf16 q).", "",
             "| batch | heads | kv_len | qlen | kv | route | time us | TB/s | TFLOP/s | params |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    for point in dict.fromkeys(r.point for r in results):
        for kv in dict.fromkeys(r.kv for r in results if r.point == point):
            here = [r for r in results if r.point == point and r.kv == kv]
            best = best_per_route(here)
            for route, r in sorted(best.items(), key=lambda kv_: kv_[1].time_us):
                lines.append(f"| {' | '.join(map(str, point))} | {kv} | {route} | "
                             f"{r.time_us:.1f} | {r.tb_s:.2f} | {r.tflops:.1f} | "
                             f"`{json.dumps(r.params)}` |")
            failed = [r for r in here if r.status != "ok"]
            for r in failed:
                notes.append(f"- {point} {kv} {r.route} `{json.dumps(r.params)}`: {r.status}")
            note = target_note(point, best) if kv == "bf16" else ""
            if note:
                notes.append(f"- {point} bf16, mlatune's best: {note}")
    fp8_note = fp8_target_note(results)
    notes += [f"- {fp8_note}"] if fp8_note else []
    lines += ["", "## Issue 19's targets and failures", "", *notes, ""]
    forms = form_lines(results)
    if forms:
        lines += ["## Forms (--forms): us in run order, median over the first form's", "",
                  *(f"- {line}" for line in forms), ""]
    md_path = out_dir / f"decode-{stamp}.md"
    md_path.write_text("\n".join(lines))
    print(f"wrote {csv_path} and {md_path}")


def parse_point(text: str) -> tuple[int, int, int, int]:
    """``--point``'s "batch,heads,kv_len,qlen"."""
    fields = text.split(",")
    if len(fields) != 4 or not all(f.strip().isdigit() and int(f) > 0 for f in fields):
        raise argparse.ArgumentTypeError(f"expected batch,heads,kv_len,qlen, got {text!r}")
    batch, heads, kv_len, qlen = map(int, fields)
    return batch, heads, kv_len, qlen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                        help="folder for the CSV and markdown (default: $OUT when set)")
    parser.add_argument("--kv", default="bf16,fp8", help="KV dtypes: bf16,fp8")
    parser.add_argument("--points", default="all",
                        help="indices into POINTS, comma separated (default all)")
    parser.add_argument("--point", action="append", default=[], type=parse_point,
                        help="a point of your own, batch,heads,kv_len,qlen (repeatable); "
                             "with it, POINTS joins only where --points names some")
    parser.add_argument("--reps", type=int, default=30, help="timed graph replays per config")
    parser.add_argument("--max-params", type=int, default=None,
                        help="only the first N parameter sets of each route")
    parser.add_argument("--also", default="",
                        help="with --max-params: also every set with one of these params true "
                             "(comma separated, e.g. fold,kv_twice)")
    parser.add_argument("--routes", default="",
                        help="only these route ids (comma separated; default every route)")
    parser.add_argument("--forms", default="",
                        help='kernel options laid over each set of a route in turn (JSON: '
                             '{"seesaw/gluon": [{}, {"lone_bars": false}]})')
    parser.add_argument("--dcp", type=int, default=1,
                        help="DCP size of every point (rank 0's step is timed)")
    args = parser.parse_args(argv)
    pick = Selection(args.max_params, tuple(filter(None, args.also.split(","))),
                     tuple(filter(None, args.routes.split(","))), parse_forms(args.forms))
    if not torch.cuda.is_available():
        print("benchmarks/decode.py needs a GPU", file=sys.stderr)
        return 2
    device = current_device()
    if args.points == "all":
        points = [] if args.point else list(POINTS)
    else:
        points = [POINTS[int(i)] for i in args.points.split(",")]
    points += args.point
    versions = library_versions()
    header = {"device": f"{device.name} ({device.arch}, {device.cu_count} SMs)",
              "dcp": args.dcp,
              "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": "PYTHONPATH=$PWD python " + " ".join(sys.argv),
              "torch": versions["torch"], "triton": versions["triton"]}
    print(header, flush=True)
    started = time.time()
    results: list[Result] = []
    for point in points:
        for kv in args.kv.split(","):
            print(f"(batch, heads, kv_len, qlen) = {point}, kv {kv}", flush=True)
            here = bench_point(point, kv, device, args.reps, pick, args.dcp)
            results += here
            best = best_per_route(here)
            for route, r in sorted(best.items(), key=lambda x: x[1].time_us):
                print(f"  best {route:18s} {_fmt(r)} {json.dumps(r.params)}")
            note = target_note(point, best) if kv == "bf16" else ""
            if note:
                print(f"  {note}")
            print(f"  [{time.time() - started:.0f} s elapsed]", flush=True)
    if fp8_target_note(results):
        print(fp8_target_note(results))
    for line in form_lines(results):
        print(f"form {line}")
    if args.out is not None:
        write_outputs(args.out, results, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
