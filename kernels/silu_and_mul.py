"""SiLU-and-multiply of the fused gate/up projection: ``out = silu(gate) * up``.

Rounding mirrors Hugging Face's ``F.silu(gate) * up`` in the activation dtype: the
SiLU result is rounded to the dtype before the product, which is rounded again.
Grid: (token, block of the intermediate dim).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import check_last_dim_contiguous, check_tensor
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, inter,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + token * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + token * stride_in + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = round_to(g / (1.0 + tl.exp(-g)), gate.dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, round_to(silu * up.to(tl.float32), gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate = [:, :I], up = [:, I:]) -> new [T, I]."""
    check_tensor("gate_up", gate_up, 2)
    check_last_dim_contiguous("gate_up", gate_up)
    tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up side by side), got {width}")
    inter = width // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
                               **launch_options(gate_up))
    return out


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
