"""FP8 GEMM: ``out = x @ dequant(weight).T + bias`` on float8_e4m3fn tensor cores (Hopper and newer).

The weight is an ``Fp8Weight``: float8_e4m3fn ``weight`` [N, K] and float32 ``scale`` [N] (per output
channel; a per-tensor checkpoint scale is repeated per channel at load), ``w[n, k] = weight[n, k] *
scale[n]``. Activations are quantized per token, dynamically: ``x_scale[m] =
max_k |x[m, k]| / 448``, ``x_fp8 = round_fp8(x * (1 / x_scale))`` (round to nearest even: the GPU's
saturating conversion, or on the interpreter the fp8 grid in float32, ``_rounding.fp8_grid``)
(``quantize_per_token`` is the same in torch).
Program ``(m, n)`` reads its first weight tile (before the PDL wait, ``_pdl``), then its rows' scales: on the
FMA path from its rows of x (a decode row in one or two loads; split-K programs each read whole rows for the
scales and multiply their chunk of K), on the tensor-core paths from ``quantize_rows``, launched first (a
16-row program would read 16 whole rows). Then it multiplies its ``[BLOCK_M, BLOCK_K]`` x tiles (quantized on
the fly, or read as fp8) and ``[BLOCK_N, BLOCK_K]`` weight tiles with float32 accumulation (products of two fp8
values are exact in float32), then applies ``x_scale[m] * scale[n]`` and the bias once. Three inner products:

- decode rows from FMA_ROWS + 1 up to ``SWAP_ROWS`` (the default): the tensor-core dot swapped,
  ``out.T = w @ x.T`` into a ``[BLOCK_N, 16]`` accumulator, x padded to 16 rows. Hopper's fp8 wgmma is 64 rows
  tall; here the weight rows fill those 64 and the few rows of x take its narrow side (16), where the unswapped
  dot would pad x to 64 rows. The weight tiles stream through shared memory (cp.async, ``num_stages`` deep)
  with no conversion instructions;
- 16 rows and more (``BLOCK_M >= 16``): fp8 tensor-core dots ``x @ w.T``. Hopper's (either way round) add a
  tile's products with fewer bits, so each tile's dot starts from zero and is added to the float32 accumulator
  (a promotion every BLOCK_K);
- FMA (``BLOCK_M < 16``; the default up to FMA_ROWS): elementwise float32 products of the fp8 values into a
  ``[BLOCK_N, BLOCK_M, BLOCK_K]`` accumulator, reduced over K after the loop (``skinny_gemm``'s FMA path).

``fp8_gemm_ref`` is the same maths in float32 torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._checks import check_bias, check_last_dim_contiguous, check_shape, check_tensor
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import fp8_grid
from .quant_gemm import fill_split_k, store_tile
from .skinny_gemm import DOT_ROWS, default_split_k, device_sms, reduce_split_k, split_k_partials, split_layout

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
    split_k: int = 1   # K chunks summed by skinny_gemm's reduce kernel (decode: more programs reading weights)
    swap_ab: bool = False  # the dot as ``out.T = w @ x.T``: weight rows fill the tensor core's 64-row side


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as float8_e4m3fn [M, K], float32 scales [M]) with ``x ~= x_fp8 * scale[:, None]``: ``scale = amax /
    448``, ``x_fp8 = round(x * (1 / scale))`` (one division a row, a product an element, as the kernel)."""
    x32 = x.float()
    amax = x32.abs().amax(dim=1)
    # tensor divisors: torch divides a CUDA tensor by a Python number as a product with its reciprocal,
    # one rounding away from the kernel's correctly rounded divisions
    scale = (amax / amax.new_full((), FP8_MAX)).clamp(min=1e-12)
    inverse = scale.new_ones(()) / scale
    return (x32 * inverse[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@triton.jit
def _row_amax(x_rows, m_mask, K, BLOCK_M: tl.constexpr, AMAX_K: tl.constexpr):
    """max_k |x[m, k]| of the program's rows (``x_rows``: [BLOCK_M, 1] pointers; float32 [BLOCK_M]), AMAX_K
    columns a load (the GEMM takes a whole decode row in one or two loads: one wait on memory, not one a tile)."""
    offs = tl.arange(0, AMAX_K)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, AMAX_K):
        x = tl.load(x_rows + k0 + offs[None, :], mask=m_mask[:, None] & ((k0 + offs) < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return amax


@triton.jit
def _row_scales(x_rows, m_mask, K, BLOCK_M: tl.constexpr, AMAX_K: tl.constexpr):
    """The rows' scales ``amax / 448`` (at least 1e-12) and their correctly rounded reciprocals ([BLOCK_M] each)."""
    scale = tl.maximum(tl.math.div_rn(_row_amax(x_rows, m_mask, K, BLOCK_M, AMAX_K), 448.0), 1e-12)
    return scale, tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), scale)


@triton.jit
def _fp8_values(x, HW_CVT: tl.constexpr):
    """float32 ``x`` (|x| <= 448 but for rounding) on the float8_e4m3fn grid, rounded to nearest even, as fp8: the
    GPU's conversion (``cvt.rn.satfinite``: round to nearest even, then clamp to +-448), or on the interpreter
    (whose conversion is not exact) a clamp and the float32 rounding of ``fp8_grid``: the same values."""
    if HW_CVT:
        q = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        q = fp8_grid(tl.minimum(tl.maximum(x, -448.0), 448.0), tl.float8e4nv).to(tl.float8e4nv)
    return q


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr,
                          HW_CVT: tl.constexpr):
    """Program m: row m of x to float8_e4m3fn with its scale (``quantize_per_token``), reading the row twice."""
    m = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m * stride_xm + offs_k[None, :]
    row = tl.full([1], 1, tl.int1)
    scale, inverse = _row_scales(x_ptr + m * stride_xm + tl.zeros([1, 1], tl.int64), row, K, 1, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32)
        q = _fp8_values(x * inverse[:, None], HW_CVT)
        tl.store(q_ptr + m * stride_qm + k0 + offs_k[None, :], q, mask=k_ok[None, :])
    tl.store(scale_ptr + m + tl.arange(0, 1), scale)


QUANTIZE_BLOCK = 1024


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token`` in one Triton launch (torch's takes about eight kernels over float32 copies of x):
    (float8_e4m3fn [M, K], float32 scales [M]), its values and scales exactly (a value rounded to zero is +0)."""
    check_tensor("x", x, 2)
    check_last_dim_contiguous("x", x)
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M and K:
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0),
                                    BLOCK_K=min(QUANTIZE_BLOCK, triton.next_power_of_2(K)), HW_CVT=x.is_cuda,
                                    num_warps=4)
    elif M:
        scale.fill_(1e-12)
    return q, scale


@triton.jit
def _load_weight_tile(w_ptrs, offs_k, k0, K, USE_DOT: tl.constexpr):
    """The weight tile at K offset ``k0``: [BLOCK_N, BLOCK_K] for the dot, [BLOCK_N, 1, BLOCK_K] for FMA (columns
    past K: 0). Weights only (no kernel writes them), so the first tile may be read before the PDL wait."""
    k_ok = (k0 + offs_k) < K
    if USE_DOT:
        w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs + k0, mask=k_ok[None, None, :], other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def _tile_dot(acc, w, x_ptrs, x_inverse, m_mask, offs_k, k0, K, USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
              X_FP8: tl.constexpr, HW_CVT: tl.constexpr):
    """acc += fp8(x tile * (1 / x_scale)) @ w.T, the weight tile ``w`` at K offset ``k0``: one tensor-core dot into
    [BLOCK_M, BLOCK_N] (USE_DOT), or its transpose ``w @ x.T`` into [BLOCK_N, BLOCK_M] (SWAP_AB), or elementwise
    float32 products into [BLOCK_N, BLOCK_M, BLOCK_K] (decode rows; each product of two fp8 values exact in
    float32). X_FP8: x is already quantized (``quantize_rows``), its tile is read as it is."""
    k_ok = (k0 + offs_k) < K
    x_mask = m_mask[:, None] & k_ok[None, :]
    if X_FP8:
        x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0)
    else:
        x = _fp8_values(tl.load(x_ptrs + k0, mask=x_mask, other=0.0).to(tl.float32) * x_inverse[:, None], HW_CVT)
    if SWAP_AB:
        acc = acc + tl.dot(w, tl.trans(x))
    elif USE_DOT:
        acc = acc + tl.dot(x, tl.trans(w))
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :, :]
    return acc


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
    stride_om, stride_split, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AMAX_K: tl.constexpr,
    USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, X_FP8: tl.constexpr, HW_CVT: tl.constexpr,
    NUM_STAGES: tl.constexpr, WHILE_LOOP: tl.constexpr, PDL: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    x_ptrs = x_rows + offs_k[None, :]
    rows = (offs_n % N).to(tl.int64)  # past-the-end columns re-read valid rows (no N mask on the weight loads)
    if USE_DOT:
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # the weight tile 3-D like the accumulator, as in skinny_gemm's FMA path
        w_ptrs = w_ptr + rows[:, None, None] * stride_wn + offs_k[None, None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # The first weight tile is read before waiting for the previous kernel (PDL: it overlaps that kernel's tail and
    # this one's reading of x for its scales); every split has at least one tile (split_layout).
    w = _load_weight_tile(w_ptrs, offs_k, k_begin, K, USE_DOT)
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    # the rows' dynamic scales (quantize_per_token's: quantize_rows' or the program's own), then the fp8 products
    if X_FP8:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=1.0)
        x_inverse = x_scale   # not read: the tiles are fp8 already
    else:
        x_scale, x_inverse = _row_scales(x_rows, m_mask, K, BLOCK_M, AMAX_K)
    acc = _tile_dot(acc, w, x_ptrs, x_inverse, m_mask, offs_k, k_begin, K, USE_DOT, SWAP_AB, X_FP8, HW_CVT)
    if WHILE_LOOP:  # the CPU interpreter cannot take runtime `range` bounds
        k0 = k_begin + BLOCK_K
        while k0 < k_end:
            w = _load_weight_tile(w_ptrs, offs_k, k0, K, USE_DOT)
            acc = _tile_dot(acc, w, x_ptrs, x_inverse, m_mask, offs_k, k0, K, USE_DOT, SWAP_AB, X_FP8, HW_CVT)
            k0 += BLOCK_K
    else:
        for k0 in tl.range(k_begin + BLOCK_K, k_end, BLOCK_K, num_stages=NUM_STAGES):
            w = _load_weight_tile(w_ptrs, offs_k, k0, K, USE_DOT)
            acc = _tile_dot(acc, w, x_ptrs, x_inverse, m_mask, offs_k, k0, K, USE_DOT, SWAP_AB, X_FP8, HW_CVT)
    if SWAP_AB:
        acc = tl.trans(acc)
    elif not USE_DOT:
        acc = tl.trans(tl.sum(acc, axis=2))
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * x_scale[:, None] * w_scale[None, :]
    store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, m_mask, n_mask, pid_k, stride_om, stride_split,
               HAS_BIAS, SPLIT)


AMAX_ELEMENTS = 8192   # x elements a program reads in one load for its rows' scales (a decode row of up to 8192)


def amax_block(block_m: int, block_k: int, K: int) -> int:
    """Columns of x a load for the rows' scales: the whole row (up to AMAX_ELEMENTS over the rows), at least
    BLOCK_K."""
    return max(block_k, min(triton.next_power_of_2(K), AMAX_ELEMENTS // block_m))


FMA_ROWS = 2   # up to here decode rows take the FMA path; then, up to SWAP_ROWS, the swapped dot
SWAP_ROWS = 16


def _config(M: int, N: int, K: int, num_sms: int) -> Fp8Config:
    """Decode rows up to FMA_ROWS: FMA products (skinny_gemm's FMA path with one byte a weight), the configs that
    led most Llama-2-7B shapes in sweeps on one H100 (bench.quant_gemm_bench; ms of linear layers a step, against
    bfloat16's skinny GEMM): 1 row [8 columns, 1024] tiles 4 stages deep, 2.52 ms (bf16 4.77; the best on three
    shapes and within 1.3% on qkv, where [16, 256] leads by 6%; the swapped dot, its scales then read in the
    program, took twice as long); 2 rows [32, 512] with 8 warps, 3.12 (4.77; each shape's best together 2.81,
    the swapped dot's best within 2% on gate_up only); K split only where the column blocks leave SMs idle.
    3 rows up to SWAP_ROWS: the swapped dot ``w @ x.T`` on x quantized first, [64 columns, 256] weight tiles 3
    stages deep (cp.async into shared memory, Hopper's fp8 wgmma 64x16x32), K split while the column blocks
    leave SMs idle: the best or within 0.5% of it on every shape at 4 and 16 rows, 3.29 and 3.38 ms (bf16 4.79
    and 4.91; at 4 rows the FMA path's [16, 256] took 4.66). More rows (fp8_linear sends bfloat16 to
    cuBLASLt): 64-row tiles, 128 columns wide once they fill the SMs (untuned)."""
    if M <= FMA_ROWS:
        block_m, block_n, block_k, warps, stages = (1, 8, 1024, 4, 4) if M == 1 else (2, 32, 512, 8, 4)
        return Fp8Config(block_m, block_n, block_k, warps, stages, default_split_k(N, K, block_n, block_k, num_sms))
    if M <= SWAP_ROWS:
        block_n, block_k = 64, 256
        split = fill_split_k(triton.cdiv(N, block_n), K, block_k, 1, num_sms)
        return Fp8Config(DOT_ROWS, block_n, block_k, 4, 3, split, True)
    wide = triton.cdiv(M, 64) * triton.cdiv(N, 128) >= num_sms
    return Fp8Config(64, 128 if wide else 64, 128, 8 if wide else 4, 3)


def _validated(config) -> Fp8Config:
    try:
        cfg = Fp8Config(*config)
    except TypeError:
        raise ValueError(f"config must be (block_m, block_n, block_k, num_warps, num_stages[, split_k[, "
                         f"swap_ab]]), got {config!r}") from None
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(cfg, name)
        if not (isinstance(value, int) and value > 0 and value & (value - 1) == 0):
            raise ValueError(f"{name} must be a power of two, got {value!r}")
    if cfg.block_m >= DOT_ROWS and min(cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"the tensor-core path (block_m >= {DOT_ROWS}) needs block_n and block_k >= 16, "
                         f"got {tuple(cfg)}")
    if not isinstance(cfg.swap_ab, bool):
        raise ValueError(f"swap_ab must be True or False, got {cfg.swap_ab!r}")
    if cfg.swap_ab and cfg.block_m < DOT_ROWS:
        raise ValueError(f"the swapped dot (swap_ab) pads x to block_m >= {DOT_ROWS} rows, got {tuple(cfg)}")
    return cfg


def _check(x, weight: Fp8Weight, bias) -> None:
    check_tensor("x", x, 2)
    check_last_dim_contiguous("x", x)
    check_tensor("weight", weight.weight, 2, dtypes=(FP8,), device=x.device)
    check_last_dim_contiguous("weight", weight.weight)
    n, k = weight.shape
    check_shape("x", x, (None, k))
    check_tensor("scale", weight.scale, 1, dtypes=(torch.float32,), device=x.device)
    check_shape("scale", weight.scale, (n,))
    check_bias(bias, n, x.device)


def fp8_gemm(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
             config: Fp8Config | tuple | None = None) -> torch.Tensor:
    """x [M, K] (quantized per token here) @ dequant(weight).T (+ bias [N]) -> new [M, N] in x's dtype. The
    tensor-core paths (``block_m >= 16``) take x quantized by ``quantize_rows`` first (one launch): their programs
    would each read all their rows' K columns for the scales; the FMA path's few rows quantize in the program."""
    _check(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    cfg = _validated(config) if config is not None else _config(M, N, K, device_sms(x.device))
    splits, k_per_split = split_layout(K, cfg)
    partial = split_k_partials(out, splits)
    bias_arg = bias if bias is not None else out
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), splits)
    pdl = launch_options(x)
    use_dot = cfg.block_m >= DOT_ROWS      # the tensor-core paths, which take x quantized first (X_FP8)
    x_in, x_scale = quantize_rows(x) if use_dot else (x, weight.scale)   # (weight.scale: a pointer never read)
    _fp8_gemm_kernel[grid](
        x_in, x_scale, weight.weight, weight.scale, bias_arg, partial, M, N, K, k_per_split,
        x_in.stride(0), weight.weight.stride(0), partial.stride(-2), partial.stride(0) if splits > 1 else 0,
        HAS_BIAS=bias is not None, SPLIT=splits > 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, AMAX_K=amax_block(cfg.block_m, cfg.block_k, K),
        NUM_STAGES=cfg.num_stages, USE_DOT=use_dot, SWAP_AB=cfg.swap_ab, X_FP8=use_dot,
        HW_CVT=x.is_cuda, WHILE_LOOP=not x.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    reduce_split_k(partial, bias, out, pdl)
    return out


FUSED_ROWS = 16   # up to here fp8_linear runs the Triton GEMM; more rows: cuBLASLt's FP8 GEMM (H100 runs below)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on an FP8 weight, activations quantized per token either way. Decode rows (up to
    FUSED_ROWS), CPU runs, float32 and odd shapes take ``fp8_gemm``; more bfloat16 rows on Hopper take torch's
    ``_scaled_mm`` with row-wise scales (the same fp8 products on cuBLASLt): on one H100 our GEMM's best config
    took 306 us for Llama-2-7B's qkv at 512 rows against 71 us for cuBLAS in bfloat16 (bench.quant_gemm_bench)."""
    if not _scaled_mm_fits(x, weight):
        return fp8_gemm(x, weight, bias)
    _check(x, weight, bias)
    x_fp8, x_scale = quantize_rows(x)
    out = torch._scaled_mm(x_fp8, weight.weight.t(), scale_a=x_scale[:, None], scale_b=weight.scale[None, :],
                           out_dtype=x.dtype)
    return out + bias if bias is not None else out


def _scaled_mm_fits(x: torch.Tensor, weight: Fp8Weight) -> bool:
    n, k = weight.shape
    return (x.shape[0] > FUSED_ROWS and x.is_cuda and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def fp8_gemm_ref(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
                 config: Fp8Config | tuple | None = None) -> torch.Tensor:
    x_fp8, x_scale = quantize_per_token(x)
    out = (x_fp8.float() @ weight.weight.float().T) * x_scale[:, None] * weight.scale[None, :]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
