"""Qwen3 (dense): Llama's decoder with each attention head's q and k RMS-normed before rotary.

    q = rmsnorm_head(h @ w_q.T), k = rmsnorm_head(h @ w_k.T)   (one [head_dim] weight each, per layer)

``head_dim`` comes from config.json (128 for Qwen3-8B, not hidden / heads). The q/k-norm
attention (``layers.QKNormAttention``, built by ``qk_norm_attention``) is shared with
``qwen3_moe``; the rest is ``llama``'s.
"""
from __future__ import annotations

from typing import Any

import torch

from engine.models.config import Family, ModelConfigError, shared_fields
from engine.models.layers import Attention, QKNormAttention
from engine.models.llama import IGNORED_CHECKPOINT_NAMES, LlamaConfig, LlamaFamilyModel, window_fields
from engine.models.llama import checkpoint_shapes as llama_shapes

ARCHITECTURES = ("Qwen3ForCausalLM",)


def qwen_window_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_layers`` of a Qwen config: the window applies only with
    ``use_sliding_window`` (off in the released configs), on Qwen2's layers (``llama.window_fields``)."""
    return window_fields(raw, is_qwen=True)


def parse_config(raw: dict[str, Any]) -> LlamaConfig:
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={raw['hidden_act']!r} is not supported; only 'silu' is")
    return LlamaConfig(
        **{**shared_fields(raw), **qwen_window_fields(raw)},
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", False)),
    )


def qk_norm_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
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
