"""What `mlatune sweep --ray` costs a candidate against the local pool, on this machine's CPU.

    python benchmarks/ray_overhead.py [--rounds 3] [--wait-ms 5] [--pin] [--tree PATH ...]
    python benchmarks/ray_overhead.py --journal JOURNAL ...   # the same figures of sweeps run

Each round sweeps one small grid (180 decode problems, one route, one timed rep) with the
local pool, then with ``--ray`` on a Ray instance started for it with one declared GPU
(fake: the actor runs on the CPU), for each ``--tree`` (an mlatune checkout; default: the
one this script imports). A candidate's cost is the spacing of the journal's results, first
to last (start-up left out), split into the worker's measured parts and the gap between
candidates. The route is the torch reference, waiting ``--wait-ms`` after each run (the
worker's CPU idle as it is while a GPU runs kernels; 0: busy throughout). ``--pin``: the
worker evaluates on CPU 0, the driver and Ray's processes run on the others, as on a host
with a core to spare beside each GPU's worker. Torch runs one thread in both pools (as Ray
gives an actor asking no CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WAIT_ENV = "MLATUNE_BENCH_WAIT_MS"  # MLATUNE_*: Ray forwards them to its workers
PIN_ENV = "MLATUNE_BENCH_PIN"
SPEC = """name = "ray-overhead"
routes = ["waiting/bench"]
[budget]
warmup = 0
min_reps = 1
max_reps = 1
[[grid]]
phase = "decode"
num_heads = [2, 4, 8]
qlen = [1, 2]
q_dtype = "fp16"
kv_dtype = "fp16"
batch = [1, 2, 3, 4, 5]
kv_len = [16, 24, 32, 40, 48, 56]
page_size = 8
"""


def _register_waiting_route() -> None:
    """``waiting/bench``: the torch reference, then a wait of WAIT_ENV ms each run; with
    PIN_ENV the thread that prepares it (the worker's) moves to CPU 0."""
    from mlatune.routes import YES, register
    from mlatune.routes.torch_ref import TorchReferenceRoute

    wait_s = float(os.environ.get(WAIT_ENV, "0")) / 1e3
    pin = bool(os.environ.get(PIN_ENV))

    class WaitingRoute(TorchReferenceRoute):
        id = "waiting/bench"

        def prepare(self, problem, inputs, *, rank=0, params=None, want_lse=True):
            if pin:
                os.sched_setaffinity(0, {0})
            prepared = super().prepare(problem, inputs, rank=rank, params=params,
                                       want_lse=want_lse)
            run = prepared.run

            def waiting_run() -> None:
                run()
                time.sleep(wait_s)

            prepared.run = waiting_run
            return prepared

        def supports(self, problem, device):
            return YES

    register(WaitingRoute())


if __name__ == "ray_overhead":  # imported through MLATUNE_PLUGINS, in workers too
    _register_waiting_route()


def figures(journal: Path) -> dict[str, float]:
    """A sweep's results' spacing, first to last, and of it the worker's measured parts
    (inputs, checks, timing) and the rest (the gap between candidates)."""
    from mlatune.measure.journal import read_records

    records = [r for r in read_records(journal)[1] if r.finished_at is not None]
    done = sorted(r.finished_at for r in records)
    spacing = 1e3 * (done[-1] - done[0]) / (len(done) - 1)
    parts = 1e3 * statistics.mean(r.worker_s for r in records)
    return {"candidates": len(records), "per_candidate_ms": spacing, "parts_ms": parts,
            "gap_ms": spacing - parts}


def one_sweep(mode: str, spec: Path, out: Path) -> dict[str, float]:
    """One sweep in this process; its ``figures``."""
    if os.environ.get(PIN_ENV):  # what this process starts inherits it
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {0})
    if mode == "ray":
        import ray

        ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, logging_level="WARNING")
    from mlatune.entry import main

    sys.argv = ["mlatune", "sweep", str(spec), "--out", str(out), "--fresh", "--json",
                *(["--ray"] if mode == "ray" else [])]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main()
    except SystemExit as exc:
        if exc.code:
            raise
    return figures(out.with_suffix(".journal.jsonl"))


def _run(mode: str, tree: Path, spec: Path, work: Path, wait_ms: float, pin: bool
         ) -> dict[str, float]:
    """``one_sweep`` in a fresh process importing ``tree``'s mlatune (its Ray workers too:
    they start in the driver's directory, which holds none)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tree}{os.pathsep}{HERE}",
           WAIT_ENV: str(wait_ms), PIN_ENV: "1" if pin else "",
           "MLATUNE_PLUGINS": "ray_overhead"}
    script = HERE / "ray_overhead.py"
    done = subprocess.run([sys.executable, str(script), "--one", mode, str(spec),
                           str(work / f"{mode}.parquet")], cwd=work, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait-ms", type=float, default=0.0)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--tree", type=Path, action="append",
                        help="an mlatune checkout whose --ray path runs (repeatable)")
    parser.add_argument("--journal", type=Path, action="append",
                        help="print the figures of this sweep's journal (repeatable)")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for journal in args.journal or []:
        print(journal, json.dumps({k: round(v, 3) for k, v in figures(journal).items()}))
    if args.journal:
        return
    if args.one:
        mode, spec, out = args.one
        print(json.dumps(one_sweep(mode, Path(spec), Path(out))))
        return
    trees = [t.resolve() for t in args.tree or [HERE.parent]]
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec = work / "ray-overhead.toml"
        spec.write_text(SPEC)
        for _ in range(args.rounds):
            for name, mode, tree in [("local", "local", trees[0]),
                                     *((f"ray {t}", "ray", t) for t in trees)]:
                runs.setdefault(name, []).append(_run(mode, tree, spec, work, args.wait_ms,
                                                      args.pin))
                print(name, runs[name][-1], flush=True)
    local = statistics.median(r["per_candidate_ms"] for r in runs["local"])
    for name, rs in runs.items():
        ms, parts, gap = (statistics.median(r[k] for r in rs)
                          for k in ("per_candidate_ms", "parts_ms", "gap_ms"))
        print(f"{name}: {ms:.2f} ms a candidate ({parts:.2f} in the worker's parts, {gap:.2f} "
              f"between them), {local / ms:.3f}x the local throughput (medians of "
              f"{len(rs)})")


if __name__ == "__main__":
    main()
