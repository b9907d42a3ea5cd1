"""YaRN rope scaling (``rope_type: yarn``, as Qwen2.5 / Qwen3 / Llama / Mistral configs carry it), read and
applied as transformers 5 does (``_compute_yarn_parameters``): the inverse frequencies blend the base ones
(extrapolation) and those divided by ``factor`` (interpolation) over the beta_fast..beta_slow ramp, and cos
and sin are multiplied by the attention factor. Yarn is one fixed table: a token's rotation depends on its
position alone, so the prefix cache keeps every token and the context is ``max_position_embeddings``.

Tiny float32 checkpoints with a 32-token original context, factor 4 and 128 positions; prompts and
generations run past 32 tokens.
"""
import copy

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models import load_model_config
from engine.models.config import ModelConfigError
from engine.models.llama import parse_config
from engine.models.rope import build_cos_sin_cache, plain_rope_length, yarn_inv_freq
from tests.tiny_models import load_hf, save_tiny_model

ORIGINAL, POSITIONS = 32, 128
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}

# name: (rope_scaling, other config.json fields)
TABLE_CASES = {
    "plain": (YARN, {}),
    "qwen2.5_long": ({**YARN, "original_max_position_embeddings": 32768},    # head_dim 128, Qwen's theta
                     dict(hidden_size=256, rope_theta=1000000.0, max_position_embeddings=131072)),
    "mscale_and_all_dim": ({**YARN, "factor": 6.0, "mscale": 0.707, "mscale_all_dim": 1.0}, {}),
    "mscale_alone_is_ignored": ({**YARN, "mscale": 0.707}, {}),
    "explicit_betas": ({**YARN, "beta_fast": 2, "beta_slow": 0.5}, {}),
    "attention_factor_given": ({**YARN, "attention_factor": 1.5}, {}),
    "not_truncated": ({**YARN, "truncate": False}, {}),
    "null_truncate_is_false": ({**YARN, "truncate": None}, {}),
    "null_factor_is_the_context_ratio": ({**YARN, "factor": None}, {}),
    "top_level_original_first": (YARN, dict(original_max_position_embeddings=16)),
    "without_original": ({"type": "yarn", "factor": 4.0}, {}),              # max_position_embeddings
    "in_rope_parameters": (None, dict(rope_parameters={**YARN, "rope_theta": 500.0})),
}


def config_json(rope_scaling, **fields):
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 2,
            "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 32,
            "max_position_embeddings": POSITIONS, "rope_scaling": rope_scaling, **fields}


def both_configs(case):
    """(ours, transformers') for the config.json of ``case``."""
    raw = config_json(TABLE_CASES[case][0], **TABLE_CASES[case][1])
    return parse_config(copy.deepcopy(raw)), LlamaConfig.from_dict(copy.deepcopy(raw))


@pytest.mark.parametrize("case", sorted(TABLE_CASES))
def test_the_yarn_frequencies_and_attention_factor_are_transformers(case):
    ours, hf = both_configs(case)
    # transformers standardises the rope again when it computes it: only then does a top-level original
    # context (set after the constructor's first pass) take priority
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert ours.rope.rope_type == "yarn"
    assert ours.rope.original_max_position_embeddings == hf.rope_parameters["original_max_position_embeddings"]
    assert ours.rope.theta == hf.rope_parameters["rope_theta"]
    assert ours.rope.attention_factor == attention_factor
    assert torch.equal(yarn_inv_freq(ours.rope, ours.head_dim), inv_freq)


def test_a_yarn_rope_without_a_factor_is_refused_as_in_transformers():
    raw = config_json({"rope_type": "yarn", "original_max_position_embeddings": ORIGINAL})
    with pytest.raises(KeyError, match="factor"):
        LlamaConfig.from_dict(copy.deepcopy(raw))
    with pytest.raises(ModelConfigError, match="yarn rope scaling needs a factor"):
        parse_config(raw)


@pytest.mark.parametrize("case", ["plain", "qwen2.5_long", "mscale_and_all_dim", "attention_factor_given"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_yarn_table_is_transformers_cos_and_sin(case, dtype):
    """Our rows: transformers' rotary embedding's cos | sin, the attention factor included, rounded alike."""
    ours, hf = both_configs(case)
    table = build_cos_sin_cache(ours, POSITIONS, dtype, "cpu")
    half = ours.head_dim // 2
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, POSITIONS, ours.head_dim, dtype=dtype),
                                        torch.arange(POSITIONS)[None])
    assert torch.equal(table[:, :half], cos[0, :, :half].float())
    assert torch.equal(table[:, half:], sin[0, :, :half].float())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("yarn")
    paths = {family: save_tiny_model(family, root / family, max_position_embeddings=POSITIONS, rope_scaling=YARN)
             for family in ("llama", "qwen3", "qwen2")}
    return {family: (path, load_hf(path)) for family, path in paths.items()}


def make_engine(path, backend="torch", caching=True):
    return Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend=backend, num_slots=512,
                               dtype="float32", max_requests=4, max_prefill_tokens=16, prefix_caching=caching))


def prompt_of(length, seed):
    return torch.randint(3, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_generate(engine, hf, request_id, prompt, new_tokens=12):
    """One request through the engine: transformers' greedy tokens, logprobs within 1e-4."""
    events = engine.generate([GenerationRequest(request_id, prompt, new_tokens, stop_token_ids=[])])[request_id]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
    assert [e.token_id for e in events] == ref.sequences[0, len(prompt):].tolist(), len(prompt)
    for e, logits in zip(events, ref.logits):
        assert e.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[e.token_id].item(), abs=1e-4)


def test_the_config_serves_transformers_context_with_one_fixed_table(models):
    path, hf = models["qwen3"]
    config = load_model_config(path)
    assert (config.rope.rope_type, config.rope.factor, config.rope.original_max_position_embeddings) == (
        "yarn", 4.0, ORIGINAL)
    assert config.max_context == hf.config.max_position_embeddings == POSITIONS
    assert plain_rope_length(config) is None


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_generation_past_the_original_context_matches_transformers(models, family):
    """Prompts of 5 and 24 tokens cross 32 while decoding; one of 40 is beyond it from the prefill on (in
    16-token chunks)."""
    path, hf = models[family]
    engine = make_engine(path, caching=False)
    for i, length in enumerate((5, 24, 40)):
        assert_generate(engine, hf, i, prompt_of(length, i))


def test_the_triton_rotary_kernel_reads_the_yarn_table(models):
    path, hf = models["llama"]
    assert_generate(make_engine(path, backend="triton", caching=False), hf, 0, prompt_of(40, 5), new_tokens=6)


def test_the_prefix_cache_reuses_every_token_of_a_yarn_prompt(models):
    """Rotation by position alone: a 40-token prompt's keys serve a prompt extending it, which still
    answers as transformers does."""
    path, hf = models["qwen3"]
    engine = make_engine(path)
    prompt = prompt_of(40, 6)
    assert_generate(engine, hf, 0, prompt, new_tokens=4)
    assert_generate(engine, hf, 1, prompt + [7], new_tokens=4)
    assert engine.router.scheduler.cache.stats.hit_tokens == 40
