"""Bloom (bigscience/bloom-560m ... bloom-7b1, bloom) over TokenAttention.

With T new tokens of a ragged batch:

    residual = layernorm(word_embeddings[ids])        (word_embeddings_layernorm)
    per layer:
        residual += mlp_out; h = layernorm(residual)   (input_layernorm, fused into add_layernorm)
        qkv = h @ w_qkv.T + b_qkv       the checkpoint's rows interleaved per head: [heads, 3 (q|k|v), head_dim]
        attention without rotary: score += slope[h] * (k_pos - q_pos)   (ALiBi, inside the attention kernels)
        residual += h @ w_dense.T + b_dense; h = layernorm(residual)     (post_attention_layernorm)
        h = dense_4h_to_h(gelu_tanh(dense_h_to_4h(h)))  (biased, intermediate 4 * hidden, no gate)
    ln_f, then the lm head tied to word_embeddings

Tensor parallel: whole heads per rank. The interleaved ``query_key_value`` rows of head h are
``3 * head_dim`` consecutive rows, so an equal split of its rows hands each rank whole heads; the
rank then reorders them to q | k | v (weight and bias) once at load. Each rank holds its heads'
ALiBi slopes, sliced from the list for all heads (for head counts that are not a power of two the
list is not a geometric sequence, so a rank cannot compute its own from its head count).

Names: transformers' ``save_pretrained`` writes ``transformer.h.0...``; bigscience's checkpoints
(bloom-7b1) have no ``transformer.`` prefix. Both load (``with_transformer_prefix``).

Context: config.json has no ``max_position_embeddings`` (ALiBi has no trained position table);
the limit is ``DEFAULT_CONTEXT``, the one TGI's launcher uses for such configs, unless config.json
names one. ``--rope-scaling`` does not apply (no rotary embedding) and is refused.

The KV cache holds K as projected (the rotary/store kernel without a cos/sin table), so cached prefixes
are reused as for any model; the attention kernels skip the shared-prefix (cascade) path under ALiBi,
which needs each row's positions. ``--kv-cache-dtype``: int8 as for every model; fp8's per-tensor scales
are 1.0 (no Bloom checkpoint carries any).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.config import (DTYPES, Family, ModelConfig, ModelConfigError, RopeConfig, as_tuple, check_positive,
                                  with_defaults)
from engine.models.layers import (Attention, GeluMLP, LayerNorm, LayerNormDecoderLayer, Linear, LMHead,
                                  RowParallelLinear, VocabParallelEmbedding, head_weight, run_layernorm_layers)
from engine.models.parallel import FULL, Slice, TensorParallel, read
from engine.ops import KernelOps
from engine.worker.forward_batch import ForwardBatch
from engine.worker.kv_cache import KVCache
from kernels.score_mods import ScoreMods, alibi_slopes

ARCHITECTURES = ("BloomForCausalLM",)
PREFIX = "transformer."
# TGI's context when config.json names none (its launcher's default max_position_embeddings)
DEFAULT_CONTEXT = 4096
# transformers' BloomConfig defaults of the fields read here that a config.json may leave out
DEFAULTS = dict(bos_token_id=1, eos_token_id=2, layer_norm_epsilon=1e-5, tie_word_embeddings=True)


@dataclass(frozen=True)
class BloomConfig(ModelConfig):
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True

    @property
    def intermediate_size(self) -> int:
        return 4 * self.hidden_size

    def sharded_sizes(self) -> dict[str, int]:
        return {**super().sharded_sizes(), "intermediate_size": self.intermediate_size}


def _first(raw: dict[str, Any], *names: str) -> Any:
    """The first of ``names`` config.json has (Bloom's own spelling first, then transformers' generic one)."""
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    raise KeyError(" / ".join(names))


def parse_config(raw: dict[str, Any]) -> BloomConfig:
    raw = with_defaults(raw, DEFAULTS)
    if raw.get("apply_residual_connection_post_layernorm"):
        raise ModelConfigError("apply_residual_connection_post_layernorm=true is not supported for Bloom (no "
                               "released checkpoint uses it); only the pre-norm residual is served")
    if raw.get("rope_scaling") or raw.get("rope_parameters"):
        raise ModelConfigError("Bloom has no rotary embedding (ALiBi positions): rope scaling (--rope-scaling / "
                               "--rope-factor or config.json rope_scaling) does not apply; drop it")
    hidden, heads = int(_first(raw, "hidden_size", "n_embed")), int(_first(raw, "n_head", "num_attention_heads"))
    check_positive(hidden_size=hidden, n_head=heads, n_layer=int(_first(raw, "n_layer", "num_hidden_layers")),
                   vocab_size=int(raw["vocab_size"]))
    if hidden % heads:
        raise ModelConfigError(f"hidden_size={hidden} is not a multiple of n_head={heads}")
    return BloomConfig(
        architecture=(raw.get("architectures") or [None])[0],
        hidden_size=hidden, num_layers=int(_first(raw, "n_layer", "num_hidden_layers")), num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings") or DEFAULT_CONTEXT),
        rope=RopeConfig(theta=10000.0),          # unused: no rotary embedding
        sliding_window=None, bos_token_id=raw.get("bos_token_id"), eos_token_ids=as_tuple(raw.get("eos_token_id")),
        checkpoint_dtype=DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "")),
        layer_norm_epsilon=float(raw["layer_norm_epsilon"]),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
    )


def checkpoint_shapes(c: BloomConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Bloom checkpoint must hold (transformers' names), with its full shape."""
    hidden, inter = c.hidden_size, c.intermediate_size
    shapes = {PREFIX + "word_embeddings.weight": (c.vocab_size, hidden)}
    norms = [PREFIX + "word_embeddings_layernorm", PREFIX + "ln_f"]
    for i in range(c.num_layers):
        p = f"{PREFIX}h.{i}."
        linears = {"self_attention.query_key_value": (3 * hidden, hidden), "self_attention.dense": (hidden, hidden),
                   "mlp.dense_h_to_4h": (inter, hidden), "mlp.dense_4h_to_h": (hidden, inter)}
        for name, shape in linears.items():
            shapes[p + name + ".weight"] = shape
            shapes[p + name + ".bias"] = (shape[0],)
        norms += [p + "input_layernorm", p + "post_attention_layernorm"]
    for norm in norms:
        shapes[norm + ".weight"] = (hidden,)
        shapes[norm + ".bias"] = (hidden,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes


def with_transformer_prefix(checkpoint):
    """The checkpoint under transformers' names: bigscience's ``h.0...`` read as ``transformer.h.0...``
    (``lm_head`` is outside the prefix); a checkpoint already named so is returned as it is."""
    names = checkpoint.names()
    if all(n.startswith(PREFIX) or n.startswith("lm_head.") for n in names):
        return checkpoint
    return checkpoint.renamed(lambda n: n if n.startswith(PREFIX) or n.startswith("lm_head.") else PREFIX + n)


def interleaved_to_qkv(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows [heads, 3, head_dim] (Bloom's fused layout) -> [3, heads, head_dim] (q | k | v), weight or bias."""
    return t.reshape(heads, 3, head_dim, -1).transpose(0, 1).reshape(t.shape)


class BloomModel:
    def __init__(self, config: BloomConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device,
                 max_positions: int, tp: TensorParallel = TensorParallel()):
        tp.check(config)
        self.config, self.ops, self.tp, self.dtype = config, ops, tp, dtype
        self.num_heads = self.num_kv_heads = tp.heads(config)      # on this shard
        self.device = torch.device(device)
        first = tp.rank * self.num_heads
        self.alibi_slopes = alibi_slopes(config.num_heads)[first : first + self.num_heads].to(self.device)
        self.embed_tokens: VocabParallelEmbedding | None = None
        self.embed_norm: LayerNorm | None = None
        self.lm_head: LMHead | None = None
        self.final_norm: LayerNorm | None = None
        self.layers: list[LayerNormDecoderLayer] = []

    # ---- weights -------------------------------------------------------------------

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return checkpoint_shapes(self.config)

    def weight_slices(self) -> dict[str, Slice]:
        """Column-parallel (query_key_value: whole heads; dense_h_to_4h; embeddings) weights and their
        biases split by rows; row-parallel weights (dense, dense_4h_to_h) by columns, their bias whole."""
        tp = self.tp
        slices = {}
        for name in self.checkpoint_shapes():
            module, kind = name.rsplit(".", 2)[-2:]
            if module in ("dense", "dense_4h_to_h"):
                slices[name] = tp.row() if kind == "weight" else FULL
            elif module in ("query_key_value", "dense_h_to_4h", "word_embeddings", "lm_head"):
                slices[name] = tp.column()
            else:
                slices[name] = FULL
        return slices

    def load_weights(self, checkpoint) -> None:
        """Strictly check the checkpoint, then read this shard's slice of every tensor once."""
        checkpoint = with_transformer_prefix(checkpoint)
        checkpoint.check(self.checkpoint_shapes())
        slices = self.weight_slices()
        tensors = {name: read(checkpoint, name, slices[name], self.dtype, self.device)
                   for name in checkpoint.progress(list(slices), desc=f"Loading weights (shard {self.tp.rank})")}
        self._assemble(tensors)

    def _assemble(self, t: dict[str, torch.Tensor]) -> None:
        c, tp = self.config, self.tp
        embed = t.pop(PREFIX + "word_embeddings.weight")
        self.embed_tokens = VocabParallelEmbedding(embed, tp.vocab_start(c), tp)
        self.embed_norm = self._norm(t, PREFIX + "word_embeddings_layernorm")
        self.lm_head = LMHead(head_weight(t, embed, c), tp)
        self.final_norm = self._norm(t, PREFIX + "ln_f")
        self.layers = [self._layer(t, f"{PREFIX}h.{i}.") for i in range(c.num_layers)]

    def _norm(self, t: dict[str, torch.Tensor], name: str) -> LayerNorm:
        return LayerNorm(t.pop(name + ".weight"), t.pop(name + ".bias"), self.config.layer_norm_epsilon)

    def _linear(self, t: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return t.pop(name + ".weight"), t.pop(name + ".bias")

    def _layer(self, t: dict[str, torch.Tensor], p: str) -> LayerNormDecoderLayer:
        c, tp, heads = self.config, self.tp, self.num_heads
        weight, bias = self._linear(t, p + "self_attention.query_key_value")
        qkv = Linear(interleaved_to_qkv(weight, heads, c.head_dim), interleaved_to_qkv(bias, heads, c.head_dim))
        dense_weight, dense_bias = self._linear(t, p + "self_attention.dense")
        attention = Attention(qkv, RowParallelLinear(dense_weight, tp, dense_bias), heads, heads, c.head_dim,
                              c.head_dim**-0.5, ScoreMods(alibi_slopes=self.alibi_slopes))
        up = Linear(*self._linear(t, p + "mlp.dense_h_to_4h"))
        down_weight, down_bias = self._linear(t, p + "mlp.dense_4h_to_h")
        mlp = GeluMLP(up, RowParallelLinear(down_weight, tp, down_bias), "tanh")
        return LayerNormDecoderLayer(self._norm(t, p + "input_layernorm"), attention,
                                     self._norm(t, p + "post_attention_layernorm"), mlp)

    # ---- forward -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of every new token."""
        ops = self.ops
        residual = self.embed_norm(ops, self.embed_tokens(batch.input_ids))
        return run_layernorm_layers(ops, self.layers, self.final_norm, residual, batch, kv_cache, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32 logits (the GEMM in the model dtype, as transformers does)."""
        return self.lm_head(self.ops, hidden)


FAMILY = Family(ARCHITECTURES, parse_config, BloomModel, checkpoint_shapes,
                view=with_transformer_prefix)
