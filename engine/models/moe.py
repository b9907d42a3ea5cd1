"""What the mixture-of-experts families (``mixtral``, ``qwen2_moe``, ``qwen3_moe``) share.

Their decoder is Llama's (``llama.LlamaFamilyModel``) with the MLP of a layer replaced by a
sparse MoE block:

    logits  = h @ w_router.T                       [T, E]  (router replicated on every shard; with a
                                                            shared expert its gate is the router's last row)
    weights, ids = topk(softmax(logits in float32), k)     (``KernelOps.moe_route``: renormalised, rounded
                                                            as the config says)
    out     = sum_j weights[:, j] * expert_{ids[:, j]}(h)  (``KernelOps.fused_moe``: one launch per projection)
    out    += sigmoid(h @ w_shared_gate.T) * shared_expert(h)  (Qwen2-MoE's shared expert, in ``fused_moe`` too)
    all-reduce(out)                                         (each shard holds a slice of every expert)

Tensor parallelism slices each expert like ``GatedMLP``: gate/up rows (column), down columns
(row); the partial outputs of the experts and of the shared expert are summed by one
all-reduce. What differs per family is explicit in its module: the checkpoint names of the
experts (``ExpertNames``), the config fields, whether the router's weights are renormalised
and rounded to the model dtype, the shared expert, the dense layers, Qwen3's q/k norms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.models.config import ModelConfigError
from engine.models.llama import LlamaConfig, LlamaFamilyModel, checkpoint_shapes as llama_shapes, dense_mlp_shapes
from engine.models.parallel import FULL, Slice, TensorParallel
from engine.models.qwen3 import qk_norm_attention, qk_norm_shapes
from kernels.fused_moe import SharedExpert


@dataclass(frozen=True)
class ExpertNames:
    """Checkpoint names of a layer's MoE block: ``<layer>.<block>experts.<e>.<gate|up|down>.weight``."""
    block: str                    # "block_sparse_moe." (Mixtral) or "mlp." (Qwen)
    gate: str
    up: str
    down: str
    router: str = "gate"


MIXTRAL_NAMES = ExpertNames("block_sparse_moe.", "w1", "w3", "w2")
QWEN_NAMES = ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0            # of each expert
    norm_topk_prob: bool = True               # renormalise the top-k weights to sum 1
    round_router_weights: bool = False        # weights cast to the model dtype (Qwen), else float32 (Mixtral)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()        # layers with a plain gated MLP (``intermediate_size``)
    qk_norm: bool = False                     # Qwen3's per-head q/k RMSNorm

    def sharded_sizes(self) -> dict[str, int]:
        sizes = {**super().sharded_sizes(), "moe_intermediate_size": self.moe_intermediate_size}
        if not self.dense_layers:
            del sizes["intermediate_size"]    # no layer has a dense MLP of that size (Mixtral: it is the expert's)
        if self.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return sizes


def moe_fields(raw: dict[str, Any], expert_size_key: str) -> dict[str, Any]:
    """The ``MoEConfig`` fields config.json spells the same way in every MoE family (``raw`` with the
    family's defaults, ``config.with_defaults``). The expert count is ``num_experts`` (Qwen's released
    configs) or ``num_local_experts`` (Mixtral, and what transformers 5 writes for Qwen3-MoE)."""
    num_experts_key = "num_experts" if "num_experts" in raw else "num_local_experts"
    experts, top_k = int(raw[num_experts_key]), int(raw["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ModelConfigError(f"num_experts_per_tok={top_k} must be between 1 and {num_experts_key}={experts}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={raw['hidden_act']!r} is not supported; only 'silu' is")
    return dict(num_experts=experts, top_k=top_k, moe_intermediate_size=int(raw[expert_size_key]),
                rms_norm_eps=float(raw["rms_norm_eps"]), tie_word_embeddings=bool(raw["tie_word_embeddings"]))


def qwen_dense_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """Layers transformers builds with a dense MLP: listed in ``mlp_only_layers``, or off the
    ``decoder_sparse_step`` (a layer i is sparse when (i + 1) % step == 0)."""
    layers, step = int(raw["num_hidden_layers"]), int(raw.get("decoder_sparse_step", 1) or 1)
    only = set(raw.get("mlp_only_layers") or ())
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


@dataclass
class SparseMoE:
    """Router, this shard's slice of every expert, and maybe a shared expert with its gate."""
    router: torch.Tensor                      # [E, hidden], replicated; with a shared expert [E + 1, hidden]:
                                              # its gate's row last, so one GEMM gives both logits
    w_gate_up: torch.Tensor                   # [E, 2 * I / shards, hidden]: gate rows, then up rows
    w_down: torch.Tensor                      # [E, hidden, I / shards]
    top_k: int
    renormalize: bool
    round_weights: bool
    tp: TensorParallel
    shared_gate_up: torch.Tensor | None = None   # [2 * I_shared / shards, hidden]
    shared_down: torch.Tensor | None = None      # [hidden, I_shared / shards]
    GEMM_FIELDS = ("router",)                    # ``ops.linear``'s (``layers.gemm_weights``); the experts: fused_moe

    def route(self, ops, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) from the router logits, as transformers' router
        computes them (the shared expert's gate logit, when there is one, is not routed)."""
        return ops.moe_route(logits[:, :self.w_gate_up.shape[0]], self.top_k, self.renormalize,
                             logits.dtype if self.round_weights else None)

    def __call__(self, ops, x: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(x, self.router)
        weights, ids = self.route(ops, logits)
        shared = None
        if self.shared_gate_up is not None:
            shared = SharedExpert(self.shared_gate_up, self.shared_down, logits[:, self.w_gate_up.shape[0]:])
        return self.tp.all_reduce(ops.fused_moe(x, self.w_gate_up, self.w_down, weights, ids, shared))


def moe_checkpoint_shapes(c: MoEConfig, names: ExpertNames) -> dict[str, tuple[int, ...]]:
    """Every tensor an MoE checkpoint must hold, with its full shape."""
    shapes = llama_shapes(c, lambda c, i, p: _layer_mlp_shapes(c, names, i, p))
    return {**shapes, **qk_norm_shapes(c)} if c.qk_norm else shapes


def _layer_mlp_shapes(c: MoEConfig, names: ExpertNames, layer: int, p: str) -> dict[str, tuple[int, ...]]:
    if layer in c.dense_layers:
        return dense_mlp_shapes(c, layer, p)
    h, i = c.hidden_size, c.moe_intermediate_size
    b = p + names.block
    shapes = {b + names.router + ".weight": (c.num_experts, h)}
    for e in range(c.num_experts):
        shapes.update({f"{b}experts.{e}.{names.gate}.weight": (i, h), f"{b}experts.{e}.{names.up}.weight": (i, h),
                       f"{b}experts.{e}.{names.down}.weight": (h, i)})
    if c.shared_expert_intermediate_size:
        shapes.update(dense_mlp_shapes(c, layer, b, "shared_expert.", c.shared_expert_intermediate_size))
        shapes[b + "shared_expert_gate.weight"] = (1, h)
    return shapes


class MoEFamilyModel(LlamaFamilyModel):
    """Llama's decoder with sparse MoE blocks; a family subclass sets ``names``."""
    names: ExpertNames
    config: MoEConfig

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return moe_checkpoint_shapes(self.config, self.names)

    def weight_slices(self) -> dict[str, Slice]:
        """Llama's slices, plus each expert's gate/up (column) and down (row); routers replicated."""
        slices = super().weight_slices()
        column, row = self.tp.column(), self.tp.row()
        by_module = {self.names.gate: column, self.names.up: column, self.names.down: row}
        for name in slices:
            if ".experts." in name:
                slices[name] = by_module[name.rsplit(".", 2)[-2]]
            elif name.endswith(("." + self.names.router + ".weight", "shared_expert_gate.weight", "_norm.weight")):
                slices[name] = FULL
        return slices

    def _attention(self, t: dict[str, torch.Tensor], p: str):
        attention = super()._attention(t, p)
        return qk_norm_attention(attention, t, p, self.config.rms_norm_eps) if self.config.qk_norm else attention

    def _mlp(self, t: dict[str, torch.Tensor], p: str, prefix: str = "mlp."):
        if int(p.split(".")[2]) in self.config.dense_layers:
            return super()._mlp(t, p)
        c, n, b = self.config, self.names, p + self.names.block
        experts = range(c.num_experts)
        w_gate_up = torch.stack([torch.cat([t.pop(f"{b}experts.{e}.{n.gate}.weight"),
                                            t.pop(f"{b}experts.{e}.{n.up}.weight")]) for e in experts])
        w_down = torch.stack([t.pop(f"{b}experts.{e}.{n.down}.weight") for e in experts])
        router = t.pop(b + n.router + ".weight")
        if not c.shared_expert_intermediate_size:
            return SparseMoE(router, w_gate_up, w_down, c.top_k, c.norm_topk_prob, c.round_router_weights, self.tp)
        shared = super()._mlp(t, b, "shared_expert.")
        router = torch.cat([router, t.pop(b + "shared_expert_gate.weight")])
        return SparseMoE(router, w_gate_up, w_down, c.top_k, c.norm_topk_prob, c.round_router_weights, self.tp,
                         shared.gate_up.weight, shared.down.weight)


def family_shapes(names: ExpertNames) -> Callable[[MoEConfig], dict[str, tuple[int, ...]]]:
    """``Family.checkpoint_shapes`` of an MoE family with these expert names."""
    return lambda c: moe_checkpoint_shapes(c, names)
