"""LayerNorm (weight and bias), and the fused residual add + LayerNorm, one program per token row.

Rounding follows ``torch.nn.LayerNorm`` in the activation dtype (StarCoder2, Bloom): mean,
variance, normalisation and the affine ``* weight + bias`` all in float32, one rounding to
the dtype at the end. The fused variant first forms ``residual + x`` in the activation dtype
(as transformers' ``residual + hidden``) and writes it back into ``residual``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import check_last_dim_contiguous, check_same_dtype, check_shape, check_tensor
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to

MAX_HIDDEN = 65536


@triton.jit
def _layernorm_kernel(
    x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr,
    stride_x, stride_residual, stride_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # round the sum to the activation dtype, as the torch add does
        summed = round_to(h + r.to(tl.float32), x.dtype)
        tl.store(residual_ptr + row * stride_residual + cols, summed, mask=mask)
        h = summed.to(tl.float32)
    mean = tl.sum(h, axis=0) / hidden
    centred = tl.where(mask, h - mean, 0.0)
    variance = tl.sum(centred * centred, axis=0) / hidden
    normed = centred * tl.math.rsqrt(variance + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(normed * w + b, x.dtype), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    check_tensor("x", x, 2)
    check_last_dim_contiguous("x", x)
    for name, param in (("weight", weight), ("bias", bias)):
        check_tensor(name, param, 1, device=x.device)
        check_shape(name, param, (x.shape[1],))
        check_same_dtype(name, param, x.dtype)
        check_last_dim_contiguous(name, param)
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[1]} exceeds the kernel's limit of {MAX_HIDDEN}")


def _launch(x, residual, weight, bias, out, eps: float) -> None:
    tokens, hidden = x.shape
    if tokens == 0:
        return
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 256, 1), 16)
    res = residual if residual is not None else x
    _layernorm_kernel[(tokens,)](
        x, res, weight, bias, out,
        x.stride(0), res.stride(0), out.stride(0),
        hidden, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps, **launch_options(x),
    )


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (last dim contiguous), weight and bias [H] -> new [T, H] tensor, x's dtype."""
    _check(x, weight, bias)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, weight, bias, out, eps)
    return out


def add_layernorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """In place ``residual <- x + residual`` (in the dtype); returns layernorm(residual)."""
    _check(x, weight, bias)
    check_tensor("residual", residual, 2, device=x.device)
    check_shape("residual", residual, tuple(x.shape))
    check_same_dtype("residual", residual, x.dtype)
    check_last_dim_contiguous("residual", residual)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, bias, out, eps)
    return out


def layernorm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layernorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float) -> torch.Tensor:
    residual.copy_(residual + x)
    return layernorm_ref(residual, weight, bias, eps)
