"""FP8 GEMM: ``out = x @ dequant(weight).T + bias`` on float8_e4m3fn tensor cores (Hopper and newer).

The weight is an ``Fp8Weight``: float8_e4m3fn ``weight`` [N, K] and float32 ``scale`` [N] (per output
channel; a per-tensor checkpoint scale is repeated per channel at load), ``w[n, k] = weight[n, k] *
scale[n]``. Activations are quantized per token, dynamically, inside the kernel: ``x_scale[m] =
max_k |x[m, k]| / 448``, ``x_fp8 = round_fp8(x / x_scale)`` (``quantize_per_token`` is the same in torch).
Program ``(m, n)`` first reads its rows of x for their scales, then multiplies its ``[BLOCK_M, BLOCK_K]``
x tiles, quantized on the fly, and ``[BLOCK_N, BLOCK_K]`` weight tiles in fp8 with float32 accumulation
(products of two fp8 values are exact in float32), then applies ``x_scale[m] * scale[n]`` and the bias
once. ``fp8_gemm_ref`` is the same maths in float32 torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._checks import check_last_dim_contiguous, check_shape, check_tensor
from ._rounding import round_to
from .skinny_gemm import device_sms

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class Fp8Weight:
    """A float8_e4m3fn linear weight [N, K] with a float32 scale per output channel."""
    weight: torch.Tensor     # float8_e4m3fn [N, K]
    scale: torch.Tensor      # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)


class Fp8Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as float8_e4m3fn [M, K], float32 scales [M]) with ``x ~= x_fp8 * scale[:, None]``."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (x32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@triton.jit
def _to_fp8(v, EMULATE_CAST: tl.constexpr):
    """float32 ``v`` (within +-448) to float8_e4m3fn, rounded to nearest even. The GPU's cast does that; the
    CPU interpreter's drops the carry when the mantissa rounds up, so there the value is rounded by hand
    first (normals: 3 mantissa bits; subnormals: multiples of 2^-9) and the cast is then exact."""
    if EMULATE_CAST:
        a = tl.abs(v)
        bits = a.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        subnormal = (a + 16384.0) - 16384.0          # float32's spacing at 2^14 is 2^-9
        rounded = tl.where(a >= 0.015625, normal, subnormal)
        v = tl.where(v < 0, -rounded, rounded)
    return v.to(tl.float8e4nv)


@triton.jit
def _row_amax(x_ptrs, m_mask, offs_k, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """max_k |x[m, k]| of the program's rows (float32, [BLOCK_M])."""
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return amax


@triton.jit
def _tile_dot(acc, x_ptrs, w_ptrs, x_scale, m_mask, offs_k, k0, K, EMULATE_CAST: tl.constexpr):
    """acc += fp8(x tile / x_scale) @ w tile.T at K offset ``k0``."""
    k_ok = (k0 + offs_k) < K
    x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    x = tl.minimum(tl.maximum(tl.math.div_rn(x, x_scale[:, None]), -448.0), 448.0)
    w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
    return tl.dot(_to_fp8(x, EMULATE_CAST), tl.trans(w), acc)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, WHILE_LOOP: tl.constexpr, EMULATE_CAST: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + (offs_n % N)[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # the rows' dynamic scales (quantize_per_token's), then the fp8 products
    x_scale = tl.maximum(tl.math.div_rn(_row_amax(x_ptrs, m_mask, offs_k, K, BLOCK_M, BLOCK_K), 448.0), 1e-12)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if WHILE_LOOP:  # the CPU interpreter cannot take runtime `range` bounds
        k0 = 0
        while k0 < K:
            acc = _tile_dot(acc, x_ptrs, w_ptrs, x_scale, m_mask, offs_k, k0, K, EMULATE_CAST)
            k0 += BLOCK_K
    else:
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            acc = _tile_dot(acc, x_ptrs, w_ptrs, x_scale, m_mask, offs_k, k0, K, EMULATE_CAST)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _config(M: int, N: int, num_sms: int) -> Fp8Config:
    """Not tuned on a GPU yet (first guesses). Decode batches: 16-row tiles, narrow column blocks (more
    programs to read the weights); more rows: 64-row tiles, 128 columns wide once they fill the SMs."""
    if M <= 16:
        return Fp8Config(16, 32, 128, 4, 4)
    wide = triton.cdiv(M, 64) * triton.cdiv(N, 128) >= num_sms
    return Fp8Config(64, 128 if wide else 64, 128, 8 if wide else 4, 3)


def _check(x, weight: Fp8Weight, bias) -> None:
    check_tensor("x", x, 2)
    check_last_dim_contiguous("x", x)
    check_tensor("weight", weight.weight, 2, dtypes=(FP8,), device=x.device)
    check_last_dim_contiguous("weight", weight.weight)
    n, k = weight.shape
    check_shape("x", x, (None, k))
    check_tensor("scale", weight.scale, 1, dtypes=(torch.float32,), device=x.device)
    check_shape("scale", weight.scale, (n,))
    if bias is not None:
        check_tensor("bias", bias, 1, device=x.device)
        check_shape("bias", bias, (n,))


def fp8_gemm(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
             config: Fp8Config | tuple | None = None) -> torch.Tensor:
    """x [M, K] (quantized per token here) @ dequant(weight).T (+ bias [N]) -> new [M, N] in x's dtype."""
    _check(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    cfg = Fp8Config(*config) if config is not None else _config(M, N, device_sms(x.device))
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n))
    _fp8_gemm_kernel[grid](
        x, weight.weight, weight.scale, bias if bias is not None else out, out, M, N, K,
        x.stride(0), weight.weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        WHILE_LOOP=not x.is_cuda, EMULATE_CAST=not x.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def fp8_gemm_ref(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
                 config: Fp8Config | tuple | None = None) -> torch.Tensor:
    x_fp8, x_scale = quantize_per_token(x)
    out = (x_fp8.float() @ weight.weight.float().T) * x_scale[:, None] * weight.scale[None, :]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
