"""RMSNorm, and the fused residual add + RMSNorm, one program per token row.

Rounding follows Hugging Face ``LlamaRMSNorm``: normalise in float32, round to the
activation dtype, then multiply by the weight and round again. The fused variant first
forms ``residual + x`` in the activation dtype (as HF's ``residual + hidden``) and
writes it back into ``residual``.

The norm stays a launch of its own. Run inside the skinny GEMM that reads it (every program
summing the residual tile, the rms applied in the epilogue, the sum written to a new tensor),
it was slower on one H200 (2026-11-30, µs a GEMM, chains in a CUDA graph with PDL, norm + GEMM
-> fused): Llama-2-7B gate|up 44.5 -> 47.6 and Qwen3-30B-A3B q|k|v 7.6 -> 9.2 at one row, where
the extra registers (72 -> 96 and 48 -> 59 a thread) leave fewer programs resident to hide the
weights' latency; 31.7 -> 51.6 and 49.3 -> 89.6 at two rows; only Llama-2-7B's q|k|v gained,
25.9 -> 24.7. Whole batch-1 steps (``bench.profile_step``): Llama-2-7B 3.708 -> 3.910 ms,
Qwen3-30B-A3B (16 layers) 0.928 -> 0.952. ``bench.launch_cost`` bounds what removing the norm
launches could save: 0.060 ms of Qwen3's 0.930, nothing of Llama-2-7B's 3.707 (PDL hides them
behind its larger GEMMs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    check_last_dim_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to

MAX_HIDDEN = 65536


@triton.jit
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_residual, stride_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)     # a weight: before the wait (kernels._pdl)
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # round the sum to the activation dtype, as the torch add does
        summed = round_to(h + r.to(tl.float32), x.dtype)
        tl.store(residual_ptr + row * stride_residual + cols, summed, mask=mask)
        h = summed.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / hidden
    normed = round_to(h * tl.math.rsqrt(variance + eps), x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(w * normed, x.dtype), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("x", x, 2)
    check_tensor("weight", weight, 1, device=x.device)
    check_shape("weight", weight, (x.shape[1],))
    check_same_dtype("weight", weight, x.dtype)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[1]} exceeds the kernel's limit of {MAX_HIDDEN}")


def _launch(x, residual, weight, out, eps: float) -> None:
    tokens, hidden = x.shape
    if tokens == 0:
        return
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 256, 1), 16)
    res = residual if residual is not None else x
    _rmsnorm_kernel[(tokens,)](
        x, res, weight, out,
        x.stride(0), res.stride(0), out.stride(0),
        hidden, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps, **launch_options(x),
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (last dim contiguous), weight [H] -> new [T, H] tensor, x's dtype."""
    _check(x, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, weight, out, eps)
    return out


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In place ``residual <- x + residual`` (in the dtype); returns rmsnorm(residual)."""
    _check(x, weight)
    check_tensor("residual", residual, 2, device=x.device)
    check_shape("residual", residual, tuple(x.shape))
    check_same_dtype("residual", residual, x.dtype)
    check_last_dim_contiguous("residual", residual)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, out, eps)
    return out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    residual.copy_(residual + x)
    return rmsnorm_ref(residual, weight, eps)
