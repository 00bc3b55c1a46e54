"""Run Triton kernels in the interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here,
before any test module imports mlatune's kernels.
"""

import os
import sys

# Where the environment sets PYTHONDONTWRITEBYTECODE (this project's CPU dev machine does), every
# process of the suite (xdist workers, the sweeps' subprocesses and their workers, some
# hundreds) would compile mlatune's modules again, about 0.25 s each. The suite keeps them
# in the checkout's __pycache__ folders (git-ignored) instead.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from mlatune.kernels.interpreter import quicken

    quicken()  # as a CPU sweep's workers do

# Under pytest-xdist (README's `-n 2`) each worker process gets one core's share of torch's
# threads, so two workers do not oversubscribe the CI machine's two cores (timings that tests
# compare, such as first sight's, stay apart).
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(
        os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
