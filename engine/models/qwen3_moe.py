"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, ``qwen3``) with a sparse MoE block (``moe``).

Router: softmax over ``num_experts``, top ``num_experts_per_tok``, renormalised when
``norm_topk_prob`` (true in Qwen3-30B-A3B), the weights rounded to the model dtype; experts
``mlp.experts.<e>.gate_proj|up_proj|down_proj`` of size ``moe_intermediate_size``; no shared
expert; ``mlp_only_layers`` / ``decoder_sparse_step`` layers are dense.
"""
from __future__ import annotations

from typing import Any

from engine.models.config import Family, shared_fields
from engine.models.llama import IGNORED_CHECKPOINT_NAMES
from engine.models.moe import QWEN_NAMES, MoEConfig, MoEFamilyModel, family_shapes, moe_fields, qwen_dense_layers
from engine.models.qwen3 import qwen_window_fields

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def parse_config(raw: dict[str, Any]) -> MoEConfig:
    return MoEConfig(
        **{**shared_fields(raw), **qwen_window_fields(raw)},
        **moe_fields(raw, "moe_intermediate_size"),
        intermediate_size=int(raw["intermediate_size"]),
        qkv_bias=bool(raw.get("attention_bias", False)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)), round_router_weights=True,
        dense_layers=qwen_dense_layers(raw), qk_norm=True,
    )


class Qwen3MoeModel(MoEFamilyModel):
    names = QWEN_NAMES


FAMILY = Family(ARCHITECTURES, parse_config, Qwen3MoeModel, family_shapes(QWEN_NAMES), IGNORED_CHECKPOINT_NAMES)
