"""Rounding float32 values to the storage dtype, shared by the kernels.

``x.to(tl.bfloat16)`` rounds to nearest even on the GPU but truncates under the Triton CPU
interpreter; rounding the bits by hand first gives the same result on both.
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
