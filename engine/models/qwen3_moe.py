"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, ``qwen3``) with a sparse MoE block (``moe``).

Router: softmax over ``num_experts``, top ``num_experts_per_tok``, renormalised when
``norm_topk_prob`` (true in Qwen3-30B-A3B), the weights rounded to the model dtype; experts
``mlp.experts.<e>.gate_proj|up_proj|down_proj`` of size ``moe_intermediate_size``; no shared
expert; ``mlp_only_layers`` / ``decoder_sparse_step`` layers are dense. Unlike dense Qwen3, the
sliding window (with ``use_sliding_window``) applies on every layer: transformers' Qwen3-MoE
attention reads ``sliding_window`` alone (no ``layer_types``, no ``max_window_layers``).
"""
from __future__ import annotations

from typing import Any

from engine.models.config import Family, every_layer_window, shared_fields, with_defaults
from engine.models.llama import IGNORED_CHECKPOINT_NAMES
from engine.models.moe import QWEN_NAMES, MoEConfig, MoEFamilyModel, family_shapes, moe_fields, qwen_dense_layers

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
# transformers' Qwen3MoeConfig defaults of the fields read here (``config.with_defaults``)
DEFAULTS = dict(num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                attention_bias=False, use_sliding_window=False, sliding_window=4096, norm_topk_prob=False,
                decoder_sparse_step=1)


def window_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """With ``use_sliding_window``, ``sliding_window`` (null: none) on every layer."""
    window = raw["sliding_window"] if raw["use_sliding_window"] else None
    return every_layer_window(window, int(raw["num_hidden_layers"]))


def parse_config(raw: dict[str, Any]) -> MoEConfig:
    raw = with_defaults(raw, DEFAULTS)
    return MoEConfig(
        **{**shared_fields(raw), **window_fields(raw)},
        **moe_fields(raw, "moe_intermediate_size"),
        intermediate_size=int(raw["intermediate_size"]),
        qkv_bias=bool(raw["attention_bias"]), o_bias=bool(raw["attention_bias"]),
        norm_topk_prob=bool(raw["norm_topk_prob"]), round_router_weights=True,
        dense_layers=qwen_dense_layers(raw), qk_norm=True,
    )


class Qwen3MoeModel(MoEFamilyModel):
    names = QWEN_NAMES


FAMILY = Family(ARCHITECTURES, parse_config, Qwen3MoeModel, family_shapes(QWEN_NAMES), IGNORED_CHECKPOINT_NAMES)
