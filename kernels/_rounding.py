"""Rounding float32 values to the storage dtype, shared by the kernels.

``x.to(tl.bfloat16)`` rounds to nearest even on the GPU but truncates under the Triton CPU
interpreter; rounding the bits by hand first gives the same result on both. Likewise for fp8: the
interpreter converts float32 to fp8 by truncating the mantissa (its "round to nearest" mode carries wrongly
into the exponent) but converts representable values exactly, so ``fp8_grid`` rounds on the fp8 grid in
float32 first (the KV cache's fp8 stores, the FP8 GEMM's activations).
"""
import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to nearest even in ``dtype`` (fp16, bf16 or fp32)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # noqa: PLR0124 (keep NaN a NaN)
    return x.to(dtype)


@triton.jit
def fp8_grid(x, dtype: tl.constexpr):
    """float32 ``x`` clamped to the fp8 ``dtype``'s range (float8e4nv or float8e5) and rounded to nearest even on its
    grid (subnormals included), still float32: ``.to(dtype)`` is then exact."""
    if dtype == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        exponent = tl.maximum(((x.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127, -6)
        up = ((127 + 3 - exponent) << 23).to(tl.float32, bitcast=True)        # 2 ** (mantissa bits - exponent)
        down = ((127 - 3 + exponent) << 23).to(tl.float32, bitcast=True)
    else:
        x = tl.minimum(tl.maximum(x, -57344.0), 57344.0)
        exponent = tl.maximum(((x.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127, -14)
        up = ((127 + 2 - exponent) << 23).to(tl.float32, bitcast=True)
        down = ((127 - 2 + exponent) << 23).to(tl.float32, bitcast=True)
    y = x * up                                      # |y| < 2 ** (mantissa bits + 1): an integer on the grid
    y = (y + 12582912.0) - 12582912.0              # + 1.5 * 2**23 and back: |y| < 2**22 rounded to nearest even
    return y * down
