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

# pytest-xdist workers share the machine's cores: torch's default (one thread per core in every
# worker) oversubscribes them, and its spinning threads made the demo-model tests 5-8x slower
# under ``-n 2`` on 2 cores than alone. Each worker takes its share.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
