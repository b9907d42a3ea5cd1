"""StarCoder2 beyond the shared parity test: the Triton LayerNorm and GeLU kernels end to end
(under the interpreter on the CPU), ``use_bias: false``, the window kept in the config, refusals."""
import json

import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models import build_model, load_model_config
from engine.models.config import ModelConfigError
from engine.models.parallel import TensorParallel
from engine.ops import KernelOps
from weights.checkpoint import open_checkpoint
from tests.tiny_models import load_hf, save_tiny_model

PROMPTS = [[5, 9, 11, 200, 17], [7, 300, 42]]


def check_greedy(path, backend, new_tokens):
    hf = load_hf(path)
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend=backend, num_slots=128,
                                 dtype="float32", max_requests=4, max_prefill_tokens=16))
    out = engine.generate([GenerationRequest(i, p, new_tokens, stop_token_ids=[]) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):]
        assert [e.token_id for e in out[i]] == ref.tolist(), i


def test_triton_layernorm_and_gelu_kernels_in_the_model_match_transformers(tmp_path):
    check_greedy(save_tiny_model("starcoder2", tmp_path / "sc2", num_hidden_layers=1), "triton", 6)


def test_without_biases_and_untied_with_the_exact_gelu(tmp_path):
    path = save_tiny_model("starcoder2", tmp_path / "sc2", use_bias=False, tie_word_embeddings=False, hidden_act="gelu")
    config = load_model_config(path)
    assert not config.use_bias and not config.tie_word_embeddings and config.gelu_approximate == "none"
    check_greedy(path, "torch", 8)


def test_the_sliding_window_is_applied_in_the_kernels_and_the_context_is_the_models(tmp_path):
    path = save_tiny_model("starcoder2", tmp_path / "sc2", sliding_window=100)
    config = load_model_config(path)
    assert config.sliding_window == 100 and config.max_context == config.max_position_embeddings == 512
    model = build_model(config, KernelOps.create("torch"), torch.float32, "cpu", 512, TensorParallel())
    with open_checkpoint(path) as checkpoint:
        model.load_weights(checkpoint)
    assert all(layer.attention.mods.window == 100 for layer in model.layers)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_act", "relu", "hidden_act='relu' is not supported for StarCoder2"),
    ("norm_type", "rms_norm", "only StarCoder2's layer_norm and default MLP are supported"),
])
def test_unsupported_variants_are_refused(tmp_path, field, value, message):
    path = save_tiny_model("starcoder2", tmp_path / "sc2")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(ModelConfigError, match=message):
        load_model_config(path)
