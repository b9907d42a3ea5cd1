"""StarCoder2 (starcoder2-3b / 7b / 15b) over TokenAttention.

Per layer, with T new tokens of a ragged batch:

    residual += mlp_out             (fused into add_layernorm)
    h   = layernorm(residual) (weight and bias)
    qkv = h @ w_qkv.T + b_qkv       q | k | v, GQA, rotary as Llama
    residual += h @ w_o.T + b_o; h = layernorm(residual)
    h = gelu_tanh(h @ w_c_fc.T + b_c_fc) @ w_c_proj.T + b_c_proj     (no gate)

Biases everywhere when ``use_bias`` (the default); embeddings tied unless the config says
otherwise. The projections may be GPTQ / AWQ / FP8 (``engine.models.quantized``; biases stay in the model
dtype). The sliding window (4096 in every released checkpoint) applies on every layer, inside the
attention kernels (``ScoreMods``); the context is the model's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.config import Family, ModelConfig, ModelConfigError, shared_fields, with_defaults
from engine.models.layers import (Attention, GeluMLP, LayerNorm, LayerNormDecoderLayer, Linear, LMHead,
                                  RowParallelLinear, Rotary, VocabParallelEmbedding, head_weight,
                                  run_layernorm_layers)
from engine.models.parallel import FULL, Slice, TensorParallel
from engine.models.quantized import LinearWeight, drop_zero_biases, read_weight
from engine.ops import KernelOps
from engine.worker.forward_batch import ForwardBatch
from engine.worker.kv_cache import KV_SCALE_PATTERNS, KVCache
from kernels.score_mods import ScoreMods
from weights.quant_formats import quantized_shapes

ARCHITECTURES = ("Starcoder2ForCausalLM",)
IGNORED_CHECKPOINT_NAMES = (r"rotary_emb\.inv_freq$", *KV_SCALE_PATTERNS)   # KV scales: the worker reads them
# transformers' hidden_act -> torch's GeLU form
GELU_FORMS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
# transformers' Starcoder2Config defaults of the fields read here (``config.with_defaults``)
DEFAULTS = dict(num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=50256, eos_token_id=50256,
                tie_word_embeddings=True, use_bias=True, norm_epsilon=1e-5, hidden_act="gelu_pytorch_tanh",
                sliding_window=None)


@dataclass(frozen=True)
class Starcoder2Config(ModelConfig):
    intermediate_size: int = 0
    norm_epsilon: float = 1e-5
    use_bias: bool = True
    tie_word_embeddings: bool = True
    gelu_approximate: str = "tanh"

    def sharded_sizes(self) -> dict[str, int]:
        return {**super().sharded_sizes(), "intermediate_size": self.intermediate_size}


def parse_config(raw: dict[str, Any]) -> Starcoder2Config:
    raw = with_defaults(raw, DEFAULTS)
    act = raw["hidden_act"]
    if act not in GELU_FORMS:
        raise ModelConfigError(f"hidden_act={act!r} is not supported for StarCoder2; supported: "
                               f"{', '.join(GELU_FORMS)}")
    if raw.get("norm_type", "layer_norm") != "layer_norm" or raw.get("mlp_type", "default") != "default":
        raise ModelConfigError(f"norm_type={raw.get('norm_type')!r} / mlp_type={raw.get('mlp_type')!r}: only "
                               f"StarCoder2's layer_norm and default MLP are supported")
    sliding = raw.get("sliding_window")
    return Starcoder2Config(
        **{**shared_fields(raw), "sliding_window": int(sliding) if sliding else None},
        intermediate_size=int(raw["intermediate_size"]),
        norm_epsilon=float(raw["norm_epsilon"]),
        use_bias=bool(raw["use_bias"]),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        gelu_approximate=GELU_FORMS[act],
    )


def checkpoint_shapes(c: Starcoder2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a StarCoder2 checkpoint must hold, with its full shape."""
    hidden, q_rows, kv_rows = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,),
              "model.norm.bias": (hidden,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        linears = {"self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
                   "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
                   "mlp.c_fc": (c.intermediate_size, hidden), "mlp.c_proj": (hidden, c.intermediate_size)}
        for name, shape in linears.items():
            shapes[p + name + ".weight"] = shape
            if c.use_bias:
                shapes[p + name + ".bias"] = (shape[0],)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[p + norm + ".weight"] = (hidden,)
            shapes[p + norm + ".bias"] = (hidden,)
    return shapes


class Starcoder2Model:
    def __init__(self, config: Starcoder2Config, ops: KernelOps, dtype: torch.dtype, device: torch.device,
                 max_positions: int, tp: TensorParallel = TensorParallel()):
        tp.check(config)
        self.config, self.ops, self.tp, self.dtype = config, ops, tp, dtype
        self.num_heads = tp.heads(config)          # on this shard
        self.num_kv_heads = tp.kv_heads(config)
        self.device = torch.device(device)
        self.rotary = Rotary(config, max_positions, dtype, self.device)
        self.embed_tokens: VocabParallelEmbedding | None = None
        self.lm_head: LMHead | None = None
        self.final_norm: LayerNorm | None = None
        self.layers: list[LayerNormDecoderLayer] = []

    # ---- weights -------------------------------------------------------------------

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return checkpoint_shapes(self.config)

    def weight_slices(self) -> dict[str, Slice]:
        """The part of each checkpoint tensor this shard holds: column-parallel weights and their
        biases split by rows; row-parallel weights by columns (their bias whole, added once)."""
        tp, c = self.tp, self.config
        column, kv = tp.column(), tp.kv_column(c)
        by_module = {"q_proj": column, "k_proj": kv, "v_proj": kv, "c_fc": column, "embed_tokens": column,
                     "lm_head": column}
        slices = {}
        for name in self.checkpoint_shapes():
            module, kind = name.rsplit(".", 2)[-2:]
            if module in ("o_proj", "c_proj"):
                slices[name] = tp.row() if kind == "weight" else FULL
            else:
                slices[name] = by_module.get(module, FULL)
        return slices

    def load_weights(self, checkpoint) -> None:
        """Strictly check the checkpoint, then read this shard's slice of every tensor once."""
        q = self.config.quantization
        checkpoint.check(quantized_shapes(self.checkpoint_shapes(), q),
                         ignore_unexpected=IGNORED_CHECKPOINT_NAMES + (q.ignored_names if q else ()))
        drop_zero_biases(checkpoint, self.checkpoint_shapes(), q)
        slices = self.weight_slices()
        tensors = {name: self._read(checkpoint, name, slices[name])
                   for name in checkpoint.progress(list(slices), desc=f"Loading weights (shard {self.tp.rank})")}
        self._assemble(tensors)

    def _read(self, checkpoint, name: str, piece: Slice) -> LinearWeight:
        """This shard's ``piece`` of one tensor; a quantized layer's weight from its quantized tensors."""
        return read_weight(checkpoint, name, piece, self.config.quantization, self.dtype, self.device)

    def _assemble(self, t: dict[str, torch.Tensor]) -> None:
        c, tp = self.config, self.tp
        embed = t.pop("model.embed_tokens.weight")
        self.embed_tokens = VocabParallelEmbedding(embed, tp.vocab_start(c), tp)
        self.lm_head = LMHead(head_weight(t, embed, c), tp)
        self.final_norm = self._norm(t, "model.norm")
        self.layers = [self._layer(t, f"model.layers.{i}.") for i in range(c.num_layers)]

    def _norm(self, t: dict[str, torch.Tensor], name: str) -> LayerNorm:
        return LayerNorm(t.pop(name + ".weight"), t.pop(name + ".bias"), self.config.norm_epsilon)

    def _bias(self, t: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        return t.pop(name + ".bias") if self.config.use_bias else None

    def _layer(self, t: dict[str, torch.Tensor], p: str) -> LayerNormDecoderLayer:
        c, tp = self.config, self.tp
        qkv_names = [p + f"self_attn.{n}_proj" for n in "qkv"]
        qkv = Linear.fused([t.pop(n + ".weight") for n in qkv_names],
                           [t.pop(n + ".bias") for n in qkv_names] if c.use_bias else None)
        o = RowParallelLinear(t.pop(p + "self_attn.o_proj.weight"), tp, self._bias(t, p + "self_attn.o_proj"))
        attention = Attention(qkv, o, self.num_heads, self.num_kv_heads, c.head_dim, c.head_dim**-0.5,
                              ScoreMods(window=c.sliding_window) if c.sliding_window else None)
        up = Linear(t.pop(p + "mlp.c_fc.weight"), self._bias(t, p + "mlp.c_fc"))
        down = RowParallelLinear(t.pop(p + "mlp.c_proj.weight"), tp, self._bias(t, p + "mlp.c_proj"))
        mlp = GeluMLP(up, down, c.gelu_approximate)
        return LayerNormDecoderLayer(self._norm(t, p + "input_layernorm"), attention,
                                     self._norm(t, p + "post_attention_layernorm"), mlp)

    # ---- forward -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of every new token."""
        ops = self.ops
        rotary = self.rotary(batch)
        residual = self.embed_tokens(batch.input_ids)
        return run_layernorm_layers(ops, self.layers, self.final_norm, residual, batch, kv_cache, rotary)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32 logits (the GEMM in the model dtype, as transformers does)."""
        return self.lm_head(self.ops, hidden)


FAMILY = Family(ARCHITECTURES, parse_config, Starcoder2Model, checkpoint_shapes, IGNORED_CHECKPOINT_NAMES)
