"""Activation-and-multiply of the fused gate/up projection: ``out = act(gate) * up``.

``act`` is a constexpr of the one kernel (``ACTIVATIONS``): SiLU (Llama's) or GeLU with the
tanh approximation (Gemma's ``gelu_pytorch_tanh``). Rounding mirrors Hugging Face's
``act(gate) * up`` in the activation dtype: the activation is rounded to the dtype before
the product, which is rounded again.
Grid: (token, block of the intermediate dim).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import check_last_dim_contiguous, check_tensor
from ._math import tanh
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, inter,
    BLOCK: tl.constexpr, PDL: tl.constexpr, GELU_TANH: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + token * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + token * stride_in + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:   # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as torch's approximate="tanh"
        act = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = round_to(act, gate.dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, round_to(act * up.to(tl.float32), gate.dtype), mask=mask)


ACTIVATIONS = ("silu", "gelu_tanh")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate = [:, :I], up = [:, I:]) -> new [T, I]."""
    return act_and_mul(gate_up, "silu")


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation`` (one of ``ACTIVATIONS``) of the gate times up: gate_up [T, 2I] -> new [T, I]."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
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
                               GELU_TANH=activation == "gelu_tanh", **launch_options(gate_up))
    return out


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def act_and_mul_ref(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    inter = gate_up.shape[-1] // 2
    gate = gate_up[:, :inter]
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * gate_up[:, inter:]
