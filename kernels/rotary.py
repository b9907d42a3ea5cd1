"""Rotary position embedding (Neox / HF-Llama half-split style), in place on q and k.

``cos_sin_cache[p] = cat(cos(p * inv_freq) * scale, sin(p * inv_freq) * scale)`` is built
by the caller for every rope variant; the kernel only gathers row ``positions[t]``.
With ``x1 = x[..., :D/2]`` and ``x2 = x[..., D/2:]``:
``out1 = x1 * cos - x2 * sin`` and ``out2 = x2 * cos + x1 * sin`` (float32 math).
Grid: (token, block of heads); each program rotates a block of q heads and of k heads.
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
from ._rounding import round_to


@triton.jit
def _rotate_heads(x_ptr, stride_head, heads, head_block, cos, sin, offs_d, half, BLOCK_H: tl.constexpr):
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < half)
    ptr1 = x_ptr + offs_h[:, None] * stride_head + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + half, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(ptr1, round_to(a * cos - b * sin, x1.dtype), mask=mask)
    tl.store(ptr1 + half, round_to(b * cos + a * sin, x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cache_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_cache,
    q_heads, k_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_HALF)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=offs_d < half, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + half + offs_d, mask=offs_d < half, other=0.0)[None, :]
    if head_block * BLOCK_H < q_heads:
        _rotate_heads(q_ptr + token * stride_q_token, stride_q_head, q_heads, head_block,
                      cos, sin, offs_d, half, BLOCK_H)
    if head_block * BLOCK_H < k_heads:
        _rotate_heads(k_ptr + token * stride_k_token, stride_k_head, k_heads, head_block,
                      cos, sin, offs_d, half, BLOCK_H)


def _check(q, k, positions, cos_sin_cache) -> None:
    check_tensor("q", q, 3)
    device = q.device
    check_tensor("k", k, 3, device=device)
    check_tensor("positions", positions, 1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, dtypes=(torch.float32,), device=device)
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    check_shape("k", k, (tokens, None, head_dim))
    check_same_dtype("k", k, q.dtype)
    check_shape("positions", positions, (tokens,))
    check_shape("cos_sin_cache", cos_sin_cache, (None, head_dim))
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """In place: rotate q [T, Hq, D] and k [T, Hk, D] by the cache rows at ``positions`` [T]."""
    _check(q, k, positions, cos_sin_cache)
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if tokens == 0:
        return
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(max(q_heads, k_heads)), max(1, 2048 // block_half))
    grid = (tokens, triton.cdiv(max(q_heads, k_heads), block_h))
    _rotary_kernel[grid](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q_heads, k_heads, head_dim // 2,
        BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4,
    )


def rotary_embedding_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> None:
    half = q.shape[-1] // 2
    rows = cos_sin_cache[positions.long()]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated.to(x.dtype))
