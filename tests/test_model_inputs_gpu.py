"""Both input families on the GPU, as the sweep checks them (``worker._ProblemCache``'s
cases): every route that serves these problems here, with its first parameter sets, passes
the model-like inputs wherever it passes the standard normal ones. Prints each candidate's
errors on each family (run with ``python -m pytest -m gpu -s tests/test_model_inputs_gpu.py``).
"""

import pytest
import torch

from mlatune import routes
from mlatune.arch import current_device
from mlatune.check.accuracy import check
from mlatune.problem import MLAProblem
from mlatune.sweep.worker import _ProblemCache, _run_checked

pytestmark = pytest.mark.gpu

PROBLEMS = [
    MLAProblem(num_heads=16, qlen=1, batch=8, kv_len=4096, kv_dtype="bf16"),
    MLAProblem(num_heads=16, qlen=1, batch=8, kv_len=4096, kv_dtype="fp8_e4m3fn"),
    MLAProblem(num_heads=128, qlen=2, batch=4, kv_len=32768, kv_dtype="fp8_e4m3fn"),
    MLAProblem(num_heads=8, qlen=2, batch=16, kv_len=8192, kv_dtype="bf16", dcp_size=2),
    MLAProblem(num_heads=16, qlen=1, batch=32, kv_len=8192, q_dtype="fp8_e4m3fn",
               kv_dtype="fp8_e4m3fn"),
    MLAProblem(phase="prefill", num_heads=16, qlen=1024, kv_len=1024, batch=2, page_size=1),
    MLAProblem(phase="prefill", num_heads=16, qlen=1024, kv_len=1024, batch=2, page_size=1,
               q_dtype="fp8_e4m3fn", kv_dtype="fp8_e4m3fn"),
]
PARAMS_PER_ROUTE = 2


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need a GPU: run them on the device machine")
    return torch.device("cuda:0")


@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.label for p in PROBLEMS])
def test_routes_that_pass_normal_inputs_pass_model_like_ones(cuda, problem):
    device = current_device()
    cache = _ProblemCache()
    cases = [cache.case(problem, 1, cuda, i) for i in range(cache.count())]
    assert [c.name.split(" ")[0] for c in cases] == ["model-like", "normal"]
    failed = []
    for route, verdict in routes.verdicts(problem, device, None):
        if not verdict.ok or route.id == "reference/torch":
            continue
        for params in route.param_space(problem, device)[:PARAMS_PER_ROUTE]:
            accs = []
            for case in cases:
                checked = _run_checked(problem, route, params, case, cuda)
                ref_out, ref_lse = case.ref
                accs.append(check(problem, checked.out, ref_out, checked.lse,
                                  ref_lse if checked.lse is not None else None,
                                  rounding=routes.rounding(route, problem, params)))
            model, normal = accs
            print(f"{problem.label} {route.id} {params}: model-like {model.summary} "
                  f"({model.reason}); normal {normal.summary} ({normal.reason})")
            if normal.ok and not model.ok:
                failed.append(f"{route.id} {params}: {model.reason}")
    assert failed == []
