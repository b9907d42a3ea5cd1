"""Mixtral: Mistral's attention with a sparse MoE block in every layer (``moe``).

Router: softmax over ``num_local_experts``, top ``num_experts_per_tok``, always renormalised
to sum 1, kept in float32; experts ``block_sparse_moe.experts.<e>.w1|w3|w2`` (gate, up,
down) of size ``intermediate_size``; no shared expert, no dense layer. ``sliding_window`` (null in
Mixtral-8x7B) applies on every layer.
"""
from __future__ import annotations

from typing import Any

from engine.models.config import Family, every_layer_window, shared_fields, with_defaults
from engine.models.llama import IGNORED_CHECKPOINT_NAMES
from engine.models.moe import MIXTRAL_NAMES, MoEConfig, MoEFamilyModel, family_shapes, moe_fields

ARCHITECTURES = ("MixtralForCausalLM",)
# transformers' MixtralConfig defaults of the fields read here (``config.with_defaults``)
DEFAULTS = dict(num_key_value_heads=8, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, rope_theta=1e6,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, sliding_window=None)


def parse_config(raw: dict[str, Any]) -> MoEConfig:
    raw = with_defaults(raw, DEFAULTS)
    window = raw["sliding_window"]
    return MoEConfig(
        **{**shared_fields(raw),
           **every_layer_window(window, int(raw["num_hidden_layers"]))},
        **moe_fields(raw, "intermediate_size"),
        intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=True, round_router_weights=False,
    )


class MixtralModel(MoEFamilyModel):
    names = MIXTRAL_NAMES


FAMILY = Family(ARCHITECTURES, parse_config, MixtralModel, family_shapes(MIXTRAL_NAMES), IGNORED_CHECKPOINT_NAMES)
