"""Test-wide setup.

On a machine without CUDA the Triton kernels run under the interpreter, so the
variable must be set before any module imports triton (``triton.jit`` reads it
when a kernel is decorated). Engines built in tests pick their kernel backend
explicitly, so setting it here does not slow down the torch-reference paths.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
