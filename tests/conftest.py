"""Test-session setup that must run before anything imports the Triton kernels.

``triton.jit`` decides when a kernel module is imported (at decoration) whether its
kernels are compiled or run by the interpreter, so without a CUDA device
TRITON_INTERPRET=1 has to be in the environment before any test module, in any
directory, imports ``kernels`` or the Triton attention back end.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
