"""The step cost model prices a cached token's KV in the bytes the cache really stores (``--kv-cache-dtype``):
an int8 or fp8 cache holds about twice the context per weights' bytes of a bfloat16 one."""
import pytest
import torch

from engine.assembly import EngineConfig, plan_engine, step_cost_model
from engine.models.llama import FAMILY
from tests.tiny_models import save_tiny_model

# one layer, two KV heads of 128 dims: a token's KV is 2 * 2 * 128 values a layer (int8: + 4 scale bytes a head)
TINY = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, rope_theta=10000.0, hidden_size=256,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=512,
            vocab_size=1000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)


def test_kv_weight_tokens_count_the_kv_caches_bytes():
    config = FAMILY.parse_config(TINY)
    weight_bytes = 2 * (4 * 256 * 256 + 3 * 256 * 512 + 1000 * 256)     # bfloat16 q, k, v, o, the MLP, the head
    _, bf16 = step_cost_model(config, torch.bfloat16)
    _, fp8 = step_cost_model(config, torch.bfloat16, torch.float8_e4m3fn)
    _, int8 = step_cost_model(config, torch.bfloat16, torch.int8)
    assert bf16 == weight_bytes // (2 * 2 * 128 * 2) and step_cost_model(config)[1] == bf16   # bfloat16 default
    assert fp8 == weight_bytes // (2 * 2 * 128)
    assert int8 == weight_bytes // (2 * 2 * 128 + 2 * 2 * 4)                # the per-head float32 scales
    assert 1.9 < int8 / bf16 < fp8 / bf16 <= 2.0


def test_the_plan_prices_the_kv_cache_dtype_it_is_given(tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama")
    tokens = {kv: plan_engine(EngineConfig(model_dir=str(path), device="cpu", dtype="bfloat16", max_requests=2,
                                           kv_cache_dtype=kv)).scheduler.kv_weight_tokens
              for kv in (None, "fp8_e4m3fn", "int8")}
    assert tokens["fp8_e4m3fn"] == pytest.approx(2 * tokens[None], abs=1)
    assert tokens[None] < tokens["int8"] < tokens["fp8_e4m3fn"]           # int8: its scales on top
