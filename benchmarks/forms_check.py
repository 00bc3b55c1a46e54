"""The Gluon decode kernels before and after a change, side by side on one GPU.

    python benchmarks/forms_check.py --old .old_kernels --out DIR [--rounds 7]
    python benchmarks/forms_check.py --old .old_kernels --out DIR --check-only --jobs 6

``--old``: a folder holding the kernel files as they were (``gluon_*.py``, e.g. written by
``git show <commit>:mlatune/kernels/<file>.py``), imported as a package of their own. At
each point (batch, heads, kv_len, qlen; page 64) each Gluon route's first param set there
(and the seesaw's two-requests and the transposed route's widening sets where offered) runs
through the old kernel, called as the old route called it (the boolean spelling), and
through the new one, called as the route calls it now. Both are checked against the torch
reference (``mlatune.check``, the route's tolerance) and against each other (bit-equal
outputs or not), then timed by ``mlatune.measure.timers.measure`` (cold L2, CUDA-graph
replay, median of the repetitions), old and new alternating, ``--rounds`` times each; the
ratio is the new median over the old. ``--check-only`` compiles and checks the cases in
``--jobs`` processes (filling triton's cache) and writes ``checks.json``, which a later run
into the same ``--out`` takes instead of checking again, so that it only loads kernels and
times them. Writes ``forms_check.json`` and ``forms_check.txt`` under ``--out``.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlatune import capability, routes  # noqa: E402
from mlatune.arch import current_device  # noqa: E402
from mlatune.check import reference  # noqa: E402
from mlatune.check.accuracy import check  # noqa: E402
from mlatune.check.inputs import make_decode_inputs  # noqa: E402
from mlatune.measure.timers import Budget, measure  # noqa: E402
from mlatune.problem import FP8_DTYPES, MLAProblem  # noqa: E402

# (batch, heads, kv_len, qlen, kv dtype)
POINTS = [(128, 128, 4096, 1, "bf16"), (64, 64, 4096, 1, "bf16"), (8, 128, 32768, 1, "bf16"),
          (128, 16, 4096, 2, "bf16"), (128, 16, 4096, 4, "bf16"), (128, 16, 8192, 1, "bf16"),
          (64, 16, 4096, 1, "bf16"), (1, 16, 4096, 1, "bf16"), (128, 16, 8192, 1, "fp8_e4m3fn")]
ROUTES = ("wgmma/gluon", "seesaw/gluon", "transposed/gluon")
EXTRA_FORMS = {"seesaw/gluon": "two-requests", "transposed/gluon": "mma16"}
SEESAW_OPTIONS = ("chunked", "pdl", "slim", "lone_bars", "afresh_q", "rope_regs")
MMA8_OPTIONS = ("defer_sums", "stacked", "wide_vt", "warp_max", "slim")
PACKAGE = "old_gluon_kernels"


@dataclasses.dataclass
class Case:
    point: tuple
    route: str
    params: dict  # the current spelling
    old_params: dict  # the boolean spelling the old route stored

    @property
    def name(self) -> str:
        b, h, n, q, kv = self.point
        return f"({b}, {h}, {n}, {q}) {kv} {self.route} {json.dumps(self.params)}"


def load_old(folder: Path) -> dict[str, ModuleType]:
    """The kernel files in ``folder`` as package ``PACKAGE`` (their imports of one another
    rewritten to it; every other import, e.g. ``mlatune.kernels.reduce``, kept)."""
    root = Path(tempfile.mkdtemp(prefix="forms_check_"))
    package = root / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    for path in sorted(folder.glob("gluon_*.py")):
        text = re.sub(r"mlatune\.kernels\.(gluon_\w+)", rf"{PACKAGE}.\1", path.read_text())
        text = re.sub(r"from mlatune\.kernels import (gluon_\w+)", rf"from {PACKAGE} import \1",
                      text)
        (package / path.name).write_text(text)
    sys.path.insert(0, str(root))
    return {path.stem: importlib.import_module(f"{PACKAGE}.{path.stem}")
            for path in sorted(folder.glob("gluon_*.py"))}


def problem_at(point: tuple) -> MLAProblem:
    batch, heads, kv_len, qlen, kv = point
    return MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen, kv_dtype=kv)


def boolean_spelling(route_id: str, params: dict, fp8: bool) -> dict:
    """``params`` as the route stored them before form ids."""
    split = {"num_splits": params["num_splits"]}
    if route_id == "seesaw/gluon":
        return {**split, **dict.fromkeys(SEESAW_OPTIONS, True),
                "two_requests": params["form"] == "two-requests"}
    if route_id == "transposed/gluon":
        if params["form"] == "mma8":
            return {**split, "pdl": True, "ws": True, "fp8_mma": True,
                    **dict.fromkeys(MMA8_OPTIONS, True)}
        return {**split, "pdl": True, **({"ws": True} if fp8 else {})}
    return split


def cases(device) -> list[Case]:
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


def built(old, case: Case):
    problem = problem_at(case.point)
    inputs = make_decode_inputs(problem, seed=sum(case.point[:4]), device="cuda")
    return problem, inputs, old_launcher(old, case, problem, inputs), \
        new_launcher(case, problem, inputs)


def checked(old, case: Case) -> dict:
    """Both kernels run once against the reference, and against each other."""
    problem, inputs, (run_old, out_old, lse_old), (run_new, out_new, lse_new) = built(old, case)
    run_old()
    run_new()
    torch.cuda.synchronize()
    want_out, want_lse = reference.decode_shard(inputs, inputs.shards[0])
    rounding = routes.rounding(routes.get(case.route), problem, case.params)
    result = {"identical": bool(torch.equal(out_old, out_new) and torch.equal(lse_old, lse_new))}
    for which, out, lse in (("old", out_old, lse_old), ("new", out_new, lse_new)):
        acc = check(problem, out, want_out, lse, want_lse, **rounding)
        result[which] = {"ok": bool(acc.ok), "summary": acc.summary, "reason": acc.reason}
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


def warm(old_folder: Path, shard: int, jobs: int, out: Path) -> None:
    """Worker ``shard`` of ``jobs``: compile and check its share of the cases."""
    old = load_old(old_folder)
    results = {}
    for i, case in enumerate(cases(current_device())):
        if i % jobs == shard:
            try:
                results[case.name] = checked(old, case)
            except Exception as exc:  # reported, not fatal: the other cases still run
                results[case.name] = {"error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(results))


def check_all(args: argparse.Namespace) -> None:
    """Every case compiled and checked by ``args.jobs`` worker processes, into checks.json."""
    checks: dict[str, dict] = {}
    workers = [subprocess.Popen([sys.executable, __file__, "--old", str(args.old), "--out",
                                 str(args.out), "--warm", f"{i}/{args.jobs}:{args.out}/w{i}.json"])
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
    ap.add_argument("--old", type=Path, required=True, help="folder of the old gluon_*.py")
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
        warm(args.old, shard, jobs, Path(path))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.check_only:
        check_all(args)
        return
    device = current_device()
    saved = args.out / "checks.json"
    checks: dict[str, dict] = json.loads(saved.read_text()) if saved.exists() else {}
    old = load_old(args.old)
    budget = Budget(warmup=2, min_reps=20, max_reps=40, max_seconds=0.5, race_ratio=0.0)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    header = (f"{command}\n{device.name}, torch {torch.__version__}, "
              f"{datetime.date.today().isoformat()}, commit {commit()} (+ working tree), "
              f"{args.rounds} rounds old/new alternating, cold L2, CUDA-graph replay")
    print(header, flush=True)
    rows = []
    for case in cases(device):
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
               f"{len(rows)}") if ratios else "nothing timed"
    print(summary, flush=True)
    (args.out / "forms_check.json").write_text(json.dumps(
        {"header": header, "summary": summary, "rows": rows}, indent=1))
    (args.out / "forms_check.txt").write_text(
        "\n".join([header, *(line(r) for r in rows), summary]) + "\n")


def line(row: dict) -> str:
    if "error" in row:
        return f"{row['case']}: ERROR {row['error']}"
    ok = "ok" if row["old"]["ok"] and row["new"]["ok"] else \
        f"FAILED old {row['old']['reason']} new {row['new']['reason']}"
    timing = (f"old {row['old_us']:.1f} us, new {row['new_us']:.1f} us, "
              f"ratio {row['ratio']:.4f}") if "ratio" in row else "not timed"
    return (f"{row['case']}: {timing}; {ok} ({row['new']['summary']}); "
            f"{'bit-identical' if row['identical'] else 'outputs differ'}")


if __name__ == "__main__":
    main()
