"""Run Triton kernels in the interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here,
before any test module imports mlatune's kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
