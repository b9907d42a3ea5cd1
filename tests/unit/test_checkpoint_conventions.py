"""Checkpoints as Hugging Face ships them beyond the plain case, served as transformers serves them: a tied LM
head that the checkpoint stores as well, configs that leave fields to their config class's defaults or name
their model by ``model_type`` alone; and broken ones refused with a message that says what is wrong."""
from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine.generation import Engine, EngineConfig
from engine.models import load_model_config, supported_architectures
from engine.models.config import ARCHITECTURE_OF_MODEL_TYPE, ModelConfigError
from tests.tiny_models import save_tiny_model
from tests.unit.test_model_config_transformers import greedy_equals_transformers
from weights.checkpoint import CheckpointError

WEIGHTS = "model.safetensors"


def edit_config(path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def store_lm_head(path, change: float) -> None:
    """Add ``lm_head.weight`` (the embedding plus ``change``) to a tied checkpoint's one file."""
    tensors = safetensors.torch.load_file(path / WEIGHTS)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + change
    safetensors.torch.save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})


def engine_of(path) -> Engine:
    return Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", num_slots=64,
                               dtype="float32", max_requests=2, max_prefill_tokens=32))


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_a_tied_checkpoint_that_stores_an_equal_lm_head_serves_the_embedding(family, tmp_path):
    path = save_tiny_model(family, tmp_path / family, tie_word_embeddings=True)
    store_lm_head(path, change=0.0)
    greedy_equals_transformers(path)
    model = engine_of(path).worker.model
    assert model.lm_head.weight is model.embed_tokens.weight      # no second copy of the vocabulary


def test_a_tied_checkpoint_whose_lm_head_differs_serves_it_as_transformers_does(tmp_path, caplog):
    """transformers 5 unties them then (with a warning) and so does the engine."""
    path = save_tiny_model("llama", tmp_path / "llama", tie_word_embeddings=True)
    store_lm_head(path, change=0.05)
    greedy_equals_transformers(path)
    assert "lm_head.weight differs" in caplog.text
    model = engine_of(path).worker.model
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_starcoder2_and_bloom_fields_config_json_omits_take_transformers_defaults(tmp_path):
    """StarCoder2: 2 KV heads, 4096 positions, token ids 50256; Bloom: token ids 1 and 2."""
    path = save_tiny_model("starcoder2", tmp_path / "starcoder2", num_attention_heads=4, num_key_value_heads=2)
    edit_config(path, lambda c: [c.pop(k) for k in ("num_key_value_heads", "max_position_embeddings",
                                                    "bos_token_id", "eos_token_id")])
    hf = transformers.Starcoder2Config.from_pretrained(path)
    ours = load_model_config(path)
    assert (ours.num_kv_heads, ours.max_context) == (hf.num_key_value_heads, hf.max_position_embeddings) == (2, 4096)
    assert (ours.bos_token_id, ours.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,)) == (50256, (50256,))
    greedy_equals_transformers(path)
    bloom = transformers.BloomConfig()
    ours = load_model_config(write_config(tmp_path / "bloom", {"architectures": ["BloomForCausalLM"], "n_layer": 2,
                                                                "n_head": 4, "hidden_size": 64, "vocab_size": 128}))
    assert (ours.bos_token_id, ours.eos_token_ids) == (bloom.bos_token_id, (bloom.eos_token_id,)) == (1, (2,))


def write_config(path, config) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_config_without_architectures_is_served_by_its_model_type(tmp_path):
    path = save_tiny_model("qwen3", tmp_path / "qwen3")
    edit_config(path, lambda c: c.pop("architectures"))
    assert load_model_config(path).architecture == "Qwen3ForCausalLM"
    greedy_equals_transformers(path)
    with pytest.raises(ModelConfigError, match="names no architecture .* supported: LlamaForCausalLM"):
        load_model_config(write_config(tmp_path / "gpt2", {"model_type": "gpt2", "n_layer": 2}))


def test_each_model_type_names_the_architecture_transformers_builds_for_it():
    assert sorted(ARCHITECTURE_OF_MODEL_TYPE.values()) == sorted(supported_architectures())
    for model_type, architecture in ARCHITECTURE_OF_MODEL_TYPE.items():
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == architecture


def two_shards(path) -> list[str]:
    """The checkpoint's one file split into two shards (no index yet); the tensors' names."""
    tensors = safetensors.torch.load_file(path / WEIGHTS)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, held in shards.items():
        safetensors.torch.save_file({n: tensors[n] for n in held}, path / file, metadata={"format": "pt"})
    os.remove(path / WEIGHTS)
    return names


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_refused_by_name(tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama")
    names = two_shards(path)
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"puts tensor '.*' in model-00001-of-00002.safetensors, which does "
                                              r"not hold it .*download the checkpoint again"):
        engine_of(path)


def test_a_truncated_shard_of_an_index_is_named_as_truncated(tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama")
    names = two_shards(path)
    half = len(names) // 2
    index = {"metadata": {}, "weight_map": {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors"
                                            for i, n in enumerate(names)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    second = path / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="cannot open .*model-00002-of-00002.safetensors as safetensors.*"
                                              "corrupt or truncated"):
        engine_of(path)


@pytest.mark.parametrize("field", ["num_attention_heads", "num_hidden_layers", "hidden_size", "vocab_size"])
def test_a_size_of_zero_is_refused_by_name(field, tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama")
    edit_config(path, lambda c: c.update({field: 0}))
    with pytest.raises(ModelConfigError, match=f"{field}=0: it must be a positive number"):
        load_model_config(path)


def test_a_config_json_that_is_not_an_object_is_refused(tmp_path):
    with pytest.raises(ModelConfigError, match="holds a JSON list, not an object"):
        load_model_config(write_config(tmp_path / "list", [{"architectures": ["LlamaForCausalLM"]}]))
