"""Random gemma-7b and gemma-2-9b checkpoints (real configs, layers reduced): our engine against
transformers on one GPU, float32 greedy tokens identical on 4 prompts x 32 tokens; bf16 close
(near-ties, tests/gpu/greedy.py) and CUDA graphs equal eager.

gemma-2-9b's window is 4096, longer than these prompts: a second run of the same weights with
``sliding_window`` 64 (a config beside symlinked weights) makes the kernels' window matter.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from tests.gpu.greedy import (describe, engine_greedy, max_logprob_gap, near_tie_problem, prompts,
                              transformers_greedy)

NEW_TOKENS = 32
FP32_LOGPROB_TOL = 2e-3
BF16_LOGPROB_TOL = 0.35


def with_window(model_dir: str, window: int, out) -> str:
    """``model_dir``'s weights (symlinked) under a config.json with another sliding window."""
    out.mkdir()
    for name in os.listdir(model_dir):
        if name != "config.json":
            os.symlink(os.path.join(model_dir, name), out / name)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
    return str(out)


def tanh_gelu_reference(model_dir: str) -> dict:
    """``from_pretrained`` overrides that make transformers run Gemma 1's GeLU as the tanh one, as we do.

    Gemma 1 configs say ``hidden_act: "gelu"``, a legacy value for the tanh approximation. transformers 5.24
    maps it to ``gelu_pytorch_tanh`` in GemmaConfig; the GPU machine's 5.17 builds ``GELUActivation`` (exact).
    On one H200, 8-layer gemma-7b, float32: the chosen tokens' logprobs 0.0031 from ours against 5.17 as it
    reads the config, 0.0001 with this override."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    legacy = config.get("architectures") == ["GemmaForCausalLM"] and config.get("hidden_act") == "gelu"
    return {"hidden_act": "gelu_pytorch_tanh"} if legacy else {}


def check_float32(model_dir: str):
    all_prompts = prompts(vocab_size=256000)
    ref = transformers_greedy(model_dir, torch.float32, all_prompts, NEW_TOKENS, **tanh_gelu_reference(model_dir))
    ours = engine_greedy(all_prompts, NEW_TOKENS, model_dir=model_dir, dtype="float32")
    print("\n" + describe(ours, ref, "ours fp32", "transformers fp32"))
    assert [g.tokens for g in ours] == [g.tokens for g in ref]
    assert max(max_logprob_gap(a, b) for a, b in zip(ours, ref)) < FP32_LOGPROB_TOL


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_float32_greedy_tokens_equal_transformers(gemma_dirs, family):
    check_float32(gemma_dirs[family])


def test_float32_gemma2_with_a_window_shorter_than_the_prompts(gemma_dirs, tmp_path):
    check_float32(with_window(gemma_dirs["gemma2"], 64, tmp_path / "window64"))


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_bfloat16_is_close_to_transformers_and_graphs_equal_eager(gemma_dirs, family):
    model_dir, all_prompts = gemma_dirs[family], prompts(vocab_size=256000)
    ref = transformers_greedy(model_dir, torch.bfloat16, all_prompts, NEW_TOKENS, **tanh_gelu_reference(model_dir))
    graphs = engine_greedy(all_prompts, NEW_TOKENS, model_dir=model_dir)
    eager = engine_greedy(all_prompts, NEW_TOKENS, model_dir=model_dir, cuda_graphs=())
    print("\n" + describe(graphs, ref, "ours bf16", "transformers bf16"))
    assert [g.tokens for g in graphs] == [g.tokens for g in eager], "CUDA graphs != eager"
    problems = [near_tie_problem(a, b, "ours", "transformers") for a, b in zip(graphs, ref)]
    assert not any(problems), problems
    assert max(max_logprob_gap(a, b) for a, b in zip(graphs, ref)) < BF16_LOGPROB_TOL
