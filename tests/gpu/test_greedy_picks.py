"""The decode and verify CUDA graphs' greedy picks (``GraphOutputs.picks``) on one GPU.

A step whose rows are all plain greedy takes its tokens and logprobs from the picks computed inside the
graph; a row that asks for top-n tokens sends the step through the sampler's processors instead. On the
demo model both give the same tokens, and logprobs within float32 rounding, in a batch, alone (the
batch-1 graph) and with ``--speculate 2`` (the verify graphs' picks)."""
import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import SamplingParams
from tests.gpu.greedy import release_memory

PROMPTS = [[1, 450, 496, 1735, 1701], [1, 822, 584], [1, 306, 763, 278, 564, 310, 278, 3186], [1, 13]]
NEW_TOKENS = 24


def generate(params: SamplingParams, alone: bool, **config) -> list[list[tuple[int, float]]]:
    with Engine(EngineConfig(model_dir="weights/demo", num_slots=4096, max_requests=8, **config)) as engine:
        groups = [[i] for i in range(len(PROMPTS))] if alone else [list(range(len(PROMPTS)))]
        out = {}
        for group in groups:
            out.update(engine.generate([GenerationRequest(i, PROMPTS[i], NEW_TOKENS, params, stop_token_ids=[])
                                        for i in group]))
    release_memory()
    return [[(e.token_id, e.logprob) for e in out[i]] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("alone", [False, True])
@pytest.mark.parametrize("speculate", [0, 2])
def test_graph_picks_give_the_samplers_tokens_and_logprobs(alone, speculate):
    picked = generate(SamplingParams(), alone, speculate=speculate)
    processed = generate(SamplingParams(top_n_tokens=1), alone, speculate=speculate)
    for ours, theirs in zip(picked, processed):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        torch.testing.assert_close(torch.tensor([lp for _, lp in ours]), torch.tensor([lp for _, lp in theirs]),
                                   atol=1e-5, rtol=1e-5)
