"""Two shards (nvidia-h200-x2): TP=2 against TP=1 on a random Llama-2-7B-shaped checkpoint.

float32: greedy tokens identical for 64 tokens on 4 prompts. bfloat16: the all-reduce
sums the two halves in another order than one GPU's GEMM, so the near-tie criterion of
tests/gpu/greedy.py applies.
"""
import pytest
import torch

from tests.gpu.greedy import describe, engine_greedy, max_logprob_gap, near_tie_problem, prompts

FP32_LOGPROB_TOL = 2e-3
BF16_LOGPROB_TOL = 0.35


@pytest.fixture(scope="module", autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        raise AssertionError("these tests need 2 GPUs (nvidia-h200-x2)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_shards_against_one(llama2_7b_dir, dtype):
    all_prompts = prompts()
    one = engine_greedy(all_prompts, model_dir=llama2_7b_dir, dtype=dtype, num_shards=1)
    two = engine_greedy(all_prompts, model_dir=llama2_7b_dir, dtype=dtype, num_shards=2)
    print("\n" + describe(two, one, f"TP=2 {dtype}", f"TP=1 {dtype}"))
    if dtype == "float32":
        assert [g.tokens for g in two] == [g.tokens for g in one]
        assert max(max_logprob_gap(a, b) for a, b in zip(two, one)) < FP32_LOGPROB_TOL
    else:
        problems = [near_tie_problem(a, b, "TP=2", "TP=1") for a, b in zip(two, one)]
        assert not any(problems), problems
        assert max(max_logprob_gap(a, b) for a, b in zip(two, one)) < BF16_LOGPROB_TOL
