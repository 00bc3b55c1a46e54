"""Check and time the Hopper Gluon MLA decode kernel on a GPU (issue 19, item 1).

    python3 benchmarks/gluon_check.py --out DIR

Needs an sm_90 GPU and triton 3.6.x (``mlatune/kernels/gluon_hopper.py``). The
kernels (``VARIANTS``: the first kernel, the warp-specialized seesaw kernel of
``mlatune/kernels/gluon_seesaw.py`` and its chunked form, whose tiles land in 64-column
chunks that S starts on, the transposed kernel of ``mlatune/kernels/gluon_transposed.py``,
which also reads fp8 caches (the split reduce as a programmatic dependent launch and an
fp8 cache widened by the warp-specialized form of ``gluon_transposed_ws``, as the route's
widening sets run it; as stored rows ran it, "plain"; with split partials merged always by
a second kernel or always by the last split; over fp8 caches also with fp8 MMAs,
``gluon_transposed_fp8``, as the route's fp8_mma sets run it, and its other forms);
``--skip`` leaves some out; ``--experimental`` adds kernels whose current
form has not run on a GPU (``EXPERIMENTAL``)) are each checked and timed.
Steps, each caught so that one failure never ends the run:
1. smoke: a child process (``--smoke``, 75 s limit, so a hang or an illegal
   address cannot take this process down) runs small problems: one split and
   several, causal verify, fp16, 128 heads, stale cache slots set to NaN;
   it prints the accuracy of each. If it fails, the kernel is not run here.
2. per point (batch, heads, kv_len, qlen), bf16, page 64: inputs from
   ``make_decode_inputs`` with ragged lengths, outputs poisoned with NaN, each
   route checked against ``reference.decode_shard`` (rel L2 of out, max LSE
   error, bf16 bounds of check/accuracy.py); the Gluon kernel also with another
   split count and with the stale slots of each request's last page set to NaN.
   Then every route is timed by ``sweep.bench.measure`` (CUDA-graph replay,
   L2 flushed before every repetition) on full-length inputs (every request
   kv_len long, as benchmarks/decode.py), beside ``padded/triton`` and
   ``dense/flashmla`` when FlashMLA is installed.
Writes DIR/gluon_check.json and .csv after every point; points that would
start after ``--budget`` seconds (200) are skipped.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

POINTS = [  # (batch, heads, kv_len, qlen, kv dtype): q is bf16
    (1, 16, 4096, 1, "bf16"), (64, 16, 4096, 1, "bf16"), (128, 16, 8192, 1, "bf16"),
    (128, 16, 4096, 2, "bf16"), (128, 16, 4096, 4, "bf16"), (64, 64, 4096, 1, "bf16"),
    (128, 128, 4096, 1, "bf16"), (8, 128, 32768, 1, "bf16"), (128, 16, 8192, 1, "fp8"),
    (64, 16, 4096, 1, "fp8"), (1, 16, 4096, 1, "fp8"), (128, 16, 4096, 2, "fp8"),
]
SMOKE = [  # (batch, heads, kv_len, qlen, dtype (q; the cache too unless fp8), num_splits)
    (3, 16, 300, 1, "bf16", 1), (3, 16, 300, 1, "bf16", 3), (2, 16, 200, 2, "bf16", 1),
    (2, 16, 700, 4, "bf16", 4), (2, 128, 500, 1, "bf16", 2), (3, 16, 300, 1, "fp16", 2),
    (2, 32, 130, 3, "fp16", 1), (3, 16, 300, 1, "fp8", 1), (2, 16, 700, 4, "fp8", 3),
    (2, 8, 200, 2, "fp8", 1),
]
OTHERS = ("padded/triton", "dense/flashmla")
FIRST = "wgmma/gluon"  # the first kernel (mlatune/kernels/gluon_hopper.py), as its route
SEESAW = "seesaw/gluon"  # the warp-specialized kernel (mlatune/kernels/gluon_seesaw.py)
SEESAW_CHUNKED = "seesaw/gluon chunked"  # its CHUNKED form: decode_launcher(chunked=True)
SEESAW_PDL = "seesaw/gluon pdl"  # chunked, the split reduce a programmatic dependent launch
SEESAW_SLIM = "seesaw/gluon slim"  # chunked + pdl, the softmax in fewer instructions
SEESAW_LONE = "seesaw/gluon lone"  # slim, each mbarrier its own allocation (the route's sets)
TRANSPOSED = "transposed/gluon"  # keys as the MMA's M (mlatune/kernels/gluon_transposed.py)
# as the route's 16-bit and widening param sets run it: the reduce (more than 2 splits) a
# programmatic dependent launch, an fp8 cache widened by a partition of its own
# (gluon_transposed_ws.py)
TRANSPOSED_PLAIN = "transposed/gluon plain"  # as stored rows ran it: neither
TRANSPOSED_REDUCE = "transposed/gluon reduce"  # plain, its partials merged by a second kernel
TRANSPOSED_MERGE = "transposed/gluon merge"  # ... by the last split, whatever the count
# fp8 only: fp8 MMAs (gluon_transposed_fp8.py), q as two e4m3 terms (the row sums reduced
# every tile, as stored fp8_mma rows ran; deferred to the end, as the route's fp8_mma sets
# run since session 13), and as one (q quantized per row: held to the quantized-q tolerance)
TRANSPOSED_FP8MMA = "transposed/gluon fp8mma"
TRANSPOSED_FP8MMA_1TERM = "transposed/gluon fp8mma 1term"
TRANSPOSED_FP8MMA_DEFERRED = "transposed/gluon fp8mma deferred"  # P's sums once at the end
FP8MMA = {TRANSPOSED_FP8MMA: {}, TRANSPOSED_FP8MMA_1TERM: {"q_terms": 1},
          TRANSPOSED_FP8MMA_DEFERRED: {"defer_sums": True}}  # launcher options
VARIANTS = [FIRST, SEESAW, SEESAW_CHUNKED, SEESAW_PDL, SEESAW_SLIM, SEESAW_LONE, TRANSPOSED,
            TRANSPOSED_PLAIN, TRANSPOSED_REDUCE, TRANSPOSED_MERGE, *FP8MMA]
# the variants' roundings past their dtypes, as check's keywords (routes.rounding): P in e4m3
# with q's two terms, q quantized with one
ROUNDING = {v: {"q_quantized": o.get("q_terms") == 1, "p_rounded": o.get("q_terms") != 1}
            for v, o in FP8MMA.items()}
NO_ROUNDING = {"q_quantized": False, "p_rounded": False}
FP8_ONLY = tuple(FP8MMA)
FP8_VARIANTS = (TRANSPOSED, TRANSPOSED_PLAIN, TRANSPOSED_REDUCE, TRANSPOSED_MERGE, *FP8_ONLY)
# Not run unless --experimental (a hang would stop the smoke, and with it every Gluon timing):
# kernels whose current form has not run on a GPU.
EXPERIMENTAL: tuple[str, ...] = ()
SKIPPED: set[str] = set()  # --skip (the child smoke run gets it through the environment)
DEVICE = "cuda"  # a dry run of the plumbing may set "cpu" (with a stand-in kernel)


# An error after which the process's CUDA context is lost: the smoke child stops there and
# names the variant, and the parent leaves it out and runs the smoke again.
FATAL_ERRORS = ("CUDA error", "illegal memory access", "illegal instruction",
                "unspecified launch failure", "misaligned address")
FATAL_LINE = "smoke: fatal error in "
SMOKE_TRIES = 3


def fatal_variant(text: str) -> str | None:
    """The variant the smoke child named as having lost its CUDA context, if any."""
    found = re.search(f"^{FATAL_LINE}(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else None


def last_line(exc: BaseException) -> str:
    lines = [ln for ln in traceback.format_exception_only(type(exc), exc) if ln.strip()]
    return " ".join(lines[-1].split())[:300]


def problem_of(batch, heads, kv_len, qlen, dtype="bf16"):
    """dtype "fp8": a bf16 q over an e4m3 cache; else q and cache of that dtype."""
    from mlatune.problem import MLAProblem
    q_dtype, kv_dtype = ("bf16", "fp8_e4m3fn") if dtype == "fp8" else (dtype, dtype)
    return MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen, q_dtype=q_dtype,
                      kv_dtype=kv_dtype, page_size=64)


def variants_for(dtype: str) -> list[str]:
    return [v for v in VARIANTS if (v in FP8_VARIANTS if dtype == "fp8" else v not in FP8_ONLY)
            and v not in SKIPPED]


def gluon_prepare(problem, inputs, num_splits=None, variant=FIRST):
    shard = inputs.shards[0]
    args = (inputs.q, shard.kv_cache, shard.block_table, shard.seq_lens)
    kwargs = dict(qlen=problem.qlen, sm_scale=inputs.softmax_scale, causal=problem.causal,
                  num_splits=num_splits, max_seq_len=problem.kv_len)
    if variant == FIRST:
        from mlatune.kernels.gluon_hopper import decode_launcher
        return decode_launcher(*args, **kwargs)
    if variant in FP8MMA:
        from mlatune.kernels.gluon_transposed_fp8 import decode_launcher as fp8_launcher
        return fp8_launcher(*args, **kwargs, kv_scale=inputs.kv_scale, pdl=True,
                            **FP8MMA[variant])
    if variant in (TRANSPOSED, TRANSPOSED_PLAIN, TRANSPOSED_REDUCE, TRANSPOSED_MERGE):
        from mlatune.kernels import gluon_transposed, gluon_transposed_ws
        merge = {TRANSPOSED_REDUCE: "reduce", TRANSPOSED_MERGE: "kernel"}.get(variant, "auto")
        new = variant == TRANSPOSED
        ws = new and problem.kv_dtype != problem.q_dtype  # the route's widening fp8 sets
        kernel = gluon_transposed_ws if ws else gluon_transposed
        return kernel.decode_launcher(*args, **kwargs, kv_scale=inputs.kv_scale, merge=merge,
                                      pdl=new)
    from mlatune.kernels.gluon_seesaw import decode_launcher as seesaw_launcher
    return seesaw_launcher(*args, **kwargs,
                           chunked=variant in (SEESAW_CHUNKED, SEESAW_PDL, SEESAW_SLIM,
                                               SEESAW_LONE),
                           pdl=variant in (SEESAW_PDL, SEESAW_SLIM, SEESAW_LONE),
                           slim=variant in (SEESAW_SLIM, SEESAW_LONE),
                           lone_bars=variant == SEESAW_LONE)


def route_prepare(route_id, problem, inputs):
    from mlatune import routes
    from mlatune.arch import current_device
    route = routes.get(route_id)
    verdict = route.supports(problem, current_device())
    if not verdict:
        raise RuntimeError(f"refused: {verdict.reason}")
    p = route.prepare(problem, inputs)
    # A route may hand back the library's own tensors after a run (FlashMLA does): the
    # check reads Prepared.out/.lse after running, so out and lse here are callables.
    return p.run, lambda: p.out, lambda: p.lse


def route_rounding(route_id, problem) -> dict[str, bool]:
    from mlatune import routes
    return routes.rounding(routes.get(route_id), problem)


def poison_stale_slots(inputs) -> int:
    """Set the slots past each request's length in its last page to NaN; returns how many."""
    shard = inputs.shards[0]
    page = shard.kv_cache.shape[1]
    count = 0
    for b, n in enumerate(shard.seq_lens.tolist()):
        if n % page:
            pid = int(shard.block_table[b, (n - 1) // page])
            shard.kv_cache[pid, n % page:] = float("nan")
            count += page - n % page
    return count


def check_run(run, out, lse, problem, ref, rounding: dict[str, bool] = NO_ROUNDING) -> dict:
    """Poison, run, compare (with the looser tolerances ``rounding`` names)."""
    from mlatune.check.accuracy import check
    from mlatune.check.inputs import poison_
    poison_(out() if callable(out) else out, lse() if callable(lse) else lse)
    run()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    if callable(out):
        out, lse = out(), lse()
    acc = check(problem, out, ref[0], lse, ref[1], **rounding)
    return dict(ok=acc.ok, rel_l2=acc.rel_l2, lse_err=acc.lse_max_abs, reason=acc.reason)


def fmt_acc(a: dict) -> str:
    return (f"{'ok' if a['ok'] else 'FAIL'} rel_l2={a['rel_l2']:.3g} "
            f"lse_err={a['lse_err']:.3g}" + ("" if a["ok"] else f" ({a['reason']})"))


# --- smoke (child process) -------------------------------------------------------------------

def smoke() -> int:
    from mlatune.check import reference
    from mlatune.check.inputs import make_decode_inputs
    failed = 0
    start = time.time()  # each line's elapsed time tells a slow compile from a hang
    cases = [(c, v) for c in SMOKE for v in variants_for(c[4])]
    for (batch, heads, kv_len, qlen, dtype, splits), variant in cases:
        problem = problem_of(batch, heads, kv_len, qlen, dtype)
        name = (f"[{time.time() - start:5.1f} s] smoke {(batch, heads, kv_len, qlen)} {dtype} "
                f"splits={splits} {variant}")
        try:
            inputs = make_decode_inputs(problem, seed=1, device=DEVICE, ragged=True)
            ref = reference.decode_shard(inputs, inputs.shards[0])
            run, out, lse = gluon_prepare(problem, inputs, splits, variant)
            rounding = ROUNDING.get(variant, NO_ROUNDING)
            a = check_run(run, out, lse, problem, ref, rounding)
            stale = poison_stale_slots(inputs)
            b = check_run(run, out, lse, problem, ref, rounding)
            print(f"{name}: {fmt_acc(a)}; {stale} stale slots NaN: {fmt_acc(b)}", flush=True)
            failed += not (a["ok"] and b["ok"])
        except Exception as exc:  # report and go on to the next case
            print(f"{name}: error {last_line(exc)}", flush=True)
            if any(e in str(exc) for e in FATAL_ERRORS):  # every later case would fail too
                print(f"{FATAL_LINE}{variant}", flush=True)
                return 3
            failed += 1
    print(f"smoke: {len(cases) - failed}/{len(cases)} cases passed", flush=True)
    return 0


def run_smoke_child(timeout_s: float) -> tuple[bool, str]:
    """The smoke cases in a child process: (it finished, what it said)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--smoke"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")
        tail = tail.decode() if isinstance(tail, bytes) else tail
        return False, f"{tail}\nsmoke: timed out after {timeout_s:.0f} s (hang?)"
    text = done.stdout + ("" if done.returncode == 0 else
                          "\n".join(done.stderr.splitlines()[-25:]))
    return done.returncode == 0, text


def smoke_until_clean(timeout_s: float, meta: dict) -> bool:
    """The smoke child, run again without a variant that lost its CUDA context (at most
    ``SMOKE_TRIES`` runs); whether it finished, so that the Gluon kernels run here."""
    for _ in range(SMOKE_TRIES):
        print("smoke (child process) ...", flush=True)
        finished, text = run_smoke_child(timeout_s)
        print(text.rstrip(), flush=True)
        meta["smoke"] = meta.get("smoke", "") + text
        bad = fatal_variant(text)
        if finished or bad is None:
            break
        print(f"{bad}: left out (a fatal error); the smoke runs again without it", flush=True)
        SKIPPED.add(bad)
        meta.setdefault("left_out", []).append(bad)
        os.environ["GLUON_CHECK_SKIP"] = ",".join(sorted(SKIPPED))
    meta["smoke_finished"] = finished
    if not finished:
        print("the smoke run did not finish: the Gluon kernel is not run in this process")
    return finished


# --- points ----------------------------------------------------------------------------------

def run_point(point, gluon_ok: bool, seconds: float) -> list[dict]:
    from mlatune.check import reference
    from mlatune.check.inputs import make_decode_inputs
    from mlatune.sweep.bench import Budget, measure
    problem = problem_of(*point)
    dtype = point[4]
    ragged = make_decode_inputs(problem, seed=0, device=DEVICE, ragged=True)
    ref_r = reference.decode_shard(ragged, ragged.shards[0])
    full = make_decode_inputs(problem, seed=2, device=DEVICE, ragged=False)
    ref_f = reference.decode_shard(full, full.shards[0])
    budget = Budget(warmup=2, min_reps=10, max_reps=60, max_seconds=seconds, race_ratio=0.0)
    ids = (variants_for(dtype) if gluon_ok else []) + list(OTHERS)
    rows = []
    for rid in ids:
        row = dict(batch=point[0], heads=point[1], kv_len=point[2], qlen=point[3], kv=dtype,
                   route=rid, status="ok")
        is_gluon = rid in VARIANTS
        try:
            if is_gluon:
                def prep(p, x, splits=None, v=rid):
                    return gluon_prepare(p, x, splits, v)
            else:
                def prep(p, x, splits=None, r=rid):
                    return route_prepare(r, p, x)
            run, out, lse = prep(problem, ragged)
            rounding = route_rounding(rid, problem) if not is_gluon \
                else ROUNDING.get(rid, NO_ROUNDING)
            row.update(rounding)
            a = check_run(run, out, lse, problem, ref_r, rounding)
            row.update(ragged_ok=a["ok"], rel_l2=a["rel_l2"], lse_err=a["lse_err"])
            if is_gluon:
                # Forced split counts: the direct store path and the merged one, whatever
                # pick_splits chose.
                for splits in (1, 5):
                    run2, out2, lse2 = prep(problem, ragged, splits)
                    a2 = check_run(run2, out2, lse2, problem, ref_r, rounding)
                    row[f"splits{splits}_ok"] = a2["ok"]
                    row[f"splits{splits}_rel_l2"] = a2["rel_l2"]
                    a = a if a2["ok"] else a2
            run, out, lse = prep(problem, full)
            b = check_run(run, out, lse, problem, ref_f, rounding)
            row.update(full_ok=b["ok"], full_rel_l2=b["rel_l2"], full_lse_err=b["lse_err"])
            if not (a["ok"] and b["ok"]):
                row["status"] = f"inaccurate: {a['reason'] if not a['ok'] else b['reason']}"
            if row["status"] == "ok" or is_gluon:  # the kernel's speed is news even if wrong
                t = measure(run, DEVICE, budget)
                row.update(time_us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us, reps=t.reps,
                           timer=t.timer, tb_s=problem.min_bytes() / t.median_us / 1e6,
                           tflops=problem.flops() / t.median_us / 1e6)
            if is_gluon:
                n = poison_stale_slots(ragged)
                run, out, lse = prep(problem, ragged)
                c = check_run(run, out, lse, problem, ref_r, rounding)
                row.update(stale_nan_slots=n, stale_nan_ok=c["ok"])
        except Exception as exc:  # one route's failure is a result; go on
            row["status"] = f"error: {last_line(exc)}"
        rows.append(row)
        print("  " + line_of(row), flush=True)
    del ragged, full, ref_r, ref_f
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def line_of(r: dict) -> str:
    head = f"{r['route']:26s}"
    if "time_us" not in r:
        return f"{head} {r['status']}"
    if r["status"] != "ok":
        head += f" [{r['status'][:60]}]"
    extra = ""
    if r["route"] in VARIANTS:
        extra = (f" splits1={'ok' if r.get('splits1_ok') else 'FAIL'}"
                 f" splits5={'ok' if r.get('splits5_ok') else 'FAIL'}"
                 f" stale_nan={'ok' if r.get('stale_nan_ok') else 'FAIL'}")
    return (f"{head} {r['time_us']:9.1f} us {r['tb_s']:5.2f} TB/s {r['tflops']:6.1f} TFLOP/s"
            f"  rel_l2 {r['rel_l2']:.2g} lse_err {r['lse_err']:.2g}{extra}")


def summary(point, rows) -> str:
    t = {r["route"]: r.get("time_us", math.nan) for r in rows}
    ok = {r["route"]: r.get("time_us", math.nan) for r in rows
          if r["route"] in VARIANTS and r["status"] == "ok"}
    best = min(ok, key=ok.get) if ok else FIRST
    g = t.get(best, math.nan)
    parts = [f"{point}: best gluon {best} {g:.1f} us"]
    seesaw, chunked, first = (t.get(v, math.nan) for v in (SEESAW, SEESAW_CHUNKED, FIRST))
    if not math.isnan(t.get(TRANSPOSED, math.nan)):
        parts.append(f"transposed {t[TRANSPOSED]:.1f} us")
    if not math.isnan(seesaw):
        parts.append(f"seesaw {seesaw:.1f} us (seesaw/first {seesaw / first:.2f}x)")
    if not math.isnan(chunked):
        parts.append(f"chunked {chunked:.1f} us (chunked/seesaw {chunked / seesaw:.2f}x)")
    if not math.isnan(pdl := t.get(SEESAW_PDL, math.nan)):
        parts.append(f"pdl {pdl:.1f} us (pdl/chunked {pdl / chunked:.2f}x)")
    if not math.isnan(slim := t.get(SEESAW_SLIM, math.nan)):
        parts.append(f"slim {slim:.1f} us (slim/pdl {slim / pdl:.2f}x)")
    if not math.isnan(lone := t.get(SEESAW_LONE, math.nan)):
        parts.append(f"lone {lone:.1f} us (lone/slim {lone / slim:.2f}x)")
    for rid in OTHERS:
        if not math.isnan(t.get(rid, math.nan)):
            parts.append(f"{rid} {t[rid]:.1f} us (gluon/{rid.split('/')[0]} {g / t[rid]:.2f}x)")
    return "; ".join(parts)


def write(out_dir: Path, meta: dict, rows: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gluon_check.json").write_text(json.dumps(dict(meta, rows=rows), indent=1,
                                                         default=str))
    keys = sorted({k for r in rows for k in r})
    with open(out_dir / "gluon_check.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gluon-check"))
    ap.add_argument("--smoke", action="store_true", help="run only the smoke cases (the child)")
    ap.add_argument("--seconds", type=float, default=0.6, help="timing budget per route and point")
    ap.add_argument("--smoke-timeout", type=float, default=120.0)
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds for the whole run: points that would start past it are skipped")
    ap.add_argument("--skip", default=os.environ.get("GLUON_CHECK_SKIP", ""),
                    help="kernels not to run, comma-separated (e.g. wgmma/gluon)")
    ap.add_argument("--experimental", action="store_true",
                    default=os.environ.get("GLUON_CHECK_EXPERIMENTAL") == "1",
                    help=f"also run the experimental kernels ({', '.join(EXPERIMENTAL)})")
    ap.add_argument("--kv", choices=("bf16", "fp8"), help="only the points of this cache dtype")
    args = ap.parse_args()
    SKIPPED.update(v for v in args.skip.split(",") if v)
    if not args.experimental:
        SKIPPED.update(EXPERIMENTAL)
    os.environ["GLUON_CHECK_SKIP"] = args.skip
    os.environ["GLUON_CHECK_EXPERIMENTAL"] = "1" if args.experimental else "0"
    os.environ.pop("TRITON_INTERPRET", None)
    if args.smoke:
        return smoke()
    import triton
    start = time.time()
    meta = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), command=" ".join(sys.argv),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                torch=torch.__version__, triton=triton.__version__)
    print(json.dumps(meta), flush=True)
    if not torch.cuda.is_available():
        print("no GPU: nothing to do")
        return 1
    from mlatune.kernels.gluon_common import gluon_available
    gluon_ok, why = gluon_available()
    if gluon_ok:
        gluon_ok = smoke_until_clean(args.smoke_timeout, meta)
    else:
        print(f"Gluon kernel skipped: {why}")
    print(f"[{time.time() - start:5.1f} s] points", flush=True)
    rows: list[dict] = []
    for point in [p for p in POINTS if args.kv in (None, p[4])]:
        if time.time() - start > args.budget - 12:
            print(f"{point}: skipped, the {args.budget:.0f} s budget is spent", flush=True)
            rows.append(dict(batch=point[0], heads=point[1], kv_len=point[2], qlen=point[3],
                             kv=point[4], route="all", status="skipped: time budget"))
            continue
        print(f"{point} page 64", flush=True)
        try:
            got = run_point(point, gluon_ok, args.seconds)
            print("  " + summary(point, got), flush=True)
        except Exception as exc:  # inputs or reference failed: note it, go on
            print(f"  error: {last_line(exc)}", flush=True)
            got = [dict(batch=point[0], heads=point[1], kv_len=point[2], qlen=point[3],
                        kv=point[4], route="all", status=f"error: {last_line(exc)}")]
        rows += got
        meta["elapsed_s"] = round(time.time() - start, 1)
        write(args.out, meta, rows)
        print(f"[{time.time() - start:5.1f} s]", flush=True)
    print(f"wrote {args.out}/gluon_check.json and .csv in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
