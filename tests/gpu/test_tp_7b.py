"""Two shards (nvidia-h200-x2): TP=2 greedy tokens equal TP=1 on a random Llama-2-7B."""
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.sampling import SamplingParams

NEW_TOKENS = 64
PROMPT_LENGTHS = [7, 64, 129, 300]


def _tokens(model_dir, num_shards):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    requests = [GenerationRequest(i, p, NEW_TOKENS, SamplingParams(), stop_token_ids=[]) for i, p in enumerate(prompts)]
    with Engine(EngineConfig(model_dir=model_dir, num_slots=8192, max_requests=8, num_shards=num_shards)) as engine:
        out = engine.generate(requests)
    return {i: [e.token_id for e in events] for i, events in out.items()}


def test_two_shards_equal_one(llama2_7b_dir):
    if torch.cuda.device_count() < 2:
        raise AssertionError("this test needs 2 GPUs (nvidia-h200-x2)")
    one, two = _tokens(llama2_7b_dir, 1), _tokens(llama2_7b_dir, 2)
    diffs = {i: next(k for k, (a, b) in enumerate(zip(one[i], two[i])) if a != b) for i in one if one[i] != two[i]}
    print(f"TP=2 vs TP=1: {'identical' if not diffs else f'first differences at {diffs}'}")
    assert not diffs
