"""The tensor-parallel building blocks every model family composes.

Each block holds plain tensors (this shard's slice; no autograd, nothing created during
forward, so the decode CUDA graphs capture it) and runs its kernels through the
``KernelOps`` it is called with. Which slice of a checkpoint tensor a block holds comes
from ``TensorParallel`` (column: output rows split; row: input columns split, then one
all-reduce; vocab: rows split by token id):

| block | holds | forward |
| --- | --- | --- |
| ``Linear`` | column-parallel or replicated weight (parts fused, e.g. q|k|v); dense, 4-bit or FP8 | ``x @ w.T + b`` |
| ``RowParallelLinear`` | the input-column slice (+ the whole bias) | ``all_reduce(x @ w.T) (+ b)`` |
| ``VocabParallelEmbedding`` | this shard's token rows | rows of the ids it holds, all-reduced |
| ``LMHead`` | this shard's vocabulary rows | float32 logits, columns gathered |
| ``GatedMLP`` | gate|up fused, down | ``down(act(gate) * up)`` (SiLU or GeLU-tanh) |
| ``GeluMLP`` | up (c_fc), down (c_proj), biased | ``down(gelu(up))`` |
| ``LayerNorm`` | weight, bias, eps (replicated) | LayerNorm, or the residual add + LayerNorm |
| ``LayerNormDecoderLayer`` | LayerNorms, attention, GeLU MLP | ``run_layernorm_layers``: StarCoder2, Bloom |
| ``Rotary`` | the cos/sin table | the table and positions the rotary kernel reads |
| ``Attention`` | qkv (fused), o, score mods | rotary + KV store, prefill or decode attention over the cache (with the layer's sliding window / soft-cap / ALiBi), o |
| ``QKNormAttention`` | as ``Attention``, + q/k norms | per-head RMSNorm of q and k before rotary (Qwen3) |
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.models.config import ModelConfig
from engine.models.parallel import TensorParallel
from engine.models.quantized import LinearWeight, fuse
from engine.models.rope import (build_cos_sin_cache, build_longrope_cache, cos_sin_rows, dynamic_inv_freq,
                                plain_rope_length)
from kernels.score_mods import ScoreMods

log = logging.getLogger(__name__)


@dataclass
class Linear:
    """y = x @ weight.T (+ bias); ``fused`` joins parts (e.g. q, k, v) along the output rows. The weight is
    a tensor or a quantized one (``engine.models.quantized``: 4-bit GPTQ/AWQ, FP8); ``ops.linear`` dispatches."""
    weight: LinearWeight
    bias: torch.Tensor | None = None
    GEMM_FIELDS = ("weight",)     # what ``ops.linear`` multiplies by (``gemm_weights``)

    @classmethod
    def fused(cls, weights: list[LinearWeight], biases: list[torch.Tensor] | None = None) -> "Linear":
        return cls(fuse(weights), torch.cat(biases, dim=0) if biases else None)

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


@dataclass
class RowParallelLinear:
    """This shard's input columns; the partial products are summed over the shards, then the
    (whole, replicated) bias is added once."""
    weight: LinearWeight
    tp: TensorParallel
    bias: torch.Tensor | None = None
    GEMM_FIELDS = ("weight",)

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return ops.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(ops.linear(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)


@dataclass
class VocabParallelEmbedding:
    """Rows ``vocab_start .. vocab_start + len(weight)`` of the embedding on this shard."""
    weight: torch.Tensor
    vocab_start: int
    tp: TensorParallel

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.weight[input_ids]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = self.weight[local.masked_fill(outside, 0)]
        hidden.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(hidden)


@dataclass
class LMHead:
    """This shard's vocabulary rows of the output projection (maybe the embedding's, tied)."""
    weight: torch.Tensor
    tp: TensorParallel
    GEMM_FIELDS = ("weight",)

    def __call__(self, ops, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32 logits (the GEMM in the model dtype, as transformers does)."""
        return self.tp.gather_columns(ops.linear(hidden, self.weight)).float()


def head_weight(t: dict[str, torch.Tensor], embed: torch.Tensor, config) -> torch.Tensor:
    """The LM head's weight (``lm_head.weight`` taken from ``t``), or the embedding when tied. Where config.json
    ties them but the checkpoint stores both (``head_stored_though_tied``), the embedding serves when the two
    are equal and the stored head when they differ, as transformers 5 unties them then (with a warning)."""
    if config.tie_word_embeddings:
        return embed
    head = t.pop("lm_head.weight")
    if not config.head_stored_though_tied:
        return head
    if torch.equal(head, embed):
        return embed
    log.warning("config.json ties the LM head to the embedding (tie_word_embeddings), but the checkpoint's "
                "lm_head.weight differs from it: serving lm_head.weight, as transformers does; set "
                "tie_word_embeddings to false in config.json to silence this")
    return head


@dataclass
class GatedMLP:
    gate_up: Linear               # [2 * intermediate / shards, hidden]: gate rows, then up rows
    down: RowParallelLinear
    activation: str = "silu"      # of the gate: "silu" (Llama) or "gelu_tanh" (Gemma)

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        return self.down(ops, ops.act_and_mul(self.gate_up(ops, x), self.activation))


@dataclass
class GeluMLP:
    """The non-gated MLP (StarCoder2, Bloom): ``down(gelu(up(x)))``, up column- and down row-parallel."""
    up: Linear                    # [intermediate / shards, hidden] (+ bias)
    down: RowParallelLinear
    approximate: str              # torch's GeLU form: "tanh" or "none"

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        return self.down(ops, ops.gelu(self.up(ops, x), self.approximate))


@dataclass
class LayerNorm:
    """LayerNorm with weight and bias (replicated on every shard)."""
    weight: torch.Tensor          # [hidden]
    bias: torch.Tensor            # [hidden]
    eps: float

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        return ops.layernorm(x, self.weight, self.bias, self.eps)

    def add(self, ops, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` in place; returns the norm of the new residual."""
        return ops.add_layernorm(x, residual, self.weight, self.bias, self.eps)


class Rotary:
    """The cos/sin rows the rotary kernel reads for a batch's new tokens.

    Every rope type but ``dynamic`` and ``longrope`` reads one precomputed table by position (``yarn``'s
    rows carry its attention factor). Those
    two rotate a token by the length of the forward pass that computes it in transformers' ``generate``
    (``rope.plain_rope_length``): a token at position p of a request whose prompt has n tokens takes the
    rotation of L = max(n, p + 1) tokens. A prompt's tokens all take its whole length's, in one step or
    in chunks; a decoded (or drafted) token at p that of p + 1 tokens; keys already cached keep theirs.
    The batch gives L per token (``ForwardBatch.token_seq_len``) where a row holds prompt tokens; without
    it, every row is a decode or verify row and L = p + 1.

    ``dynamic`` (NTK) uses the plain base while L is within the trained context, else the NTK base of L.
    ``longrope`` (Phi-3) reads one of two fixed tables: the long-factor one when L is longer than
    ``original_max_position_embeddings``, else the short-factor one; both carry the attention factor.
    """

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device):
        self.config, self.dtype = config, dtype
        self.longrope = config.rope.rope_type == "longrope"
        self.max_positions = max_positions
        self.table = (build_longrope_cache(config, max_positions, dtype, device) if self.longrope
                      else build_cos_sin_cache(config, max_positions, dtype, device))
        self.dynamic = config.rope.rope_type == "dynamic"
        self.plain_length = plain_rope_length(config)

    def __call__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, index of each new token's row in it)."""
        if self.plain_length is None:
            return self.table, batch.positions
        seq_len = batch.token_seq_len if batch.token_seq_len is not None else batch.positions + 1
        longer = seq_len > self.plain_length
        if self.longrope:
            return self.table, batch.positions + longer.to(batch.positions.dtype) * self.max_positions
        inv_freq = dynamic_inv_freq(self.config, seq_len.clamp(min=self.plain_length).to(torch.float32))
        rows = cos_sin_rows(batch.positions, inv_freq.to(batch.positions.device), self.dtype)
        rows = torch.where(longer[:, None], rows, self.table[batch.positions])
        return rows, torch.arange(batch.positions.shape[0], device=rows.device)


@dataclass
class Attention:
    """Self-attention of this shard's heads over the TokenAttention cache."""
    qkv: Linear                   # [(heads + 2 * kv_heads) * head_dim / shards, hidden]: q, k, v rows
    o: RowParallelLinear
    num_heads: int                # on this shard
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    mods: ScoreMods | None = None  # this layer's sliding window / logit soft-cap / ALiBi (this shard's heads)

    def __call__(self, ops, hidden, batch, kv, req_to_token, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                 output=None):
        """``rotary``: ``Rotary``'s (table, rows); None for a model without rotary embedding (Bloom's ALiBi):
        K is stored as projected. ``output``: the step's ``OutputRows`` at the last layer: every token's K and
        V are stored, then only those tokens attend (the result has their rows)."""
        q, k, v = self.project_qkv(ops, hidden)
        table, positions = rotary if rotary is not None else (None, None)
        ops.rotary_store_kv(q, k, v, positions, table, kv, batch.out_slots, self.head_norms())
        if output is not None:
            q, batch = q[output.index], output.batch
        tokens, q_size = q.shape[0], self.num_heads * self.head_dim
        if batch.is_decode:
            out = ops.decode_attention(q, kv, req_to_token, batch.req_rows, batch.seq_len, self.sm_scale,
                                       shared=batch.shared_prefix, mods=self.mods)
        else:
            attend = batch.attention or ops.prefill_attention
            out = attend(q, kv, req_to_token, batch.req_rows, batch.q_start, batch.q_len, batch.seq_len, self.sm_scale,
                         batch.max_q_len, shared=batch.shared_prefix, max_seq_len=batch.max_seq_len, mods=self.mods,
                         context=batch.context)
        return self.o(ops, out.reshape(tokens, q_size))

    def head_norms(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q_norm, k_norm, eps) when each q and k head is RMS-normed before rotary (in its kernel)."""
        return None

    def project_qkv(self, ops, hidden) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D] of the new tokens, before rotary."""
        qkv = self.qkv(ops, hidden)
        tokens, q_size, kv_size = qkv.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        return q, k, v


@dataclass
class QKNormAttention(Attention):
    """Qwen3's attention: each head's q and k RMS-normed over the head dim before rotary (by the
    rotary kernel, ``ops.rotary_store_kv``'s ``head_norms``)."""
    q_norm: torch.Tensor | None = None    # [head_dim]
    k_norm: torch.Tensor | None = None    # [head_dim]
    eps: float = 1e-6

    def head_norms(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        return self.q_norm, self.k_norm, self.eps


@dataclass
class LayerNormDecoderLayer:
    """A pre-norm decoder layer with LayerNorms and a non-gated GeLU MLP (StarCoder2, Bloom)."""
    input_norm: LayerNorm
    attention: Attention
    post_norm: LayerNorm
    mlp: GeluMLP


def run_layernorm_layers(ops, layers: list[LayerNormDecoderLayer], final_norm: LayerNorm, residual: torch.Tensor,
                         batch, kv_cache, rotary) -> torch.Tensor:
    """The final-normed hidden states after ``layers``; each residual add is fused into the next norm.
    ``residual`` (the embeddings) is updated in place; ``rotary``: None for a model without rotary."""
    hidden = layers[0].input_norm(ops, residual)
    for index, layer in enumerate(layers):
        output, residual = narrow_at_last_layer(batch, index, len(layers), residual)
        attn = layer.attention(ops, hidden, batch, kv_cache.layer(index), kv_cache.req_to_token, rotary, output)
        hidden = layer.post_norm.add(ops, attn, residual)
        mlp = layer.mlp(ops, hidden)
        next_norm = layers[index + 1].input_norm if index + 1 < len(layers) else final_norm
        hidden = next_norm.add(ops, mlp, residual)
    return hidden


def narrow_at_last_layer(batch, index: int, layers: int, residual: torch.Tensor):
    """(the ``OutputRows`` layer ``index`` narrows its attention to, the residual stream over the same tokens):
    the step's ``batch.output`` and its rows of ``residual`` at the last layer, else (None, ``residual``)."""
    output = batch.output if index == layers - 1 else None
    return output, residual if output is None else residual[output.index]


def gemm_weights(*roots) -> list[LinearWeight]:
    """One weight of each (format, shape, dtype) that ``ops.linear`` multiplies by under ``roots`` (a model, its
    draft heads): the ``GEMM_FIELDS`` of every block reachable through the engine's objects' attributes, lists,
    tuples and dicts (``Linear``, ``RowParallelLinear``, ``LMHead``, an MoE block's router). The worker runs
    each once at every row count a step can give it (``engine.worker.gemm_warmup``)."""
    found: dict[tuple, LinearWeight] = {}
    for obj in engine_objects(*roots):
        for name in getattr(type(obj), "GEMM_FIELDS", ()):
            weight = getattr(obj, name)
            found.setdefault(gemm_key(weight), weight)
    return list(found.values())


def attention_blocks(*roots) -> list[Attention]:
    """Every ``Attention`` under ``roots`` (a model's layers' self-attention, whatever its family)."""
    return [obj for obj in engine_objects(*roots) if isinstance(obj, Attention)]


def engine_objects(*roots):
    """Each object reachable from ``roots`` through the engine's objects' attributes, lists, tuples and dicts, once."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, (torch.Tensor, str, bytes, int, float)) or obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("engine.") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())


def gemm_key(weight: LinearWeight) -> tuple:
    """What decides which kernels a product with ``weight`` runs: its format, shape and (dense) dtype."""
    return type(weight).__name__, tuple(weight.shape), getattr(weight, "dtype", None)
