"""The quantized KV cache's one format: how a K/V row is stored and read back.

``kv_scales`` travels beside ``kv_layer`` [S+1, 2*Hk, D] and its shape says the scheme:

| kv_layer dtype        | kv_scales                 | stored value                                   |
| --------------------- | ------------------------- | ---------------------------------------------- |
| the model's (16/32 b) | None                      | x                                              |
| int8                  | [S+1, 2*Hk] float32       | round(x / s), s = amax over the head dim / 127 |
|                       | (per token and KV head)   | (computed when the token is stored)            |
| float8 e4m3fn / e5m2  | [2] float32 (K's, V's)    | clamp(x / s, format's range), rounded to nearest even |

Dequantized: ``stored * s``. The rotary/store kernel quantizes as it writes (``quantize``);
the attention kernels read each gathered block in registers (``load_kv``), so no dequantized
copy of the cache ever exists: int8 blocks become float16 integers whose per-token scales multiply
the scores (K) and the probabilities (V) instead; fp8 blocks become float16 (which holds both
formats' values exactly; one conversion for two e4m3 values on Hopper) whose per-tensor scales
multiply the scores (K) and the weighted values (V). The decode kernel's walk without dots reads
both as float32 with integer ops (``int8_as_float32``, ``fp8_as_float32``).
The ``*_ref`` functions are the torch references.

fp8 values are rounded on the fp8 grid in float32 first (``_rounding.fp8_grid``), which gives the same
bits on the GPU and in the Triton CPU interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES
from ._rounding import fp8_grid

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
KV_DTYPES = (*FLOAT_DTYPES, *QUANTIZED_DTYPES)
INT8_MAX = 127.0
# (largest finite value, mantissa bits, smallest normal exponent) of each fp8 format
FP8_FORMATS = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}
# KV_SCALES constexpr of the kernels
NO_SCALES, TOKEN_SCALES, TENSOR_SCALES = 0, 1, 2


def scale_args(kv_layer: torch.Tensor, kv_scales: torch.Tensor | None) -> dict:
    """The kernels' trailing scale arguments (by name): the scales, their stride per slot and per kv
    head, the offset of V's scales from K's, and ``KV_SCALES``."""
    kv_heads = kv_layer.shape[1] // 2
    if kv_scales is None:         # unread
        args = (kv_layer, 0, 0, 0, NO_SCALES)
    elif kv_scales.dim() == 2:
        args = (kv_scales, kv_scales.stride(0), 1, kv_heads, TOKEN_SCALES)
    else:
        args = (kv_scales, 0, 0, 1, TENSOR_SCALES)
    names = ("scales_ptr", "stride_scale_slot", "stride_scale_head", "v_scale_offset", "KV_SCALES")
    return dict(zip(names, args))


def wide_slots(kv_layer: torch.Tensor) -> bool:
    """Whether a slot's offset into ``kv_layer`` (slot * its stride, in elements) can pass int32's range: the
    prefill kernel then computes the offsets in int64 (``WIDE_SLOTS``), else in int32, which takes the loop over
    128-key blocks (Llama-3.1-8B heads) from 603 to 540 SASS instructions (sm_90, Triton 3.6). One H200, one
    call, two runs each: ``bench.prefill_attention_bench`` whole 32k-token prompt 481-483 -> 489-490 TFLOP/s,
    100k 482-483 -> 486-488, a 4,096-token chunk at 32k 403-412 -> 412-422 but at 100k 478-483 -> 466-470; one
    prompt prefilled alone in 4,096-token chunks 1.332-1.333 -> 1.322-1.325 s (32k), 7.825-7.852 -> 7.785-7.800 s
    (100k); in another call, a step of one stream row beside a 32-token chunk at 90,000 keys 9.67 -> 9.50 ms.
    The decode and shared-prefix kernels (bound by memory, not timed with it) keep int64."""
    return kv_layer.shape[0] * kv_layer.stride(0) > 2 ** 31 - 1


def check_kv(kv_layer: torch.Tensor, kv_scales: torch.Tensor | None, dtype: torch.dtype) -> None:
    """``kv_layer`` holds ``dtype`` values unquantized, or a quantized dtype with its matching scales."""
    if kv_layer.dtype not in QUANTIZED_DTYPES:
        if kv_layer.dtype != dtype:
            raise ValueError(f"kv_layer has dtype {kv_layer.dtype} but must match {dtype}")
        if kv_scales is not None:
            raise ValueError(f"kv_scales given for an unquantized kv_layer ({kv_layer.dtype}); pass None")
        return
    if kv_scales is None or kv_scales.dtype != torch.float32 or kv_scales.device != kv_layer.device:
        raise ValueError(f"a {kv_layer.dtype} kv_layer needs float32 kv_scales on {kv_layer.device}, got "
                         f"{None if kv_scales is None else (kv_scales.dtype, str(kv_scales.device))}")
    if kv_layer.dtype == torch.int8:
        expected = tuple(kv_layer.shape[:2])
        if tuple(kv_scales.shape) != expected or kv_scales.stride(1) != 1:
            raise ValueError(f"int8 kv_scales have shape {tuple(kv_scales.shape)}; expected {expected} (one "
                             f"scale per slot and KV head, contiguous last dim)")
    elif tuple(kv_scales.shape) != (2,):
        raise ValueError(f"fp8 kv_scales have shape {tuple(kv_scales.shape)}; expected (2,): K's and V's scale")


# ---- Triton ---------------------------------------------------------------------------------


@triton.jit
def round_to_fp8(x, dtype: tl.constexpr):
    """float32 ``x`` clamped to the fp8 format's range, rounded to nearest even on its grid, in ``dtype``."""
    return fp8_grid(x, dtype).to(dtype)


@triton.jit
def quantize(x, scale, dtype: tl.constexpr):
    """float32 ``x`` divided by its (broadcast) ``scale`` and rounded to the int8 or fp8 ``dtype``."""
    y = x / scale
    if dtype == tl.int8:
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        return ((y + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        return round_to_fp8(y, dtype)


@triton.jit
def row_scales(a, b):
    """int8's scale of each row of the two halves ``a``, ``b`` [H, D/2] of a head: amax / 127 (1 for a zero row,
    whose values are all 0 whatever it is)."""
    amax = tl.maximum(tl.max(tl.abs(a), 1), tl.max(tl.abs(b), 1))
    return tl.where(amax > 0, amax / 127.0, 1.0)


@triton.jit
def int8_as_float16(x):
    """int8 values as float16, exactly, with integer ops: the byte biased by 128 (its sign bit flipped) under
    float16's exponent of 1024 is ``1152 + x``, then 1152 is subtracted. On an H100 that is a LOP3, a PRMT and
    half an HADD2 a value, where ``x.to(float32)`` and a narrowing take two quarter-rate conversions (the int8
    cache's attention was bound by them)."""
    bits = x.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x6480
    return bits.to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def int8_as_float32(x):
    """int8 values as float32, exactly, with integer ops: the byte biased by 128 (its sign bit flipped) as the low
    mantissa bits under float32's exponent of 2**23 is ``2**23 + 128 + x``, then that offset is subtracted: a byte
    extraction, a logic op and an FADD a value, no conversion instruction. For the float32 sums of the decode walk
    without dots (``kernels.decode_attention``), where ``int8_as_float16`` needed a float16 -> float32 conversion
    more: one H200, Llama-2-7B heads, 512 requests x 416 keys, us a layer 608.6 -> 527.1 (same launch)."""
    bits = x.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x4B000080
    return bits.to(tl.float32, bitcast=True) - 8388736.0


# fp8 bytes read as float32 with integer ops (``fp8_as_float32``): (the left shift that puts the format's exponent
# and mantissa bits under float32's, float32's exponent bias less the format's)
FP8_AS_FLOAT32 = {torch.float8_e4m3fn: (20, 120), torch.float8_e5m2: (21, 112)}


@triton.jit
def fp8_as_float32(x, SHIFT: tl.constexpr):
    """fp8 values as float32 times 2**-(float32's bias less the format's: ``FP8_AS_FLOAT32``),
    exactly, with integer ops: the sign-extended byte shifted left by ``SHIFT`` holds the format's exponent and
    mantissa under float32's and the sign above them, whose copies between are cleared. Subnormal fp8 values
    land on float32's subnormals (the GPU's FMAs keep them); the caller's power-of-two factors undo the offset.
    A byte extraction, a shift and a logic op a value, where ``.to(float32)`` takes two conversions."""
    bits = x.to(tl.int8, bitcast=True).to(tl.int32) << SHIFT
    return (bits & (((1 << (SHIFT + 7)) - 1) | -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def dot_query(q, UPCAST: tl.constexpr, KV_SCALES: tl.constexpr):
    """q as the attention's dots take it: float32 (UPCAST); float16 beside a quantized cache, whose values
    ``load_kv`` gives in float16 (q's bfloat16 values fit float16's range in practice, and gain mantissa); else as
    loaded."""
    if UPCAST:
        q = q.to(tl.float32)
    elif KV_SCALES != 0:
        q = q.to(tl.float16)
    return q


@triton.jit
def load_kv(base, slots, stride_kv_slot, mask, scale_base, stride_scale_slot, n_mask, dtype: tl.constexpr,
            KV_SCALES: tl.constexpr, BOUNDED: tl.constexpr):
    """One gathered K or V block [N, D] at ``slots`` in ``dtype``, unscaled, and its scales: per slot [N] float32
    for an int8 cache (exact integers; the caller scales the scores for K and the probabilities for V, [N]
    products instead of [N, D]), the tensor's one for fp8 (the caller scales the scores for K and the weighted
    values for V), 1 unquantized. ``scale_base``: this kv head's scales (per slot, or the one per-tensor value);
    ``n_mask``: the block's positions to read (when BOUNDED)."""
    x = tl.load(base + slots[:, None] * stride_kv_slot, mask=mask, other=0.0)
    scale = 1.0
    if KV_SCALES == 1:
        if BOUNDED:
            scale = tl.load(scale_base + slots * stride_scale_slot, mask=n_mask, other=0.0)
        else:
            scale = tl.load(scale_base + slots * stride_scale_slot)
        if dtype == tl.float16:
            x = int8_as_float16(x)
        else:
            x = x.to(dtype)
    elif KV_SCALES == 2:
        scale = tl.load(scale_base)
        x = x.to(dtype)
    return x, scale


# ---- torch references -----------------------------------------------------------------------


def quantize_ref(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] as stored in ``dtype``: (values, scales). int8 computes its scales [T, H] (``scale``
    unused); fp8 divides by the per-tensor ``scale`` (a 0-dim float32 tensor) and returns it."""
    x = x.float()
    if dtype == torch.int8:
        amax = x.abs().amax(dim=-1)
        scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
        return (x / scales[..., None]).clamp(-INT8_MAX, INT8_MAX).round().to(torch.int8), scales
    limit = FP8_FORMATS[dtype][0]
    return (x / scale).clamp(-limit, limit).to(dtype), scale


def dequantize_ref(x: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Stored K or V rows [N, H, D] -> float32; ``scales`` [N, H] (int8), a 0-dim per-tensor scale, or None."""
    if scales is None:
        return x.float()
    return x.float() * (scales[..., None] if scales.dim() == 2 else scales)


def gather_kv_ref(kv_layer: torch.Tensor, kv_scales: torch.Tensor | None, slots: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V [N, Hk, D] of ``slots`` (only those rows are dequantized)."""
    kv_heads = kv_layer.shape[1] // 2
    rows = kv_layer[slots]
    if kv_scales is None:
        return rows[:, :kv_heads].float(), rows[:, kv_heads:].float()
    if kv_scales.dim() == 2:
        k_scales, v_scales = kv_scales[slots, :kv_heads], kv_scales[slots, kv_heads:]
    else:
        k_scales, v_scales = kv_scales[0], kv_scales[1]
    return dequantize_ref(rows[:, :kv_heads], k_scales), dequantize_ref(rows[:, kv_heads:], v_scales)
