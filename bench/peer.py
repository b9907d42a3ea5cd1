"""The peer: transformers on the same token lists, in the same run.

``generate`` for batch 1 (decode tokens/s: a 1-token run's time is subtracted so the
prefill is not counted), ``generate_batch`` (continuous batching) for many requests.
"""
from __future__ import annotations

import time

import torch

from .workloads import Workload


# transformers' attention for these is eager only (Gemma 2: SDPA cannot soft-cap the scores; Bloom: its
# ALiBi attention has no SDPA path, from_pretrained refuses attn_implementation="sdpa")
EAGER_ONLY = ("Gemma2ForCausalLM", "BloomForCausalLM")


def attention_implementation(model_dir: str) -> str:
    """transformers' fastest attention that serves this checkpoint: SDPA, else eager."""
    import json
    from pathlib import Path

    architecture = (json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [None])[0]
    return "eager" if architecture in EAGER_ONLY else "sdpa"


def load(model_dir: str, dtype=torch.bfloat16):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype, device_map="cuda",
                                                               attn_implementation=attention_implementation(model_dir))
    return model.eval()


def _timed_generate(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt], device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    assert out.shape[1] - len(prompt) == new_tokens
    return time.perf_counter() - start


def decode_tokens_per_s(model, workload: Workload) -> float:
    prompt, n = workload.prompts[0], workload.max_new_tokens
    _timed_generate(model, prompt, 8)                      # warm-up
    full = min(_timed_generate(model, prompt, n) for _ in range(2))
    prefill = min(_timed_generate(model, prompt, 1) for _ in range(3))
    return (n - 1) / (full - prefill)


def batch_tokens_per_s(model, workload: Workload) -> tuple[float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=workload.max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    model.generate_batch(workload.prompts[:4], generation_config=config)   # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = model.generate_batch(workload.prompts, generation_config=config)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    values = results.values() if isinstance(results, dict) else results
    generated = sum(len(getattr(r, "generated_tokens", r) or []) for r in values)
    return generated / elapsed, generated
