"""Phi-3 (Phi-3-mini-4k / -128k): the Llama family's layer with fused checkpoint tensors and longrope.

The forward is the Llama family's (RMSNorm, rotary, GQA attention, SiLU-gated MLP); what
differs is the checkpoint and the rope:

- ``self_attn.qkv_proj`` = q | k | v rows and ``mlp.gate_up_proj`` = gate | up rows are one
  tensor each. A tensor-parallel rank reads its q heads, its k/v heads (or the one KV head its
  q heads share) and its part of gate and of up, each part sliced on its own
  (``parallel.read_fused``): an equal split of the fused rows would be wrong.
- ``longrope`` (older name ``su``) rope scaling: short and long factors and the cos/sin factor
  (``config.parse_rope``, ``layers.Rotary``). ``partial_rotary_factor`` < 1 is refused there.
- GPTQ / AWQ / FP8 checkpoints fuse the packed tensors the same way: each part is cut from them along
  the output rows (``quantized.read_fused_linear``; 4-bit part boundaries on multiples of 8).
- Phi-3-mini-4k has ``sliding_window`` 2047, on every layer (as transformers' Phi-3 attention):
  the attention kernels apply it (``ScoreMods``); the context is the model's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.config import Family, ModelConfigError, shared_fields
from engine.models.layers import Attention, GatedMLP, Linear, RowParallelLinear
from engine.models.llama import DecoderLayer, LlamaConfig, LlamaFamilyModel
from engine.models.parallel import FULL, Slice, read_fused
from engine.models.quantized import LinearWeight, read_fused_linear
from engine.worker.kv_cache import KV_SCALE_PATTERNS

ARCHITECTURES = ("Phi3ForCausalLM",)
IGNORED_CHECKPOINT_NAMES = (r"rotary_emb\.inv_freq$", *KV_SCALE_PATTERNS)   # KV scales: the worker reads them


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    pass


def parse_config(raw: dict[str, Any]) -> Phi3Config:
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={raw['hidden_act']!r} is not supported for Phi-3; only 'silu' is")
    sliding = raw.get("sliding_window")
    shared = shared_fields(raw)
    return Phi3Config(
        **{**shared, "sliding_window": int(sliding) if sliding else None},
        sliding_layers=(True,) * shared["num_layers"] if sliding else (),
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
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
