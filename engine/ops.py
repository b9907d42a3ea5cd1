"""The one place that picks how an operation runs: a Triton kernel or its torch reference.

Every kernel in ``kernels/`` has a launcher and a ``*_ref`` with the same signature.
The model receives a ``KernelOps`` at construction (no global switch): ``TritonOps`` on
CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (how CI proves the kernels end to end);
``TorchOps`` (the references) on the CPU otherwise, or with --disable-custom-kernels.
Each op is a plain method that calls its kernel or reference by name, so go-to-definition
from the model reaches the kernel. A layer's KV cache arrives as one ``KVLayer`` value;
the methods unwrap what each kernel reads.
"""
from __future__ import annotations

import os

import torch

from engine.worker.kv_cache import KVLayer
from kernels import (decode_attention, fp8_gemm, fused_moe, gelu, greedy, layernorm, moe_route, penalties,
                     prefill_attention, quant_gemm, rmsnorm, rotary, silu_and_mul, skinny_gemm)

BACKENDS = ("triton", "torch")


def default_backend(device: torch.device) -> str:
    """Triton on CUDA, or on the CPU under the Triton interpreter; else torch."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "torch"


class KernelOps:
    """The ops the models and the sampler call; ``create`` picks the implementation."""
    backend: str

    @staticmethod
    def create(backend: str) -> "KernelOps":
        if backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        return TritonOps() if backend == "triton" else TorchOps()


class TritonOps(KernelOps):
    backend = "triton"

    def rmsnorm(self, x, weight, eps: float):
        return rmsnorm.rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps: float):
        return rmsnorm.add_rmsnorm(x, residual, weight, eps)

    def rotary_store_kv(self, q, k, v, positions, cos_sin_cache, kv: KVLayer, slots, head_norms=None) -> None:
        """Rotate q in place; rotated k and v into their slots of the KV cache (no cos_sin_cache: no rotation);
        ``head_norms`` (q_norm, k_norm, eps): q and k heads RMS-normed first."""
        rotary.rotary_store_kv(q, k, v, positions, cos_sin_cache, kv.data, slots, kv.scales, head_norms)

    def prefill_attention(self, q, kv: KVLayer, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale,
                          max_q_len: int, shared=None, max_seq_len: int | None = None, mods=None, out=None,
                          context=None):
        """``mods``: the layer's sliding window / soft-cap / ALiBi (``kernels.score_mods.ScoreMods``); ``out``: write
        the result there (a piecewise graph's static buffer) rather than into a new tensor; ``context``: the rows whose
        long contexts go to cuDNN first (``kernels.context_attention.ContextPlan``)."""
        return prefill_attention.prefill_attention(q, kv.data, req_to_token, req_rows, q_start, q_len, seq_len,
                                                   sm_scale, max_q_len, shared=shared, max_seq_len=max_seq_len,
                                                   mods=mods, kv_scales=kv.scales, out=out, context=context)

    def prefill_attention_call(self, q, kv: KVLayer, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale,
                               max_q_len: int, shared=None, max_seq_len: int | None = None, mods=None, out=None,
                               context=None):
        """``prefill_attention`` of these rows checked and planned once: a callable of any layer's q and ``KVLayer``
        shaped as these that writes ``out`` (the piecewise graphs' eager attention, one call a layer)."""
        call = prefill_attention.PrefillCall(q, kv.data, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale,
                                             max_q_len, shared=shared, max_seq_len=max_seq_len, mods=mods,
                                             kv_scales=kv.scales, out=out, context=context)
        return lambda layer_q, layer: call(layer_q, layer.data, layer.scales)

    def decode_attention(self, q, kv: KVLayer, req_to_token, req_rows, seq_len, sm_scale, shared=None, mods=None):
        """``shared``: a prefix several rows share (``ForwardBatch.shared_prefix``), attended to once for them."""
        return decode_attention.decode_attention(q, kv.data, req_to_token, req_rows, seq_len, sm_scale, shared=shared,
                                                 mods=mods, kv_scales=kv.scales)

    def silu_and_mul(self, gate_up):
        return silu_and_mul.silu_and_mul(gate_up)

    def act_and_mul(self, gate_up, activation: str):
        """``activation`` ("silu" | "gelu_tanh") of the gate half times the up half."""
        return silu_and_mul.act_and_mul(gate_up, activation)

    def layernorm(self, x, weight, bias, eps: float):
        return layernorm.layernorm(x, weight, bias, eps)

    def add_layernorm(self, x, residual, weight, bias, eps: float):
        return layernorm.add_layernorm(x, residual, weight, bias, eps)

    def gelu(self, x, approximate: str):
        return gelu.gelu(x, approximate)

    def apply_penalties(self, logits, counts, pool_rows, repetition, frequency, presence) -> None:
        """In place on float32 logits; ``counts`` rows of ``pool_rows`` (< 0: no penalties)."""
        penalties.apply_penalties(logits, counts, pool_rows, repetition, frequency, presence)

    def greedy_pick(self, logits):
        """(first argmax [N] int64, its log_softmax [N] float32) of float32 logits [N, V], each row read once."""
        return greedy.greedy_pick(logits)

    def linear(self, x, weight, bias=None):
        """F.linear semantics on the weight's format: 4-bit (GPTQ / AWQ) and FP8 through their GEMMs for decode
        rows, dequantized / cuBLASLt for more; dense: small decode batches take the skinny GEMM."""
        if isinstance(weight, quant_gemm.Int4Weight):
            return quant_gemm.int4_linear(x, weight, bias)
        if isinstance(weight, fp8_gemm.Fp8Weight):
            return fp8_gemm.fp8_linear(x, weight, bias)
        return skinny_gemm.linear(x, weight, bias)

    def moe_route(self, logits, top_k: int, renormalize: bool, round_dtype=None):
        """(weights [T, k] float32, expert ids [T, k] int32): softmax, top-k, renormalised and rounded as
        the config says (one launch)."""
        return moe_route.moe_route(logits, top_k, renormalize, round_dtype)

    def fused_moe(self, x, w_gate_up, w_down, topk_weights, topk_ids, shared=None):
        """Each token through its top-k experts, router-weighted and summed (one launch per projection), plus
        the ``shared`` expert (``kernels.fused_moe.SharedExpert``) if there is one."""
        return fused_moe.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, shared)


class TorchOps(KernelOps):
    backend = "torch"

    def rmsnorm(self, x, weight, eps: float):
        return rmsnorm.rmsnorm_ref(x, weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps: float):
        return rmsnorm.add_rmsnorm_ref(x, residual, weight, eps)

    def rotary_store_kv(self, q, k, v, positions, cos_sin_cache, kv: KVLayer, slots, head_norms=None) -> None:
        rotary.rotary_store_kv_ref(q, k, v, positions, cos_sin_cache, kv.data, slots, kv.scales, head_norms)

    def prefill_attention(self, q, kv: KVLayer, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale,
                          max_q_len: int, shared=None, max_seq_len: int | None = None, mods=None, out=None,
                          context=None):
        return prefill_attention.prefill_attention_ref(q, kv.data, req_to_token, req_rows, q_start, q_len,
                                                       seq_len, sm_scale, max_q_len, mods=mods, kv_scales=kv.scales,
                                                       out=out)

    def prefill_attention_call(self, q, kv: KVLayer, req_to_token, req_rows, q_start, q_len, seq_len, sm_scale,
                               max_q_len: int, shared=None, max_seq_len: int | None = None, mods=None, out=None,
                               context=None):
        return lambda layer_q, layer: self.prefill_attention(layer_q, layer, req_to_token, req_rows, q_start, q_len,
                                                             seq_len, sm_scale, max_q_len, shared, max_seq_len, mods,
                                                             out)

    def decode_attention(self, q, kv: KVLayer, req_to_token, req_rows, seq_len, sm_scale, shared=None, mods=None):
        return decode_attention.decode_attention_ref(q, kv.data, req_to_token, req_rows, seq_len, sm_scale,
                                                     mods=mods, kv_scales=kv.scales)

    def silu_and_mul(self, gate_up):
        return silu_and_mul.silu_and_mul_ref(gate_up)

    def act_and_mul(self, gate_up, activation: str):
        return silu_and_mul.act_and_mul_ref(gate_up, activation)

    def layernorm(self, x, weight, bias, eps: float):
        return layernorm.layernorm_ref(x, weight, bias, eps)

    def add_layernorm(self, x, residual, weight, bias, eps: float):
        return layernorm.add_layernorm_ref(x, residual, weight, bias, eps)

    def gelu(self, x, approximate: str):
        return gelu.gelu_ref(x, approximate)

    def apply_penalties(self, logits, counts, pool_rows, repetition, frequency, presence) -> None:
        penalties.apply_penalties_ref(logits, counts, pool_rows, repetition, frequency, presence)

    def greedy_pick(self, logits):
        return greedy.greedy_pick_ref(logits)

    def linear(self, x, weight, bias=None):
        if isinstance(weight, quant_gemm.Int4Weight):
            return quant_gemm.int4_gemm_ref(x, weight, bias)
        if isinstance(weight, fp8_gemm.Fp8Weight):
            return fp8_gemm.fp8_gemm_ref(x, weight, bias)
        return skinny_gemm.skinny_gemm_ref(x, weight, bias)

    def moe_route(self, logits, top_k: int, renormalize: bool, round_dtype=None):
        return moe_route.moe_route_ref(logits, top_k, renormalize, round_dtype)

    def fused_moe(self, x, w_gate_up, w_down, topk_weights, topk_ids, shared=None):
        return fused_moe.fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids, shared)
