"""GPU-only tests: run by bench/gpu_run.sh on the GPU machine (pytest tests/gpu)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    raise pytest.UsageError("tests/gpu needs a CUDA device; run it on the GPU machine")


@pytest.fixture(scope="session")
def llama2_7b_dir():
    """A random Llama-2-7B-shaped bf16 checkpoint written by bench/gpu_run.sh."""
    path = os.environ.get("LLAMA2_7B_DIR")
    if not path or not os.path.isdir(path):
        raise pytest.UsageError("set LLAMA2_7B_DIR to a checkpoint from `python -m weights.random_checkpoint`")
    return path


@pytest.fixture(scope="session")
def gemma_dirs():
    """Random gemma-7b and gemma-2-9b checkpoints (layers reduced) written by bench/gpu_run.sh's gemma stage."""
    dirs = {name: os.environ.get(var) for name, var in (("gemma", "GEMMA_7B_DIR"), ("gemma2", "GEMMA2_9B_DIR"))}
    if not all(path and os.path.isdir(path) for path in dirs.values()):
        raise pytest.UsageError("set GEMMA_7B_DIR and GEMMA2_9B_DIR to checkpoints from "
                                "`python -m weights.random_checkpoint --config gemma-7b|gemma-2-9b --num-layers N`")
    return dirs
