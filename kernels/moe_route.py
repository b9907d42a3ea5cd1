"""Mixture-of-experts routing in one launch: each token's top-k experts and their weights, as
transformers' routers compute them from the router logits in float32:

    weights, ids = topk(softmax(logits.float()), k)
    weights = weights / weights.sum()            (``renormalize``: Mixtral, Qwen3-MoE)
    weights = weights.to(dtype).float()          (``round_dtype``: the Qwen MoE families)

One program per token reads its E logits once (E rounded up to a power of two in one block) and
picks the k largest probabilities one at a time, the lowest expert id first among equal ones
(``torch.topk`` leaves the order of ties unspecified: equal weights may sit in other slots, and a tie
at the k-th place may choose the other expert). A row whose probabilities are NaN (a NaN or +inf
logit) still chooses k real experts, the lowest ids first, with NaN weights: an id past
the last expert would send the expert kernels out of bounds. In torch these were six to eight
launches per MoE layer, each a few microseconds of a batch-1 decode step that reads only a few MB
of expert weights.

Tried and not kept (stop 76, ``.diag/s76_routed_moe_tried.patch``): no routing launch for one token, each program of
the two one-token expert kernels routing the token from its logits itself (this kernel's loop as a shared function;
the down kernel before its PDL wait). Its outputs were bit-equal to this launch's on the GPU, but on one H200 Qwen3-
30B-A3B's 16-layer batch-1 step (``bench.profile_step``, three runs each, alternating) went 0.930-0.931 -> 1.048-1.050
ms: every one of the gate|up launch's 3,072 programs (2 warps each) pays the top-k loop's 16 reductions before its
first weight load, where the one routing program paid them once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_tensor
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to

ROUND_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
NOT_A_NUMBER: tl.constexpr = tl.constexpr(-0.5)     # the rank of a NaN probability: below 0, above the -1 of no expert


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits,
                  K: tl.constexpr, K_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, RENORMALIZE: tl.constexpr,
                  ROUND_DTYPE: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_BLOCK)
    valid = experts < num_experts
    wait_for_prior_kernel(PDL)
    x = tl.load(logits_ptr + token * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    allow_next_kernel(PDL)
    e = tl.exp(x - tl.max(x, 0))
    probs = e / tl.sum(e, 0)
    # past the experts: -1, below every probability, never chosen. A NaN probability (a NaN or +inf logit makes
    # the whole row NaN) ranks as NOT_A_NUMBER, below the real ones: the ids stay real experts, the weights NaN.
    probs = tl.where(valid, tl.where(probs == probs, probs, NOT_A_NUMBER), -1.0)
    slots = tl.arange(0, K_BLOCK)
    weights = tl.zeros([K_BLOCK], dtype=tl.float32)
    ids = tl.zeros([K_BLOCK], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(probs, 0)
        chosen = tl.min(tl.where(probs == best, experts, E_BLOCK), 0)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, chosen, ids)
        probs = tl.where(experts == chosen, -1.0, probs)
    weights = tl.where(weights == NOT_A_NUMBER, float("nan"), weights)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)          # the padding slots hold 0
    weights = round_to(weights, ROUND_DTYPE).to(tl.float32)
    tl.store(weights_ptr + token * K + slots, weights, mask=slots < K)
    tl.store(ids_ptr + token * K + slots, ids, mask=slots < K)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool,
              round_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype) -> (weights [T, k] float32, expert ids [T, k] int32)."""
    _check(logits, top_k, round_dtype)
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens:
        e_block = triton.next_power_of_2(experts)
        _route_kernel[(tokens,)](
            logits, weights, ids, experts, logits.stride(0),
            K=top_k, K_BLOCK=triton.next_power_of_2(top_k), E_BLOCK=e_block, RENORMALIZE=renormalize,
            ROUND_DTYPE=ROUND_DTYPES[round_dtype or torch.float32], num_warps=1 if e_block <= 256 else 4,
            **launch_options(logits))
    return weights, ids


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool,
                  round_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, top_k, round_dtype)
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_dtype is not None:
        weights = weights.to(round_dtype).float()
    return weights, ids.to(torch.int32)


def _check(logits: torch.Tensor, top_k: int, round_dtype: torch.dtype | None) -> None:
    check_tensor("logits", logits, 2)
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the experts")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k {top_k} must be 1 to the {logits.shape[1]} experts")
    if round_dtype is not None and round_dtype not in ROUND_DTYPES:
        raise ValueError(f"round_dtype must be one of {sorted(map(str, ROUND_DTYPES))}, got {round_dtype}")
