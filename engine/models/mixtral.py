"""Mixtral: Mistral's attention with a sparse MoE block in every layer (``moe``).

Router: softmax over ``num_local_experts``, top ``num_experts_per_tok``, always renormalised
to sum 1, kept in float32; experts ``block_sparse_moe.experts.<e>.w1|w3|w2`` (gate, up,
down) of size ``intermediate_size``; no shared expert, no dense layer.
"""
from __future__ import annotations

from typing import Any

from engine.models.config import Family, shared_fields
from engine.models.llama import IGNORED_CHECKPOINT_NAMES, window_fields
from engine.models.moe import MIXTRAL_NAMES, MoEConfig, MoEFamilyModel, family_shapes, moe_fields

ARCHITECTURES = ("MixtralForCausalLM",)


def parse_config(raw: dict[str, Any]) -> MoEConfig:
    return MoEConfig(
        **{**shared_fields(raw), **window_fields(raw, is_qwen=False)},
        **moe_fields(raw, "intermediate_size"),
        intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=True, round_router_weights=False,
    )


class MixtralModel(MoEFamilyModel):
    names = MIXTRAL_NAMES


FAMILY = Family(ARCHITECTURES, parse_config, MixtralModel, family_shapes(MIXTRAL_NAMES), IGNORED_CHECKPOINT_NAMES)
