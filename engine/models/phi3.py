"""Phi-3 (Phi-3-mini-4k / -128k): the Llama family's layer with fused checkpoint tensors and longrope.

The forward is the Llama family's (RMSNorm, rotary, GQA attention, SiLU-gated MLP); what
differs is the checkpoint and the rope:

- ``self_attn.qkv_proj`` = q | k | v rows and ``mlp.gate_up_proj`` = gate | up rows are one
  tensor each. A tensor-parallel rank reads its q heads, its k/v heads (or the one KV head its
  q heads share) and its part of gate and of up, each part sliced on its own
  (``parallel.read_fused``): an equal split of the fused rows would be wrong.
- ``longrope`` rope scaling (``su`` and ``yarn`` are read as longrope, as transformers' Phi3Config does;
  other types are refused, as it refuses them): short and long factors and the cos/sin factor
  (``config.parse_rope``, ``layers.Rotary``), with the top-level ``original_max_position_embeddings``
  (4096 when absent) over the rope dict's. ``partial_rotary_factor`` < 1 is refused there.
- GPTQ / AWQ / FP8 checkpoints fuse the packed tensors the same way: each part is cut from them along
  the output rows (``quantized.read_fused_linear``; 4-bit part boundaries on multiples of 8).
- Phi-3-mini-4k has ``sliding_window`` 2047, on every layer (as transformers' Phi-3 attention):
  the attention kernels apply it (``ScoreMods``); the context is the model's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.config import Family, ModelConfigError, every_layer_window, shared_fields, with_defaults
from engine.models.layers import Attention, GatedMLP, Linear, RowParallelLinear
from engine.models.llama import DecoderLayer, LlamaConfig, LlamaFamilyModel
from engine.models.parallel import FULL, Slice, read_fused
from engine.models.quantized import LinearWeight, read_fused_linear
from engine.worker.kv_cache import KV_SCALE_PATTERNS

ARCHITECTURES = ("Phi3ForCausalLM",)
IGNORED_CHECKPOINT_NAMES = (r"rotary_emb\.inv_freq$", *KV_SCALE_PATTERNS)   # KV scales: the worker reads them
# transformers' Phi3Config defaults of the fields read here (``config.with_defaults``)
DEFAULTS = dict(max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=32000, tie_word_embeddings=False, sliding_window=None)
ROPE_TYPE_ALIASES = {"su": "longrope", "yarn": "longrope"}     # older Phi-3 configs' names for longrope


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    pass


def _rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` / ``rope_parameters`` with the type's old names read as longrope; a config.json type
    other than default or longrope is refused (transformers' Phi3Config refuses it). The context-extending
    type of --rope-scaling (TGI's launcher) stays allowed."""
    fields = {}
    for key in ("rope_scaling", "rope_parameters"):
        rope = dict(raw.get(key) or {})
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if not rope.get("extends_context") and ROPE_TYPE_ALIASES.get(kind, kind) not in ("default", "longrope"):
            raise ModelConfigError(f"{key} type {kind!r} is not supported for Phi-3 (transformers' Phi3Config "
                                   f"accepts longrope, or its old names su and yarn): fix config.json")
        if kind in ROPE_TYPE_ALIASES:
            fields[key] = {**rope, "type": "longrope", "rope_type": "longrope"}
    return fields


def parse_config(raw: dict[str, Any]) -> Phi3Config:
    raw = with_defaults(raw, DEFAULTS)
    raw = {**raw, **_rope_fields(raw)}
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={raw['hidden_act']!r} is not supported for Phi-3; only 'silu' is")
    window, shared = raw["sliding_window"], shared_fields(raw)
    return Phi3Config(
        **{**shared, **every_layer_window(window, shared["num_layers"])},
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        qkv_bias=False,
    )


def checkpoint_shapes(c: Phi3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Phi-3 checkpoint must hold, with its full shape."""
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.qkv_proj.weight"] = (qkv_rows, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.num_heads * c.head_dim)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
    return shapes


class Phi3Model(LlamaFamilyModel):
    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return checkpoint_shapes(self.config)

    def weight_slices(self) -> dict[str, Slice]:
        """The unfused tensors' slices (the fused ones are read part by part in ``_read``)."""
        tp = self.tp
        by_suffix = {"o_proj": tp.row(), "down_proj": tp.row(), "embed_tokens": tp.column(), "lm_head": tp.column()}
        return {name: by_suffix.get(name.rsplit(".", 2)[-2], FULL) for name in self.checkpoint_shapes()}

    def fused_parts(self, name: str) -> tuple[list[int], list[Slice]] | None:
        """(rows of each part, this rank's slice of each part) of a fused tensor, else None."""
        c, tp = self.config, self.tp
        if name.endswith("self_attn.qkv_proj.weight"):
            kv_rows, kv = c.num_kv_heads * c.head_dim, tp.kv_column(c)
            return [c.num_heads * c.head_dim, kv_rows, kv_rows], [tp.column(), kv, kv]
        if name.endswith("mlp.gate_up_proj.weight"):
            return [c.intermediate_size] * 2, [tp.column()] * 2
        return None

    def _read(self, checkpoint, name: str, piece: Slice) -> LinearWeight:
        parts, q = self.fused_parts(name), self.config.quantization
        if parts is None:
            return super()._read(checkpoint, name, piece)
        if q is not None and q.quantizes(name):
            return read_fused_linear(checkpoint, name.removesuffix(".weight"), *parts, q, self.dtype, self.device)
        return read_fused(checkpoint, name, *parts, self.dtype, self.device)

    def _layer(self, t: dict[str, torch.Tensor], p: str) -> DecoderLayer:
        c, tp = self.config, self.tp
        attention = Attention(Linear(t.pop(p + "self_attn.qkv_proj.weight")),
                              RowParallelLinear(t.pop(p + "self_attn.o_proj.weight"), tp), self.num_heads,
                              self.num_kv_heads, c.head_dim, c.head_dim**-0.5, self._mods(p))
        mlp = GatedMLP(Linear(t.pop(p + "mlp.gate_up_proj.weight")),
                       RowParallelLinear(t.pop(p + "mlp.down_proj.weight"), tp))
        return DecoderLayer(t.pop(p + "input_layernorm.weight"), attention,
                            t.pop(p + "post_attention_layernorm.weight"), mlp)


FAMILY = Family(ARCHITECTURES, parse_config, Phi3Model, checkpoint_shapes, IGNORED_CHECKPOINT_NAMES)
