"""The step budget's inputs the engine derives: the cost model from the weight shapes, and the host
``max_seq_len`` the worker hands the prefill attention (it lets a long context split its keys)."""
import torch

from engine import ops as ops_module
from engine.assembly import ATTENTION_EFFICIENCY, step_cost_model
from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models.llama import FAMILY
from tests.tiny_models import save_tiny_model

BASE = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, rope_theta=10000.0, hidden_size=4096,
            num_hidden_layers=32, num_attention_heads=32, bos_token_id=1, eos_token_id=2)
LLAMA2_7B = dict(BASE, intermediate_size=11008, num_key_value_heads=32, vocab_size=32000,
                 max_position_embeddings=4096)
LLAMA31_8B = dict(BASE, intermediate_size=14336, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=131072)


def test_the_cost_model_follows_the_weight_shapes():
    span7, kv7 = step_cost_model(FAMILY.parse_config(LLAMA2_7B))
    span8, kv8 = step_cost_model(FAMILY.parse_config(LLAMA31_8B))
    # Llama-2-7B: 202M layer weights a layer over 2 * 32 heads * 128 dims -> ~24.7k positions (x efficiency)
    assert abs(span7 - ATTENTION_EFFICIENCY * 24704) <= 1
    # GQA: a quarter of the KV heads -> about four times (and more weights) the context per weights' bytes
    assert 25_000 < kv7 < 25_500 and 4 * kv7 < kv8 < 5 * kv7
    assert span8 > span7                                   # a bigger MLP: more matmul per attention FLOP


def test_quantized_weights_are_fewer_bytes_to_read_but_as_many_flops():
    from dataclasses import replace

    from weights.quant_formats import QuantConfig

    dense = FAMILY.parse_config(LLAMA2_7B)
    span, kv = step_cost_model(dense)
    span4, kv4 = step_cost_model(replace(dense, quantization=QuantConfig("gptq", group_size=128)))
    span8, kv8 = step_cost_model(replace(dense, quantization=QuantConfig("fp8")))
    head = 32000 * 4096 // (2 * 32 * 32 * 128)          # the LM head stays in the model dtype
    assert span4 == span8 == span
    assert kv4 == (kv - head) // 4 + head and kv8 == (kv - head) // 2 + head


def test_the_worker_hands_the_prefill_attention_the_longest_sequence(tmp_path, monkeypatch):
    path = save_tiny_model("llama", tmp_path / "llama")
    seen = []
    original = ops_module.TorchOps.prefill_attention

    def recording(self, q, kv, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale, max_q_len, shared=None,
                  max_seq_len=None, **rest):
        seen.append((max_seq_len, int(seq_len.max())))
        return original(self, q, kv, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale, max_q_len,
                        shared=shared, max_seq_len=max_seq_len, **rest)

    monkeypatch.setattr(ops_module.TorchOps, "prefill_attention", recording)
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", num_slots=512,
                                 max_requests=4, max_prefill_tokens=16))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (40, 7)]
    engine.generate([GenerationRequest(i, p, 2, stop_token_ids=[]) for i, p in enumerate(prompts)])
    assert seen and all(host == device for host, device in seen)
    assert max(host for host, _ in seen) >= 40               # the 40-token prompt's later chunks


def test_a_moe_tokens_matmuls_count_its_chosen_experts_only():
    """Mixtral-8x7B: a token's matmuls use 2 of 8 experts (attention span of the ~0.2B weights
    per layer it uses, not the 1.4B all experts hold); a decode step reads all of them."""
    from engine.models import family_for
    from weights.random_checkpoint import REAL_CONFIGS

    raw = REAL_CONFIGS["mixtral-8x7b"]
    span, kv = step_cost_model(family_for(raw["architectures"][0]).parse_config(raw))
    per_layer_used = 4096 * (2 * 4096 + 2 * 1024) + 2 * 3 * 14336 * 4096 + 8 * 4096   # attention, 2 experts, router
    assert abs(span - int(ATTENTION_EFFICIENCY * per_layer_used / (2 * 32 * 128))) <= 1
    per_layer_all = per_layer_used + 6 * 3 * 14336 * 4096
    assert kv == (32 * per_layer_all + 32000 * 4096) // (2 * 32 * 8 * 128)   # all experts' bytes, 8 KV heads


def test_the_scheduler_knows_the_attention_tile_of_the_kernels_it_runs():
    """The prefill attention's tokens per program (``tile_shape``) reach the scheduler: the demo model (group 3:
    one head a program) on the interpreter's 32-row tiles takes 32 tokens; the torch references have no tiles."""
    from engine.assembly import EngineConfig, plan_engine
    tiles = {backend: plan_engine(EngineConfig(model_dir="weights/demo", max_requests=2, kernel_backend=backend))
             .scheduler.attention_tile for backend in ("triton", "torch")}
    assert tiles == {"triton": 32, "torch": 1}
