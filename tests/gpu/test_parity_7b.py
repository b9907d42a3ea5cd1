"""A random Llama-2-7B-shaped bf16 checkpoint: our engine against transformers on one GPU.

float32 on both sides: greedy tokens identical for 64 tokens on 4 prompts (any
difference is a bug). bfloat16: see tests/gpu/greedy.py for why the check is a near-tie
criterion; CUDA-graph decoding gives exactly the eager tokens.
"""
import pytest
import torch

from engine.worker.gemm_warmup import padded_tokens
from tests.gpu.greedy import (describe, engine_greedy, engine_greedy_batch_and_alone, max_logprob_gap, near_tie_problem,
                              prompts, transformers_greedy)

FP32_LOGPROB_TOL = 2e-3
BF16_LOGPROB_TOL = 0.35      # bf16 rounding in another order; a wrong rope or attention costs whole nats


@pytest.fixture(scope="module")
def all_prompts():
    return prompts()


def test_float32_greedy_tokens_equal_transformers(llama2_7b_dir, all_prompts):
    ref = transformers_greedy(llama2_7b_dir, torch.float32, all_prompts)
    ours = engine_greedy(all_prompts, model_dir=llama2_7b_dir, dtype="float32")
    print("\n" + describe(ours, ref, "ours fp32", "transformers fp32"))
    assert [g.tokens for g in ours] == [g.tokens for g in ref]
    assert max(max_logprob_gap(a, b) for a, b in zip(ours, ref)) < FP32_LOGPROB_TOL


def test_bfloat16_is_close_to_transformers_and_graphs_equal_eager(llama2_7b_dir, all_prompts):
    ref = transformers_greedy(llama2_7b_dir, torch.bfloat16, all_prompts)
    graphs = engine_greedy(all_prompts, model_dir=llama2_7b_dir)
    eager = engine_greedy(all_prompts, model_dir=llama2_7b_dir, cuda_graphs=())
    print("\n" + describe(graphs, ref, "ours bf16", "transformers bf16"))
    assert [g.tokens for g in graphs] == [g.tokens for g in eager], "CUDA graphs != eager"
    problems = [near_tie_problem(a, b, "ours", "transformers") for a, b in zip(graphs, ref)]
    assert not any(problems), problems
    assert max(max_logprob_gap(a, b) for a, b in zip(graphs, ref)) < BF16_LOGPROB_TOL


def test_float32_greedy_tokens_behind_cached_prefixes_equal_transformers(llama2_7b_dir):
    """Six prompts behind one 300-token prefix in one batch (five map the first one's cached prefix in one
    step: one broadcast piece of ``Step.prefixes``, a shared-prefix group), then each alone (its whole prompt
    but the last token cached): every run gives transformers' greedy tokens."""
    base = prompts()
    tails = [base[0], base[1][:20], base[2][:33], base[0][:3], base[1], base[2][:9]]
    all_prompts = [base[3] + tail for tail in tails]
    ref = transformers_greedy(llama2_7b_dir, torch.float32, all_prompts, new_tokens=16)
    batch, alone = engine_greedy_batch_and_alone(all_prompts, 16, model_dir=llama2_7b_dir, dtype="float32")
    print("\n" + describe(batch, ref, "ours fp32 batch", "transformers fp32"))
    assert [g.tokens for g in batch] == [g.tokens for g in ref]
    assert [g.tokens for g in alone] == [g.tokens for g in ref]
    assert max(max_logprob_gap(a, b) for a, b in zip(batch + alone, ref + ref)) < FP32_LOGPROB_TOL


def test_float32_greedy_tokens_of_a_padded_eager_step_equal_transformers(llama2_7b_dir):
    """Three prompts of 719 tokens prefilled in one step of 2,157 tokens: more than the piecewise graphs take,
    so the step runs eagerly with 3 padding tokens in a row of their own (``engine.worker.gemm_warmup``). The
    tokens are transformers' greedy ones."""
    g = torch.Generator().manual_seed(1)
    all_prompts = [torch.randint(3, 32000, (719,), generator=g).tolist() for _ in range(3)]
    assert padded_tokens(3 * 719) == 3 * 719 + 3
    ref = transformers_greedy(llama2_7b_dir, torch.float32, all_prompts, new_tokens=16)
    ours = engine_greedy(all_prompts, 16, model_dir=llama2_7b_dir, dtype="float32")
    print("\n" + describe(ours, ref, "ours fp32 padded step", "transformers fp32"))
    assert [g.tokens for g in ours] == [g.tokens for g in ref]
    assert max(max_logprob_gap(a, b) for a, b in zip(ours, ref)) < FP32_LOGPROB_TOL
