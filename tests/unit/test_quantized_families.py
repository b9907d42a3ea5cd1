"""Quantized checkpoints beyond the Llama family's layout, and what hub writers add: Phi-3 (q|k|v and gate|up
fused in the checkpoint: each part cut from the packed tensors) and StarCoder2 (biased projections, GeLU MLP)
give transformers' greedy tokens on their dequantized float32 twins; AutoGPTQ's zero biases on layers without
one are dropped (a non-zero one is refused), and biases of layers that have one (Qwen2's q/k/v) are applied."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.quantized import OutputRows
from kernels.fp8_gemm import Fp8Weight
from tests.quant_models import FORMATS, add_zero_biases, save_quantized_pair
from tests.unit.test_quantized_parity import assert_matches, engine_outputs, load_shard, logprob_tol, reference
from weights.checkpoint import CheckpointError, open_checkpoint


@pytest.mark.parametrize("family,fmt", [("phi3", "gptq_act_order"), ("phi3", "fp8_tensor"),
                                        ("starcoder2", "awq_g32"), ("starcoder2", "fp8_channel")])
def test_phi3_and_starcoder2_quantized_checkpoints_match_transformers(family, fmt, tmp_path):
    quantized, twin = save_quantized_pair(fmt, tmp_path, family=family)
    assert_matches(engine_outputs(quantized), reference(twin, fmt), logprob_tol(fmt))


@pytest.mark.parametrize("family", ["phi3", "starcoder2"])
def test_two_shards_match_transformers(family, tmp_path):
    """Phi-3: each rank holds half of q, of k, of v (and of gate, of up): words of AWQ's column packing per
    part. StarCoder2: column-parallel biases split with their layer, row-parallel ones added once, after
    the all-reduce of the 4-bit partial products."""
    quantized, twin = save_quantized_pair("awq_g16", tmp_path, family=family)
    assert_matches(engine_outputs(quantized, num_shards=2), reference(twin, "awq_g16", 2), logprob_tol("awq_g16"))


def test_a_fused_part_off_the_packing_is_a_clear_error(tmp_path):
    quantized, _ = save_quantized_pair("awq_g32", tmp_path, family="phi3")
    with open_checkpoint(quantized) as checkpoint:
        part = OutputRows(checkpoint, "model.layers.0.self_attn.qkv_proj", 64, 96, FORMATS["awq_g32"])
        assert part.shape("model.layers.0.self_attn.qkv_proj.qweight") == (64, 4)
        assert torch.equal(part.read("model.layers.0.self_attn.qkv_proj.scales"),
                           checkpoint.read("model.layers.0.self_attn.qkv_proj.scales")[:, 64:96])
        with pytest.raises(CheckpointError, match="output rows 64:100 .* not on multiples of 8"):
            OutputRows(checkpoint, "model.layers.0.self_attn.qkv_proj", 64, 100, FORMATS["awq_g32"])


def test_autogptq_zero_biases_are_dropped_and_real_ones_applied(tmp_path):
    """Qwen2: q/k/v carry biases (read and applied); o/gate/up/down get AutoGPTQ's zeros."""
    quantized, twin = save_quantized_pair("gptq_act_order", tmp_path, family="qwen2")
    added = add_zero_biases(quantized)
    assert "model.layers.0.mlp.down_proj.bias" in added and "model.layers.0.self_attn.q_proj.bias" not in added
    assert_matches(engine_outputs(quantized), reference(twin, "gptq_act_order"), 1e-3)


@pytest.mark.parametrize("fmt", ["gptq_g32", "awq_g32"])
def test_a_non_zero_bias_on_a_layer_without_one_is_refused_by_name(fmt, tmp_path):
    quantized, _ = save_quantized_pair(fmt, tmp_path)
    add_zero_biases(quantized)
    path = quantized / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.up_proj.bias"][3] = 0.5
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.bias is a non-zero bias"):
        load_shard(quantized, 0, 1)


@pytest.mark.parametrize("family", ["phi3", "starcoder2"])
def test_quantize_fp8_at_load_holds_the_weights_of_the_fp8_checkpoint(family, tmp_path):
    """--quantize fp8 on the float checkpoint (Phi-3: each fused part's rows quantized per channel) gives the
    weights and scales of the per-channel FP8 checkpoint written from the same model."""
    quantized, _ = save_quantized_pair("fp8_channel", tmp_path, family=family)
    at_load, written = load_shard(tmp_path / "float", 0, 1, quantize="fp8"), load_shard(quantized, 0, 1)
    for a, b in ((at_load.layers[1].attention.qkv, written.layers[1].attention.qkv),
                 (at_load.layers[1].mlp.down, written.layers[1].mlp.down)):
        assert isinstance(a.weight, Fp8Weight) and torch.equal(a.weight.scale, b.weight.scale)
        assert torch.equal(a.weight.weight.view(torch.uint8), b.weight.weight.view(torch.uint8))
