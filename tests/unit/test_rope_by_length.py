"""Ropes that rotate a token by the length of the forward pass computing it (Phi-3's ``longrope``,
NTK ``dynamic``): whatever chunks a prompt is cut into and whatever the prefix cache holds, every
token takes the rotation transformers' ``generate`` gives it (``engine.models.rope.plain_rope_length``):
a prompt's tokens that of the whole prompt, a decoded token that of its own position + 1.

Tiny float32 checkpoints whose plain length is 20 (Phi-3's ``original_max_position_embeddings``) or
24 (a Llama's trained context, doubled by ``--rope-scaling dynamic``); prompts of 12 to 40 tokens in
16-token chunks.
"""
import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from tests.tiny_models import load_hf, save_tiny_model

PHI3_ORIGINAL = 20
LLAMA_TRAINED = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    phi3 = save_tiny_model("phi3", root / "phi3", original_max_position_embeddings=PHI3_ORIGINAL,
                           sliding_window=None)     # the tiny Phi-3's window of 9 would hide the first chunk
    dynamic = save_tiny_model("llama", root / "dynamic", max_position_embeddings=LLAMA_TRAINED,
                              rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    return {"longrope": (phi3, None, load_hf(phi3)),
            "dynamic": (dynamic, ("dynamic", 2.0), load_hf(dynamic))}


def make_engine(path, rope_scaling, backend="torch", caching=True):
    return Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend=backend, num_slots=512,
                               dtype="float32", max_requests=4, max_prefill_tokens=16, rope_scaling=rope_scaling,
                               prefix_caching=caching))


def prompt_of(length, seed):
    return torch.randint(3, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_generate(engine, hf, request_id, prompt, new_tokens=6):
    """One request through the engine: transformers' greedy tokens, logprobs within 1e-4."""
    events = engine.generate([GenerationRequest(request_id, prompt, new_tokens, stop_token_ids=[])])[request_id]
    with torch.no_grad():
        hf(torch.tensor([[1]]))     # transformers' dynamic rope keeps the longest sequence's base until one within
                                    # the trained context passes: a fresh model's for every reference
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
    assert [e.token_id for e in events] == ref.sequences[0, len(prompt):].tolist(), len(prompt)
    for e, logits in zip(events, ref.logits):
        assert e.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[e.token_id].item(), abs=1e-4)


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_long_prompt_in_chunks_takes_its_whole_length_rotation(models, rope, backend):
    """40 tokens in 16-token chunks: the first chunk ends within the plain length, yet rotates as the
    whole prompt does."""
    path, scaling, hf = models[rope]
    assert_generate(make_engine(path, scaling, backend, caching=False), hf, 0, prompt_of(40, 1))


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
def test_the_prefix_cache_never_gives_a_key_of_another_rotation(models, rope):
    """A short prompt's cached keys are not given to a longer prompt that extends it, nor a long prompt's
    to a short one that it extends; a short prompt still takes a short one's. (Short sequences stay within
    20 tokens: transformers' Phi-3 prefills a sequence again when decoding crosses its original context,
    ``test_phi3_longrope``.)"""
    path, scaling, hf = models[rope]
    engine = make_engine(path, scaling)
    stats = engine.router.scheduler.cache.stats
    short, extra = prompt_of(12, 2), prompt_of(23, 3)
    assert_generate(engine, hf, 1, short)                  # cached: 12 prompt + 5 decoded tokens, all plain
    assert_generate(engine, hf, 2, short + extra)          # 35 tokens: rotates as 35, takes nothing
    assert_generate(engine, hf, 3, short + extra)          # and left nothing
    assert stats.hit_tokens == 0
    assert_generate(engine, hf, 4, (short + extra)[:14])   # within the plain length: request 1's 12 tokens
    assert stats.hit_tokens == len(short)


def test_without_a_length_rotation_the_cache_holds_every_token(tmp_path):
    """A plain rope: a long prompt's prefix is reused as before (the guard applies to those ropes only)."""
    path = save_tiny_model("llama", tmp_path / "llama", max_position_embeddings=LLAMA_TRAINED * 2)
    engine = make_engine(path, None)
    prompt = prompt_of(40, 4)
    engine.generate([GenerationRequest(0, prompt, 2, stop_token_ids=[])])
    engine.generate([GenerationRequest(1, prompt + [7], 2, stop_token_ids=[])])
    assert engine.router.scheduler.cache.stats.hit_tokens == 40
