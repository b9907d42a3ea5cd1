"""GeLU of a non-gated MLP's up projection (StarCoder2, Bloom): ``out = gelu(x)``.

``approximate`` is torch's: ``"tanh"`` (transformers' ``gelu_pytorch_tanh``) or ``"none"``
(the exact erf form, ``gelu``). The value is computed in float32 and rounded once to the
activation dtype, as ``F.gelu`` does on a half-precision tensor.
Grid: (token, block of the feature dim).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import check_last_dim_contiguous, check_tensor
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to

APPROXIMATIONS = ("tanh", "none")


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); |x| > 15 is +-1 in float32, so clamp (no exp overflow)
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _gelu_kernel(x_ptr, out_ptr, stride_in, stride_out, width,
                 TANH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + token * stride_in + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if TANH:
        inner = 0.7978845608028654 * (h + 0.044715 * h * h * h)     # sqrt(2 / pi) * (x + 0.044715 x^3)
        y = 0.5 * h * (1.0 + _tanh(inner))
    else:
        y = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))  # x * Phi(x)
    tl.store(out_ptr + token * stride_out + cols, round_to(y, x.dtype), mask=mask)


def _check_approximate(approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} is not a GeLU form; choose one of {', '.join(APPROXIMATIONS)}")


def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """x [T, N] (last dim contiguous) -> new [T, N], x's dtype."""
    check_tensor("x", x, 2)
    check_last_dim_contiguous("x", x)
    _check_approximate(approximate)
    tokens, width = x.shape
    out = torch.empty((tokens, width), dtype=x.dtype, device=x.device)
    if tokens == 0 or width == 0:
        return out
    block = min(triton.next_power_of_2(width), 1024)
    grid = (tokens, triton.cdiv(width, block))
    _gelu_kernel[grid](x, out, x.stride(0), out.stride(0), width, TANH=approximate == "tanh", BLOCK=block,
                       num_warps=4, **launch_options(x))
    return out


def gelu_ref(x: torch.Tensor, approximate: str) -> torch.Tensor:
    _check_approximate(approximate)
    return F.gelu(x, approximate=approximate)
