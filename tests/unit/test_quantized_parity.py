"""Quantized checkpoints (GPTQ, AWQ, FP8) and --quantize fp8: greedy tokens equal transformers' on the same
model dequantized to float32 (float32 compute), on one and two shards, with the torch references and the
Triton kernels (interpreter). FP8's reference also rounds each linear layer's input to FP8 per token, as
its GEMM does (``tests.quant_models.fake_quantize_activations``)."""
import json
from dataclasses import replace

import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models import build_model, load_model_config
from engine.models.config import ModelConfigError
from engine.models.parallel import ShardingError, TensorParallel
from engine.models.quantized import fuse
from engine.ops import KernelOps
from kernels.fp8_gemm import Fp8Weight
from kernels.quant_gemm import Int4Weight
from tests.e2e.server import free_port
from tests.quant_models import FORMATS, fake_quantize_activations, save_quantized_pair
from tests.tiny_models import load_hf, save_tiny_model
from tests.unit.test_parity import hf_reference, prompts, run_engine_with_late_joiners
from weights.checkpoint import CheckpointError, open_checkpoint

# new tokens of the interpreter test's two requests: one decode step of both rows, then two of the second alone
# (a one-row step costs the interpreter as much as the 22-token prefill)
INTERPRETER_TOKENS = (2, 4)


def reference(twin, fmt, num_shards=1, q=None):
    hf = load_hf(twin)
    if fmt.startswith("fp8"):
        fake_quantize_activations(hf, num_shards, q)
    return hf


def engine_outputs(model_dir, backend="torch", num_shards=1, quantize=None):
    config = EngineConfig(model_dir=str(model_dir), device="cpu", kernel_backend=backend, num_slots=512,
                          dtype="float32", max_requests=8, max_prefill_tokens=24, num_shards=num_shards,
                          master_port=free_port(), quantize=quantize)
    with Engine(config) as engine:
        outputs = run_engine_with_late_joiners(engine, prompts())
        assert engine.kv_usage()[0] == 0
    return outputs


def logprob_tol(fmt):
    """4-bit: the same float32 weights; FP8: an activation rounded the other way moves a logprob a little."""
    return 1e-1 if fmt.startswith("fp8") else 1e-3


def assert_matches(outputs, hf, logprob_tol):
    for i, prompt in enumerate(prompts()):
        tokens, logprobs = hf_reference(hf, prompt)
        assert [o.token_id for o in outputs[i]] == tokens, f"prompt {i}"
        for o, ref in zip(outputs[i], logprobs):
            assert o.logprob == pytest.approx(ref[o.token_id].item(), abs=logprob_tol)


@pytest.mark.parametrize("fmt", ["gptq_act_order", "gptq_g32", "gptq_per_column", "awq_g32", "fp8_tensor",
                                 "fp8_channel"])
def test_quantized_checkpoint_matches_transformers_on_its_dequantized_twin(fmt, tmp_path):
    quantized, twin = save_quantized_pair(fmt, tmp_path)
    assert_matches(engine_outputs(quantized), reference(twin, fmt), logprob_tol(fmt))


@pytest.mark.parametrize("family,fmt", [("qwen3", "awq_g32"), ("gemma", "gptq_act_order"), ("gemma2", "fp8_channel")])
def test_other_families_with_quantized_linear_layers_match_transformers(family, fmt, tmp_path):
    """Qwen3 (q/k norms) and Gemma / Gemma 2 (GeLU MLP, soft-caps, window) load their projections the same way."""
    quantized, twin = save_quantized_pair(fmt, tmp_path, family=family)
    assert_matches(engine_outputs(quantized), reference(twin, fmt), logprob_tol(fmt))


@pytest.mark.parametrize("family,fmt", [("llama", "gptq_act_order"), ("llama", "awq_g16"), ("llama", "fp8_channel"),
                                        ("starcoder2", "gptq_g32")])
def test_triton_kernels_under_the_interpreter_match_transformers(family, fmt, tmp_path):
    """Prefill (22 tokens: dot tiles), decode of two rows (16-row dots), then of one (the FMA path; the
    first request stops early) through the kernels (StarCoder2: with the layers' biases); fewer tokens
    than the other tests: the interpreter is slow."""
    quantized, twin = save_quantized_pair(fmt, tmp_path, family=family)
    hf = reference(twin, fmt)
    config = EngineConfig(model_dir=str(quantized), device="cpu", kernel_backend="triton", num_slots=128,
                          dtype="float32", max_requests=4, max_prefill_tokens=32)
    requests = [GenerationRequest(i, p, INTERPRETER_TOKENS[i], stop_token_ids=[]) for i, p in enumerate(prompts()[:2])]
    with Engine(config) as engine:
        outputs = engine.generate(requests)
    for request in requests:
        ids = torch.tensor([request.prompt_ids])
        expected = hf.generate(ids, max_new_tokens=request.max_new_tokens, do_sample=False)[0, ids.shape[1]:]
        assert [e.token_id for e in outputs[request.request_id]] == expected.tolist(), fmt


@pytest.mark.parametrize("fmt", ["gptq_act_order", "awq_g16", "fp8_tensor"])
def test_two_shards_match_transformers(fmt, tmp_path):
    """Column slices cut packed columns, row slices whole groups (act-order: every group's scales, AWQ:
    its groups' rows of scales and zeros); FP8's
    row-parallel layers scale each shard's part of a token on its own (the reference does the same)."""
    quantized, twin = save_quantized_pair(fmt, tmp_path)
    assert_matches(engine_outputs(quantized, num_shards=2), reference(twin, fmt, 2), logprob_tol(fmt))


def load_shard(model_dir, rank, world, quantize=None):
    config = load_model_config(model_dir, quantize=quantize)
    model = build_model(config, KernelOps.create("torch"), torch.float32, "cpu", 64, TensorParallel(rank, world))
    with open_checkpoint(model_dir) as checkpoint:
        model.load_weights(checkpoint)
    return model


def test_linear_layers_are_quantized_and_embeddings_and_head_stay_dense(tmp_path):
    quantized, _ = save_quantized_pair("awq_g32", tmp_path)
    model = load_shard(quantized, 0, 1)
    layer = model.layers[0]
    for linear in (layer.attention.qkv, layer.attention.o, layer.mlp.gate_up, layer.mlp.down):
        assert isinstance(linear.weight, Int4Weight)
    assert layer.attention.qkv.weight.shape == (3 * 64, 64) and layer.mlp.down.weight.shape == (64, 160)
    assert model.lm_head.weight.dtype == torch.float32 and model.embed_tokens.weight.dtype == torch.float32


def dense_linears(model) -> set[str]:
    """The decoder linear layers (``<layer>.<qkv|o|gate_up|down>``) the model holds unquantized."""
    return {f"{i}.{name}" for i, layer in enumerate(model.layers)
            for name, linear in (("qkv", layer.attention.qkv), ("o", layer.attention.o),
                                 ("gate_up", layer.mlp.gate_up), ("down", layer.mlp.down))
            if isinstance(linear.weight, torch.Tensor)}


@pytest.mark.parametrize("fmt,left,dense", [
    ("awq_g32", {"skip": ("model.layers.0.mlp",)}, {"0.gate_up", "0.down"}),           # a parent module's path
    ("gptq_g32", {"skip": ("layers.1.self_attn",)}, {"1.qkv", "1.o"}),                # a substring (AutoAWQ, vLLM)
    ("awq_g16", {"skip": ("model.layers.*.mlp.down_proj",)}, {"0.down", "1.down"}),  # transformers 5: a regex
    ("fp8_channel", {"ignore": ("re:.*mlp.down_proj",)}, {"0.down", "1.down"}),       # compressed-tensors regex
    ("fp8_channel", {"ignore": ("model.layers.1.self_attn.o_proj",)}, {"1.o"}),       # compressed-tensors name
    # GPTQ's modules_in_block_to_quantize: only those layers of each block (q|k|v partly: dequantized, dense)
    ("gptq_g32", {"only": ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")},
     {"0.qkv", "0.gate_up", "1.qkv", "1.gate_up"}),
    # GPTQModel's dynamic: the first matching rule decides; "-:" leaves the layer unquantized
    ("gptq_act_order", {"dynamic": ((r"model\.layers\.0\.mlp\.down_proj", False), (r".*\.mlp\..*", True))},
     {"1.gate_up", "1.down", "0.gate_up"}),
])
def test_layers_the_checkpoint_leaves_unquantized_load_dense_and_match_transformers(fmt, left, dense, tmp_path):
    """modules_to_not_convert / ignore entries match layers by the libraries' rules
    (``weights.quant_formats.not_converted``, ``ignored``): those layers are dense in the checkpoint and here."""
    quant = replace(FORMATS[fmt], **left)
    quantized, twin = save_quantized_pair(fmt, tmp_path, quant=quant)
    assert dense_linears(load_shard(quantized, 0, 1)) == dense
    assert_matches(engine_outputs(quantized), reference(twin, fmt, q=quant), logprob_tol(fmt))


def test_a_fused_layer_with_some_parts_left_unquantized_runs_dense_and_matches_transformers(tmp_path):
    """k_proj of layer 0 and up_proj of layer 1 unquantized: those layers' q|k|v and gate|up dequantize their
    4-bit parts (act-order: input columns back in x's order) and run dense; the others stay 4-bit."""
    quant = replace(FORMATS["gptq_act_order"], skip=("model.layers.0.self_attn.k_proj", "layers.1.mlp.up_proj"))
    quantized, twin = save_quantized_pair("gptq_act_order", tmp_path, quant=quant)
    assert dense_linears(load_shard(quantized, 0, 1)) == {"0.qkv", "1.gate_up"}
    assert_matches(engine_outputs(quantized), reference(twin, "gptq_act_order"), logprob_tol("gptq_act_order"))


def test_fuse_dequantizes_fp8_parts_beside_dense_ones():
    dense = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    fp8 = Fp8Weight((torch.randn(4, 16) * 100).to(torch.float8_e4m3fn), torch.rand(4) + 0.5)
    fused = fuse([fp8, dense])
    assert torch.equal(fused, torch.cat([fp8.weight.float() * fp8.scale[:, None], dense]))


def test_act_order_rows_are_sorted_by_group_at_load(tmp_path):
    """One shard: every group's rows consecutive (no g_idx left, x read through perm); a row-parallel shard
    holds uneven parts of the groups and keeps the sorted g_idx."""
    quantized, _ = save_quantized_pair("gptq_act_order", tmp_path)
    qkv = load_shard(quantized, 0, 1).layers[0].attention.qkv.weight
    assert qkv.g_idx is None and sorted(qkv.perm.tolist()) == list(range(64))
    o = load_shard(quantized, 0, 2).layers[0].attention.o.weight
    assert o.perm is not None and torch.equal(o.g_idx, o.g_idx.sort().values)


def test_a_shard_that_would_split_a_group_is_a_clear_error(tmp_path):
    quantized, _ = save_quantized_pair("gptq_g32", tmp_path)      # down_proj: 160 rows, 80 a shard
    with pytest.raises(ShardingError, match="80 rows a shard, not a multiple of the quantization group_size 32"):
        load_shard(quantized, 1, 2)


def test_quantize_fp8_quantizes_a_float_checkpoint_per_channel_at_load(tmp_path):
    """Same weights as the per-channel FP8 checkpoint written from the same model: same tokens and logprobs."""
    quantized, twin = save_quantized_pair("fp8_channel", tmp_path)
    float_dir = tmp_path / "float"
    model = load_shard(float_dir, 0, 1, quantize="fp8")
    assert isinstance(model.layers[0].mlp.gate_up.weight, Fp8Weight)
    at_load = engine_outputs(float_dir, quantize="fp8")
    from_checkpoint = engine_outputs(quantized)
    assert {i: [(o.token_id, o.logprob) for o in out] for i, out in at_load.items()} == \
           {i: [(o.token_id, o.logprob) for o in out] for i, out in from_checkpoint.items()}


def test_quantize_flags_that_do_not_match_the_checkpoint_are_clear_errors(tmp_path):
    float_dir = save_tiny_model("llama", tmp_path / "float")
    with pytest.raises(CheckpointError, match="--quantize gptq does not match a checkpoint without"):
        engine_outputs(float_dir, quantize="gptq")
    quantized, _ = save_quantized_pair("awq_g32", tmp_path / "awq")
    with pytest.raises(CheckpointError, match="--quantize fp8 does not match a awq checkpoint"):
        load_model_config(quantized, quantize="fp8")


def test_a_quantized_checkpoint_of_a_moe_family_is_a_clear_error_that_lists_the_supported_ones(tmp_path):
    path = save_tiny_model("mixtral", tmp_path / "mixtral")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="quantized weights .awq. are supported for LlamaForCausalLM.*"
                                               "Phi3ForCausalLM, Starcoder2ForCausalLM, not MixtralForCausalLM "
                                               ".mixture-of-experts"):
        load_model_config(path)
