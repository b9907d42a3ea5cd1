"""A long prompt's chunks behind their contexts through cuDNN (``kernels.context_attention``) on the GPU, bfloat16.

A random Llama-3.1-8B-shaped checkpoint (layers reduced: ``LLAMA31_DIR``, ``python -m weights.random_checkpoint
--config llama-3.1-8b --num-layers 4``) and a 12,000-token prompt in 4,096-token steps: the second and third chunks
attend to their first 4,096 and 8,192 keys through cuDNN. Their greedy tokens against transformers bfloat16 and
against the engine with the path off, by ``tests/gpu/greedy.py``'s near-tie rule.
"""
import os

import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import SamplingParams
from tests.gpu.greedy import TOP_N, Greedy, describe, near_tie_problem, transformers_greedy

PROMPT_TOKENS = 12_000
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llama31_dir():
    path = os.environ.get("LLAMA31_DIR")
    if not path or not os.path.isdir(path):
        raise pytest.UsageError("set LLAMA31_DIR to a checkpoint from `python -m weights.random_checkpoint --config "
                                "llama-3.1-8b --num-layers 4`")
    return path


def engine_run(path: str, prompt: list[int], context) -> tuple[Greedy, list[tuple[int, int]]]:
    """The engine's greedy run of one prompt, and the (queries, keys) of every row it sent to cuDNN (after the
    warm-up's)."""
    sent = []
    config = EngineConfig(model_dir=path, dtype="bfloat16", num_slots=16384, max_requests=2,
                          max_seq_len=PROMPT_TOKENS + 400, max_prefill_tokens=4096, context_attention=context)
    with Engine(config) as engine:
        paths = engine.worker.context_attention
        if paths is not None:
            attend = paths.attend
            paths.attend = lambda rows, *a: sent.extend((r.q_len, r.keys) for r in rows) or attend(rows, *a)
        out = engine.generate([GenerationRequest(0, prompt, NEW_TOKENS, SamplingParams(top_n_tokens=TOP_N),
                                                 stop_token_ids=[])])[0]
    torch.cuda.empty_cache()
    return Greedy([e.token_id for e in out], [e.logprob for e in out],
                  [dict(zip(e.top_ids, e.top_logprobs)) for e in out]), sent


def test_long_prompt_chunks_through_cudnn_are_near_transformers_bf16(llama31_dir):
    from engine.models import load_model_config
    config = load_model_config(llama31_dir)
    prompt = torch.randint(3, config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, sent = engine_run(llama31_dir, prompt, EngineConfig.context_attention)
    # every layer but the last, which attends for the one token the step reads (``OutputRows``)
    assert sent == [(4096, 4096)] * (config.num_layers - 1) + [(3808, 8192)] * (config.num_layers - 1)
    kernel_only, none_sent = engine_run(llama31_dir, prompt, None)
    assert none_sent == []
    ref = transformers_greedy(llama31_dir, torch.bfloat16, [prompt], NEW_TOKENS)[0]
    print("\n" + describe([ours], [ref], "ours bf16 (cuDNN contexts)", "transformers bf16")
          + "\n" + describe([ours], [kernel_only], "ours bf16 (cuDNN contexts)", "ours bf16 (prefill kernel only)"))
    assert near_tie_problem(ours, ref, "ours", "transformers") is None
    assert near_tie_problem(ours, kernel_only, "cuDNN contexts", "kernel only") is None
