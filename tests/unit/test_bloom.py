"""Bloom beyond the shared parity tests (test_parity.py: engine API == transformers, torch and the Triton
interpreter; test_tensor_parallel.py: TP=2 == TP=1): bigscience's names without ``transformer.``, the
interleaved query_key_value per shard, each shard's ALiBi slopes, the real config, refusals."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.assembly import step_cost_model
from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models import build_model, check_checkpoint, family_for, load_model_config
from engine.models.bloom import DEFAULT_CONTEXT, interleaved_to_qkv
from engine.models.config import ModelConfigError
from engine.models.parallel import TensorParallel
from engine.ops import KernelOps
from kernels.score_mods import alibi_slopes
from tests.tiny_models import load_hf, save_tiny_model
from weights.checkpoint import CheckpointError, open_checkpoint
from weights.random_checkpoint import REAL_CONFIGS, tensor_shapes, with_num_layers, write_random_checkpoint

PROMPTS = [[5, 9, 11, 200, 17], [7, 300, 42]]


def greedy(path, new_tokens=8):
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", num_slots=128,
                                 dtype="float32", max_requests=4, max_prefill_tokens=16))
    out = engine.generate([GenerationRequest(i, p, new_tokens, stop_token_ids=[]) for i, p in enumerate(PROMPTS)])
    return [[e.token_id for e in out[i]] for i in range(len(PROMPTS))]


def hf_greedy(path, new_tokens=8):
    hf = load_hf(path)
    return [hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]


def strip_prefix(path):
    """Rewrite the saved checkpoint under bigscience's names (``h.0...``, ``word_embeddings...``)."""
    tensors = load_file(path / "model.safetensors")
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})


def load(path, rank=0, world=1):
    config = load_model_config(path)
    model = build_model(config, KernelOps.create("torch"), torch.float32, "cpu", 64, TensorParallel(rank, world))
    with open_checkpoint(path) as checkpoint:
        model.load_weights(checkpoint)
    return model


def test_bigscience_names_without_the_transformer_prefix_load_and_match_transformers(tmp_path):
    path = save_tiny_model("bloom", tmp_path / "bloom")
    strip_prefix(path)
    with open_checkpoint(path) as checkpoint:
        assert "h.0.self_attention.query_key_value.weight" in checkpoint
        check_checkpoint(checkpoint, load_model_config(path))
    assert greedy(path) == hf_greedy(path)


def test_a_checkpoint_holding_a_tensor_under_both_names_is_refused(tmp_path):
    path = save_tiny_model("bloom", tmp_path / "bloom")
    tensors = load_file(path / "model.safetensors")
    tensors["ln_f.weight"] = tensors["transformer.ln_f.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with open_checkpoint(path) as checkpoint, pytest.raises(CheckpointError, match="are both named"):
        check_checkpoint(checkpoint, load_model_config(path))


def test_each_shard_holds_whole_heads_of_the_interleaved_qkv_and_their_slopes(tmp_path):
    """query_key_value rows are [heads, 3, head_dim]: rank r holds heads 3r..3r+2 of the 6, as q | k | v."""
    path = save_tiny_model("bloom", tmp_path / "bloom")             # 6 heads of 16
    with open_checkpoint(path) as checkpoint:
        weight = checkpoint.read("transformer.h.1.self_attention.query_key_value.weight")
        bias = checkpoint.read("transformer.h.1.self_attention.query_key_value.bias")
    per_head = weight.view(6, 3, 16, 96)
    full = alibi_slopes(6)
    for rank in range(2):
        model = load(path, rank, 2)
        heads = per_head[3 * rank: 3 * rank + 3]
        expected = torch.cat([heads[:, 0], heads[:, 1], heads[:, 2]]).reshape(3 * 48, 96)
        attention = model.layers[1].attention
        assert torch.equal(attention.qkv.weight, expected)
        assert torch.equal(attention.qkv.bias, bias.view(6, 3, 16)[3 * rank: 3 * rank + 3].transpose(0, 1).reshape(-1))
        assert torch.equal(attention.mods.alibi_slopes, full[3 * rank: 3 * rank + 3])
    # 6 heads: the first 4 a geometric sequence from 2^-2, then the odd steps of 8 heads' (2^-1, 2^-3 powers)
    torch.testing.assert_close(full, torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))


def test_interleaved_to_qkv_groups_the_rows_by_part():
    rows = torch.arange(2 * 3 * 2).float()                           # head, part, dim
    assert interleaved_to_qkv(rows, 2, 2).tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]


def test_the_real_config_parses_and_its_context_is_tgis_default():
    raw = REAL_CONFIGS["bloom-7b1"]
    config = family_for("BloomForCausalLM").parse_config(raw)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (4096, 32, 32, 128)
    assert config.num_layers == 30 and config.intermediate_size == 16384 and config.layer_norm_epsilon == 1e-5
    assert config.max_context == DEFAULT_CONTEXT == 4096 and config.eos_token_ids == (2,)
    attention_span, kv_tokens = step_cost_model(config)     # the layer matrices are found (not only Llama's names)
    assert attention_span > 100 and kv_tokens > 1000


def test_the_real_config_checkpoint_loads_in_transformers_and_the_engine(tmp_path):
    shrunk = {**REAL_CONFIGS["bloom-7b1"], "hidden_size": 64, "n_head": 4, "vocab_size": 512}
    config = with_num_layers(shrunk, 2)
    assert config["n_layer"] == 2
    assert family_for("BloomForCausalLM").checkpoint_shapes(family_for("BloomForCausalLM").parse_config(config)) \
        == tensor_shapes(config)
    path = write_random_checkpoint(tmp_path, shrunk, dtype="float32", num_layers=2)
    with open_checkpoint(path) as checkpoint:
        assert torch.equal(checkpoint.read("transformer.ln_f.weight"), torch.ones(64))   # a norm: ones
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert {key: list(value) for key, value in info.items()} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    assert len(load(path).layers) == 2


@pytest.mark.parametrize("field,value,message", [
    ("apply_residual_connection_post_layernorm", True, "apply_residual_connection_post_layernorm=true is not"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "Bloom has no rotary embedding"),
    ("n_head", 5, "hidden_size=96 is not a multiple of n_head=5"),
])
def test_unsupported_variants_are_refused(tmp_path, field, value, message):
    path = save_tiny_model("bloom", tmp_path / "bloom")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(ModelConfigError, match=message):
        load_model_config(path)


def test_rope_scaling_from_the_command_line_is_refused(tmp_path):
    path = save_tiny_model("bloom", tmp_path / "bloom")
    with pytest.raises(ModelConfigError, match="--rope-scaling"):
        load_model_config(path, rope_scaling=("linear", 2.0))


def test_requests_behind_a_cached_prefix_match_transformers_with_the_triton_kernels(tmp_path):
    """Nine requests behind one 70-token prefix: the prefix cache hands the later eight its unrotated K/V
    slots, the router groups them as sharing it, and the attention kernels (under the interpreter) attend
    without the shared-prefix path (ALiBi needs each row's positions); every token is transformers' (3 a
    request: the eight prefill their own tokens, then decode twice as one group)."""
    path = save_tiny_model("bloom", tmp_path / "bloom")
    hf = load_hf(path)
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="triton", num_slots=1024,
                                 dtype="float32", max_requests=10, max_prefill_tokens=256))
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 384, (70,), generator=g).tolist()
    all_prompts = [prefix + torch.randint(3, 384, (1 + i % 4,), generator=g).tolist() for i in range(9)]
    request = lambda i: GenerationRequest(i, all_prompts[i], 3, stop_token_ids=[])  # noqa: E731
    shared_rows = []
    schedule = engine.router.scheduler.schedule

    def recording_schedule():
        step = schedule()
        shared_rows.append(sum(r.shared_prefix_len > 0 for r in step.rows))
        return step

    engine.router.scheduler.schedule = recording_schedule
    outputs = engine.generate([request(0)])               # caches the prefix
    outputs.update(engine.generate([request(i) for i in range(1, 9)]))
    assert max(shared_rows) == 8
    for i, prompt in enumerate(all_prompts):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
        assert [o.token_id for o in outputs[i]] == out[0, len(prompt):].tolist(), f"request {i}"
    assert engine.kv_usage()[0] == 0


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3fn"])
def test_a_quantized_kv_cache_stores_k_unrotated_in_the_kernels_as_the_references(kv, tmp_path):
    """--kv-cache-dtype: the store kernel quantizes K without rotating it, ALiBi attention dequantizes;
    the Triton kernels (interpreter) generate what the torch references do."""
    path = save_tiny_model("bloom", tmp_path / "bloom")
    out = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend=backend, num_slots=128,
                                     dtype="float32", max_requests=4, max_prefill_tokens=16, kv_cache_dtype=kv))
        events = engine.generate([GenerationRequest(i, p, 6, stop_token_ids=[]) for i, p in enumerate(PROMPTS)])
        out[backend] = [[e.token_id for e in events[i]] for i in range(len(PROMPTS))]
    assert out["triton"] == out["torch"]


def test_an_untied_lm_head_is_read_from_the_checkpoint(tmp_path):
    path = save_tiny_model("bloom", tmp_path / "bloom", tie_word_embeddings=False)
    with open_checkpoint(path) as checkpoint:
        assert "lm_head.weight" in checkpoint
    model = load(path)
    assert not model.config.tie_word_embeddings and model.lm_head.weight is not model.embed_tokens.weight
    assert greedy(path) == hf_greedy(path)
