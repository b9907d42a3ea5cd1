"""Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (q/k/v biases) with a sparse MoE block (``moe``).

Router: softmax over ``num_experts``, top ``num_experts_per_tok``, renormalised only when
``norm_topk_prob``, the weights rounded to the model dtype; experts ``mlp.experts.<e>.
gate_proj|up_proj|down_proj`` of size ``moe_intermediate_size``; a shared expert
(``mlp.shared_expert``, ``shared_expert_intermediate_size``) every token takes, scaled by
``sigmoid(mlp.shared_expert_gate(h))``. Layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` have a dense MLP of ``intermediate_size``.
"""
from __future__ import annotations

from typing import Any

from engine.models.config import Family, shared_fields
from engine.models.llama import IGNORED_CHECKPOINT_NAMES
from engine.models.moe import QWEN_NAMES, MoEConfig, MoEFamilyModel, family_shapes, moe_fields, qwen_dense_layers
from engine.models.qwen3 import qwen_window_fields

ARCHITECTURES = ("Qwen2MoeForCausalLM",)


def parse_config(raw: dict[str, Any]) -> MoEConfig:
    return MoEConfig(
        **{**shared_fields(raw), **qwen_window_fields(raw)},
        **moe_fields(raw, "moe_intermediate_size"),
        intermediate_size=int(raw["intermediate_size"]),
        qkv_bias=bool(raw.get("qkv_bias", True)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)), round_router_weights=True,
        shared_expert_intermediate_size=int(raw["shared_expert_intermediate_size"]),
        dense_layers=qwen_dense_layers(raw),
    )


class Qwen2MoeModel(MoEFamilyModel):
    names = QWEN_NAMES


FAMILY = Family(ARCHITECTURES, parse_config, Qwen2MoeModel, family_shapes(QWEN_NAMES), IGNORED_CHECKPOINT_NAMES)
