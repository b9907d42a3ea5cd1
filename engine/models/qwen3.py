"""Qwen3 (dense): Llama's decoder with each attention head's q and k RMS-normed before rotary.

    q = rmsnorm_head(h @ w_q.T), k = rmsnorm_head(h @ w_k.T)   (one [head_dim] weight each, per layer)

``head_dim`` comes from config.json (128 for Qwen3-8B, not hidden / heads; 128 when absent, as
transformers' default). ``attention_bias`` puts a bias on q, k, v and o. The q/k-norm attention
(``layers.QKNormAttention``, built by ``qk_norm_attention``) is shared with ``qwen3_moe``; the rest
is ``llama``'s.
"""
from __future__ import annotations

from typing import Any

import torch

from engine.models.config import Family, ModelConfigError, layer_windows, shared_fields, sliding_layers, with_defaults
from engine.models.layers import Attention, QKNormAttention
from engine.models.llama import IGNORED_CHECKPOINT_NAMES, LlamaConfig, LlamaFamilyModel
from engine.models.llama import checkpoint_shapes as llama_shapes

ARCHITECTURES = ("Qwen3ForCausalLM",)
# transformers' Qwen3Config defaults of the fields read here (``config.with_defaults``)
DEFAULTS = dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, sliding_window=4096,
                max_window_layers=28)


def qwen3_window_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_layers`` as transformers' Qwen3Config: the window only with
    ``use_sliding_window`` (off in the released configs), on the layers ``layer_types`` marks, else on
    the layers from ``max_window_layers`` on."""
    window = raw["sliding_window"] if raw["use_sliding_window"] else None
    first = int(raw["max_window_layers"])
    sliding = sliding_layers(raw, int(raw["num_hidden_layers"]), lambda i: window is not None and i >= first)
    return layer_windows(window, sliding, f"use_sliding_window={raw['use_sliding_window']}")


def parse_config(raw: dict[str, Any]) -> LlamaConfig:
    raw = with_defaults(raw, DEFAULTS)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={raw['hidden_act']!r} is not supported; only 'silu' is")
    return LlamaConfig(
        **{**shared_fields(raw), **qwen3_window_fields(raw)},
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        qkv_bias=bool(raw["attention_bias"]),
        o_bias=bool(raw["attention_bias"]),
    )


def qk_norm_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """What Qwen3's attention adds to Llama's: the q/k norms (o_proj's bias is Llama's ``o_bias``)."""
    return {f"model.layers.{i}.self_attn.{n}_norm.weight": (c.head_dim,) for i in range(c.num_layers) for n in "qk"}


def checkpoint_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    return {**llama_shapes(c), **qk_norm_shapes(c)}


def qk_norm_attention(attention: Attention, t: dict[str, torch.Tensor], p: str, eps: float) -> QKNormAttention:
    """Llama's attention block of layer ``p`` with the q/k norms ``self_attn.{q,k}_norm`` (replicated)."""
    return QKNormAttention(attention.qkv, attention.o, attention.num_heads, attention.num_kv_heads,
                           attention.head_dim, attention.sm_scale, mods=attention.mods,
                           q_norm=t.pop(p + "self_attn.q_norm.weight"), k_norm=t.pop(p + "self_attn.k_norm.weight"),
                           eps=eps)


class Qwen3Model(LlamaFamilyModel):
    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return checkpoint_shapes(self.config)

    def _attention(self, t: dict[str, torch.Tensor], p: str) -> QKNormAttention:
        return qk_norm_attention(super()._attention(t, p), t, p, self.config.rms_norm_eps)


FAMILY = Family(ARCHITECTURES, parse_config, Qwen3Model, checkpoint_shapes, IGNORED_CHECKPOINT_NAMES)
