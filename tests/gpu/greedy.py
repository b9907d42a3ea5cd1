"""Greedy runs of transformers and of our engine on the same prompts, and their comparison.

In float32 the two must agree token for token. In bfloat16 a random 7B model's
next-token distribution is nearly flat (the best token's logprob is about -6 and the
best two are often within 0.05 nats), while bfloat16 arithmetic done in another order
(our ragged batched prefill and padded decode against transformers' one-prompt GEMMs)
moves logprobs by about 0.1 nats. Two correct bf16 implementations therefore part
ways at near-ties, and the check is vLLM's ``check_logprobs_close``: equal tokens with
close logprobs up to the first difference, and there each side's token is among the
other's top candidates.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import transformers

from bench.peer import attention_implementation
from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import SamplingParams

NEW_TOKENS = 64
PROMPT_LENGTHS = [7, 64, 129, 300]
TOP_N = 5


@dataclass
class Greedy:
    tokens: list[int]
    logprobs: list[float]                  # of each chosen token
    top: list[dict[int, float]]            # the TOP_N best tokens of each step and their logprobs


def prompts(vocab_size: int = 32000) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def transformers_greedy(model_dir: str, dtype: torch.dtype, all_prompts: list[list[int]],
                        new_tokens: int = NEW_TOKENS, **load) -> list[Greedy]:
    """``load``: more ``from_pretrained`` arguments (e.g. ``experts_implementation``)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map="cuda",
                                                               attn_implementation=attention_implementation(model_dir),
                                                               **load)
    runs = greedy_runs(model, all_prompts, new_tokens)
    del model
    release_memory()
    return runs


def greedy_runs(model, all_prompts: list[list[int]], new_tokens: int) -> list[Greedy]:
    """A loaded transformers model's greedy tokens, their logprobs and top-N, one prompt at a time."""
    runs = []
    for prompt in all_prompts:
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
        top = [_top(lp) for lp in logprobs]
        runs.append(Greedy(tokens, [lp[t].item() for lp, t in zip(logprobs, tokens)], top))
    return runs


def _top(logprobs: torch.Tensor) -> dict[int, float]:
    values, ids = logprobs.topk(TOP_N)
    return dict(zip(ids.tolist(), values.tolist()))


def engine_greedy(all_prompts: list[list[int]], new_tokens: int = NEW_TOKENS, **config) -> list[Greedy]:
    return engine_greedy_batch_and_alone(all_prompts, new_tokens, alone=False, **config)[0]


def engine_greedy_batch_and_alone(all_prompts: list[list[int]], new_tokens: int = NEW_TOKENS, alone: bool = True,
                                  **config) -> tuple[list[Greedy], list[Greedy]]:
    """The prompts' greedy runs in one batch, then (``alone``) each prompt by itself (batch-1
    decode, whose kernels may differ), from one engine."""
    params = SamplingParams(top_n_tokens=TOP_N)
    requests = [GenerationRequest(i, p, new_tokens, params, stop_token_ids=[]) for i, p in enumerate(all_prompts)]
    with Engine(EngineConfig(num_slots=8192, max_requests=8, **config)) as engine:
        batch = engine.generate(requests)
        single = {}
        for r in requests if alone else ():
            single.update(engine.generate([GenerationRequest(100 + r.request_id, r.prompt_ids, new_tokens, params,
                                                             stop_token_ids=[])]))
    release_memory()

    def runs(out, first_id):
        return [Greedy([e.token_id for e in out[first_id + i]], [e.logprob for e in out[first_id + i]],
                       [dict(zip(e.top_ids, e.top_logprobs)) for e in out[first_id + i]]) for i in range(len(all_prompts))]
    return runs(batch, 0), runs(single, 100) if alone else []


def release_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def first_difference(a: Greedy, b: Greedy) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)


def max_logprob_gap(a: Greedy, b: Greedy) -> float:
    """Largest |logprob| difference of the chosen tokens up to the first difference."""
    end = first_difference(a, b)
    return max((abs(x - y) for x, y in zip(a.logprobs[:end], b.logprobs[:end])), default=0.0)


def near_tie_problem(a: Greedy, b: Greedy, name_a: str, name_b: str) -> str | None:
    """None when the runs agree, or part at a step where each token is in the other's top TOP_N."""
    k = first_difference(a, b)
    if k is None:
        return None
    if a.tokens[k] in b.top[k] and b.tokens[k] in a.top[k]:
        return None
    return (f"step {k}: {name_a} chose {a.tokens[k]} (top {a.top[k]}), {name_b} chose {b.tokens[k]} "
            f"(top {b.top[k]}): not a near-tie")


def describe(a: list[Greedy], b: list[Greedy], name_a: str, name_b: str) -> str:
    diffs = [first_difference(x, y) for x, y in zip(a, b)]
    gaps = [max_logprob_gap(x, y) for x, y in zip(a, b)]
    parts = ["identical" if d is None else f"first difference at step {d}" for d in diffs]
    return (f"{name_a} vs {name_b}: " + "; ".join(f"prompt {i}: {p}" for i, p in enumerate(parts))
            + f"; max chosen-token logprob gap before it {max(gaps):.4f}")
