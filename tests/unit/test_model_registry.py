"""The model registry is the seam: architectures map to families; configs, checkpoint checks and
models go through it; an unknown architecture names the supported ones."""
import dataclasses
import json

import pytest

from engine.models import (FAMILIES, MODEL_REGISTRY, build_model, check_checkpoint, family_for, load_model_config,
                           supported_architectures)
from engine.models.config import ModelConfigError
from engine.models.parallel import TensorParallel
from engine.ops import KernelOps
from tests.tiny_models import save_tiny_model
from weights.checkpoint import open_checkpoint


def test_every_registered_architecture_maps_to_its_family():
    for family in FAMILIES:
        for architecture in family.architectures:
            assert MODEL_REGISTRY[architecture] is family
    assert set(supported_architectures()) >= {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


def test_an_unknown_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelConfigError, match="unsupported architecture 'GPT2LMHeadModel'.*Qwen2ForCausalLM"):
        load_model_config(tmp_path)
    with pytest.raises(ModelConfigError, match="supported: LlamaForCausalLM"):
        family_for(None)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_configs_checkpoints_and_models_go_through_the_registry(tmp_path, name):
    path = save_tiny_model(name, tmp_path / name)
    config = load_model_config(path)
    assert dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3
    model = build_model(config, KernelOps.create("torch"), config.checkpoint_dtype, "cpu", 64, TensorParallel())
    assert type(model) is family_for(config.architecture).model
    with open_checkpoint(path) as checkpoint:
        check_checkpoint(checkpoint, config)


def test_a_checkpoint_missing_a_tensor_is_refused_by_the_registry_check(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny_model("llama", tmp_path / "llama")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with open_checkpoint(path) as checkpoint, pytest.raises(ValueError, match="model.norm.weight"):
        check_checkpoint(checkpoint, load_model_config(path))


def test_rope_scaling_from_the_command_line_extends_the_context(tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama")
    plain, scaled = load_model_config(path), load_model_config(path, rope_scaling=("dynamic", 2.0))
    assert (scaled.rope.rope_type, scaled.rope.factor) == ("dynamic", 2.0)
    assert scaled.max_context == 2 * plain.max_context


def test_a_sliding_window_does_not_cap_the_context(tmp_path):
    """The kernels apply the window, so the context limit is the model's (it used to be the window)."""
    config = load_model_config(save_tiny_model("mistral_window", tmp_path / "m"))
    assert config.sliding_window == 7 and config.max_context == 512


def test_gemma2_config_reads_its_layers_scales_and_caps(tmp_path):
    path = save_tiny_model("gemma2", tmp_path / "g")
    config = load_model_config(path)
    assert config.sliding_layers == (True, False)            # transformers' layer_types: even layers slide
    assert (config.sliding_window, config.attn_logit_softcapping, config.final_logit_softcapping) == (6, 3.0, 8.0)
    assert config.sm_scale == 24 ** -0.5 and config.head_dim == 16 and config.tie_word_embeddings
    raw = json.loads((path / "config.json").read_text())
    for bad, message in ((dict(hidden_activation="gelu"), "hidden_activation='gelu' is not supported"),
                         (dict(layer_types=["sliding_attention"]), "layer_types must list")):
        (path / "config.json").write_text(json.dumps({**raw, **bad}))
        with pytest.raises(ModelConfigError, match=message):
            load_model_config(path)
    (path / "config.json").write_text(json.dumps({**raw, "layer_types": None}))
    assert load_model_config(path).sliding_layers == (True, False)   # configs without it: the even-layer rule


def test_qwen2_slides_only_from_max_window_layers_on(tmp_path):
    config = load_model_config(save_tiny_model("qwen2_window", tmp_path / "q"))
    assert config.sliding_layers == (False, True) and [config.layer_window(i) for i in range(2)] == [None, 5]
