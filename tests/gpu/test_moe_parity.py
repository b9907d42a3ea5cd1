"""Random real-config checkpoints of the MoE families and Qwen3 (layers reduced to fit one
80 GB GPU in float32): greedy tokens identical to transformers on 4 prompts x 32 new tokens,
float32 on both sides (any difference is a bug), with the fused MoE kernel: the prompts in one
batch, then each alone (batch-1 decode takes the one-token path).

The checkpoints are written under $MOE_DIR (bench/gpu_run.sh moe sets it; a temporary
directory otherwise) by ``weights.random_checkpoint --num-layers``.
"""
import os
from pathlib import Path

import pytest
import torch

from tests.gpu import greedy
from tests.gpu.greedy import describe, engine_greedy_batch_and_alone, max_logprob_gap, transformers_greedy
from weights.random_checkpoint import REAL_CONFIGS, write_random_checkpoint

# config name -> decoder layers kept: float32 weights of 47, 38, 42 and 33 GB, one model at a time
# (transformers' then ours); bench.moe_bench measures the same checkpoints in bfloat16.
MODELS = {"mixtral-8x7b": 8, "qwen1.5-moe-a2.7b": 16, "qwen3-30b-a3b": 16, "qwen3-8b": 36}
NEW_TOKENS = 32
FP32_LOGPROB_TOL = 2e-3


def checkpoint(name: str, tmp_root: Path) -> str:
    """The random bf16 checkpoint of ``name`` with its layers reduced (written once)."""
    root = Path(os.environ.get("MOE_DIR") or tmp_root)
    path = root / f"{name}-{MODELS[name]}l"
    if not (path / "config.json").is_file():
        write_random_checkpoint(path, name, dtype="bfloat16", device="cuda", num_layers=MODELS[name])
    return str(path)


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_greedy_tokens_equal_transformers(name, tmp_path_factory):
    model_dir = checkpoint(name, tmp_path_factory.mktemp("moe"))
    all_prompts = greedy.prompts(REAL_CONFIGS[name]["vocab_size"])
    # the reference is transformers' per-expert loop (not its GPU default, grouped_mm)
    ref = transformers_greedy(model_dir, torch.float32, all_prompts, NEW_TOKENS, experts_implementation="eager")
    # in one batch (the grouped experts), then each prompt alone (batch-1 decode: the one-token path)
    ours, alone = engine_greedy_batch_and_alone(all_prompts, NEW_TOKENS, model_dir=model_dir, dtype="float32")
    print(f"\n{name}: " + describe(ours, ref, "ours fp32", "transformers fp32")
          + "\n  alone: " + describe(alone, ref, "ours fp32 alone", "transformers fp32"))
    assert all(len(g.tokens) == NEW_TOKENS for g in ours + alone + ref)
    assert [g.tokens for g in ours] == [g.tokens for g in alone] == [g.tokens for g in ref]
    assert max(max_logprob_gap(a, b) for a, b in zip(ours + alone, ref + ref)) < FP32_LOGPROB_TOL
