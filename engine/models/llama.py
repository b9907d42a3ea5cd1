"""The Llama family (Llama 1/2/3/3.1, Mistral, Qwen2) over TokenAttention.

Per layer, with T new tokens of a ragged batch (``ForwardBatch``):

    residual += attn_out            (fused into add_rmsnorm)
    h   = rmsnorm(residual)                                   [T, hidden]
    qkv = h @ w_qkv.T (+ b_qkv)     q | k | v side by side    [T, q + 2 kv]
    rotary(q); rotary(k), v -> KV slots (one kernel); attention over req_to_token
    residual += h @ w_o.T; h = rmsnorm(residual)
    h = silu(h @ w_gate.T) * (h @ w_up.T) @ w_down.T          (gate|up fused)

GEMMs are cuBLAS, or the skinny GEMM kernel for small decode batches; both, and the
norms, rotary + KV store, attention and activation, come from ``KernelOps``. The model holds
plain tensors (no autograd, no lazy attributes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.config import ModelConfig
from engine.models.parallel import FULL, Slice, TensorParallel, read
from engine.models.rope import build_cos_sin_cache
from engine.ops import KernelOps
from engine.worker.forward_batch import ForwardBatch
from engine.worker.kv_cache import KVCache

# Buffers some checkpoints carry that the model recomputes.
IGNORED_CHECKPOINT_NAMES = (r"rotary_emb\.inv_freq$",)


def checkpoint_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this family must hold, with its full shape."""
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
    return shapes


@dataclass
class LayerWeights:
    input_norm: torch.Tensor    # [hidden]
    w_qkv: torch.Tensor         # [q + 2 kv, hidden]
    b_qkv: torch.Tensor | None  # [q + 2 kv]
    w_o: torch.Tensor           # [hidden, q]
    post_norm: torch.Tensor     # [hidden]
    w_gate_up: torch.Tensor     # [2 intermediate, hidden]
    w_down: torch.Tensor        # [hidden, intermediate]


class LlamaFamilyModel:
    def __init__(self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device,
                 max_positions: int, tp: TensorParallel = TensorParallel()):
        tp.check(config)
        self.config = config
        self.ops = ops
        self.tp = tp
        self.num_heads = tp.heads(config)          # on this shard
        self.num_kv_heads = tp.kv_heads(config)
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.sm_scale = config.head_dim**-0.5
        self.cos_sin_cache = build_cos_sin_cache(config, max_positions, dtype, self.device)
        self.embed_tokens: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.layers: list[LayerWeights] = []

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
            slices[name] = by_suffix.get(module, FULL)
        return slices

    def load_weights(self, checkpoint) -> None:
        """Strictly check the checkpoint, then read this shard's slice of every tensor once."""
        checkpoint.check(self.checkpoint_shapes(), ignore_unexpected=IGNORED_CHECKPOINT_NAMES)
        tensors = {}
        slices = self.weight_slices()
        for name in checkpoint.progress(list(slices), desc=f"Loading weights (shard {self.tp.rank})"):
            tensors[name] = read(checkpoint, name, slices[name], self.dtype, self.device)
        self._assemble(tensors)

    def _assemble(self, t: dict[str, torch.Tensor]) -> None:
        c = self.config
        self.embed_tokens = t.pop("model.embed_tokens.weight")
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else t.pop("lm_head.weight")
        self.final_norm = t.pop("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn = [t.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            bias = [t.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"] if c.qkv_bias else None
            self.layers.append(LayerWeights(
                input_norm=t.pop(p + "input_layernorm.weight"),
                w_qkv=torch.cat(attn, dim=0),
                b_qkv=torch.cat(bias, dim=0) if bias else None,
                w_o=t.pop(p + "self_attn.o_proj.weight"),
                post_norm=t.pop(p + "post_attention_layernorm.weight"),
                w_gate_up=torch.cat([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")], dim=0),
                w_down=t.pop(p + "mlp.down_proj.weight"),
            ))

    # ---- forward -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of every new token."""
        eps = self.config.rms_norm_eps
        residual = self._embed(batch.input_ids)
        hidden = self.ops.rmsnorm(residual, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            attn = self._attention(hidden, layer, batch, kv_cache.layer(index), kv_cache.req_to_token)
            hidden = self.ops.add_rmsnorm(attn, residual, layer.post_norm, eps)
            mlp = self._mlp(hidden, layer)
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            hidden = self.ops.add_rmsnorm(mlp, residual, next_norm, eps)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.embed_tokens[input_ids]
        local = input_ids - self.tp.vocab_start(self.config)
        outside = (local < 0) | (local >= self.embed_tokens.shape[0])
        hidden = self.embed_tokens[local.masked_fill(outside, 0)]
        hidden.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(hidden)

    def _attention(self, hidden, layer: LayerWeights, batch: ForwardBatch, kv_layer, req_to_token):
        c, ops = self.config, self.ops
        qkv = self.ops.linear(hidden, layer.w_qkv, layer.b_qkv)
        tokens, q_size, kv_size = qkv.shape[0], self.q_size, self.kv_size
        q = qkv[:, :q_size].view(tokens, self.num_heads, c.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, self.num_kv_heads, c.head_dim)
        v = qkv[:, q_size + kv_size :].view(tokens, self.num_kv_heads, c.head_dim)
        ops.rotary_store_kv(q, k, v, batch.positions, self.cos_sin_cache, kv_layer, batch.out_slots)
        if batch.is_decode:
            out = ops.decode_attention(q, kv_layer, req_to_token, batch.req_rows, batch.seq_len, self.sm_scale)
        else:
            out = ops.prefill_attention(q, kv_layer, req_to_token, batch.req_rows, batch.q_start, batch.q_len,
                                        batch.seq_len, self.sm_scale, batch.max_q_len)
        return self.tp.all_reduce(self.ops.linear(out.reshape(tokens, q_size), layer.w_o))

    def _mlp(self, hidden, layer: LayerWeights):
        gate_up = self.ops.linear(hidden, layer.w_gate_up)
        return self.tp.all_reduce(self.ops.linear(self.ops.silu_and_mul(gate_up), layer.w_down))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32 logits (the GEMM in the model dtype, as transformers does)."""
        return self.tp.gather_columns(self.ops.linear(hidden, self.lm_head)).float()
