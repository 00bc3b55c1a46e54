"""The measurement pipeline on a real GPU (run with `python -m pytest -m gpu`)."""

import pytest
import torch

from mlatune import routes
from mlatune.arch import current_device
from mlatune.measure import timers
from mlatune.problem import MLAProblem
from mlatune.sweep.worker import _ProblemCache, evaluate

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need a GPU: run them on the device machine")
    return torch.device("cuda:0")


def test_device_is_described(cuda):
    d = current_device()
    assert d.is_gpu and d.cu_count > 0 and d.arch.startswith(("sm_", "gfx"))


def test_graph_timing_of_a_matmul(cuda):
    a = torch.randn(4096, 4096, device=cuda, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    t = timers.measure(lambda: torch.matmul(a, a, out=c), cuda)
    assert t.timer == "cuda_graph" and 0 < t.p20_us <= t.median_us <= t.p80_us
    tflops = 2 * 4096**3 / (t.median_us * 1e-6) / 1e12
    print(f"bf16 4096^3 matmul: {t.median_us:.1f} us, {tflops:.0f} TFLOP/s")
    assert tflops > 50  # far below any GPU's rate: a timing bug, not a slow GPU


@pytest.mark.parametrize(("graph_safe", "warmup", "calls", "runs"), [
    (True, 1, 2, 2 + 10), (True, 4, 2, 4 + 10), (False, 2, 2 + 10, 2 + 10)])
def test_untimed_runs(cuda, graph_safe, warmup, calls, runs):
    """A capture calls the route twice (a side-stream run, the capture itself) and
    runs it twice (that run, a first replay), which covers two warm-ups; eager
    timing calls and runs it once per warm-up and per repetition."""
    counter = torch.zeros((), device=cuda)
    calls_seen = []

    def run():
        calls_seen.append(1)
        counter.add_(1)

    budget = timers.Budget(warmup=warmup, min_reps=10, max_reps=10, settle=0)
    t = timers.measure(run, cuda, budget, graph_safe=graph_safe)
    assert t.reps == 10 and t.timer == ("cuda_graph" if graph_safe else "cuda_event")
    assert len(calls_seen) == calls and counter.item() == runs


@pytest.mark.parametrize("problem", [
    MLAProblem(num_heads=16, qlen=2, batch=8, kv_len=2048, kv_dtype="bf16"),
    MLAProblem(num_heads=16, qlen=1, batch=8, kv_len=2048, kv_dtype="fp8_e4m3fn", dcp_size=2),
    MLAProblem(phase="prefill", num_heads=16, qlen=512, kv_len=512, batch=2, page_size=1),
], ids=["verify-bf16", "decode-fp8-dcp2", "prefill-bf16"])
def test_reference_route_end_to_end(cuda, problem):
    task = {"problem": problem.as_dict(), "route": routes.get("reference/torch").id,
            "params": {}, "seed": 1, "budget": {"warmup": 1, "min_reps": 3, "max_reps": 5},
            "tolerances": {}}
    result = evaluate(task, cuda, _ProblemCache())
    assert result.status == "ok", result
    assert result.rel_err < 1e-2 and result.time_us > 0 and result.timer == "cuda_event"


def test_a_sweep_on_the_gpu_compiles_ahead_and_times_from_graphs(cuda, tmp_path):
    """Compile-ahead workers, then the timed pass: every Triton candidate ok, timed from a
    CUDA graph, with the cost split journaled; the compile pass journals nothing."""
    from mlatune.sweep import runner, spec
    from mlatune.sweep.journal import Journal, read

    s = spec.parse({"routes": ["padded/triton", "gluon/triton"], "max_params_per_route": 2,
                    "budget": {"min_reps": 5, "max_reps": 20, "max_seconds": 0.1},
                    "grid": [{"num_heads": 16, "qlen": 1, "batch": [2, 8], "kv_len": 1024,
                              "kv_dtype": ["bf16", "fp8_e4m3fn"]}]}, "gpu-test.toml")
    device = current_device()
    header = {"spec_sha256": s.sha256, "arch": device.arch, "device_name": device.name}
    journal = Journal(tmp_path / "j.jsonl", header, resume=False)
    result = runner.run(s, device, journal, timeout_s=300, compile_workers=2)
    journal.close()
    records = read(tmp_path / "j.jsonl")[1]
    ran = [r for r in records if r["status"] != "unsupported"]
    assert ran and all(r["status"] == "ok" for r in ran), ran
    assert all(r["timer"] == "cuda_graph" for r in ran)
    assert all(r["first_check_s"] > 0 and r["bench_s"] > 0 for r in ran)
    assert result.seconds["compile_ahead_wall_s"] > 0
    assert not any(r["status"] == "checked" for r in records)
