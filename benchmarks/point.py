"""One route at one problem, run eagerly (`benchmarks/clock_probe.sh`): three warm-up runs,
N runs between cudaProfilerStart/Stop (for `ncu --profile-from-start off`), then a loop held
for POINT_SECONDS (default 2: long enough for a power limit to show).

    python benchmarks/point.py ROUTE BATCH,HEADS,KV,QLEN,DCP[,CACHE] 'PARAMS_JSON' N

CACHE: the cache's dtype, bf16 (the default) or fp8_e4m3fn (q stays bf16).
"""

import json
import os
import sys
import time

import torch

from mlatune import routes
from mlatune.check.inputs import make_decode_inputs
from mlatune.problem import MLAProblem


def main(route_id: str, shape: str, params: str, profiled: int) -> None:
    fields = shape.split(",")
    if len(fields) not in (5, 6):
        raise SystemExit(f"shape {shape!r}: BATCH,HEADS,KV,QLEN,DCP[,CACHE]")
    batch, heads, kv_len, qlen, dcp = (int(x) for x in fields[:5])
    problem = MLAProblem(num_heads=heads, batch=batch, kv_len=kv_len, qlen=qlen,
                         q_dtype="bf16", kv_dtype=fields[5] if len(fields) == 6 else "bf16",
                         page_size=64, dcp_size=dcp)
    inputs = make_decode_inputs(problem, seed=0, device="cuda")
    prepared = routes.get(route_id).prepare(problem, inputs, params=json.loads(params))
    _runs(prepared, 3)
    torch.cuda.cudart().cudaProfilerStart()
    _runs(prepared, profiled)
    torch.cuda.cudart().cudaProfilerStop()
    t0 = time.time()
    _runs(prepared, 3)
    reps = max(3, int(float(os.environ.get("POINT_SECONDS", "2")) * 3 / (time.time() - t0)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    _runs(prepared, reps, sync=False)
    end.record()
    torch.cuda.synchronize()
    print(f"POINT {route_id} {shape} {params}: {start.elapsed_time(end) * 1e3 / reps:.1f} us "
          f"eager mean over {reps} (wall {time.time() - t0:.2f} s)", flush=True)


def _runs(prepared, n: int, sync: bool = True) -> None:
    for _ in range(n):
        prepared.run()
    if sync:
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
