"""Our cos/sin tables equal transformers' rotary embeddings for every rope variant."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.models.llama import parse_config
from engine.models.rope import build_cos_sin_cache

VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_table_matches_transformers(variant, dtype):
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                            vocab_size=32, max_position_embeddings=128, rope_theta=10000.0,
                            rope_scaling=VARIANTS[variant])
    hf_config.architectures = ["LlamaForCausalLM"]
    ours = parse_config(hf_config.to_dict())
    assert ours.rope.rope_type == variant
    positions = torch.arange(100)
    table = build_cos_sin_cache(ours, 128, dtype, "cpu")
    x = torch.zeros(1, 100, 32, dtype=dtype)
    cos, sin = LlamaRotaryEmbedding(hf_config)(x, positions[None])
    half = 16
    assert torch.equal(table[:100, :half], cos[0, :, :half].float())
    assert torch.equal(table[:100, half:], sin[0, :, :half].float())


def test_dynamic_scaling_beyond_the_trained_length_uses_the_ntk_base():
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                            vocab_size=32, max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    hf_config.architectures = ["LlamaForCausalLM"]
    ours = parse_config(hf_config.to_dict())
    table = build_cos_sin_cache(ours, 100, torch.float32, "cpu")
    rotary = LlamaRotaryEmbedding(hf_config)
    # transformers rotates the token at position p of a growing sequence with the base for p + 1 tokens
    for p in (63, 64, 80, 99):
        cos, _ = rotary(torch.zeros(1, p + 1, 32), torch.arange(p + 1)[None])
        assert torch.allclose(table[p, :16], cos[0, p, :16], atol=1e-6), p
