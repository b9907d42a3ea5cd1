"""The Gemma family (Gemma, Gemma 2) over TokenAttention.

What differs from Llama (``engine.models.llama``, whose weight names, slices and loading it
reuses), as transformers' ``modeling_gemma`` / ``modeling_gemma2`` define it:
- RMSNorm multiplies by ``1 + weight``: the 1 is added at load, so the shared rmsnorm kernel
  runs unchanged (exact in float32; in bf16 the sum is rounded to the dtype once at load);
- the embedding is scaled by sqrt(hidden) rounded to the model dtype (transformers' normalizer);
- the MLP is gated GeLU with the tanh approximation; head_dim comes from the config (256 when absent);
- the output projection is the embedding (tied), or ``lm_head`` when ``tie_word_embeddings`` is false.
Refused: ``attention_bias`` and ``use_bidirectional_attention`` (no released Gemma sets them).
Gemma 2 adds, per layer (transformers' ``Gemma2DecoderLayer``):

    h = residual + post_attn_norm(attention(input_norm(residual)))
    residual = h + post_ff_norm(mlp(pre_ff_norm(h)))

with attention scores soft-capped (``attn_logit_softcapping``), scaled by
``query_pre_attn_scalar ** -0.5``, a sliding window on the layers ``layer_types`` marks
``sliding_attention`` (without it: the even layers 0, 2, ..., transformers' default), and the
final logits soft-capped (``final_logit_softcapping``). A field config.json omits takes transformers'
default (``DEFAULTS``: soft-caps 50 and 30, scalar 256, window 4096); a null one is off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.config import Family, ModelConfigError, layer_windows, shared_fields, sliding_layers, with_defaults
from engine.models.layers import Attention, GatedMLP, Linear, RowParallelLinear, narrow_at_last_layer
from engine.models.llama import IGNORED_CHECKPOINT_NAMES, LlamaConfig, LlamaFamilyModel
from engine.models.llama import checkpoint_shapes as llama_checkpoint_shapes
from engine.models.parallel import TensorParallel
from engine.ops import KernelOps
from engine.worker.forward_batch import ForwardBatch
from engine.worker.kv_cache import KVCache
from kernels.score_mods import ScoreMods

ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM")
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh")
# transformers' GemmaConfig / Gemma2Config defaults of the fields read here (``config.with_defaults``)
_SHARED_DEFAULTS = dict(head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1,
                        tie_word_embeddings=True, attention_bias=False, use_bidirectional_attention=None)
DEFAULTS = {"GemmaForCausalLM": dict(_SHARED_DEFAULTS, num_key_value_heads=16, hidden_act="gelu_pytorch_tanh"),
            "Gemma2ForCausalLM": dict(_SHARED_DEFAULTS, num_key_value_heads=4, hidden_activation="gelu_pytorch_tanh",
                                      query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                                      final_logit_softcapping=30.0)}


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    gemma2: bool = False
    query_pre_attn_scalar: float | None = None      # Gemma 2's sm_scale is its -1/2 power
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def _check(raw: dict[str, Any], gemma2: bool) -> None:
    """Gemma's MLP is GeLU-tanh: Gemma 1 reads ``hidden_act`` (its configs say "gelu", which transformers maps
    to the tanh one), Gemma 2 ``hidden_activation``. Attention biases and bidirectional attention are refused."""
    key = "hidden_activation" if gemma2 else "hidden_act"
    allowed = GELU_TANH_NAMES if gemma2 else (*GELU_TANH_NAMES, "gelu")
    if raw[key] not in allowed:
        raise ModelConfigError(f"{key}={raw[key]!r} is not supported for {raw['architectures'][0]}; "
                               f"supported: {', '.join(allowed)}")
    for name, what in (("attention_bias", "biases on q/k/v/o"),
                       ("use_bidirectional_attention", "non-causal attention")):
        if raw[name]:
            raise ModelConfigError(f"{name}={raw[name]!r} ({what}) is not supported for {raw['architectures'][0]}: "
                                   f"this engine serves causal Gemma without attention biases; set it false or "
                                   f"serve the model with transformers")


def parse_config(raw: dict[str, Any]) -> GemmaConfig:
    gemma2 = raw["architectures"][0] == "Gemma2ForCausalLM"
    raw = with_defaults(raw, DEFAULTS[raw["architectures"][0]])
    _check(raw, gemma2)
    shared = shared_fields(raw)
    optional = lambda name: float(raw[name]) if gemma2 and raw[name] else None  # noqa: E731
    windows = {}
    if gemma2:
        sliding = sliding_layers(raw, shared["num_layers"], lambda i: i % 2 == 0)
        windows = layer_windows(raw["sliding_window"], sliding, "sliding_window")
    return GemmaConfig(
        **{**shared, "sliding_window": None, **windows},
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        gemma2=gemma2,
        query_pre_attn_scalar=optional("query_pre_attn_scalar"),
        attn_logit_softcapping=optional("attn_logit_softcapping"),
        final_logit_softcapping=optional("final_logit_softcapping"),
    )


def checkpoint_shapes(c: GemmaConfig) -> dict[str, tuple[int, ...]]:
    shapes = llama_checkpoint_shapes(c)
    if c.gemma2:
        for i in range(c.num_layers):
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                shapes[f"model.layers.{i}.{norm}.weight"] = (c.hidden_size,)
    return shapes


@dataclass
class GemmaLayer:
    input_norm: torch.Tensor            # every norm weight here is 1 + the checkpoint's
    attention: Attention
    post_attn_norm: torch.Tensor        # Gemma 1: the pre-MLP norm; Gemma 2: after attention
    mlp: GatedMLP
    pre_ff_norm: torch.Tensor | None    # Gemma 2 only
    post_ff_norm: torch.Tensor | None


class GemmaFamilyModel(LlamaFamilyModel):
    """Llama's weight reading and slicing; Gemma's norms, embedding scale, MLP, attention mods and layer order."""

    def __init__(self, config: GemmaConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device,
                 max_positions: int, tp: TensorParallel = TensorParallel()):
        super().__init__(config, ops, dtype, device, max_positions, tp)
        # transformers multiplies by sqrt(hidden) as a tensor of the model dtype
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=dtype))

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return checkpoint_shapes(self.config)

    def _assemble(self, t: dict[str, torch.Tensor]) -> None:
        super()._assemble(t)
        self.final_norm = self.final_norm + 1

    def _layer(self, t: dict[str, torch.Tensor], p: str) -> GemmaLayer:
        c, tp = self.config, self.tp
        mods = ScoreMods(window=c.layer_window(int(p.split(".")[2])), softcap=c.attn_logit_softcapping)
        qkv = Linear.fused([t.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        attention = Attention(qkv, RowParallelLinear(t.pop(p + "self_attn.o_proj.weight"), tp), self.num_heads,
                              self.num_kv_heads, c.head_dim, c.sm_scale, mods if mods.any else None)
        gate_up = Linear.fused([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")])
        mlp = GatedMLP(gate_up, RowParallelLinear(t.pop(p + "mlp.down_proj.weight"), tp), "gelu_tanh")
        norm = lambda name: t.pop(p + name + ".weight") + 1  # noqa: E731
        return GemmaLayer(norm("input_layernorm"), attention, norm("post_attention_layernorm"), mlp,
                          norm("pre_feedforward_layernorm") if c.gemma2 else None,
                          norm("post_feedforward_layernorm") if c.gemma2 else None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of every new token (residual adds fused into the norms)."""
        ops, eps = self.ops, self.config.rms_norm_eps
        rotary = self.rotary(batch)
        residual = self.embed_tokens(batch.input_ids) * self.embed_scale
        hidden = ops.rmsnorm(residual, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            output, residual = narrow_at_last_layer(batch, index, len(self.layers), residual)
            attn = layer.attention(ops, hidden, batch, kv_cache.layer(index), kv_cache.req_to_token, rotary, output)
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            if self.config.gemma2:
                hidden = ops.add_rmsnorm(ops.rmsnorm(attn, layer.post_attn_norm, eps), residual, layer.pre_ff_norm,
                                         eps)
                mlp = ops.rmsnorm(layer.mlp(ops, hidden), layer.post_ff_norm, eps)
            else:
                hidden = ops.add_rmsnorm(attn, residual, layer.post_attn_norm, eps)
                mlp = layer.mlp(ops, hidden)
            hidden = ops.add_rmsnorm(mlp, residual, next_norm, eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32 logits, soft-capped for Gemma 2 (``cap * tanh(logits / cap)``)."""
        logits = self.lm_head(self.ops, hidden)
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


FAMILY = Family(ARCHITECTURES, parse_config, GemmaFamilyModel, checkpoint_shapes, IGNORED_CHECKPOINT_NAMES)
