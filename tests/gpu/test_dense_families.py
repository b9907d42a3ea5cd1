"""Phi-3, StarCoder2 and Bloom on one GPU: random real-config checkpoints against transformers.

float32 on both sides, greedy tokens identical on 4 prompts (tests/gpu/greedy.py: 7 to 300
tokens, 64 new tokens each). Phi-3-mini-128k also gets a 4,200-token prompt, beyond its 4,096
original context, so the long longrope factors and the attention factor are proven at real
shape, prefilled in one step and in chunks (tests/unit/test_rope_by_length.py).
The checkpoints come from bench/gpu_run.sh's ``dense`` stage (DENSE_DIRS="name=dir ..."), Bloom-7b1's
from its ``bloom`` stage (ALiBi in both attention kernels, K stored unrotated; a test needs only its own
checkpoint in DENSE_DIRS).
"""
import os

import pytest
import torch

from tests.gpu.greedy import describe, engine_greedy, max_logprob_gap, prompts, transformers_greedy

FP32_LOGPROB_TOL = 2e-3
NAMES = ["phi-3-mini-4k", "phi-3-mini-128k", "starcoder2-7b", "bloom-7b1"]


def checkpoint_dir(name: str) -> str:
    dirs = dict(item.split("=", 1) for item in os.environ.get("DENSE_DIRS", "").split())
    if name not in dirs or not os.path.isdir(dirs[name]):
        raise pytest.UsageError(f"set DENSE_DIRS to 'name=dir ...' with {name} (bash bench/gpu_run.sh dense)")
    return dirs[name]


def vocab_size(path: str) -> int:
    from engine.models import load_model_config
    return load_model_config(path).vocab_size


@pytest.mark.parametrize("name", NAMES)
def test_float32_greedy_tokens_equal_transformers(name):
    path = checkpoint_dir(name)
    all_prompts = prompts(vocab_size(path))
    ref = transformers_greedy(path, torch.float32, all_prompts)
    ours = engine_greedy(all_prompts, model_dir=path, dtype="float32")
    print(f"\n{name}: " + describe(ours, ref, "ours fp32", "transformers fp32"))
    assert [g.tokens for g in ours] == [g.tokens for g in ref]
    assert max(max_logprob_gap(a, b) for a, b in zip(ours, ref)) < FP32_LOGPROB_TOL


@pytest.mark.parametrize("chunk", [8192, 1024])
def test_phi3_128k_long_prompt_uses_the_long_factors_as_transformers(chunk):
    """In one step, and in 1,024-token chunks whose first four end within the original context (every prompt
    token still takes the long factors: ``layers.Rotary``)."""
    path = checkpoint_dir("phi-3-mini-128k")
    g = torch.Generator().manual_seed(1)
    long_prompt = [torch.randint(3, vocab_size(path), (4200,), generator=g).tolist()]
    ref = transformers_greedy(path, torch.float32, long_prompt)
    ours = engine_greedy(long_prompt, model_dir=path, dtype="float32", max_prefill_tokens=chunk)
    print(f"\nphi-3-mini-128k, 4200-token prompt in {chunk}-token steps: "
          + describe(ours, ref, "ours fp32", "transformers fp32"))
    assert ours[0].tokens == ref[0].tokens
    assert max_logprob_gap(ours[0], ref[0]) < FP32_LOGPROB_TOL
