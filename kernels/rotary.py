"""Rotary position embedding (Neox / HF-Llama half-split style) fused with the KV-cache write.

For every new token ``t`` of a step:

- ``q[t]`` is rotated in place;
- ``kv_layer[slots[t], :Hk] = rotate(k[t])`` and ``kv_layer[slots[t], Hk:] = v[t]``
  (``k`` itself is left as it was: attention reads K from the cache).

Without a ``cos_sin_cache`` (models with no rotary embedding: Bloom's ALiBi) the same kernel only
stores: q is left as it is and K is written unrotated (the ``ROTARY`` constexpr).

``cos_sin_cache[p] = cat(cos(p * inv_freq) * scale, sin(p * inv_freq) * scale)`` is built
by the caller for every rope variant; the kernel only gathers row ``positions[t]``.
With ``x1 = x[..., :D/2]`` and ``x2 = x[..., D/2:]``:
``out1 = x1 * cos - x2 * sin`` and ``out2 = x2 * cos + x1 * sin`` (float32 math, rounded to
the dtype). One kernel instead of a rotary kernel plus a copy kernel saves a launch and a
round trip of K through memory per layer. Qwen3's per-head q/k RMSNorm (``head_norms``) runs in
the same kernel before the rotation: two launches fewer a layer.
Grid: (token, block of heads); each program handles a block of q heads and of kv heads.
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
from ._kv_quant import KV_DTYPES, check_kv, quantize, quantize_ref, row_scales, scale_args
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to
from .rmsnorm import rmsnorm_ref


@triton.jit
def _norm_weight(weight_ptr, offs_d, half):
    """The halves [1, BLOCK_HALF] of a head norm's weight [D], in float32 (read before the PDL wait: a weight)."""
    w1 = tl.load(weight_ptr + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(weight_ptr + half + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
    return w1, w2


@triton.jit
def _head_rmsnorm(x1, x2, w1, w2, eps, half):
    """Heads [BLOCK_H, D] held as two halves, each RMS-normed over D and scaled by the weight's halves ``w1``,
    ``w2`` (``_norm_weight``), rounded as ``kernels.rmsnorm`` (and transformers' RMSNorm): the normalised value
    to the dtype, then the product."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * half) + eps)[:, None]
    n1 = round_to(w1 * round_to(a * rstd, x1.dtype).to(tl.float32), x1.dtype)
    n2 = round_to(w2 * round_to(b * rstd, x1.dtype).to(tl.float32), x1.dtype)
    return n1, n2


@triton.jit
def _write_heads(src_ptr, src_stride_head, dst_ptr, dst_stride_head, heads, head_block, cos, sin, offs_d, half,
                  BLOCK_H: tl.constexpr, ROTATE: tl.constexpr, scale_ptr=None, stride_scale_head=0,
                  KV_SCALES: tl.constexpr = 0, norm_weight=None, eps=0.0, NORM: tl.constexpr = False):
    """dst heads of the block <- the src heads rotated (``ROTATE``) or copied as they are; into a quantized
    cache (``KV_SCALES``) quantized, int8's per-head scales written at ``scale_ptr``. ``NORM``: each head
    RMS-normed over the head dim first, with ``norm_weight``'s halves (``_head_rmsnorm``)."""
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < half)
    src1 = src_ptr + offs_h[:, None] * src_stride_head + offs_d[None, :]
    dst1 = dst_ptr + offs_h[:, None] * dst_stride_head + offs_d[None, :]
    x1 = tl.load(src1, mask=mask, other=0.0)
    x2 = tl.load(src1 + half, mask=mask, other=0.0)
    if NORM:
        x1, x2 = _head_rmsnorm(x1, x2, norm_weight[0], norm_weight[1], eps, half)
    if ROTATE:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        y1 = a * cos - b * sin
        y2 = b * cos + a * sin
    else:
        y1 = x1.to(tl.float32)
        y2 = x2.to(tl.float32)
    dtype = dst_ptr.dtype.element_ty
    if KV_SCALES == 1:
        scale = row_scales(y1, y2)
        tl.store(scale_ptr + offs_h * stride_scale_head, scale, mask=offs_h < heads)
        tl.store(dst1, quantize(y1, scale[:, None], dtype), mask=mask)
        tl.store(dst1 + half, quantize(y2, scale[:, None], dtype), mask=mask)
    elif KV_SCALES == 2:
        scale = tl.load(scale_ptr)
        tl.store(dst1, quantize(y1, scale, dtype), mask=mask)
        tl.store(dst1 + half, quantize(y2, scale, dtype), mask=mask)
    elif ROTATE:
        tl.store(dst1, round_to(y1, dtype), mask=mask)
        tl.store(dst1 + half, round_to(y2, dtype), mask=mask)
    else:
        tl.store(dst1, x1, mask=mask)
        tl.store(dst1 + half, x2, mask=mask)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, slots_ptr, cache_ptr, kv_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_cache, stride_kv_slot, stride_kv_head,
    q_heads, kv_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
    scales_ptr, stride_scale_slot, stride_scale_head, v_scale_offset, KV_SCALES: tl.constexpr,
    ROTARY: tl.constexpr = True, q_norm_ptr=None, k_norm_ptr=None, eps=0.0, HEAD_NORM: tl.constexpr = False,
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_HALF)
    # Before the PDL wait (kernels._pdl): the positions and slots, which the step's inputs hold (written before
    # the norm and the qkv projection, two or more launches back: read through L2), the cos/sin rows and the head
    # norms' weights (never written), so that only q, k and v are read after it
    if ROTARY:
        pos = tl.load(positions_ptr + token, cache_modifier=".cg").to(tl.int64)
        cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=offs_d < half, other=0.0)[None, :]
        sin = tl.load(cache_ptr + pos * stride_cache + half + offs_d, mask=offs_d < half, other=0.0)[None, :]
    else:                       # no rotation: positions, the cache and q are not read (cos/sin unused)
        cos = tl.zeros([1, BLOCK_HALF], dtype=tl.float32)
        sin = cos
    slot = tl.load(slots_ptr + token, cache_modifier=".cg").to(tl.int64)
    q_norm = _norm_weight(q_norm_ptr, offs_d, half) if HEAD_NORM else None
    k_norm = _norm_weight(k_norm_ptr, offs_d, half) if HEAD_NORM else None
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    if ROTARY:
        if head_block * BLOCK_H < q_heads:
            q_row = q_ptr + token * stride_q_token
            _write_heads(q_row, stride_q_head, q_row, stride_q_head, q_heads, head_block,
                          cos, sin, offs_d, half, BLOCK_H, True, norm_weight=q_norm, eps=eps, NORM=HEAD_NORM)
    if head_block * BLOCK_H < kv_heads:
        slot_row = kv_ptr + slot * stride_kv_slot
        k_scales = scales_ptr + slot * stride_scale_slot
        _write_heads(k_ptr + token * stride_k_token, stride_k_head, slot_row, stride_kv_head, kv_heads, head_block,
                      cos, sin, offs_d, half, BLOCK_H, ROTARY, k_scales, stride_scale_head, KV_SCALES,
                      k_norm, eps, HEAD_NORM)
        _write_heads(v_ptr + token * stride_v_token, stride_v_head, slot_row + kv_heads * stride_kv_head,
                      stride_kv_head, kv_heads, head_block, cos, sin, offs_d, half, BLOCK_H, False,
                      k_scales + v_scale_offset, stride_scale_head, KV_SCALES)


def _check(q, k, v, positions, cos_sin_cache, kv_layer, slots, kv_scales, head_norms=None) -> None:
    check_tensor("q", q, 3)
    device = q.device
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (the kernel moves each head in two halves), got {head_dim}")
    check_tensor("k", k, 3, device=device)
    check_shape("k", k, (tokens, None, head_dim))
    check_tensor("v", v, 3, device=device)
    check_shape("v", v, tuple(k.shape))
    check_tensor("kv_layer", kv_layer, 3, dtypes=KV_DTYPES, device=device)
    check_shape("kv_layer", kv_layer, (None, 2 * k.shape[1], head_dim))
    check_kv(kv_layer, kv_scales, q.dtype)
    for name, t in (("k", k), ("v", v)):
        check_same_dtype(name, t, q.dtype)
    check_tensor("slots", slots, 1, dtypes=INDEX_DTYPES, device=device)
    check_shape("slots", slots, (tokens,))
    for name, t in (("q", q), ("k", k), ("v", v), ("kv_layer", kv_layer)):
        check_last_dim_contiguous(name, t)
    if head_norms is not None:
        q_norm, k_norm, _ = head_norms
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            check_tensor(name, w, 1, device=device)
            check_shape(name, w, (head_dim,))
            check_same_dtype(name, w, q.dtype)
    if cos_sin_cache is None:
        if positions is not None:
            raise ValueError("positions given without a cos_sin_cache: pass both to rotate, neither to only store")
        if head_norms is not None:
            raise ValueError("head_norms need the rotation (a cos_sin_cache): the kernel norms the heads it rotates")
        return
    check_tensor("positions", positions, 1, dtypes=INDEX_DTYPES, device=device)
    check_shape("positions", positions, (tokens,))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, dtypes=(torch.float32,), device=device)
    check_shape("cos_sin_cache", cos_sin_cache, (None, head_dim))
    check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None,
                    cos_sin_cache: torch.Tensor | None, kv_layer: torch.Tensor, slots: torch.Tensor,
                    kv_scales: torch.Tensor | None = None,
                    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """Rotate q [T, Hq, D] in place; write rotated k and v [T, Hk, D] into kv_layer [S+1, 2*Hk, D] at ``slots``,
    quantized when the cache is (``kv_scales``, ``kernels._kv_quant``: int8's scales written, fp8's read).
    ``positions`` and ``cos_sin_cache`` None: no rotation (q untouched, k stored as it is).
    ``head_norms`` (q_norm [D], k_norm [D], eps): each q and k head RMS-normed before the rotation
    (Qwen3), in the same launch."""
    _check(q, k, v, positions, cos_sin_cache, kv_layer, slots, kv_scales, head_norms)
    rotary = cos_sin_cache is not None
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if tokens == 0:
        return
    block_half = triton.next_power_of_2(head_dim // 2)
    heads = max(q_heads, kv_heads) if rotary else kv_heads           # the heads a token's programs write
    block_h = min(triton.next_power_of_2(heads), max(1, 512 // block_half))  # 8 heads of 128 a program
    grid = (tokens, triton.cdiv(heads, block_h))
    _rotary_store_kv_kernel[grid](
        q, k, v, positions if rotary else slots, slots, cos_sin_cache if rotary else q, kv_layer,   # unread stand-ins
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0) if rotary else 0, kv_layer.stride(0), kv_layer.stride(1),
        q_heads, kv_heads, head_dim // 2,
        BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4, **launch_options(q), **scale_args(kv_layer, kv_scales),
        ROTARY=rotary, **_norm_args(head_norms),
    )


def _norm_args(head_norms) -> dict:
    if head_norms is None:
        return {}
    q_norm, k_norm, eps = head_norms
    return dict(q_norm_ptr=q_norm, k_norm_ptr=k_norm, eps=float(eps), HEAD_NORM=True)


def rotate_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the cache rows at ``positions``, as a new tensor in x's dtype."""
    half = x.shape[-1] // 2
    rows = cos_sin_cache[positions.long()]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None,
                        cos_sin_cache: torch.Tensor | None, kv_layer: torch.Tensor, slots: torch.Tensor,
                        kv_scales: torch.Tensor | None = None,
                        head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    kv_heads = k.shape[1]
    slots = slots.long()
    if head_norms is not None:
        q_norm, k_norm, eps = head_norms
        q.copy_(rmsnorm_ref(q, q_norm, eps))
        k = rmsnorm_ref(k, k_norm, eps)

    def rotate(x):
        return x if cos_sin_cache is None else rotate_ref(x, positions, cos_sin_cache)

    if cos_sin_cache is not None:
        q.copy_(rotate(q))
    if kv_scales is None:
        kv_layer[slots, :kv_heads] = rotate(k)
        kv_layer[slots, kv_heads:] = v
        return
    for half, x, per_tensor in ((slice(None, kv_heads), rotate(k.float()), 0),
                                (slice(kv_heads, None), v, 1)):
        values, scales = quantize_ref(x, kv_layer.dtype, kv_scales[per_tensor] if kv_scales.dim() == 1 else None)
        kv_layer[slots, half] = values
        if kv_scales.dim() == 2:
            kv_scales[slots, half] = scales
