"""The Llama family (Llama 1/2/3/3.1, Mistral, Qwen2) over TokenAttention.

Per layer, with T new tokens of a ragged batch (``ForwardBatch``):

    residual += attn_out            (fused into add_rmsnorm)
    h   = rmsnorm(residual)                                   [T, hidden]
    qkv = h @ w_qkv.T (+ b_qkv)     q | k | v side by side    [T, q + 2 kv]
    rotary(q); rotary(k), v -> KV slots (one kernel); attention over req_to_token
    residual += h @ w_o.T; h = rmsnorm(residual)
    h = silu(h @ w_gate.T) * (h @ w_up.T) @ w_down.T          (gate|up fused)

The blocks come from ``engine.models.layers``; GEMMs are cuBLAS, or the skinny GEMM kernel
for small decode batches; both, and the norms, rotary + KV store, attention and activation,
come from ``KernelOps``. Llama, Mistral and Qwen2 differ only in what ``parse_config`` reads
(GQA, q/k/v and o biases, tied embeddings, rope variant, Mistral's and Qwen2's sliding window, and
transformers' defaults for the fields config.json omits: ``DEFAULTS``). Their linear
layers may be quantized (GPTQ / AWQ 4-bit, FP8: ``config.quantization``); embeddings and the LM head
stay in the model dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.config import Family, ModelConfig, ModelConfigError, shared_fields, with_defaults
from engine.models.config import sliding_layers as config_sliding_layers
from engine.models.layers import (Attention, GatedMLP, Linear, LMHead, RowParallelLinear, Rotary,
                                  VocabParallelEmbedding, head_weight, narrow_at_last_layer)
from engine.models.parallel import FULL, Slice, TensorParallel
from engine.models.quantized import LinearWeight, drop_zero_biases, read_weight
from engine.ops import KernelOps
from engine.worker.forward_batch import ForwardBatch
from engine.worker.kv_cache import KV_SCALE_PATTERNS, KVCache
from kernels.score_mods import ScoreMods
from weights.quant_formats import quantized_shapes

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Buffers some checkpoints carry that the model recomputes.
IGNORED_CHECKPOINT_NAMES = (r"rotary_emb\.inv_freq$", *KV_SCALE_PATTERNS)   # KV scales: the worker's


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False                    # biases on q, k and v
    o_bias: bool = False                      # a bias on o (whole on every shard, added once after the all-reduce)
    sliding_layers: tuple[bool, ...] = ()     # per layer: does ``sliding_window`` apply (empty: no window)

    def layer_window(self, index: int) -> int | None:
        return self.sliding_window if self.sliding_layers and self.sliding_layers[index] else None

    def sharded_sizes(self) -> dict[str, int]:
        return {**super().sharded_sizes(), "intermediate_size": self.intermediate_size}


# transformers' LlamaConfig / MistralConfig / Qwen2Config defaults of the fields read here (``config.with_defaults``)
DEFAULTS = {"LlamaForCausalLM": dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                     tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
            "MistralForCausalLM": dict(num_key_value_heads=8, max_position_embeddings=4096 * 32, bos_token_id=1,
                                       eos_token_id=2, tie_word_embeddings=False, sliding_window=4096),
            "Qwen2ForCausalLM": dict(max_position_embeddings=32768, tie_word_embeddings=False, use_sliding_window=False,
                                     sliding_window=4096, max_window_layers=28)}


def parse_config(raw: dict[str, Any]) -> LlamaConfig:
    """Llama: ``attention_bias`` puts a bias on q, k, v and o (``mlp_bias`` is refused), no sliding window
    (transformers' Llama attention reads none); Mistral: no biases (its attention ignores ``attention_bias``),
    a window on every layer; Qwen2: q, k and v biases, none on o, a window with ``use_sliding_window``."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={raw['hidden_act']!r} is not supported; only 'silu' is")
    architecture = raw["architectures"][0]
    raw = with_defaults(raw, DEFAULTS[architecture])
    is_llama = architecture == "LlamaForCausalLM"
    if is_llama and raw["mlp_bias"]:
        raise ModelConfigError(f"mlp_bias={raw['mlp_bias']!r} (biases on gate/up/down) is not supported for "
                               f"{architecture}: this engine serves Llama MLPs without biases; set it false or serve "
                               f"the model with transformers")
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = is_llama and bool(raw["attention_bias"])
    windows = {"sliding_window": None, "sliding_layers": ()} if is_llama else window_fields(raw, is_qwen2)
    return LlamaConfig(
        **{**shared_fields(raw), **windows},
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        qkv_bias=attention_bias or is_qwen2,
        o_bias=attention_bias,
    )


def window_fields(raw: dict[str, Any], is_qwen: bool) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_layers`` (Llama-family configs): Qwen's window applies only with
    ``use_sliding_window``; Mistral's whenever ``sliding_window`` is set (a null one is off)."""
    sliding = raw.get("sliding_window") if (not is_qwen or raw.get("use_sliding_window")) else None
    if not sliding:
        return {"sliding_window": None, "sliding_layers": ()}
    return {"sliding_window": int(sliding),
            "sliding_layers": _sliding_layers(raw, int(raw["num_hidden_layers"]), is_qwen)}


def _sliding_layers(raw: dict[str, Any], num_layers: int, is_qwen2: bool) -> tuple[bool, ...]:
    """Mistral slides on every layer (transformers ignores a Mistral config's layer_types); Qwen2 on its
    layer_types, else from ``max_window_layers`` on (transformers' rule)."""
    if not is_qwen2:
        return (True,) * num_layers
    first = int(raw["max_window_layers"])
    return config_sliding_layers(raw, num_layers, lambda i: i >= first)


def checkpoint_shapes(c: LlamaConfig, mlp_shapes=None) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this family must hold, with its full shape; ``mlp_shapes(c,
    layer, prefix)`` names a layer's MLP tensors (families with other MLPs pass theirs)."""
    mlp_shapes = mlp_shapes or dense_mlp_shapes
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (c.num_heads * c.head_dim, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.num_kv_heads * c.head_dim, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.num_kv_heads * c.head_dim, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.num_heads * c.head_dim)
        if c.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.num_heads * c.head_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (c.num_kv_heads * c.head_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (c.num_kv_heads * c.head_dim,)
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        shapes.update(mlp_shapes(c, i, p))
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
    return shapes


def dense_mlp_shapes(c: LlamaConfig, layer: int, p: str, prefix: str = "mlp.", inter: int | None = None):
    """The gated MLP's gate/up/down (``prefix`` and ``inter`` for other MLPs of the same form)."""
    inter = inter or c.intermediate_size
    h = c.hidden_size
    return {p + prefix + "gate_proj.weight": (inter, h), p + prefix + "up_proj.weight": (inter, h),
            p + prefix + "down_proj.weight": (h, inter)}


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor    # [hidden]
    attention: Attention
    post_norm: torch.Tensor     # [hidden]
    mlp: GatedMLP               # or any block called as mlp(ops, hidden) (e.g. moe.SparseMoE)


class LlamaFamilyModel:
    def __init__(self, config: LlamaConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device,
                 max_positions: int, tp: TensorParallel = TensorParallel()):
        tp.check(config)
        self.config = config
        self.ops = ops
        self.tp = tp
        self.num_heads = tp.heads(config)          # on this shard
        self.num_kv_heads = tp.kv_heads(config)
        self.dtype = dtype
        self.device = torch.device(device)
        self.rotary = Rotary(config, max_positions, dtype, self.device)
        self.embed_tokens: VocabParallelEmbedding | None = None
        self.lm_head: LMHead | None = None
        self.final_norm: torch.Tensor | None = None
        self.layers: list[DecoderLayer] = []

    # ---- weights -------------------------------------------------------------------

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return checkpoint_shapes(self.config)

    def weight_slices(self) -> dict[str, Slice]:
        """The part of each checkpoint tensor this shard holds."""
        tp, c = self.tp, self.config
        column, row, kv = tp.column(), tp.row(), tp.kv_column(c)
        by_suffix = {"q_proj": column, "k_proj": kv, "v_proj": kv, "o_proj": row, "gate_proj": column,
                     "up_proj": column, "down_proj": row, "embed_tokens": column, "lm_head": column}
        slices = {}
        for name in self.checkpoint_shapes():
            module = name.rsplit(".", 2)[-2]
            piece = by_suffix.get(module, FULL)
            # a row-parallel layer's bias is whole on every shard (``RowParallelLinear`` adds it once)
            slices[name] = FULL if piece is row and name.endswith(".bias") else piece
        return slices

    def load_weights(self, checkpoint) -> None:
        """Strictly check the checkpoint, then read this shard's slice of every tensor once."""
        q = self.config.quantization
        checkpoint.check(quantized_shapes(self.checkpoint_shapes(), q),
                         ignore_unexpected=IGNORED_CHECKPOINT_NAMES + (q.ignored_names if q else ()))
        drop_zero_biases(checkpoint, self.checkpoint_shapes(), q)
        tensors = {}
        slices = self.weight_slices()
        for name in checkpoint.progress(list(slices), desc=f"Loading weights (shard {self.tp.rank})"):
            tensors[name] = self._read(checkpoint, name, slices[name])
        self._assemble(tensors)

    def _read(self, checkpoint, name: str, piece: Slice) -> LinearWeight:
        """This shard's ``piece`` of one tensor (a family with fused checkpoint tensors reads their parts);
        the weight of a quantized linear layer comes from its quantized tensors (``engine.models.quantized``)."""
        return read_weight(checkpoint, name, piece, self.config.quantization, self.dtype, self.device)

    def _assemble(self, t: dict[str, torch.Tensor]) -> None:
        c, tp = self.config, self.tp
        embed = t.pop("model.embed_tokens.weight")
        self.embed_tokens = VocabParallelEmbedding(embed, tp.vocab_start(c), tp)
        self.lm_head = LMHead(head_weight(t, embed, c), tp)
        self.final_norm = t.pop("model.norm.weight")
        self.layers = [self._layer(t, f"model.layers.{i}.") for i in range(c.num_layers)]

    def _layer(self, t: dict[str, torch.Tensor], p: str) -> DecoderLayer:
        attention, mlp = self._attention(t, p), self._mlp(t, p)
        return DecoderLayer(t.pop(p + "input_layernorm.weight"), attention,
                            t.pop(p + "post_attention_layernorm.weight"), mlp)

    def _attention(self, t: dict[str, torch.Tensor], p: str) -> Attention:
        c, tp = self.config, self.tp
        qkv = Linear.fused([t.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"],
                           [t.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"] if c.qkv_bias else None)
        o = RowParallelLinear(t.pop(p + "self_attn.o_proj.weight"), tp,
                              t.pop(p + "self_attn.o_proj.bias") if c.o_bias else None)
        return Attention(qkv, o, self.num_heads,
                         self.num_kv_heads, c.head_dim, c.head_dim**-0.5, self._mods(p))

    def _mods(self, p: str) -> ScoreMods | None:
        """The layer's score mods: its sliding window, if it slides."""
        window = self.config.layer_window(int(p.split(".")[2]))
        return ScoreMods(window=window) if window else None

    def _mlp(self, t: dict[str, torch.Tensor], p: str, prefix: str = "mlp."):
        """The gated MLP under ``p + prefix`` (families with other MLPs override this)."""
        gate_up = Linear.fused([t.pop(p + prefix + "gate_proj.weight"), t.pop(p + prefix + "up_proj.weight")])
        return GatedMLP(gate_up, RowParallelLinear(t.pop(p + prefix + "down_proj.weight"), self.tp))

    # ---- forward -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of every new token."""
        ops, eps = self.ops, self.config.rms_norm_eps
        rotary = self.rotary(batch)
        residual = self.embed_tokens(batch.input_ids)
        hidden = ops.rmsnorm(residual, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            output, residual = narrow_at_last_layer(batch, index, len(self.layers), residual)
            attn = layer.attention(ops, hidden, batch, kv_cache.layer(index), kv_cache.req_to_token, rotary, output)
            hidden = ops.add_rmsnorm(attn, residual, layer.post_norm, eps)
            mlp = layer.mlp(ops, hidden)
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            hidden = ops.add_rmsnorm(mlp, residual, next_norm, eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32 logits (the GEMM in the model dtype, as transformers does)."""
        return self.lm_head(self.ops, hidden)


FAMILY = Family(ARCHITECTURES, parse_config, LlamaFamilyModel, checkpoint_shapes, IGNORED_CHECKPOINT_NAMES)
