"""Quantized checkpoint formats: packing bit by bit, round trips, quantization_config and --quantize."""
import pytest
import torch

from weights.checkpoint import CheckpointError
from weights.quant_formats import (AWQ_ORDER, QuantConfig, act_order_g_idx, config_json, dequantize_linear,
                                   linear_shapes, pack_int4, parse_quantization, quantize_linear, quantized_shapes,
                                   unpack_int4)

GPTQ_V1 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"}
COMPRESSED_FP8 = config_json(QuantConfig("fp8", per_channel=True))


def nibble(word: int, i: int) -> int:
    return (word >> (4 * i)) & 0xF


def test_gptq_qweight_packs_eight_rows_into_a_word_low_nibble_first():
    values = torch.randint(0, 16, (16, 3), generator=torch.Generator().manual_seed(0))
    packed = pack_int4(values, 0)
    assert packed.dtype == torch.int32 and packed.shape == (2, 3)
    for p in range(2):
        for n in range(3):
            word = int(packed[p, n]) & 0xFFFFFFFF
            assert [nibble(word, i) for i in range(8)] == values[8 * p : 8 * p + 8, n].tolist()


def test_awq_packs_columns_in_its_interleaved_order():
    values = torch.arange(16).repeat(2, 1) % 16          # row: 0..15
    packed = pack_int4(values, 1, AWQ_ORDER)
    word = int(packed[0, 0]) & 0xFFFFFFFF
    # nibble i holds column AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7
    assert [nibble(word, i) for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert word == 0x75316420


@pytest.mark.parametrize("dim,order", [(0, tuple(range(8))), (1, tuple(range(8))), (1, AWQ_ORDER)])
def test_unpack_inverts_pack(dim, order):
    values = torch.randint(0, 16, (24, 32), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_int4(pack_int4(values, dim, order), dim, order), values.to(torch.int32))


def test_pack_refuses_values_outside_four_bits():
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((8, 1), 16), 0)


def test_act_order_g_idx_puts_group_size_rows_in_each_group():
    g_idx = act_order_g_idx(64, 16, torch.Generator().manual_seed(0))
    assert torch.bincount(g_idx).tolist() == [16, 16, 16, 16]
    assert not torch.equal(g_idx, torch.arange(64, dtype=torch.int32) // 16)


@pytest.mark.parametrize("q", [QuantConfig("gptq", group_size=16, zero_offset=1), QuantConfig("gptq", group_size=-1),
                               QuantConfig("gptq", group_size=16, desc_act=True), QuantConfig("awq", group_size=32),
                               QuantConfig("fp8", per_channel=True), QuantConfig("fp8")])
def test_quantize_then_dequantize_is_within_half_a_step(q):
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    g_idx = act_order_g_idx(64, 16, torch.Generator().manual_seed(3)) if q.desc_act else None
    tensors = quantize_linear(weight, q, g_idx=g_idx)
    expected = {n.removeprefix("m."): s for n, s in linear_shapes(q, "m", 48, 64).items()}
    for name, shape in expected.items():
        choices = shape if isinstance(shape, list) else [shape]
        assert tuple(tensors[name].shape) in choices, name
    error = (dequantize_linear(tensors, q) - weight).abs()
    if q.method == "fp8":       # 3 mantissa bits: relative error <= 2^-4
        assert (error <= weight.abs() / 16 + 1e-6).all()
    else:                       # at most half a quantization step (+ the float16 rounding of the scale)
        rows = torch.arange(64) // (64 if q.group_size == -1 else q.group_size) if g_idx is None else g_idx.long()
        step = tensors["scales"].float()[rows].T
        assert (error <= step * 0.5 + 1e-3).all()


def test_dequantize_reads_the_gptq_v1_zero_minus_one():
    qweight = pack_int4(torch.full((8, 8), 9), 0)
    tensors = {"qweight": qweight, "qzeros": pack_int4(torch.full((1, 8), 7), 1), "scales": torch.full((1, 8), 0.5)}
    v1 = dequantize_linear(tensors, QuantConfig("gptq", group_size=-1, zero_offset=1))
    v2 = dequantize_linear(tensors, QuantConfig("gptq", group_size=-1))
    assert torch.all(v1 == 0.5) and torch.all(v2 == 1.0)     # (9 - 8) * 0.5 and (9 - 7) * 0.5


def test_quantization_config_is_read_without_a_flag():
    assert parse_quantization({}) is None
    gptq = parse_quantization({"quantization_config": GPTQ_V1})
    assert (gptq.method, gptq.group_size, gptq.desc_act, gptq.zero_offset) == ("gptq", 128, True, 1)
    v2 = parse_quantization({"quantization_config": {**GPTQ_V1, "checkpoint_format": "gptq_v2"}})
    assert v2.zero_offset == 0
    awq = parse_quantization({"quantization_config": AWQ})
    assert (awq.method, awq.group_size) == ("awq", 128)
    fp8 = parse_quantization({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}})
    assert (fp8.method, fp8.per_channel, fp8.at_load) == ("fp8", False, False)
    channel = parse_quantization({"quantization_config": config_json(QuantConfig("fp8", per_channel=True))})
    assert (channel.method, channel.per_channel, channel.ignore) == ("fp8", True, ("lm_head",))


@pytest.mark.parametrize("spec,message", [
    ({**GPTQ_V1, "bits": 8}, "only 4-bit GPTQ"),
    ({**GPTQ_V1, "group_size": 100}, "group_size=100 is not supported"),
    ({**AWQ, "version": "gemv"}, "supported: 4-bit GEMM"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({**GPTQ_V1, "lm_head": True}, "lm_head: True: the checkpoint's LM head is quantized"),     # GPTQModel
    ({**COMPRESSED_FP8, "ignore": ["re:.*mlp.down_proj"]}, r"quantize the LM head \(lm_head\)"),
    ({**AWQ, "modules_to_not_convert": ["model.layers.(0"]}, r"'model.layers.\(0' is not a valid regular expression"),
    ({**COMPRESSED_FP8, "ignore": ["lm_head", "re:*proj"]}, r"'re:\*proj' is not a valid regular expression"),
    ({**AWQ, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert is 'lm_head': expected a list"),
    # GPTQModel's dynamic: per-layer settings other than the base ones, a bad regex, not a map
    ({**GPTQ_V1, "dynamic": {r"+:.*\.mlp\..*": {"bits": 8}}}, r"overrides \{'bits': 8\} for the layers it matches"),
    ({**GPTQ_V1, "dynamic": {"+:.*": {"group_size": 32}}}, "runs one GPTQ setting for every layer"),
    ({**GPTQ_V1, "dynamic": {"-:layers.(0": {}}}, r"dynamic rule '-:layers.\(0' is not a valid regular expression"),
    ({**GPTQ_V1, "dynamic": ["-:.*"]}, "dynamic is .*: expected a map of module regexes"),
    ({**GPTQ_V1, "modules_in_block_to_quantize": "self_attn.q_proj"}, "modules_in_block_to_quantize is 'self_attn"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4,
                                                                                "strategy": "group"}}}},
     "supported: float 8-bit weights"),
])
def test_unsupported_quantization_configs_are_clear_errors(spec, message):
    with pytest.raises(CheckpointError, match=message):
        parse_quantization({"quantization_config": spec})


LAYERS = [f"model.layers.{i}.{m}" for i in (1, 11) for m in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")]


@pytest.mark.parametrize("spec,dense", [
    # modules_to_not_convert: a substring of the name (AutoAWQ, vLLM, transformers 4), or a regex from its start
    # to a name boundary (transformers 5)
    ({**AWQ, "modules_to_not_convert": ["model.layers.1.mlp"]}, ["1.mlp.gate_proj", "1.mlp.down_proj"]),
    ({**AWQ, "modules_to_not_convert": ["layers.11."]}, [n.removeprefix("model.layers.") for n in LAYERS[3:]]),
    ({**GPTQ_V1, "modules_to_not_convert": ["down_proj", "lm_head"]}, ["1.mlp.down_proj", "11.mlp.down_proj"]),
    # a substring: layer 11 too, as AutoAWQ and vLLM read it (transformers 5: layer 1 only)
    ({**GPTQ_V1, "modules_to_not_convert": ["model.layers.1"]}, [n.removeprefix("model.layers.") for n in LAYERS]),
    ({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.\\d+.mlp.gate_proj"]},
     ["1.mlp.gate_proj", "11.mlp.gate_proj"]),
    # compressed-tensors ignore: the exact name, or re: and a regex matching from the name's start
    ({**COMPRESSED_FP8, "ignore": ["lm_head", "model.layers.1.mlp.down_proj", "q_proj"]}, ["1.mlp.down_proj"]),
    ({**COMPRESSED_FP8, "ignore": ["lm_head", "re:.*mlp.down_proj"]}, ["1.mlp.down_proj", "11.mlp.down_proj"]),
    ({**COMPRESSED_FP8, "ignore": ["lm_head", "re:model.layers.1.self"]}, ["1.self_attn.q_proj"]),
])
def test_layers_left_unquantized_are_matched_by_the_libraries_rules(spec, dense):
    q = parse_quantization({"quantization_config": spec})
    assert [n.removeprefix("model.layers.") for n in LAYERS if not q.quantizes(n + ".weight")] == dense


def test_quantize_flag_fp8_quantizes_a_float_checkpoint_and_matching_flags_pass():
    at_load = parse_quantization({}, "fp8")
    assert (at_load.method, at_load.per_channel, at_load.at_load) == ("fp8", True, True)
    assert parse_quantization({"quantization_config": GPTQ_V1}, "gptq").method == "gptq"
    assert parse_quantization({"quantization_config": AWQ}, "awq").method == "awq"
    fp8 = {"quant_method": "fp8"}
    assert parse_quantization({"quantization_config": fp8}, "fp8").at_load is False


@pytest.mark.parametrize("raw,flag,message", [
    ({}, "gptq", "--quantize gptq does not match a checkpoint without quantization_config"),
    ({"quantization_config": AWQ}, "gptq", "--quantize gptq does not match a awq checkpoint"),
    ({"quantization_config": GPTQ_V1}, "fp8", "--quantize fp8 does not match a gptq checkpoint"),
    ({}, "eetq", "--quantize eetq is not supported"),
])
def test_quantize_flag_that_does_not_match_the_checkpoint_is_a_clear_error(raw, flag, message):
    with pytest.raises(CheckpointError, match=message):
        parse_quantization(raw, flag)


def test_quantized_shapes_replace_only_the_decoder_linear_weights():
    shapes = {"model.embed_tokens.weight": (100, 64), "lm_head.weight": (100, 64),
              "model.layers.0.self_attn.q_proj.weight": (32, 64), "model.layers.0.mlp.down_proj.weight": (64, 32),
              "model.layers.0.input_layernorm.weight": (64,)}
    gptq = quantized_shapes(shapes, QuantConfig("gptq", group_size=16, desc_act=True))
    q, down = "model.layers.0.self_attn.q_proj.", "model.layers.0.mlp.down_proj."
    assert gptq == {"model.embed_tokens.weight": (100, 64), "lm_head.weight": (100, 64),
                    q + "qweight": (8, 32), q + "qzeros": (4, 4), q + "scales": (4, 32), q + "g_idx": (64,),
                    down + "qweight": (4, 64), down + "qzeros": (2, 8), down + "scales": (2, 64), down + "g_idx": (32,),
                    "model.layers.0.input_layernorm.weight": (64,)}
    awq = quantized_shapes(shapes, QuantConfig("awq", group_size=16, skip=("down_proj",)))
    assert awq["model.layers.0.self_attn.q_proj.qweight"] == (64, 4)
    assert awq["model.layers.0.mlp.down_proj.weight"] == (64, 32)          # modules_to_not_convert
    assert quantized_shapes(shapes, QuantConfig("fp8", at_load=True)) == shapes
    with pytest.raises(CheckpointError, match="cannot be 4-bit packed with group_size 48"):
        quantized_shapes(shapes, QuantConfig("gptq", group_size=48))


def test_older_repos_quantization_files_are_read_when_config_json_has_none(tmp_path):
    import json

    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "desc_act": True}))
    gptq = parse_quantization({}, model_dir=tmp_path)
    assert (gptq.method, gptq.group_size, gptq.desc_act, gptq.zero_offset) == ("gptq", 128, True, 1)
    awq_dir = tmp_path / "awq"
    awq_dir.mkdir()
    (awq_dir / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 64, "w_bit": 4,
                                                           "version": "GEMM"}))
    assert (parse_quantization({}, model_dir=awq_dir).method, parse_quantization({}, model_dir=awq_dir).group_size) \
        == ("awq", 64)
    assert parse_quantization({"quantization_config": AWQ}, model_dir=tmp_path).method == "awq"   # config.json wins


def test_the_launcher_accepts_the_quantize_values_the_loader_applies():
    """The launcher keeps its own copy (its flag parsing imports no torch): the two must agree."""
    from tgi_compat.launch_config import QUANTIZE_CHOICES, QUANTIZE_SUPPORTED
    from weights.quant_formats import QUANTIZE_FLAGS

    assert set(QUANTIZE_SUPPORTED) == set(QUANTIZE_FLAGS) and set(QUANTIZE_FLAGS) <= set(QUANTIZE_CHOICES)


def test_linear_biases_the_model_has_no_place_for_are_listed_for_the_zero_check():
    names = ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.bias",
             "model.layers.0.mlp.c_fc.bias", "model.layers.0.input_layernorm.bias", "lm_head.bias"]
    expected = {"model.layers.0.self_attn.q_proj.bias": (8,)}
    gptq = QuantConfig("gptq", group_size=32)
    assert gptq.unused_biases(names, expected) == ["model.layers.0.mlp.down_proj.bias", "model.layers.0.mlp.c_fc.bias"]
    assert QuantConfig("fp8").unused_biases(names, expected) == []
    assert gptq.quantizes("model.layers.3.mlp.c_fc.weight") and not gptq.quantizes("model.layers.3.mlp.c_fc.bias")


def test_gptq_block_modules_and_dynamic_rules_pick_the_quantized_layers():
    """modules_in_block_to_quantize lists the only quantized layers of a block; GPTQModel's dynamic rules match
    from the name's start and the first match decides (a positive rule with the base settings keeps a layer)."""
    q = parse_quantization({"quantization_config": {
        **GPTQ_V1, "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj"], ["mlp.down_proj"]],
        "dynamic": {r"+:model\.layers\.1\.mlp\..*": {"bits": 4, "damp_percent": 0.05},
                    r"-:model\.layers\.1\..*": {}}}})
    quantized = {name: q.quantizes(name + ".weight") for name in
                 ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj",
                  "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj")}
    assert quantized == {"model.layers.0.self_attn.q_proj": True, "model.layers.0.self_attn.o_proj": False,
                         "model.layers.0.mlp.down_proj": True, "model.layers.1.self_attn.q_proj": False,
                         "model.layers.1.mlp.down_proj": True, "model.layers.1.mlp.up_proj": False}
