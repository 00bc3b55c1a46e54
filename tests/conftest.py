"""Without a GPU, Triton kernels run in the interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before
any test module imports a kernel.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
