"""Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (q/k/v biases) with a sparse MoE block (``moe``).

Router: softmax over ``num_experts``, top ``num_experts_per_tok``, renormalised only when
``norm_topk_prob``, the weights rounded to the model dtype; experts ``mlp.experts.<e>.
gate_proj|up_proj|down_proj`` of size ``moe_intermediate_size``; a shared expert
(``mlp.shared_expert``, ``shared_expert_intermediate_size``) every token takes, scaled by
``sigmoid(mlp.shared_expert_gate(h))``. Layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` have a dense MLP of ``intermediate_size``. The sliding window (with
``use_sliding_window``) applies on the layers ``layer_types`` marks, else on the even layers below
``max_window_layers`` (transformers' Qwen2MoeConfig; not dense Qwen2's rule).
"""
from __future__ import annotations

from typing import Any

from engine.models.config import Family, layer_windows, shared_fields, sliding_layers, with_defaults
from engine.models.llama import IGNORED_CHECKPOINT_NAMES
from engine.models.moe import QWEN_NAMES, MoEConfig, MoEFamilyModel, family_shapes, moe_fields, qwen_dense_layers

ARCHITECTURES = ("Qwen2MoeForCausalLM",)
# transformers' Qwen2MoeConfig defaults of the fields read here (``config.with_defaults``)
DEFAULTS = dict(num_key_value_heads=16, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                use_sliding_window=False, sliding_window=4096, max_window_layers=28, qkv_bias=True,
                norm_topk_prob=False, decoder_sparse_step=1)


def window_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` (0 without ``use_sliding_window``, as transformers sets it) on the layers
    ``layer_types`` marks, else with ``use_sliding_window`` on the even layers below ``max_window_layers``."""
    use, last = bool(raw["use_sliding_window"]), int(raw["max_window_layers"])
    window = raw["sliding_window"] if use else 0
    sliding = sliding_layers(raw, int(raw["num_hidden_layers"]), lambda i: use and i % 2 == 0 and i < last)
    return layer_windows(window, sliding, f"use_sliding_window={use}")


def parse_config(raw: dict[str, Any]) -> MoEConfig:
    raw = with_defaults(raw, DEFAULTS)
    return MoEConfig(
        **{**shared_fields(raw), **window_fields(raw)},
        **moe_fields(raw, "moe_intermediate_size"),
        intermediate_size=int(raw["intermediate_size"]),
        qkv_bias=bool(raw["qkv_bias"]),
        norm_topk_prob=bool(raw["norm_topk_prob"]), round_router_weights=True,
        shared_expert_intermediate_size=int(raw["shared_expert_intermediate_size"]),
        dense_layers=qwen_dense_layers(raw),
    )


class Qwen2MoeModel(MoEFamilyModel):
    names = QWEN_NAMES


FAMILY = Family(ARCHITECTURES, parse_config, Qwen2MoeModel, family_shapes(QWEN_NAMES), IGNORED_CHECKPOINT_NAMES)
