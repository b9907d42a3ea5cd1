"""Random checkpoints with a real model's exact config, in Hugging Face format.

No weights can be downloaded on the build machines, so GPU tests and benchmarks run on
checkpoints written here: the real ``config.json`` (Llama-2-7B, Llama-3-8B, Mistral-7B,
Qwen2-7B, ...), tensors with the real names and shapes, sharded safetensors + index, a
synthetic tokenizer of the exact vocab size. Both our server (``--model-id DIR``) and
transformers (``from_pretrained(DIR)``) load them.

    python -m weights.random_checkpoint --config llama-2-7b --out /tmp/llama2-7b --device cuda
    python -m weights.random_checkpoint --config llama-2-7b --out /tmp/llama2-7b-gptq --device cuda --quantize gptq

Tensors are generated one at a time on ``device`` (seeded per tensor, so the values do
not depend on sharding), moved to the host and written one shard at a time: host memory
never holds more than one shard.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .quant_formats import QuantConfig, act_order_g_idx, config_json, input_name, quantize_linear
from .tokenizer_builder import write_tokenizer

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                 "Phi3ForCausalLM", "Starcoder2ForCausalLM")
# Families whose names and shapes come from the engine's family module (its checkpoint_shapes).
FAMILY_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                        "BloomForCausalLM")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUANTIZED = ("gptq", "awq", "fp8")     # --quantize: the decoder's linear layers in that format


def quant_config(quantize: str, group_size: int = 128, desc_act: bool = False) -> QuantConfig:
    """The formats as the hub's checkpoints usually come: GPTQ v1 (stored zero - 1; ``desc_act``: act-order)
    and AWQ GEMM with groups of ``group_size``, FP8 with one scale per tensor."""
    if quantize not in QUANTIZED:
        raise ValueError(f"quantize {quantize!r} is not supported; expected one of {', '.join(QUANTIZED)}")
    if desc_act and quantize != "gptq":
        raise ValueError("desc_act (act-order) is a GPTQ option: pass it with quantize='gptq'")
    if quantize == "fp8":
        return QuantConfig("fp8", per_channel=False)
    return QuantConfig(quantize, group_size=group_size, desc_act=desc_act, zero_offset=1 if quantize == "gptq" else 0)

_LLAMA_2 = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 4096, "model_type": "llama", "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
    "use_cache": True, "vocab_size": 32000,
}
_LLAMA_3 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}
_LLAMA_31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}
_PHI_3_MINI = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32064,
}

# config.json of each public repo, key for key (transformers_version left out).
REAL_CONFIGS: dict[str, dict] = {
    "llama-2-7b": {  # meta-llama/Llama-2-7b-hf
        **_LLAMA_2, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32},
    "llama-2-13b": {  # meta-llama/Llama-2-13b-hf
        **_LLAMA_2, "hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40,
        "num_hidden_layers": 40, "num_key_value_heads": 40},
    "llama-3-8b": dict(_LLAMA_3),  # meta-llama/Meta-Llama-3-8B
    "llama-3.1-8b": {  # meta-llama/Llama-3.1-8B
        **_LLAMA_3, "max_position_embeddings": 131072, "mlp_bias": False, "rope_scaling": _LLAMA_31_SCALING},
    "mistral-7b-v0.1": {  # mistralai/Mistral-7B-v0.1
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 32000},
    "qwen2-7b": {  # Qwen/Qwen2-7B (q/k/v biases are implied by model_type qwen2)
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064},
    "phi-3-mini-4k": {  # microsoft/Phi-3-mini-4k-instruct
        **_PHI_3_MINI, "max_position_embeddings": 4096, "rope_scaling": None, "sliding_window": 2047},
    # microsoft/Phi-3-mini-128k-instruct. Its 48 short and 48 long factors were not reachable offline:
    # the values below are stand-ins of the right count and shape (short near 1, long rising to ~64);
    # the rest of the config is the repo's.
    "phi-3-mini-128k": {
        **_PHI_3_MINI, "max_position_embeddings": 131072, "sliding_window": 262144,
        "rope_scaling": {"type": "longrope", "short_factor": [round(1 + 0.02 * i, 2) for i in range(48)],
                         "long_factor": [round(1.0 + 63.0 * (i / 47) ** 2, 2) for i in range(48)]}},
    "starcoder2-7b": {  # bigcode/starcoder2-7b
        "architectures": ["Starcoder2ForCausalLM"], "attention_dropout": 0.1, "bos_token_id": 0,
        "embedding_dropout": 0.1, "eos_token_id": 0, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 4608,
        "initializer_range": 0.018042, "intermediate_size": 18432, "max_position_embeddings": 16384,
        "mlp_type": "default", "model_type": "starcoder2", "norm_epsilon": 1e-05, "norm_type": "layer_norm",
        "num_attention_heads": 36, "num_hidden_layers": 32, "num_key_value_heads": 4, "residual_dropout": 0.1,
        "rope_theta": 1000000, "sliding_window": 4096, "torch_dtype": "bfloat16", "use_bias": True,
        "use_cache": True, "vocab_size": 49152},
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1 (46.7B: --num-layers 4..8 fits one 80 GB GPU)
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 32000},
    "qwen1.5-moe-a2.7b": {  # Qwen/Qwen1.5-MoE-A2.7B (q/k/v biases implied; 60 experts, top-4, shared expert)
        "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
        "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False,
        "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 16, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936},
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B (128 experts, top-8, renormalised; q/k norms)
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "qwen3-8b": {  # Qwen/Qwen3-8B (head_dim 128 from the config; q/k norms)
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "bloom-7b1": {  # bigscience/bloom-7b1 (no max_position_embeddings: ALiBi; names without transformer.)
        "apply_residual_connection_post_layernorm": False, "architectures": ["BloomForCausalLM"],
        "attention_dropout": 0.0, "attention_softmax_in_fp32": True, "bias_dropout_fusion": True, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_dropout": 0.0, "hidden_size": 4096, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "masked_softmax_fusion": True, "model_type": "bloom", "n_head": 32,
        "n_inner": None, "n_layer": 30, "offset_alibi": 100, "pad_token_id": 3, "pretraining_tp": 1,
        "skip_bias_add": True, "skip_bias_add_qkv": False, "slow_but_exact": False, "torch_dtype": "float16",
        "unk_token_id": 0, "use_cache": True, "vocab_size": 250880},
    # Tiny members of the same families, for CPU tests: same keys, small sizes.
    "tiny-llama": {
        **_LLAMA_2, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "torch_dtype": "bfloat16"},
    "tiny-llama3": {  # 8 q heads / 2 kv heads, head_dim 16; 256 specials from bos like Llama-3.1
        **_LLAMA_3, "hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 8,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 1024, "bos_token_id": 768,
        "eos_token_id": 769, "max_position_embeddings": 2048, "mlp_bias": False,
        "rope_scaling": {**_LLAMA_31_SCALING, "original_max_position_embeddings": 256}},
    "tiny-mistral": {  # 8 q heads / 2 kv heads, head_dim 16
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 128, "initializer_range": 0.02, "intermediate_size": 352,
        "max_position_embeddings": 2048, "model_type": "mistral", "num_attention_heads": 8,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 512},
    "tiny-qwen2": {  # 4 q heads / 2 kv heads, head_dim 16, tied embeddings
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 960,
        "eos_token_id": 960, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 160, "max_position_embeddings": 2048, "max_window_layers": 2,
        "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 2048, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 1024},
}


_GEMMA = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2, "eos_token_id": 1, "head_dim": 256,
    "initializer_range": 0.02, "max_position_embeddings": 8192, "num_attention_heads": 16, "pad_token_id": 0,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "vocab_size": 256000,
}
REAL_CONFIGS.update({
    "gemma-7b": {  # google/gemma-7b
        **_GEMMA, "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu", "hidden_size": 3072,
        "intermediate_size": 24576, "model_type": "gemma", "num_hidden_layers": 28, "num_key_value_heads": 16,
        "rope_scaling": None, "torch_dtype": "bfloat16"},
    "gemma-2-9b": {  # google/gemma-2-9b
        **_GEMMA, "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
        "cache_implementation": "hybrid", "final_logit_softcapping": 30.0, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
        "model_type": "gemma2", "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32"},
})


def with_num_layers(config: dict, num_layers: int | None) -> dict:
    """The config with its first ``num_layers`` layers (a big model cut to fit one GPU); None keeps them all.
    The per-layer fields follow (``layer_types``, Qwen's ``mlp_only_layers`` and ``max_window_layers``)."""
    if num_layers is None:
        return config
    key = "n_layer" if "n_layer" in config else "num_hidden_layers"        # Bloom's spelling, else the usual
    if not 1 <= num_layers <= config[key]:
        raise ValueError(f"num_layers must be in 1..{config[key]}, got {num_layers}")
    config = {**config, key: num_layers}
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:num_layers]
    if config.get("mlp_only_layers"):
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < num_layers]
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    return config


def resolve_config(config: str | dict) -> dict:
    """A copy of the config: a REAL_CONFIGS name, a path to a config.json (or its directory), or a dict."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if config in REAL_CONFIGS:
        return copy.deepcopy(REAL_CONFIGS[config])
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    raise ValueError(f"unknown config {config!r}: expected one of {', '.join(REAL_CONFIGS)} "
                     f"or a path to a config.json; see --list")


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for a Llama / Mistral / Qwen2 / Gemma / Gemma 2 / Phi-3 / StarCoder2
    causal LM config; the families of ``FAMILY_ARCHITECTURES`` name theirs through the engine's family module."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture in FAMILY_ARCHITECTURES:
        from engine.models import family_for

        family = family_for(architecture)
        return family.checkpoint_shapes(family.parse_config(config))
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; expected one of "
                         f"{ARCHITECTURES + FAMILY_ARCHITECTURES}")
    if architecture == "Phi3ForCausalLM":
        return _phi3_shapes(config)
    if architecture == "Starcoder2ForCausalLM":
        return _starcoder2_shapes(config)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    qkv_bias = config.get("model_type") == "qwen2" or bool(config.get("attention_bias"))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        })
        if qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (heads * head_dim,),
                           p + "self_attn.k_proj.bias": (kv_heads * head_dim,),
                           p + "self_attn.v_proj.bias": (kv_heads * head_dim,)})
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if config.get("attention_bias") and config.get("model_type") != "qwen2":
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        shapes.update({
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
        if config.get("mlp_bias"):
            shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                           p + "mlp.down_proj.bias": (hidden,)})
        if architecture == "Gemma2ForCausalLM":
            shapes.update({p + "pre_feedforward_layernorm.weight": (hidden,),
                           p + "post_feedforward_layernorm.weight": (hidden,)})
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", architecture in ("GemmaForCausalLM", "Gemma2ForCausalLM")):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _phi3_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Phi-3: Llama's tensors with q|k|v fused in ``qkv_proj`` and gate|up in ``gate_up_proj``."""
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads, head_dim = config.get("num_key_value_heads") or heads, hidden // heads
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_up_proj.weight": (2 * inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _starcoder2_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """StarCoder2: biased q/k/v/o and c_fc/c_proj (``use_bias``), LayerNorms with bias, tied by default."""
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads, head_dim = config.get("num_key_value_heads") or heads, hidden // heads
    linears = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
               "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
               "mlp.c_fc": (inter, hidden), "mlp.c_proj": (hidden, inter)}
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for name, shape in linears.items():
            shapes[p + name + ".weight"] = shape
            if config.get("use_bias", True):
                shapes[p + name + ".bias"] = (shape[0],)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes.update({p + norm + ".weight": (hidden,), p + norm + ".bias": (hidden,)})
    shapes.update({"model.norm.weight": (hidden,), "model.norm.bias": (hidden,)})
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _plan_shards(shapes: dict[str, tuple[int, ...]], element_bytes: int, max_shard_bytes: int) -> list[list[str]]:
    """Names grouped into shards of at most max_shard_bytes (a bigger tensor gets a shard of its own)."""
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = element_bytes * _numel(shape)
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _random_tensor(name: str, shape, index: int, seed: int, dtype, device, std: float) -> torch.Tensor:
    """normal(0, std) matrices, ones for norms, normal(0, std) biases; seeded per tensor."""
    if name.endswith(("norm.weight", "ln_f.weight")):
        return torch.ones(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + index)
    tensor = torch.randn(shape, generator=generator, dtype=dtype, device=device)
    return tensor.mul_(std)


def write_random_checkpoint(out_dir: str | Path, config: str | dict, dtype: str = "bfloat16", seed: int = 0,
                            device: str | torch.device = "cpu", max_shard_bytes: int = 2 * 1024**3,
                            std: float = 0.02, num_layers: int | None = None, quantize: str | None = None,
                            desc_act: bool = False, group_size: int = 128) -> Path:
    """Write config.json, generation_config.json, random safetensors weights and a tokenizer to ``out_dir``.

    One ``model.safetensors`` when the weights fit in ``max_shard_bytes``, else
    ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``.
    ``num_layers`` keeps only the model's first layers. ``quantize`` (gptq | awq | fp8) writes the decoder's
    linear layers in that format (``quant_config``) with its quantization_config.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(_DTYPES)}")
    q = quant_config(quantize, group_size, desc_act) if quantize is not None else None
    config = with_num_layers(resolve_config(config), num_layers)
    config["torch_dtype"] = dtype
    if q is not None:
        config["quantization_config"] = config_json(q)
    torch_dtype, device = _DTYPES[dtype], torch.device(device)
    shapes = tensor_shapes(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(out_dir.glob("model*.safetensors")) + list(out_dir.glob("model*.safetensors.index.json")):
        stale.unlink()  # never leave shards of an earlier, different checkpoint next to the new one

    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"_from_model_config": True, "bos_token_id": config.get("bos_token_id"),
                  "eos_token_id": config.get("eos_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(out_dir, config)

    element_bytes = torch.empty((), dtype=torch_dtype).element_size()
    shards = _plan_shards(shapes, element_bytes, max_shard_bytes)
    order = {name: i for i, name in enumerate(shapes)}
    total_bytes = element_bytes * sum(_numel(s) for s in shapes.values())
    weight_map, written_bytes, g_idx = {}, 0, {}
    with tqdm(total=total_bytes, desc=f"Writing random weights to {out_dir}", unit="B", unit_scale=True,
              file=sys.stderr, disable=False, dynamic_ncols=True) as bar:
        for i, names in enumerate(shards):
            file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name in names:
                tensor = _random_tensor(name, shapes[name], order[name], seed, torch_dtype, device, std)
                quantized = q is not None and q.quantizes(name)
                parts = _quantized(name, tensor, q, g_idx, seed) if quantized else {name: tensor}
                for part, value in parts.items():
                    tensors[part] = value.to("cpu")
                    weight_map[part] = file
                    written_bytes += value.numel() * value.element_size()
                bar.update(tensor.numel() * element_bytes)
            save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
            del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": written_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def _quantized(name: str, weight: torch.Tensor, q: QuantConfig, g_idx: dict, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one linear layer's random ``weight`` in format ``q``; act-order layers that
    read the same input (q/k/v, gate/up) share one random ``g_idx`` (kept in ``g_idx`` by input)."""
    module, key = name.removesuffix(".weight"), input_name(name)
    if q.desc_act and key not in g_idx:
        generator = torch.Generator(device=weight.device).manual_seed(seed * 1_000_003 + len(g_idx))
        g_idx[key] = act_order_g_idx(weight.shape[1], q.group_size, generator)
    parts = quantize_linear(weight, q, g_idx=g_idx.get(key))
    return {f"{module}.{suffix}": tensor for suffix, tensor in parts.items()}


def build_parser() -> argparse.ArgumentParser:
    """The command line; ``_parse_args`` checks that ``--config`` and ``--out`` come together (``--list`` needs
    neither)."""
    parser = argparse.ArgumentParser(
        prog="python -m weights.random_checkpoint",
        description="Write a random checkpoint with a real model's exact config.json, in Hugging Face format "
                    "(sharded safetensors + index, tokenizer), loadable with --model-id DIR and by transformers.")
    parser.add_argument("--config", help="a name from --list (e.g. llama-2-7b) or a path to a config.json")
    parser.add_argument("--out", help="output directory (created; earlier model*.safetensors in it are replaced)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES),
                        help="dtype of the written tensors; also written as torch_dtype in config.json "
                             "(default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="where tensors are generated, e.g. cuda for a 7B checkpoint in seconds "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; same seed, same tensors (default: 0)")
    parser.add_argument("--std", type=float, default=0.02,
                        help="standard deviation of weights and biases; norm weights are ones (default: 0.02)")
    parser.add_argument("--max-shard-bytes", type=int, default=2 * 1024**3,
                        help="largest shard file in bytes; more weights are split into shards + index "
                             "(default: 2 GiB)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep only the first N decoder layers (a big model cut to fit one GPU; "
                             "default: all of the config's)")
    parser.add_argument("--quantize", choices=QUANTIZED, default=None,
                        help="write the decoder's linear layers quantized: gptq (4-bit, v1 zeros), awq (4-bit "
                             "GEMM) or fp8 (per-tensor scales), with the quantization_config in config.json "
                             "(default: unquantized)")
    parser.add_argument("--group-size", type=int, default=128, help="gptq / awq rows per group (default: 128)")
    parser.add_argument("--desc-act", action="store_true", help="with --quantize gptq: act-order (random g_idx)")
    parser.add_argument("--list", action="store_true", help="print the known config names and exit")
    return parser


def _parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.list and (not args.config or not args.out):
        parser.error("--config and --out are required (or use --list)")
    return args


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.list:
        for name, config in REAL_CONFIGS.items():
            layers = config.get("num_hidden_layers") or config["n_layer"]            # Bloom: n_layer, n_head
            heads = config.get("num_attention_heads") or config["n_head"]
            print(f"{name:18s} {config['architectures'][0]:20s} hidden={config['hidden_size']} "
                  f"layers={layers} heads={heads}/{config.get('num_key_value_heads', heads)} "
                  f"vocab={config['vocab_size']}")
        return 0
    path = write_random_checkpoint(args.out, args.config, dtype=args.dtype, seed=args.seed, device=args.device,
                                   max_shard_bytes=args.max_shard_bytes, std=args.std, num_layers=args.num_layers,
                                   quantize=args.quantize, desc_act=args.desc_act, group_size=args.group_size)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
