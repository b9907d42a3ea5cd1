"""weights.random_checkpoint and weights.tokenizer_builder: real configs, HF-loadable output."""
from __future__ import annotations

import json
import time

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from weights.checkpoint import open_checkpoint
from weights.random_checkpoint import REAL_CONFIGS, main, tensor_shapes, write_random_checkpoint
from weights.tokenizer_builder import build_tokenizer, write_tokenizer

TINY = ["tiny-llama", "tiny-llama3", "tiny-mistral", "tiny-qwen2"]
TEXTS = ["Hello, world! def __init__(self):\n    return None", "héllo wörld ✓ 日本", "  spaced   out\n\n\ttabs"]


@pytest.fixture(scope="module")
def sharded_dirs(tmp_path_factory):
    """Each tiny config written with shards of at most 64 KiB."""
    dirs = {}
    for name in TINY:
        dirs[name] = write_random_checkpoint(tmp_path_factory.mktemp(name), name, max_shard_bytes=64 * 1024,
                                             seed=7)
    return dirs


@pytest.mark.parametrize("name", TINY)
def test_transformers_loads_it_with_no_missing_or_unexpected_keys(sharded_dirs, name):
    path = sharded_dirs[name]
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert {key: list(value) for key, value in info.items()} == {      # lists (transformers 4) or sets (5)
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    assert type(model).__name__ == REAL_CONFIGS[name]["architectures"][0]
    ids = torch.tensor([[REAL_CONFIGS[name]["eos_token_id"], 5, 17, 300, 42]])
    logits = model(ids).logits
    assert logits.shape == (1, 5, REAL_CONFIGS[name]["vocab_size"]) and torch.isfinite(logits).all()
    # the loaded parameters are the checkpoint's tensors under the same names
    state = model.state_dict()
    with open_checkpoint(path) as checkpoint:
        for tensor_name in checkpoint.names():
            torch.testing.assert_close(state[tensor_name], checkpoint.read(tensor_name, dtype=torch.float32),
                                       rtol=0, atol=0)


@pytest.mark.parametrize("name", TINY)
def test_sharded_layout_and_index(sharded_dirs, name):
    path = sharded_dirs[name]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    assert all((path / s).stat().st_size <= 64 * 1024 + 4096 or _single_tensor(path, index, s) for s in shards)
    shapes = tensor_shapes(REAL_CONFIGS[name])
    assert set(index["weight_map"]) == set(shapes)
    assert index["metadata"]["total_size"] == sum(2 * torch.Size(s).numel() for s in shapes.values())


def _single_tensor(path, index, shard) -> bool:
    return sum(1 for f in index["weight_map"].values() if f == shard) == 1


@pytest.mark.parametrize("name", TINY)
def test_config_is_the_exact_config_with_the_dtype(sharded_dirs, name):
    path = sharded_dirs[name]
    written = json.loads((path / "config.json").read_text())
    assert written == {**REAL_CONFIGS[name], "torch_dtype": "bfloat16"}
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["bos_token_id"] == written["bos_token_id"]
    assert generation["eos_token_id"] == written["eos_token_id"]


def test_tensor_values(sharded_dirs):
    with open_checkpoint(sharded_dirs["tiny-qwen2"]) as checkpoint:
        names = checkpoint.names()
        assert "lm_head.weight" not in names  # tied
        assert "model.layers.1.self_attn.k_proj.bias" in names
        for name in names:
            tensor = checkpoint.read(name, dtype=torch.float32)
            assert checkpoint.dtype(name) == torch.bfloat16
            if name.endswith("norm.weight"):
                assert torch.equal(tensor, torch.ones_like(tensor))
            else:
                assert tensor.numel() < 2 or 0.01 < tensor.std().item() < 0.04, name
                assert tensor.abs().max() > 0


def test_single_file_same_values_as_sharded_and_seed_matters(sharded_dirs, tmp_path):
    single = write_random_checkpoint(tmp_path / "single", "tiny-llama3", seed=7)
    other_seed = write_random_checkpoint(tmp_path / "other", "tiny-llama3", seed=8)
    assert (single / "model.safetensors").is_file() and not (single / "model.safetensors.index.json").exists()
    with open_checkpoint(single) as a, open_checkpoint(sharded_dirs["tiny-llama3"]) as b, \
            open_checkpoint(other_seed) as c:
        assert a.names() == b.names()
        for name in a.names():
            assert torch.equal(a.read(name), b.read(name))
        weight = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(a.read(weight), c.read(weight))
        assert not torch.equal(a.read(weight), a.read("model.layers.1.self_attn.q_proj.weight"))


def test_float32_and_rewrite_replaces_old_shards(tmp_path):
    write_random_checkpoint(tmp_path, "tiny-mistral", max_shard_bytes=64 * 1024)
    write_random_checkpoint(tmp_path, "tiny-mistral", dtype="float32")
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"
    with open_checkpoint(tmp_path) as checkpoint:
        assert checkpoint.dtype("lm_head.weight") == torch.float32


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown config 'llama-9b'.*llama-2-7b"):
        write_random_checkpoint(tmp_path, "llama-9b")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        write_random_checkpoint(tmp_path, "tiny-llama", dtype="int8")
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel'"):
        write_random_checkpoint(tmp_path, {**REAL_CONFIGS["tiny-llama"], "architectures": ["GPT2LMHeadModel"]})


# -- tokenizers ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_tokenizer_loads_and_round_trips(sharded_dirs, name):
    config = REAL_CONFIGS[name]
    tokenizer = AutoTokenizer.from_pretrained(sharded_dirs[name])
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.eos_token_id == config["eos_token_id"]
    assert tokenizer.model_max_length == config["max_position_embeddings"]
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        if config["model_type"] == "qwen2":
            assert config["bos_token_id"] not in ids  # Qwen2 adds no BOS
        else:
            assert ids[0] == tokenizer.bos_token_id == config["bos_token_id"] and ids.count(ids[0]) == 1
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert len(tokenizer(text, add_special_tokens=False).input_ids) < len(text.encode())  # merges are used
    every_id = tokenizer.batch_decode([[i] for i in range(config["vocab_size"])])
    assert len(every_id) == config["vocab_size"]
    assert tokenizer.decode([config["eos_token_id"]]) == tokenizer.eos_token


def test_chat_template_renders(sharded_dirs):
    tokenizer = AutoTokenizer.from_pretrained(sharded_dirs["tiny-qwen2"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_llama2_size_tokenizer(tmp_path):
    config = REAL_CONFIGS["llama-2-7b"]
    write_tokenizer(tmp_path, config)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 32000
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<unk>", "<s>", "</s>"]
    assert (tokenizer.unk_token, tokenizer.bos_token, tokenizer.eos_token) == ("<unk>", "<s>", "</s>")
    ids = tokenizer(TEXTS[1]).input_ids
    assert ids[0] == 1 and tokenizer.decode(ids[1:]) == TEXTS[1]
    assert tokenizer.decode(tokenizer.encode("the", add_special_tokens=False)) == "the"
    assert max(tokenizer(" the quick brown fox", add_special_tokens=False).input_ids) < 32000


@pytest.mark.parametrize("name, specials", [
    ("llama-3-8b", {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128002: "<|reserved_special_token_0|>",
                    128006: "<|start_header_id|>", 128009: "<|eot_id|>",
                    128255: "<|reserved_special_token_250|>"}),
    ("llama-3.1-8b", {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>",
                      128255: "<|reserved_special_token_247|>"}),
    ("qwen2-7b", {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}),
])
def test_large_vocab_tokenizers(name, specials):
    config = REAL_CONFIGS[name]
    start = time.perf_counter()
    tokenizer, _ = build_tokenizer(config)
    assert time.perf_counter() - start < 20
    assert tokenizer.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    for token_id, text in specials.items():
        assert tokenizer.id_to_token(token_id) == text
    assert tokenizer.id_to_token(config["vocab_size"] - 1) is not None
    ids = tokenizer.encode(TEXTS[1]).ids
    assert tokenizer.decode(ids) == TEXTS[1]
    assert (ids[0] == config["bos_token_id"]) == (config["model_type"] != "qwen2")


# -- real configs ----------------------------------------------------------------------------


def _params(name):
    return sum(torch.Size(s).numel() for s in tensor_shapes(REAL_CONFIGS[name]).values())


@pytest.mark.parametrize("name, known, params", [
    ("llama-2-7b", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, torch_dtype="float16"), 6_738_415_616),
    ("llama-2-13b", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                         num_key_value_heads=40, vocab_size=32000), 13_015_864_320),
    ("llama-3-8b", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_key_value_heads=8,
                        vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                        bos_token_id=128000, eos_token_id=128001, rope_scaling=None), 8_030_261_248),
    ("llama-3.1-8b", dict(max_position_embeddings=131072, num_key_value_heads=8, vocab_size=128256,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
     8_030_261_248),
    ("mistral-7b-v0.1", dict(sliding_window=4096, num_key_value_heads=8, intermediate_size=14336,
                             vocab_size=32000, max_position_embeddings=32768, rope_theta=10000.0,
                             architectures=["MistralForCausalLM"]), 7_241_732_096),
    ("qwen2-7b", dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                      vocab_size=152064, num_hidden_layers=28, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      bos_token_id=151643, eos_token_id=151643, tie_word_embeddings=False,
                      architectures=["Qwen2ForCausalLM"]), 7_615_616_512),
    ("gemma-7b", dict(hidden_size=3072, head_dim=256, num_attention_heads=16, num_key_value_heads=16,
                      intermediate_size=24576, vocab_size=256000, num_hidden_layers=28, hidden_act="gelu",
                      architectures=["GemmaForCausalLM"]), 8_537_680_896),
    ("gemma-2-9b", dict(hidden_size=3584, head_dim=256, num_attention_heads=16, num_key_value_heads=8,
                        intermediate_size=14336, num_hidden_layers=42, query_pre_attn_scalar=256,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
                        architectures=["Gemma2ForCausalLM"]), 9_241_705_984),
    ("bloom-7b1", dict(hidden_size=4096, n_head=32, n_layer=30, vocab_size=250880, layer_norm_epsilon=1e-5,
                       architectures=["BloomForCausalLM"], apply_residual_connection_post_layernorm=False),
     7_069_016_064),
])
def test_real_configs_have_the_known_numbers(name, known, params):
    config = REAL_CONFIGS[name]
    assert {k: config[k] for k in known} == known
    assert _params(name) == params  # the parameter counts the model cards state


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_every_config_is_a_valid_transformers_config(name):
    config = transformers.AutoConfig.for_model(**REAL_CONFIGS[name])
    head_dim = config.hidden_size // config.num_attention_heads
    assert config.num_attention_heads % getattr(config, "num_key_value_heads", config.num_attention_heads) == 0
    if name.startswith("tiny"):
        assert head_dim in (16, 32) and 256 <= config.vocab_size <= 1024
        assert config.max_position_embeddings == 2048


# -- CLI ----------------------------------------------------------------------------------


def test_cli_list_help_and_write(tmp_path, capsys):
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in REAL_CONFIGS)
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--config", "--out", "--dtype", "--device", "--seed", "--std", "--max-shard-bytes", "--list"):
        assert flag in help_text
    with pytest.raises(SystemExit):
        main(["--config", "tiny-llama"])  # --out missing
    assert main(["--config", "tiny-llama", "--out", str(tmp_path), "--dtype", "float16", "--seed", "3"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float16"
    assert "Writing random weights" in capsys.readouterr().err
    with open_checkpoint(tmp_path) as checkpoint:
        assert checkpoint.dtype("model.embed_tokens.weight") == torch.float16


@pytest.mark.parametrize("name", ["gemma-7b", "gemma-2-9b", "mistral-7b-v0.1"])
def test_layer_override_and_the_engine_expects_the_written_shapes(name):
    """--num-layers keeps the first layers; the engine's family asks for exactly the tensors written."""
    from engine.models import family_for
    from weights.random_checkpoint import with_num_layers
    config = with_num_layers(REAL_CONFIGS[name], 2)
    assert config["num_hidden_layers"] == 2 and REAL_CONFIGS[name]["num_hidden_layers"] > 2
    family = family_for(config["architectures"][0])
    assert family.checkpoint_shapes(family.parse_config(config)) == tensor_shapes(config)
    with pytest.raises(ValueError, match="num_layers must be in 1"):
        with_num_layers(REAL_CONFIGS[name], 0)
# -- Phi-3 and StarCoder2 (fused tensors; biases and LayerNorms), shrunk from the real configs -------

SHRUNK = {
    "phi-3-mini-128k": dict(hidden_size=192, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                            vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0),  # head_dim 96: 48 factors
    "starcoder2-7b": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=512),
}


@pytest.mark.parametrize("name", list(SHRUNK))
def test_phi3_and_starcoder2_checkpoints_load_in_transformers_and_in_the_engine(name, tmp_path):
    from engine.models import check_checkpoint, load_model_config
    config = {**REAL_CONFIGS[name], **SHRUNK[name]}
    path = write_random_checkpoint(tmp_path, config, dtype="float32", num_layers=2, max_shard_bytes=256 * 1024)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert {key: list(value) for key, value in info.items()} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    ours = load_model_config(path)
    with open_checkpoint(path) as checkpoint:
        check_checkpoint(checkpoint, ours)
    assert ours.architecture == config["architectures"][0] and ours.num_layers == 2


def test_phi3_mini_has_the_model_cards_parameter_count():
    assert _params("phi-3-mini-4k") == _params("phi-3-mini-128k") == 3_821_079_552
    assert REAL_CONFIGS["phi-3-mini-4k"]["sliding_window"] == 2047
    assert len(REAL_CONFIGS["phi-3-mini-128k"]["rope_scaling"]["long_factor"]) == 3072 // 32 // 2


@pytest.mark.parametrize("quantize,desc_act", [("gptq", False), ("gptq", True), ("awq", False), ("fp8", False)])
def test_quantized_checkpoints_are_read_by_the_engine_in_their_format(quantize, desc_act, tmp_path):
    """--quantize writes the linear layers packed, with the quantization_config; the engine reads it without a
    flag and its dequantized weights are the float weights within half a quantization step."""
    from engine.models import build_model, check_checkpoint, load_model_config
    from engine.models.parallel import TensorParallel
    from engine.ops import KernelOps
    from kernels.fp8_gemm import Fp8Weight
    from kernels.quant_gemm import Int4Weight, int4_dequantize

    dense = write_random_checkpoint(tmp_path / "dense", "tiny-llama3", dtype="float32", max_shard_bytes=200_000)
    out = write_random_checkpoint(tmp_path / quantize, "tiny-llama3", dtype="float32", max_shard_bytes=200_000,
                                  quantize=quantize, desc_act=desc_act, group_size=32)
    assert (out / "model.safetensors.index.json").is_file()
    config = load_model_config(out)
    assert config.quantization.method == quantize and config.quantization.desc_act == desc_act
    model = build_model(config, KernelOps.create("torch"), torch.float32, "cpu", 64, TensorParallel())
    with open_checkpoint(out) as checkpoint:
        check_checkpoint(checkpoint, config)
        model.load_weights(checkpoint)
    down = model.layers[1].mlp.down.weight
    with open_checkpoint(dense) as checkpoint:
        expected = checkpoint.read("model.layers.1.mlp.down_proj.weight")
    if quantize == "fp8":
        assert isinstance(down, Fp8Weight)
        torch.testing.assert_close(down.weight.float() * down.scale[:, None], expected, rtol=2**-4, atol=1e-6)
    else:
        assert isinstance(down, Int4Weight) and (down.perm is not None) == desc_act   # act-order: sorted rows
        if desc_act:
            expected = expected[:, down.perm.long()]
        step = down.scales.max().item()
        assert (int4_dequantize(down) - expected).abs().max() <= step / 2 + 1e-3
