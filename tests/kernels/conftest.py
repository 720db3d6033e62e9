"""Kernel tests run compiled on a CUDA device and under the Triton interpreter on CPU.

The root tests/conftest.py already sets TRITON_INTERPRET=1 when there is no CUDA
device; this repeats it so ``pytest tests/kernels/...`` run from any rootdir does too.
It must happen before the kernel modules are imported (triton.jit reads it then).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
