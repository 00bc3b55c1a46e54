"""mlatune's benchmark driver: ``--routine`` picks what is measured, ``--case`` a named case
of benchmarks/cases.toml (default: the routine's ``default``), flags a case of one's own.
Every result line ends with `` $ `` and the command that reproduces that line alone.

    python benchmarks/bench.py --list
    python benchmarks/bench.py --routine decode --case few-heads --out decode.jsonl
    python benchmarks/bench.py --routine select-cost
    python benchmarks/bench.py --routine sweep-cost --journal runs/h200/sm_90-h200.journal.jsonl
    torchrun --nproc_per_node 2 benchmarks/bench.py --routine dcp-step

decode, prefill and step-cost need a GPU; dcp-step runs one process a GPU under torchrun
(NCCL), or with --cpu on gloo; select-cost and sweep-cost run anywhere. Timing is
mlatune's own (``mlatune.measure.timers``: cold L2, CUDA-graph replay where the route can
be captured), so figures compare with a table's. docs/benchmarks.md reads a line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's mlatune, whatever is installed
CASES = Path(__file__).with_name("cases.toml")
SCRIPT = "benchmarks/bench.py"
MARK = "  $ "  # between a result and the command that reproduces it

KV_DTYPES = {"bf16": "bf16", "fp8": "fp8_e4m3fn"}  # decode's KV; q is bf16 over both
DECODE_BACKENDS = ("/triton", "/gluon", "/flashmla", "/flashinfer")
PREFILL_DTYPES = {"fp8-ps/triton": "fp8", "bf16-ps/triton": "bf16", "sdpa/torch": "bf16"}
STEP_SETTINGS = ("bundled", "split", "persistent")


def point(text: str) -> tuple[int, int, int, int]:
    """``batch,heads,kv_len,qlen``, four positive integers."""
    fields = text.split(",")
    if len(fields) != 4 or not all(f.strip().isdigit() and int(f) > 0 for f in fields):
        raise argparse.ArgumentTypeError(f"expected batch,heads,kv_len,qlen, got {text!r}")
    batch, heads, kv_len, qlen = map(int, fields)
    return batch, heads, kv_len, qlen


def size(text: str) -> tuple[int, int]:
    """``BATCHxTOKENS``, two positive integers."""
    fields = text.lower().split("x")
    if len(fields) != 2 or not all(f.isdigit() and int(f) > 0 for f in fields):
        raise argparse.ArgumentTypeError(f"expected BATCHxTOKENS, got {text!r}")
    return int(fields[0]), int(fields[1])


def params_json(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def text_of(p: tuple[int, ...], sep: str = ",") -> str:
    return sep.join(map(str, p))


# --- printing -----------------------------------------------------------------------------
class Printer:
    """Prints result lines, each with its repro command, and appends them to ``out``."""

    def __init__(self, routine: str, out: Path | None, launcher: list[str] | None = None):
        self.routine = routine
        self.out = out
        self.launcher = launcher or [Path(sys.executable).name]

    def command(self, argv: list[str]) -> str:
        return shlex.join([*self.launcher, SCRIPT, "--routine", self.routine, *argv])

    def header(self, machine: str) -> None:
        from mlatune.arch import library_versions

        versions = library_versions()
        record = {"kind": "header", "routine": self.routine, "machine": machine,
                  "torch": versions["torch"], "triton": versions["triton"],
                  "commit": _commit(),
                  "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        print("# " + ", ".join(f"{k} {v}" for k, v in record.items() if k != "kind"),
              flush=True)
        self._write(record)

    def result(self, text: str, argv: list[str], record: dict) -> None:
        command = self.command(argv)
        print(f"{self.routine} {text}{MARK}{command}", flush=True)
        self._write({"kind": "result", "routine": self.routine, **record, "command": command})

    def _write(self, record: dict) -> None:
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")


def _commit() -> str:
    """The checkout's commit, ``-dirty`` when its files differ from it."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def refuse(message: str) -> NoReturn:
    """A run that cannot be made here or as asked: one line, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _gpu(routine: str):
    """This machine's GPU; refused without one."""
    import torch

    from mlatune.arch import current_device

    if not torch.cuda.is_available():
        refuse(f"{routine} needs a GPU (on the CPU: select-cost, sweep-cost, dcp-step --cpu)")
    return current_device()


def _device_text(device) -> str:
    return f"{device.name} ({device.arch}, {device.cu_count} SMs)"


# --- decode and prefill: every parameter set of every route, checked, then timed ----------
@dataclass
class Timed:
    route: str
    params: dict
    status: str
    time_us: float = math.nan
    p20_us: float = math.nan
    p80_us: float = math.nan
    rel_l2: float = math.nan
    timer: str = ""

    def record(self) -> dict:
        return dict(vars(self))


def _timed(route, problem, inputs, want, params: dict, device, budget) -> Timed:
    """One candidate: prepared, checked against the reference, then timed by mlatune's timer.
    A candidate that fails to compile, launch or match is a result too."""
    import torch

    from mlatune import routes
    from mlatune.check.accuracy import check
    from mlatune.check.inputs import poison_
    from mlatune.measure import timers

    result = Timed(route.id, params, "ok")
    try:
        prepared = route.prepare(problem, inputs, params=params)
        result.params = dict(prepared.params or params)
        poison_(prepared.out, prepared.lse)
        prepared.run()
        torch.cuda.synchronize()
        acc = check(problem, prepared.out, want[0], prepared.lse,
                    want[1] if prepared.lse is not None else None,
                    rounding=routes.rounding(route, problem, result.params))
        result.rel_l2 = acc.rel_l2
        if not acc.ok:
            result.status = f"rejected_accuracy: {acc.reason}"
            return result
        timing = timers.measure(prepared.run, device.torch_device, budget,
                                graph_safe=prepared.graph_safe)
        result.time_us, result.p20_us, result.p80_us = (timing.median_us, timing.p20_us,
                                                        timing.p80_us)
        result.timer = timing.timer
    except Exception as exc:
        result.status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return result


def _sets(route, problem, device, args) -> list[dict]:
    if args.params is not None:
        return [args.params]
    return route.param_space(problem, device)[:args.max_params]


def _figures(result: Timed, problem) -> str:
    if result.status != "ok":
        return result.status
    return (f"{result.time_us:.1f} us (p20 {result.p20_us:.1f}, p80 {result.p80_us:.1f}), "
            f"{problem.min_bytes() / result.time_us / 1e6:.2f} TB/s, "
            f"{problem.flops() / result.time_us / 1e6:.1f} TFLOP/s, "
            f"rel_l2 {result.rel_l2:.2g}, {result.timer}")


def _ranking(printer: Printer, label: str, results: list[tuple[Timed, list[str]]]) -> None:
    """Each route's fastest set at one problem, fastest first, against the fastest."""
    best: dict[str, tuple[Timed, list[str]]] = {}
    for r, argv in results:
        if r.status == "ok" and (r.route not in best or r.time_us < best[r.route][0].time_us):
            best[r.route] = (r, argv)
    ordered = sorted(best.values(), key=lambda pair: pair[0].time_us)
    for rank, (r, argv) in enumerate(ordered, 1):
        printer.result(f"{label} rank {rank} {r.route}: {r.time_us:.1f} us, "
                       f"{r.time_us / ordered[0][0].time_us:.2f}x the fastest", argv,
                       {**r.record(), "rank": rank, "label": label})


def _decode_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--point", nargs="+", type=point, default=[], metavar="B,H,KV,QLEN")
    p.add_argument("--kv", nargs="+", choices=list(KV_DTYPES), default=["bf16"],
                   help="KV cache dtypes (q is bf16)")
    p.add_argument("--routes", nargs="+", default=[],
                   help="route ids (default: every Triton, Gluon and vendor decode route)")
    p.add_argument("--params", type=params_json, default=None,
                   help="this parameter set alone (JSON; with one route in --routes)")
    p.add_argument("--max-params", type=int, default=None,
                   help="each route's first N parameter sets")
    p.add_argument("--dcp", type=int, default=1, help="DCP size (rank 0's share is timed)")
    p.add_argument("--page", type=int, default=64, help="the cache's page size (tokens)")
    p.add_argument("--seconds", type=float, default=0.3, help="timed repetitions per set")


def _decode(args, printer: Printer) -> None:
    import torch

    from mlatune import routes
    from mlatune.check import reference
    from mlatune.check.inputs import make_decode_inputs
    from mlatune.measure import timers
    from mlatune.problem import MLAProblem

    _check_routes(args)
    device = _gpu("decode")
    printer.header(_device_text(device))
    budget = timers.Budget(warmup=3, min_reps=10, max_reps=200, max_seconds=args.seconds)
    for at in args.point:
        for kv in args.kv:
            batch, heads, kv_len, qlen = at
            problem = MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen,
                                 q_dtype="bf16", kv_dtype=KV_DTYPES[kv],
                                 page_size=args.page, dcp_size=args.dcp)
            inputs = make_decode_inputs(problem, seed=0, device="cuda")
            want = reference.decode_shard(inputs, inputs.shards[0])
            label = f"({text_of(at, ', ')}) {kv}" + (f" dcp {args.dcp}" if args.dcp > 1 else "") \
                + (f" page {args.page}" if args.page != 64 else "")
            results = []
            viable = routes.viable(problem, device)
            for route_id in sorted(set(args.routes) - {r.id for r in viable}):
                verdict = routes.get(route_id).supports(problem, device)
                print(f"# {label}: {route_id} refuses: {verdict.reason}", flush=True)
            for route in viable:
                if not (route.id in args.routes if args.routes
                        else route.id.endswith(DECODE_BACKENDS)):
                    continue
                for params in _sets(route, problem, device, args):
                    r = _timed(route, problem, inputs, want, params, device, budget)
                    argv = ["--point", text_of(at), "--kv", kv, "--routes", route.id,
                            "--params", json.dumps(r.params, sort_keys=True),
                            "--seconds", str(args.seconds),
                            *(["--dcp", str(args.dcp)] if args.dcp > 1 else []),
                            *(["--page", str(args.page)] if args.page != 64 else [])]
                    printer.result(f"{label} {route.id} {json.dumps(r.params)}: "
                                   f"{_figures(r, problem)}", argv,
                                   {**r.record(), "label": label})
                    results.append((r, argv))
            _ranking(printer, label, results)
            del inputs
            torch.cuda.empty_cache()


def _check_routes(args) -> None:
    """Refuses route ids no route has, and --params without exactly one route."""
    from mlatune import routes

    unknown = sorted(set(args.routes) - {r.id for r in routes.all_routes()})
    if unknown:
        refuse(f"--routes: no route {', '.join(unknown)}")
    if args.params is not None and len(args.routes) != 1:
        refuse("--params needs exactly one route in --routes")


def _prefill_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", nargs="+", type=size, default=[], metavar="BxT",
                   help="batch x tokens a request (causal, no prefix)")
    p.add_argument("--heads", nargs="+", type=int, default=[16])
    p.add_argument("--routes", nargs="+", choices=list(PREFILL_DTYPES),
                   default=list(PREFILL_DTYPES))
    p.add_argument("--params", type=params_json, default=None,
                   help="this parameter set alone (JSON; with one route in --routes)")
    p.add_argument("--max-params", type=int, default=None,
                   help="each route's first N parameter sets")
    p.add_argument("--seconds", type=float, default=0.3, help="timed repetitions per set")
    p.add_argument("--seed", type=int, default=0)


def _prefill(args, printer: Printer) -> None:
    import torch

    from mlatune import routes
    from mlatune.check import reference
    from mlatune.check.inputs import make_prefill_inputs
    from mlatune.measure import timers
    from mlatune.problem import MLAProblem

    _check_routes(args)
    device = _gpu("prefill")
    printer.header(_device_text(device))
    budget = timers.Budget(warmup=3, min_reps=10, max_reps=200, max_seconds=args.seconds)
    fp8 = "fp8_e4m3fnuz" if device.arch.startswith("gfx94") else "fp8_e4m3fn"
    for batch, tokens in args.size:
        for heads in args.heads:
            label = f"{batch} x {tokens} tokens, {heads} heads"
            results = []
            for dtype in sorted({PREFILL_DTYPES[r] for r in args.routes}):
                name = fp8 if dtype == "fp8" else dtype
                problem = MLAProblem(phase="prefill", num_heads=heads, batch=batch,
                                     qlen=tokens, kv_len=tokens, q_dtype=name, kv_dtype=name)
                inputs = make_prefill_inputs(problem, args.seed, device.torch_device)
                want = reference.prefill(inputs)
                for route_id in (r for r in args.routes if PREFILL_DTYPES[r] == dtype):
                    route = routes.get(route_id)
                    verdict = route.supports(problem, device)
                    if not verdict:
                        print(f"# {label}: {route_id} refuses: {verdict.reason}", flush=True)
                        continue
                    for params in _sets(route, problem, device, args):
                        r = _timed(route, problem, inputs, want, params, device, budget)
                        argv = ["--size", f"{batch}x{tokens}", "--heads", str(heads),
                                "--routes", route_id,
                                "--params", json.dumps(r.params, sort_keys=True),
                                "--seconds", str(args.seconds), "--seed", str(args.seed)]
                        printer.result(f"{label} {name} {route_id} {json.dumps(r.params)}: "
                                       f"{_figures(r, problem)}", argv,
                                       {**r.record(), "label": label, "dtype": name})
                        results.append((r, argv))
                del inputs, want
                torch.cuda.empty_cache()
            _ranking(printer, label, results)


# --- dcp-step: a real DCP step across ranks against the sweep's one-GPU simulation ---------
def _dcp_flags(p: argparse.ArgumentParser) -> None:
    from mlatune.dcp import SCHEMES

    p.add_argument("--point", nargs="+", type=point, default=[], metavar="B,H,KV,QLEN")
    p.add_argument("--route", default="padded/triton")
    p.add_argument("--schemes", nargs="+", choices=list(SCHEMES), default=list(SCHEMES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (tiny points)")
    p.add_argument("--graph", action="store_true",
                   help="also time the step replayed from a CUDA graph (NCCL only)")


def _dcp_step(args, printer: Printer) -> None:
    import torch
    import torch.distributed as dist

    from mlatune.sweep import dcp_graph

    cuda = torch.cuda.is_available() and not args.cpu
    if args.graph and dcp_graph.refusal(torch.device("cuda" if cuda else "cpu"),
                                        "nccl" if cuda else "gloo"):
        refuse(f"--graph: {dcp_graph.REFUSAL}")
    if not cuda and not args.cpu:
        refuse("dcp-step needs GPUs (one process each, under torchrun), or --cpu")
    if "RANK" not in os.environ:  # not under torchrun: a group of this one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1:
        printer.launcher = ["torchrun", "--nproc_per_node", str(world)]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        if rank == 0:
            printer.header(f"{world} x " + (torch.cuda.get_device_name() if cuda else "CPU"))
        for at in args.point:
            rows = _dcp_point(at, args.route, args.schemes, device, args.reps, rank, world,
                              args.graph)
            for row in rows if rank == 0 else ():
                argv = ["--point", text_of(at), "--route", args.route, "--schemes",
                        row["scheme"], "--reps", str(args.reps),
                        *(["--cpu"] if args.cpu else []), *(["--graph"] if args.graph else [])]
                graph = (f", graph {row['graph_us']:.1f} us"
                         f"{'' if row['graph_ok'] else ' WRONG: ' + row['graph_reason']}"
                         if args.graph else "")
                printer.result(
                    f"({text_of(at, ', ')}) dcp {world} {args.route} {row['scheme']}: step "
                    f"{row['step_us']:.1f} us, attention {row['attention_us']:.1f} us, "
                    f"simulated {row['simulated_us']:.1f} us "
                    f"({row['step_us'] / row['simulated_us']:.2f}x the simulation)"
                    f"{graph}{'' if row['ok'] else ', WRONG: ' + row['reason']}", argv,
                    {"point": list(at), "world": world, "route": args.route, **row})
    finally:
        dist.destroy_process_group()


def _dcp_point(at, route_id: str, schemes, device, reps: int, rank: int, world: int,
               graph: bool) -> list[dict]:
    """Per scheme: the step checked against the unsharded reference for this rank's heads,
    then timed (slowest rank's median), beside the attention alone and the sweep's
    simulation (rank 0's attention plus the merge of every rank's partials)."""
    import torch

    from mlatune import routes
    from mlatune.check import reference
    from mlatune.check.accuracy import check
    from mlatune.check.inputs import make_decode_inputs
    from mlatune.dcp import local_heads, merge_ranks_into, prepare_dcp_step, time_slowest
    from mlatune.problem import MLAProblem

    batch, heads, kv_len, qlen = at
    gpu = device.type == "cuda"
    dtype = "bf16" if gpu else "fp16"
    problem = MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen,
                         dcp_size=world, q_dtype=dtype, kv_dtype=dtype,
                         page_size=64 if gpu else 8)
    inputs = make_decode_inputs(problem, seed=3, device=device, ragged=False)
    mine = local_heads(rank, heads)
    want_out, want_lse = reference.run(inputs)
    want_out, want_lse = want_out[:, mine], want_lse[:, mine]
    route = routes.get(route_id)
    rows = []
    for scheme in schemes:
        step = prepare_dcp_step(route, problem, inputs.q[:, mine].contiguous(),
                                inputs.shards[rank], inputs.seq_lens, scheme=scheme)
        out, lse = step()
        accuracy = check(problem, out, want_out, lse, want_lse)
        rows.append({"scheme": scheme, "ok": accuracy.ok, "reason": accuracy.reason,
                     "step_us": time_slowest(step, device, reps),
                     "attention_us": time_slowest(step.prepared.step, device, reps),
                     **(_dcp_graphed(step, problem, want_out, want_lse, device, reps)
                        if graph else {})})
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
    return [{**row, "simulated_us": simulated_us} for row in rows]


def _dcp_graphed(step, problem, want_out, want_lse, device, reps: int) -> dict:
    """The step without its plan captured in a CUDA graph: the replay checked against the
    reference (outputs poisoned first), then timed."""
    from mlatune.check.accuracy import check
    from mlatune.sweep import dcp_graph

    graph = dcp_graph.capture(lambda: step(plan=False))
    step.out.fill_(float("nan"))
    step.lse.fill_(float("nan"))
    graph.replay()
    accuracy = check(problem, step.out, want_out, step.lse, want_lse)
    return {"graph_ok": accuracy.ok, "graph_reason": accuracy.reason,
            "graph_us": dcp_graph.time_replay(graph, device, reps, 1)}


# --- select-cost: Dispatcher.load and select() on a real table, for a stand-in device -----
def _select_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--table", type=Path, required=True)
    p.add_argument("--spec", type=Path, required=True, help="whose problems are asked")
    p.add_argument("--arch", required=True, help="the stand-in device's arch")
    p.add_argument("--name", default="", help="the stand-in device's name")
    p.add_argument("--cus", type=int, default=0, help="the stand-in device's SM/CU count")
    p.add_argument("--only", choices=("load", "first", "again"), default=None,
                   help="print this line alone")


def _select_cost(args, printer: Printer) -> None:
    from mlatune.dispatch import Dispatcher, device_for_arch
    from mlatune.sweep.spec import load

    device = device_for_arch(args.arch, args.name, args.cus)
    printer.header(f"{platform_text()}; stand-in {_device_text(device)}")
    base = ["--table", str(args.table), "--spec", str(args.spec), "--arch", args.arch,
            *(["--name", args.name] if args.name else []),
            *(["--cus", str(args.cus)] if args.cus else [])]
    loads = []
    for _ in range(3):
        t0 = time.perf_counter()
        dispatcher = Dispatcher.load(args.table, allow_arch=args.arch, device=device)
        loads.append((time.perf_counter() - t0) * 1e3)
    if args.only in (None, "load"):
        printer.result(f"{args.table} load: {statistics.median(loads):.0f} ms (median of 3, "
                       f"min {min(loads):.0f}, max {max(loads):.0f})",
                       [*base, "--only", "load"], {"load_ms": loads})
    problems = load(args.spec).problems
    for label in ("first", "again"):
        ns, sources = [], defaultdict(int)
        for problem in problems:
            t0 = time.perf_counter_ns()
            choice = dispatcher.select(problem)
            ns.append(time.perf_counter_ns() - t0)
            sources[choice.source] += 1
        ns.sort()
        p50, p99 = ns[len(ns) // 2] / 1e3, ns[int(0.99 * (len(ns) - 1))] / 1e3
        if args.only in (None, label):
            answered = ", ".join(f"{s} {n}" for s, n in sorted(sources.items()))
            printer.result(f"{args.table} on {args.spec} {label}: {len(ns)} problems "
                           f"({answered}), p50 {p50:.2f} us, p99 {p99:.2f} us",
                           [*base, "--only", label],
                           {"pass": label, "problems": len(ns), "sources": dict(sources),
                            "p50_us": p50, "p99_us": p99})


def platform_text() -> str:
    return f"{os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.2f}"


# --- step-cost: what one attention.decode step costs an engine ----------------------------
def _step_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--point", nargs="+", type=point, default=[], metavar="B,H,KV,QLEN")
    p.add_argument("--setting", nargs="+", choices=STEP_SETTINGS, default=list(STEP_SETTINGS),
                   help="the bundled table's pick, or padded/triton forced split-KV or "
                        "persistent (device-planned)")


def _step_cost(args, printer: Printer) -> None:
    import tempfile

    from mlatune import attention
    from mlatune.dispatch import Dispatcher
    from mlatune.problem import MLAProblem

    device = _gpu("step-cost")
    printer.header(_device_text(device))
    bundled = Dispatcher.from_bundled()
    with tempfile.TemporaryDirectory() as folder:
        for at in args.point:
            batch, heads, kv_len, qlen = at
            problem = MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen)
            for setting in args.setting:
                dispatcher = bundled if setting == "bundled" else \
                    _forced(problem, setting, device, Path(folder))
                attention.plans_of(dispatcher).clear()
                row = _step_point(problem, dispatcher)
                printer.result(
                    f"({text_of(at, ', ')}) {setting} {row['route']} {row['step_kind']}: "
                    f"host {row['host_reused_us']:.1f} us reused, "
                    f"{row['host_held_step_us']:.1f} us held step "
                    f"({row['host_graph_replay_us']:.1f} us of it graph.replay), "
                    f"{row['host_replanned_us']:.1f} us replanned; device eager "
                    f"{row['eager_us']:.1f} us, graph {row['graph_us']:.1f} us "
                    f"(plan {row['plan_us']:.1f} us); another layer on its plan: host "
                    f"{row['layer_host_us']:.1f} us, graph {row['layer_graph_us']:.1f} us",
                    ["--point", text_of(at), "--setting", setting],
                    {"point": list(at), "setting": setting, **row})


def _forced(problem, setting: str, device, folder: Path):
    """A dispatcher whose one-row table makes padded/triton win with the first set of the
    setting's kind (split-KV, or persistent)."""
    from mlatune import routes, table
    from mlatune.dispatch import Dispatcher
    from mlatune.table.schema import Provenance, device_key

    space = routes.get("padded/triton").param_space(problem, device)
    params = next(p for p in space if bool(p.get("persistent")) == (setting == "persistent"))
    row = {**device_key(device), **problem.key_dict(), "route": "padded/triton",
           "route_params": json.dumps(params, sort_keys=True), "status": "ok", "reason": "",
           "time_us": 1.0, "time_us_p20": 1.0, "time_us_p80": 1.0, "timer": "cuda_graph",
           "rel_err": 0.0, "max_abs_err": 0.0, "tb_per_s": 1.0, "tflops": 1.0}
    path = table.write(table.build([row], Provenance.here()), folder / f"{setting}.parquet")
    return Dispatcher.load(path, device=device)


def _step_point(problem, dispatcher) -> dict:
    """Host time per eager call (step cached, held by the caller, replanned each call), the
    device time eager and replayed from a CUDA graph, the plan alone, and a second layer
    that reads the first one's plan."""
    import torch

    from mlatune import attention
    from mlatune.check.inputs import make_decode_inputs
    from mlatune.measure import timers

    inputs = make_decode_inputs(problem, seed=1, device="cuda", ragged=True)
    shard = inputs.shards[0]
    out = torch.empty(inputs.q.shape[0], problem.num_heads, problem.d_v, dtype=inputs.q.dtype,
                      device="cuda")
    common = dict(num_heads=problem.num_heads, qlen=problem.qlen, max_kv_len=problem.kv_len,
                  capturable=True, dispatcher=dispatcher)

    def call() -> None:
        attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                         out=out, **common)

    def host(fn: Callable[[], None], reps: int = 200) -> float:
        return timers.host_us(fn, "cuda", reps=reps, max_seconds=1.0, warm=True)

    call()
    call()  # the second eager call captures the step's private graph
    reused = host(call)
    (cached,) = attention.plans_of(dispatcher).values()
    replay = host(cached.graph.replay) if cached.graph is not None else math.nan
    step = attention.prepare_decode(inputs.q, shard.kv_cache, shard.block_table,
                                    inputs.seq_lens, out=out, **common)
    step()
    step()
    held = host(step)

    def replanned() -> None:
        attention.plans_of(dispatcher).clear()
        call()

    again = host(replanned, reps=40)
    call()
    (plan,) = attention.plans_of(dispatcher).values()
    prepared = plan.prepared
    plan_us = timers.measure(prepared.plan, "cuda").median_us if prepared.plan else 0.0
    eager = timers.measure(call, "cuda", graph_safe=False)
    graph = timers.measure(call, "cuda")
    q2, out2 = inputs.q.clone(), torch.empty_like(out)

    def layer() -> None:  # another layer of the same step: the first one's plan
        attention.decode(q2, shard.kv_cache, shard.block_table, inputs.seq_lens, out=out2,
                         reuse_plan=True, **common)

    call()
    layer()
    layer()
    return {"route": plan.choice.route_id, "source": plan.choice.source,
            "params": dict(plan.choice.params), "step_kind": prepared.step_kind.plan_on,
            "host_reused_us": reused, "host_held_step_us": held,
            "host_graph_replay_us": replay, "host_replanned_us": again,
            "eager_us": eager.median_us, "graph_us": graph.median_us, "timer": graph.timer,
            "plan_us": plan_us, "layer_host_us": host(layer),
            "layer_graph_us": timers.measure(layer, "cuda").median_us}


# --- sweep-cost: where a sweep's worker time went, from its journal ----------------------
_PAUSE_S = 60.0  # a gap this long between a device's candidates is a pause (resumed calls)


def _sweep_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--journal", type=Path, required=True)
    p.add_argument("--by", default="num_heads",
                   help="a problem field (num_heads, batch, kv_len, ...) or 'route'")
    p.add_argument("--only", default=None,
                   help="print one line alone: a value of --by, 'total', or a device")


def _sweep_cost(args, printer: Printer) -> None:
    from mlatune.measure.records import COST_PARTS
    from mlatune.sweep.journal import JournalError, read

    try:
        records = read(args.journal)[1]  # a torn last line is dropped
    except (OSError, JournalError) as exc:
        refuse(f"{args.journal}: {exc}")
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        if r["status"] != "unsupported":
            group = groups[str(r["route"] if args.by == "route" else r["key"][args.by])]
            _add_cost(group, r, COST_PARTS)
            _add_cost(groups["total"], r, COST_PARTS)
    if not groups:
        refuse(f"{args.journal}: no candidate has run yet")
    printer.header(platform_text())
    base = ["--journal", str(args.journal), "--by", args.by]
    for name in sorted(groups, key=lambda g: (g == "total", len(g), g)):
        if args.only in (None, name):
            g = groups[name]
            parts = ", ".join(f"{p.removesuffix('_s').replace('_', ' ')} {g[p]:.1f} s"
                              for p in (*COST_PARTS, "other_s"))
            printer.result(f"{args.journal} {args.by} {name}: {g['candidates']:.0f} "
                           f"candidates ({g['raced']:.0f} raced); {parts}; kernel "
                           f"{g['kernel_s']:.1f} s", [*base, "--only", name],
                           {"by": args.by, "group": name, **g})
    for device, (n, worked, in_use) in sorted(busy(records).items()):
        if args.only in (None, device):
            share = f" ({worked / in_use:.0%} busy)" if in_use > 0 else ""
            printer.result(f"{args.journal} {device}: {n} candidates, {worked:.1f} s of work "
                           f"in {in_use:.1f} s in use{share}", [*base, "--only", device],
                           {"device": device, "candidates": n, "work_s": worked,
                            "in_use_s": in_use})


def _add_cost(group: dict[str, float], r: dict, parts: tuple[str, ...]) -> None:
    group["candidates"] += 1
    group["raced"] += bool(r.get("raced"))
    for part in parts:
        group[part] += r.get(part, 0.0)
    group["other_s"] += max(0.0, r.get("elapsed_s", 0.0) - sum(r.get(p, 0.0) for p in parts))
    if r["status"] == "ok":
        group["kernel_s"] += r["time_us"] * 1e-6 * r["reps"]


def busy(records: list[dict]) -> dict[str, tuple[int, float, float]]:
    """Per device: (candidates, seconds they took, seconds the device was in use: from the
    first candidate's start to the last one's end, less pauses over ``_PAUSE_S``)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if "finished_at" in r:
            spans[r["device"]].append((r["finished_at"] - r["elapsed_s"], r["finished_at"]))
    out = {}
    for device, runs in spans.items():
        runs.sort()
        in_use, (start, end) = 0.0, runs[0]
        for s, e in runs[1:]:
            if s > end + _PAUSE_S:
                in_use, start = in_use + end - start, s
            end = max(end, e)
        out[device] = (len(runs), sum(e - s for s, e in runs), in_use + end - start)
    return out


# --- the driver -------------------------------------------------------------------------
@dataclass(frozen=True)
class Routine:
    about: str
    flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Printer], None]


ROUTINES = {
    "decode": Routine("every decode route's parameter sets at points, checked, then timed",
                      _decode_flags, _decode),
    "prefill": Routine("every prefill route's parameter sets at sizes, checked, then timed",
                       _prefill_flags, _prefill),
    "dcp-step": Routine("a DCP step across ranks against the sweep's one-GPU simulation",
                        _dcp_flags, _dcp_step),
    "select-cost": Routine("Dispatcher.load and select() latency over a table and a spec",
                           _select_flags, _select_cost),
    "step-cost": Routine("what one attention.decode step costs an engine (host and device)",
                         _step_flags, _step_cost),
    "sweep-cost": Routine("where a sweep's worker time went, from its journal",
                          _sweep_flags, _sweep_cost),
}


def cases() -> dict[str, dict[str, dict]]:
    """routine -> case name -> the case's flags (and ``about``)."""
    return tomllib.loads(CASES.read_text())


def case_argv(case: dict) -> list[str]:
    """A case's flags as command-line arguments (``about`` is no flag)."""
    argv: list[str] = []
    for key, value in case.items():
        if key == "about" or value is False:
            continue
        argv.append(f"--{key}")
        if isinstance(value, list):
            argv += [str(v) for v in value]
        elif value is not True:
            argv.append(str(value))
    return argv


def list_cases() -> None:
    known = cases()
    for name, routine in ROUTINES.items():
        print(f"{name}: {routine.about}")
        for case, flags in known.get(name, {}).items():
            print(f"  --case {case}: {flags.get('about', '')}\n"
                  f"      {shlex.join(case_argv(flags))}")


def main(argv: list[str] | None = None) -> int:
    first = argparse.ArgumentParser(description="mlatune's benchmark driver "
                                    "(docs/benchmarks.md)", add_help=False)
    first.add_argument("--routine", choices=list(ROUTINES))
    first.add_argument("--case", default=None, help="a case of benchmarks/cases.toml")
    first.add_argument("--list", action="store_true", help="the routines and their cases")
    first.add_argument("--out", type=Path, default=None,
                       help="append every result (and the run's header) as JSON lines")
    known, rest = first.parse_known_args(argv)
    if known.list:
        list_cases()
        return 0
    if known.routine is None:
        first.print_help()
        return 0 if "-h" in rest or "--help" in rest else 2
    routine = ROUTINES[known.routine]
    parser = argparse.ArgumentParser(prog=f"{SCRIPT} --routine {known.routine}",
                                     description=routine.about, parents=[first])
    routine.flags(parser)
    routine_cases = cases().get(known.routine, {})
    if known.case is not None and known.case not in routine_cases:
        parser.error(f"--case {known.case}: {known.routine} has "
                     f"{', '.join(routine_cases) or 'no cases'}")
    case = routine_cases.get(known.case or "default", {})
    args = parser.parse_args([*case_argv(case), *rest])
    routine.run(args, Printer(known.routine, known.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
