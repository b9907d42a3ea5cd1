"""Config fields read as transformers 5 reads them, or refused: each family's per-layer sliding window
(checked against the attention masks transformers' eager attention builds), the config class's defaults
for fields config.json omits, the rope fields' priorities, and the fields the engine refuses."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models import family_for, load_model_config
from engine.models.config import ModelConfigError, as_tuple
from engine.protocol.messages import SamplingParams
from tests.tiny_models import load_hf, save_tiny_model

CONFIG_CLASSES = {"Qwen3ForCausalLM": "Qwen3Config", "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
                  "Qwen2MoeForCausalLM": "Qwen2MoeConfig", "MixtralForCausalLM": "MixtralConfig",
                  "Gemma2ForCausalLM": "Gemma2Config", "GemmaForCausalLM": "GemmaConfig",
                  "Phi3ForCausalLM": "Phi3Config", "LlamaForCausalLM": "LlamaConfig",
                  "MistralForCausalLM": "MistralConfig", "Qwen2ForCausalLM": "Qwen2Config"}
# transformers' attention of these reads ``config.sliding_window`` on every layer (no layer_types)
EVERY_LAYER = {"MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM", "MistralForCausalLM"}
NO_WINDOW = {"GemmaForCausalLM", "LlamaForCausalLM"}
LAYERS = 6
SIZES = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, vocab_size=32, num_experts=4, num_local_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8, pad_token_id=0)
ALTERNATE = ["full_attention", "sliding_attention"] * (LAYERS // 2)


def parse(raw: dict):
    return family_for(raw["architectures"][0]).parse_config(raw)


def transformers_config(raw: dict):
    return getattr(transformers, CONFIG_CLASSES[raw["architectures"][0]]).from_dict(raw)


def transformers_layer_windows(raw: dict) -> tuple[int | None, ...]:
    """Per layer, the window transformers' config gives the attention (None: none)."""
    hf = transformers_config(raw)
    if raw["architectures"][0] in NO_WINDOW:                   # Gemma 1 and Llama have no window
        return (None,) * hf.num_hidden_layers
    if raw["architectures"][0] in EVERY_LAYER:
        return (hf.sliding_window,) * hf.num_hidden_layers
    return tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)


def transformers_mask_windows(raw: dict, length: int = 16) -> tuple[int | None, ...]:
    """Per layer, how many keys the last of ``length`` tokens sees in the mask transformers' eager attention
    is given (None: all of them), from a random model built from ``raw``."""
    model = transformers.AutoModelForCausalLM.from_config(transformers_config(raw), attn_implementation="eager")
    masks = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: masks.__setitem__(i, kwargs.get("attention_mask")), with_kwargs=True)
    with torch.no_grad():
        model(torch.arange(length)[None] % raw["vocab_size"])
    seen = [None if masks[i] is None else masks[i][0, 0, -1] for i in range(len(masks))]
    seen = [None if row is None else int(row.sum() if row.dtype == torch.bool else (row == 0).sum()) for row in seen]
    return tuple(None if n in (None, length) else n for n in seen)


WINDOW_CASES = [
    dict(use_sliding_window=True, sliding_window=5, max_window_layers=3),
    dict(use_sliding_window=True, sliding_window=5, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=4, max_window_layers=LAYERS),
    dict(use_sliding_window=False, sliding_window=5, max_window_layers=3),
    dict(use_sliding_window=True, sliding_window=5, layer_types=ALTERNATE),
    dict(use_sliding_window=True, sliding_window=None),
]


@pytest.mark.parametrize("case", range(len(WINDOW_CASES)))
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                                          "MixtralForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                          "Qwen2ForCausalLM", "MistralForCausalLM", "LlamaForCausalLM"])
def test_each_familys_layer_windows_are_transformers(architecture, case):
    """Qwen3: from max_window_layers on; Qwen3-MoE: every layer; Qwen2-MoE: the even layers below
    max_window_layers; all three only with use_sliding_window, layer_types first where the class reads it;
    Mixtral, Phi-3, Mistral: every layer; Qwen2: layer_types, else from max_window_layers on; Gemma 2: layer_types,
    else the even layers; Llama: none (its attention reads no window)."""
    raw = {"architectures": [architecture], **SIZES, **WINDOW_CASES[case]}
    try:
        expected = transformers_mask_windows(raw)
    except (TypeError, ValueError):      # a sliding layer without a window (Qwen2-MoE, Gemma 2): refused
        with pytest.raises(ModelConfigError, match="slide .* but their window is None"):
            parse(raw)
        return
    assert transformers_layer_windows(raw) == expected       # the reference read from the config agrees
    config = parse(raw)
    assert tuple(config.layer_window(i) for i in range(LAYERS)) == expected


@pytest.mark.parametrize("architecture,extra,message", [
    # dense Qwen3: transformers fails to build the sliding mask without a window
    ("Qwen3ForCausalLM", dict(use_sliding_window=False, layer_types=ALTERNATE),
     r"layers \[1, 3, 5\] slide \(sliding_attention\) but their window is None \(use_sliding_window=False\)"),
    # Qwen2-MoE: the window is 0 without use_sliding_window, a mask with no key
    ("Qwen2MoeForCausalLM", dict(use_sliding_window=False, layer_types=ALTERNATE), r"their window is 0"),
    ("Gemma2ForCausalLM", dict(sliding_window=None), r"layers \[0, 2, 4\] slide .* window is None"),
    ("MixtralForCausalLM", dict(sliding_window=0), "set sliding_window to a positive number of tokens"),
])
def test_a_sliding_layer_without_a_window_is_refused(architecture, extra, message):
    with pytest.raises(ModelConfigError, match=message):
        parse({"architectures": [architecture], **SIZES, **extra})


MINIMAL = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=30, num_attention_heads=32, vocab_size=64,
               num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
               shared_expert_intermediate_size=8)


@pytest.mark.parametrize("architecture", sorted(CONFIG_CLASSES))
@pytest.mark.parametrize("use_sliding_window", [False, True])
def test_fields_config_json_omits_take_transformers_defaults(architecture, use_sliding_window):
    """Only sizes given: eps, head_dim, KV heads, context, rope theta, token ids, tied embeddings, windows
    (Qwen: 4096 with use_sliding_window; Gemma 2: 4096 on even layers) and Gemma 2's caps and scalar."""
    raw = {"architectures": [architecture], **MINIMAL}
    if use_sliding_window:
        raw["use_sliding_window"] = True
    ours, hf = parse(raw), transformers_config(raw)
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.num_kv_heads == (hf.num_key_value_heads or hf.num_attention_heads)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.rope.theta == hf.rope_parameters["rope_theta"]
    assert (ours.bos_token_id, ours.eos_token_ids) == (hf.bos_token_id, as_tuple(hf.eos_token_id))
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert tuple(ours.layer_window(i) for i in range(30)) == transformers_layer_windows(raw)
    if architecture == "Gemma2ForCausalLM":
        assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == (50.0, 30.0)
        assert (ours.attn_logit_softcapping, ours.final_logit_softcapping, ours.query_pre_attn_scalar) == (
            hf.attn_logit_softcapping, hf.final_logit_softcapping, hf.query_pre_attn_scalar)


def test_a_null_field_stays_off_as_in_transformers():
    raw = {"architectures": ["Gemma2ForCausalLM"], **MINIMAL, "final_logit_softcapping": None}
    assert parse(raw).final_logit_softcapping is None is transformers_config(raw).final_logit_softcapping


@pytest.mark.parametrize("architecture,extra,message", [
    ("GemmaForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("Gemma2ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("GemmaForCausalLM", dict(attention_bias=True), "attention_bias=True"),
    ("GemmaForCausalLM", dict(hidden_activation="gelu_pytorch_tanh", hidden_act="relu"), "hidden_act='relu'"),
    ("Phi3ForCausalLM", dict(rope_scaling={"type": "linear", "factor": 2.0}),
     "type 'linear' is not supported for Phi-3"),
    ("LlamaForCausalLM", dict(rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [1.0]}),
     "rope scaling type 'su' is not supported"),
    ("LlamaForCausalLM", dict(mlp_bias=True), "mlp_bias=True"),
])
def test_fields_the_engine_does_not_apply_are_refused(architecture, extra, message):
    with pytest.raises(ModelConfigError, match=message):
        parse({"architectures": [architecture], **MINIMAL, **extra})


def greedy_equals_transformers(path, new_tokens=8):
    hf = load_hf(path)
    engine = Engine(EngineConfig(model_dir=str(path), device="cpu", kernel_backend="torch", num_slots=256,
                                 dtype="float32", max_requests=4, max_prefill_tokens=64))
    prompts = [[5, 17, 9, 200, 33], [7] * 12 + [101, 3]]
    outputs = engine.generate([GenerationRequest(i, p, new_tokens, SamplingParams(), stop_token_ids=[])
                               for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            reference = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
        assert [o.token_id for o in outputs[i]] == reference[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama"])
def test_attention_bias_adds_the_o_proj_bias_as_transformers(family, tmp_path):
    path = save_tiny_model(family, tmp_path / family, attention_bias=True)
    config = load_model_config(path)
    assert config.qkv_bias and config.o_bias and "model.layers.1.self_attn.o_proj.bias" in family_for(
        config.architecture).checkpoint_shapes(config)
    greedy_equals_transformers(path)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_mistral_and_qwen2_ignore_mlp_bias_as_transformers(family, tmp_path):
    """Only Llama's MLP reads mlp_bias (and it is refused there): the others' MLPs have no biases whatever it
    says, so their checkpoints hold none, the engine expects none and answers as transformers does."""
    path = save_tiny_model(family, tmp_path / family, mlp_bias=True)
    assert json.loads((path / "config.json").read_text())["mlp_bias"] is True
    config = load_model_config(path)
    assert not any("mlp" in name and name.endswith(".bias")
                   for name in family_for(config.architecture).checkpoint_shapes(config))
    greedy_equals_transformers(path)


def test_mistral_ignores_attention_bias_as_transformers(tmp_path):
    """transformers' Mistral attention has no biases whatever attention_bias says: its checkpoint holds none."""
    path = save_tiny_model("mistral", tmp_path / "mistral", attention_bias=True)
    config = load_model_config(path)
    assert not config.qkv_bias and not config.o_bias
    greedy_equals_transformers(path)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama"])
def test_o_proj_bias_is_whole_on_each_of_two_shards(family, tmp_path):
    """Added once, after the all-reduce (not sliced like o_proj's weight): TP=2 gives TP=1's tokens."""
    from tests.unit.test_tensor_parallel import generate, same_outputs

    path = save_tiny_model(family, tmp_path / family, attention_bias=True)
    assert same_outputs(generate(path, 2, new_tokens=6), generate(path, 1, new_tokens=6))


def test_gemma_with_untied_embeddings_reads_lm_head(tmp_path):
    path = save_tiny_model("gemma", tmp_path / "gemma", tie_word_embeddings=False)
    assert not load_model_config(path).tie_word_embeddings
    greedy_equals_transformers(path)


PHI3 = {"architectures": ["Phi3ForCausalLM"], **MINIMAL, "num_attention_heads": 8, "max_position_embeddings": 512, "pad_token_id": 0}
FACTORS = {"short_factor": [1.0 + i / 10 for i in range(4)], "long_factor": [2.0 + i for i in range(4)]}


@pytest.mark.parametrize("rope_scaling,top_level", [
    ({"type": "yarn", **FACTORS}, 64),                                            # yarn: Phi-3's longrope
    ({"type": "longrope", **FACTORS, "original_max_position_embeddings": 32}, 64),  # top-level first
    ({"type": "longrope", **FACTORS, "original_max_position_embeddings": 32}, None),  # absent: 4096
])
def test_phi3_rope_is_the_longrope_transformers_builds(rope_scaling, top_level):
    raw = {**PHI3, "rope_scaling": rope_scaling}
    if top_level:
        raw["original_max_position_embeddings"] = top_level
    rope = parse(raw).rope
    rotary = transformers.AutoModelForCausalLM.from_config(transformers_config(raw)).model.rotary_emb
    assert rope.rope_type == rotary.rope_type == "longrope"
    assert rope.original_max_position_embeddings == rotary.config.rope_parameters["original_max_position_embeddings"]
    assert rope.attention_factor == pytest.approx(rotary.attention_scaling)


def test_rope_theta_and_original_context_follow_transformers_priorities(tmp_path):
    """rope_theta: the rope dict's over the top-level one; llama3 without an original context: the model's."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "rope_theta": 7.0}
    raw = {"architectures": ["LlamaForCausalLM"], **MINIMAL, "max_position_embeddings": 1000, "rope_theta": 5.0,
           "rope_parameters": llama3}
    hf = transformers.LlamaConfig.from_dict(raw).rope_parameters
    rope = parse(raw).rope
    assert (rope.theta, rope.original_max_position_embeddings) == (7.0, 1000)
    assert (hf["rope_theta"], hf["original_max_position_embeddings"]) == (7.0, 1000)
    # --rope-scaling replaces the rope dict but keeps its theta
    (tmp_path / "config.json").write_text(json.dumps({**raw, "rope_theta": None}))
    assert load_model_config(tmp_path, rope_scaling=("dynamic", 2.0)).rope.theta == 7.0
