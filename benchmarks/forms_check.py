"""Kernels before and after a change, side by side on one GPU: the Gluon decodes, or the prefill.

    python benchmarks/forms_check.py --old .old_kernels --out DIR [--rounds 7] [--prefill]
    python benchmarks/forms_check.py --old .old_kernels --out DIR --check-only --jobs 6 [--prefill]

``--old``: a folder holding the kernel files as they were (e.g. written by ``git show
<commit>:mlatune/kernels/<file>.py``), imported as a package of their own: the decodes'
``gluon_*.py``, or with ``--prefill`` ``prefill.py`` and ``gluon_prefill_fp8.py``. Decode: at
each point (batch, heads, kv_len, qlen; page 64) each Gluon route's first param set there (and
the seesaw's two-requests set where offered). Prefill:
at the shipped H200 table's prefill shapes (causal), fp8-ps's Gluon sets and bf16-ps's first
set (the Triton kernel and its merge of split tiles). Each case runs through the old kernel,
called as the old route called it (the boolean spelling), and through the new one, called as
the route calls it now. Both are checked against the torch reference (``mlatune.check``, the
route's tolerance) and against each other (bit-equal outputs or not; prefill: also the split
tiles' partials before the merge, and the largest difference), then timed by
``mlatune.measure.timers.measure`` (cold L2, CUDA-graph replay, median of the repetitions),
old and new alternating, ``--rounds`` times each; the ratio is the new median over the old.
``--check-only`` compiles and checks the cases in ``--jobs`` processes (filling triton's
cache) and writes ``checks.json``, which a later run into the same ``--out`` takes instead of
checking again, so that it only loads kernels and times them. Writes ``forms_check.json``
and ``forms_check.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch
import triton

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlatune import capability, routes  # noqa: E402
from mlatune.arch import current_device  # noqa: E402
from mlatune.check import reference  # noqa: E402
from mlatune.check.accuracy import check  # noqa: E402
from mlatune.check.inputs import make_decode_inputs, make_prefill_inputs  # noqa: E402
from mlatune.measure.timers import Budget, measure  # noqa: E402
from mlatune.problem import DTYPES, FP8_DTYPES, MLAProblem  # noqa: E402
from mlatune.routes.prefill_triton import TILE_Q  # noqa: E402

# (batch, heads, kv_len, qlen, kv dtype)
POINTS = [(128, 128, 4096, 1, "bf16"), (64, 64, 4096, 1, "bf16"), (8, 128, 32768, 1, "bf16"),
          (128, 16, 4096, 2, "bf16"), (128, 16, 4096, 4, "bf16"), (128, 16, 8192, 1, "bf16"),
          (64, 16, 4096, 1, "bf16"), (1, 16, 4096, 1, "bf16"), (128, 16, 8192, 1, "fp8_e4m3fn")]
ROUTES = ("wgmma/gluon", "seesaw/gluon", "transposed/gluon", "transposed-mma8/gluon")
EXTRA_FORMS = {"seesaw/gluon": "two-requests"}
SEESAW_OPTIONS = ("chunked", "pdl", "slim", "lone_bars", "afresh_q", "rope_regs")
MMA8_OPTIONS = ("defer_sums", "stacked", "wide_vt", "warp_max", "slim")
PACKAGE = "old_gluon_kernels"
# Prefill: (batch, heads, tokens a request), the shipped H200 table's prefill shapes, causal;
# each in fp8 (fp8-ps) and bf16 (bf16-ps).
PREFILL_POINTS = [(1, 128, 4096), (1, 16, 4096), (8, 128, 2048), (8, 16, 2048),
                  (32, 128, 512), (32, 16, 512)]
PREFILL_ROUTES = (("fp8-ps/triton", "fp8_e4m3fn"), ("bf16-ps/triton", "bf16"))
PREFILL_MODULES = ("prefill", "gluon_prefill_fp8")
# The Gluon prefill's booleans before its form id: the kept form's values.
GLUON_PREFILL_FORM = {"pingpong": True, "permuted_v": True, "paired": False}


@dataclasses.dataclass
class Case:
    point: tuple
    route: str
    params: dict  # the current spelling
    old_params: dict  # the boolean spelling the old route stored

    @property
    def name(self) -> str:  # the point's sizes, its dtype, the route, the params
        return (f"({', '.join(map(str, self.point[:-1]))}) {self.point[-1]} {self.route} "
                f"{json.dumps(self.params)}")


def old_modules(folder: Path, prefill: bool) -> list[str]:
    """The old kernel files a check loads: the prefill's two, or the decodes' ``gluon_*``."""
    if prefill:
        return list(PREFILL_MODULES)
    return [p.stem for p in sorted(folder.glob("gluon_*.py"))
            if not p.stem.startswith("gluon_prefill")]


def load_old(folder: Path, names: list[str]) -> dict[str, ModuleType]:
    """The kernel files ``names`` in ``folder`` as package ``PACKAGE`` (their imports of one
    another rewritten to it; every other import, e.g. ``mlatune.kernels.reduce``, kept)."""
    root = Path(tempfile.mkdtemp(prefix="forms_check_"))
    package = root / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    ours = "|".join(names)
    for name in names:
        text = re.sub(rf"mlatune\.kernels\.({ours})\b", rf"{PACKAGE}.\1",
                      (folder / f"{name}.py").read_text())
        text = re.sub(rf"from mlatune\.kernels import ({ours})\b", rf"from {PACKAGE} import \1",
                      text)
        (package / f"{name}.py").write_text(text)
    sys.path.insert(0, str(root))
    return {name: importlib.import_module(f"{PACKAGE}.{name}") for name in names}


def problem_at(point: tuple) -> MLAProblem:
    batch, heads, kv_len, qlen, kv = point
    return MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen, kv_dtype=kv)


def boolean_spelling(route_id: str, params: dict, fp8: bool) -> dict:
    """``params`` as the route stored them before form ids."""
    split = {"num_splits": params["num_splits"]}
    if route_id == "seesaw/gluon":
        return {**split, **dict.fromkeys(SEESAW_OPTIONS, True),
                "two_requests": params["form"] == "two-requests"}
    if route_id.startswith("transposed"):
        if params["form"] == "mma8":
            return {**split, "pdl": True, "ws": True, "fp8_mma": True,
                    **dict.fromkeys(MMA8_OPTIONS, True)}
        return {**split, "pdl": True, **({"ws": True} if fp8 else {})}
    return split


def cases(device, prefill: bool = False) -> list[Case]:
    if prefill:
        return prefill_cases(device)
    out = []
    for point in POINTS:
        problem = problem_at(point)
        for route_id in ROUTES:
            if not capability.check(route_id, problem, "sm_90"):
                continue
            route = routes.get(route_id)
            space = route.param_space(problem, device)
            chosen = [space[0]]
            extra = [p for p in space if p.get("form") == EXTRA_FORMS.get(route_id)]
            if extra and extra[0] != space[0]:
                chosen.append(extra[0])
            for params in chosen:
                old = boolean_spelling(route_id, params, problem.kv_dtype in FP8_DTYPES)
                assert route.upgrade_params(old) == params, (route_id, old, params)
                out.append(Case(point, route_id, params, old))
    return out


def old_launcher(old: dict[str, ModuleType], case: Case, problem: MLAProblem, inputs):
    """The old kernel, called as the old route called it."""
    shard = inputs.shards[0]
    params = case.old_params
    common = dict(qlen=problem.qlen, sm_scale=inputs.softmax_scale, causal=problem.causal,
                  num_splits=params["num_splits"], max_seq_len=problem.shard_len)
    tensors = (inputs.q, shard.kv_cache, shard.block_table, shard.seq_lens)
    if case.route == "wgmma/gluon":
        return old["gluon_hopper"].decode_launcher(*tensors, **common)
    if case.route == "seesaw/gluon":
        options = {k: params[k] for k in (*SEESAW_OPTIONS, "two_requests")}
        return old["gluon_seesaw"].decode_launcher(*tensors, **common, **options)
    common["kv_scale"] = inputs.kv_scale
    if params.get("fp8_mma") and problem.kv_dtype in FP8_DTYPES:
        options = {k: params[k] for k in ("pdl", *MMA8_OPTIONS)}
        return old["gluon_transposed_fp8"].decode_launcher(*tensors, **common, **options)
    name = "gluon_transposed_ws" if params.get("ws") else "gluon_transposed"
    return old[name].decode_launcher(*tensors, **common, pdl=params["pdl"])


def new_launcher(case: Case, problem: MLAProblem, inputs):
    """The new kernel, called as the route calls it (``launcher``, as ``prepare`` does)."""
    route = routes.get(case.route)
    shard = inputs.shards[0]
    launcher, extra = route.launcher(problem, case.params)
    if route.reads_fp8:
        extra["kv_scale"] = inputs.kv_scale
    return launcher(inputs.q, shard.kv_cache, shard.block_table, shard.seq_lens,
                    qlen=problem.qlen, sm_scale=inputs.softmax_scale, causal=problem.causal,
                    num_splits=case.params["num_splits"], max_seq_len=problem.shard_len, **extra)


def prefill_problem(point: tuple) -> MLAProblem:
    batch, heads, tokens, dtype = point
    return MLAProblem(phase="prefill", num_heads=heads, batch=batch, qlen=tokens, kv_len=tokens,
                      q_dtype=dtype, kv_dtype=dtype, causal=True)


def old_prefill_spelling(params: dict) -> dict:
    """``params`` as the prefill routes stored them before: the Gluon form in booleans, a
    Triton set with ``qk_ahead`` off."""
    if params.get("kernel") == "gluon":
        return {**{k: v for k, v in params.items() if k != "form"}, **GLUON_PREFILL_FORM}
    return {**params, "qk_ahead": False}


def prefill_cases(device) -> list[Case]:
    """At each prefill point: fp8-ps's Gluon sets (where the route offers them here) and
    bf16-ps's first set (the Triton kernel)."""
    out = []
    for sizes in PREFILL_POINTS:
        for route_id, dtype in PREFILL_ROUTES:
            point = (*sizes, dtype)
            route = routes.get(route_id)
            space = route.param_space(prefill_problem(point), device)
            chosen = ([p for p in space if p.get("kernel") == "gluon"] if dtype in FP8_DTYPES
                      else space[:1])
            for params in chosen:
                old = old_prefill_spelling(params)
                assert route.upgrade_params(old) == params, (route_id, old, params)
                out.append(Case(point, route_id, params, old))
    return out


def old_prefill_launcher(old: dict[str, ModuleType], params: dict, tensors: tuple,
                         lengths: tuple, common: dict):
    """The old prefill kernel, called as the old route called it."""
    if params.get("kernel") == "gluon":
        return old["gluon_prefill_fp8"].GluonPrefill(
            *tensors, *lengths, grouped=bool(params["grouped"]), stages=params["num_stages"],
            paired=params["paired"], permuted_v=params["permuted_v"],
            pingpong=params["pingpong"], **common)
    kernels = old["prefill"]
    config = kernels.KernelConfig(params["block_m"], params["block_n"], params["num_warps"],
                                  params["num_stages"], bool(params.get("v_transposed")),
                                  params["qk_ahead"], bool(params.get("grouped")))
    return kernels.PersistentPrefill(*tensors, *lengths, config=config, **common)


def prefill_built(old, case: Case):
    """The old and the new prefill launcher over the same inputs, each writing outputs of
    its own (no head padding at these points: the route would pass the inputs as they are)."""
    problem = prefill_problem(case.point)
    assert problem.num_heads % 16 == 0, problem
    inputs = make_prefill_inputs(problem, seed=sum(case.point[:3]), device="cuda")
    lengths = (inputs.cu_seqlens_q.diff().tolist(), inputs.cu_seqlens_k.diff().tolist())
    scales = ((inputs.q_scale, inputs.k_scale, inputs.v_scale)
              if problem.kv_dtype in FP8_DTYPES else None)
    common = dict(causal=problem.causal, sm_scale=inputs.softmax_scale, scales=scales,
                  num_programs=current_device().cu_count, tile_q=TILE_Q)
    launches = []
    for which in ("old", "new"):
        out = torch.empty(inputs.q.shape[0], problem.num_heads, problem.d_v,
                          dtype=DTYPES[problem.out_dtype], device=inputs.q.device)
        lse = torch.empty(inputs.q.shape[0], problem.num_heads, device=inputs.q.device)
        tensors = (inputs.q, inputs.k, inputs.v, out, lse)
        launch = (old_prefill_launcher(old, case.old_params, tensors, lengths, common)
                  if which == "old" else
                  routes.get(case.route).launcher(case.params, tensors, lengths, common)[1])
        launches.append((launch, out, lse))
    return problem, inputs, *launches


def built(old, case: Case):
    """(problem, inputs, old (run, out, lse), new (run, out, lse))."""
    if case.route in dict(PREFILL_ROUTES):
        return prefill_built(old, case)
    problem = problem_at(case.point)
    inputs = make_decode_inputs(problem, seed=sum(case.point[:4]), device="cuda")
    return problem, inputs, old_launcher(old, case, problem, inputs), \
        new_launcher(case, problem, inputs)


def zeroed_partials(launch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A prefill launcher's split-tile partials (output, LSE) set to zeros (a slot's rows past
    its piece are never written); None for a decode launch."""
    tables = next((b for b in getattr(launch, "_buffers", ()) if hasattr(b, "part_out")), None)
    if tables is None:
        return None
    tables.part_out.zero_()
    tables.part_lse.zero_()
    return tables.part_out, tables.part_lse


def prefill_differences(launch, partials: list, outs: tuple, lses: tuple) -> dict:
    """Old against new beyond bit-equality: the partials before the merge, and the largest
    differences of the outputs and of the finite LSEs."""
    finite = torch.isfinite(lses[0]) & torch.isfinite(lses[1])
    lse_diff = (lses[0] - lses[1])[finite].abs()
    return {"split_tiles": len(launch.plan.merges),
            "partials_identical": all(torch.equal(a, b) for a, b in zip(*partials, strict=True)),
            "max_abs_diff": float((outs[0].float() - outs[1].float()).abs().max()),
            "lse_max_abs_diff": float(lse_diff.max()) if lse_diff.numel() else 0.0}


def checked(old, case: Case) -> dict:
    """Both kernels run once against the reference, and against each other."""
    problem, inputs, (run_old, out_old, lse_old), (run_new, out_new, lse_new) = built(old, case)
    partials = [zeroed_partials(run) for run in (run_old, run_new)]
    run_old()
    run_new()
    torch.cuda.synchronize()
    if problem.phase == "prefill":
        want_out, want_lse = reference.prefill(inputs)
    else:
        want_out, want_lse = reference.decode_shard(inputs, inputs.shards[0])
    rounding = routes.rounding(routes.get(case.route), problem, case.params)
    result = {"identical": bool(torch.equal(out_old, out_new) and torch.equal(lse_old, lse_new))}
    for which, out, lse in (("old", out_old, lse_old), ("new", out_new, lse_new)):
        acc = check(problem, out, want_out, lse, want_lse, rounding=rounding)
        result[which] = {"ok": bool(acc.ok), "summary": acc.summary, "reason": acc.reason}
    if partials[0] is not None:
        result.update(prefill_differences(run_new, partials, (out_old, out_new),
                                          (lse_old, lse_new)))
    return result


def timed(old, case: Case, rounds: int, budget: Budget) -> dict:
    """Old and new alternating (old, new, old, new, ...), each a ``measure`` of its own."""
    _, _, (run_old, *_), (run_new, *_) = built(old, case)
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(rounds):
        for which, run in (("old", run_old), ("new", run_new)):
            times[which].append(measure(run, "cuda", budget).median_us)
    old_us, new_us = (statistics.median(times[k]) for k in ("old", "new"))
    return {"old_us": old_us, "new_us": new_us, "ratio": new_us / old_us, "rounds": times}


def warm(old_folder: Path, shard: int, jobs: int, out: Path, prefill: bool) -> None:
    """Worker ``shard`` of ``jobs``: compile and check its share of the cases."""
    old = load_old(old_folder, old_modules(old_folder, prefill))
    results = {}
    for i, case in enumerate(cases(current_device(), prefill)):
        if i % jobs == shard:
            try:
                results[case.name] = checked(old, case)
            except Exception as exc:  # reported, not fatal: the other cases still run
                results[case.name] = {"error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(results))


def check_all(args: argparse.Namespace) -> None:
    """Every case compiled and checked by ``args.jobs`` worker processes, into checks.json."""
    checks: dict[str, dict] = {}
    mode = ["--prefill"] if args.prefill else []
    workers = [subprocess.Popen([sys.executable, __file__, "--old", str(args.old), "--out",
                                 str(args.out), *mode,
                                 "--warm", f"{i}/{args.jobs}:{args.out}/w{i}.json"])
               for i in range(args.jobs)]
    for i, worker in enumerate(workers):
        worker.wait()
        path = args.out / f"w{i}.json"
        if path.exists():
            checks.update(json.loads(path.read_text()))
            path.unlink()
    for name, result in checks.items():
        print(f"{name}: {result}", flush=True)
    (args.out / "checks.json").write_text(json.dumps(checks, indent=1))


def commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True,
                    help="folder of the old kernel files (gluon_*.py; prefill.py)")
    ap.add_argument("--prefill", action="store_true",
                    help="the prefill kernels (Gluon fp8 and Triton, with the merge)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--check-only", action="store_true",
                    help="compile and check every case, write checks.json, time nothing")
    ap.add_argument("--jobs", type=int, default=1, help="processes that compile and check")
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)  # "shard/jobs:file"
    args = ap.parse_args()
    if args.warm:
        share, path = args.warm.split(":", 1)
        shard, jobs = map(int, share.split("/"))
        warm(args.old, shard, jobs, Path(path), args.prefill)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.check_only:
        check_all(args)
        return
    device = current_device()
    saved = args.out / "checks.json"
    checks: dict[str, dict] = json.loads(saved.read_text()) if saved.exists() else {}
    old = load_old(args.old, old_modules(args.old, args.prefill))
    budget = Budget(warmup=2, min_reps=20, max_reps=40, max_seconds=0.5, race_ratio=0.0)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    header = (f"{command}\n{device.name}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{datetime.date.today().isoformat()}, commit {commit()} (+ working tree), "
              f"{args.rounds} rounds old/new alternating, cold L2, CUDA-graph replay")
    print(header, flush=True)
    rows = []
    for case in cases(device, args.prefill):
        row = {"case": case.name, "point": case.point, "route": case.route,
               "params": case.params, "old_params": case.old_params}
        try:
            row.update(checks.get(case.name) or checked(old, case))
            if "error" not in row:
                row.update(timed(old, case, args.rounds, budget))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print(line(row), flush=True)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    summary = (f"{len(ratios)} of {len(rows)} timed; ratio new/old: min {min(ratios):.4f}, "
               f"max {max(ratios):.4f}, geomean "
               f"{math.exp(statistics.fmean(map(math.log, ratios))):.4f}; all within 2%: "
               f"{all(abs(r - 1) <= 0.02 for r in ratios)}; all correct: "
               f"{all(r.get('old', {}).get('ok') and r.get('new', {}).get('ok') for r in rows)}; "
               f"outputs bit-identical: {sum(bool(r.get('identical')) for r in rows)} of "
               f"{len(rows)}{partials_summary(rows)}") if ratios else "nothing timed"
    print(summary, flush=True)
    (args.out / "forms_check.json").write_text(json.dumps(
        {"header": header, "summary": summary, "rows": rows}, indent=1))
    (args.out / "forms_check.txt").write_text(
        "\n".join([header, *(line(r) for r in rows), summary]) + "\n")


def partials_summary(rows: list[dict]) -> str:
    """The prefill's: how many cases' partials were bit-identical, and the largest
    differences of the outputs (the merged rows are where they may differ)."""
    judged = [r for r in rows if "partials_identical" in r]
    if not judged:
        return ""
    return (f"; partials bit-identical: {sum(r['partials_identical'] for r in judged)} of "
            f"{len(judged)}; largest |out diff| {max(r['max_abs_diff'] for r in judged):.3g}, "
            f"|lse diff| {max(r['lse_max_abs_diff'] for r in judged):.3g}")


def line(row: dict) -> str:
    if "error" in row:
        return f"{row['case']}: ERROR {row['error']}"
    ok = "ok" if row["old"]["ok"] and row["new"]["ok"] else \
        f"FAILED old {row['old']['reason']} new {row['new']['reason']}"
    timing = (f"old {row['old_us']:.1f} us, new {row['new_us']:.1f} us, "
              f"ratio {row['ratio']:.4f}") if "ratio" in row else "not timed"
    extra = (f" (split tiles {row['split_tiles']}; partials "
             f"{'bit-identical' if row['partials_identical'] else 'differ'}; max |out diff| "
             f"{row['max_abs_diff']:.3g}, |lse diff| {row['lse_max_abs_diff']:.3g})"
             if "partials_identical" in row else "")
    return (f"{row['case']}: {timing}; {ok} ({row['new']['summary']}); "
            f"{'bit-identical' if row['identical'] else 'outputs differ'}{extra}")


if __name__ == "__main__":
    main()
