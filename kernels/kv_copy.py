"""Copy the new tokens' K and V into their slots of one layer of the TokenAttention buffer.

``kv_layer[slots[t], :Hk] = k[t]`` and ``kv_layer[slots[t], Hk:] = v[t]``.
Grid: (token, block of kv heads).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    INDEX_DTYPES,
    check_last_dim_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
)


@triton.jit
def _copy_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slots_ptr,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head, stride_kv_slot, stride_kv_head,
    kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < kv_heads) & (offs_d[None, :] < head_dim)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    src = offs_h[:, None] * stride_k_head + offs_d[None, :]
    k = tl.load(k_ptr + token * stride_k_token + src, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    dst = kv_ptr + slot * stride_kv_slot + offs_h[:, None] * stride_kv_head + offs_d[None, :]
    tl.store(dst, k, mask=mask)
    tl.store(dst + kv_heads * stride_kv_head, v, mask=mask)


def _check(k, v, kv_layer, slots) -> None:
    check_tensor("k", k, 3)
    device = k.device
    check_tensor("v", v, 3, device=device)
    check_tensor("kv_layer", kv_layer, 3, device=device)
    check_tensor("slots", slots, 1, dtypes=INDEX_DTYPES, device=device)
    tokens, kv_heads, head_dim = k.shape
    check_shape("v", v, tuple(k.shape))
    check_shape("kv_layer", kv_layer, (None, 2 * kv_heads, head_dim))
    check_shape("slots", slots, (tokens,))
    check_same_dtype("v", v, k.dtype)
    check_same_dtype("kv_layer", kv_layer, k.dtype)
    for name, t in (("k", k), ("v", v), ("kv_layer", kv_layer)):
        check_last_dim_contiguous(name, t)


def copy_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, Hk, D] -> kv_layer [S+1, 2*Hk, D] at rows ``slots`` [T]."""
    _check(k, v, kv_layer, slots)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(kv_heads), max(1, 4096 // block_d))
    grid = (tokens, triton.cdiv(kv_heads, block_h))
    _copy_kv_kernel[grid](
        k, v, kv_layer, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_layer.stride(0), kv_layer.stride(1),
        kv_heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )


def copy_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor) -> None:
    kv_heads = k.shape[1]
    slots = slots.long()
    kv_layer[slots, :kv_heads] = k
    kv_layer[slots, kv_heads:] = v
