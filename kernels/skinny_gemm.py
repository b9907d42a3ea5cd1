"""Skinny GEMM for decode: ``out = x @ weight.T + bias`` with few rows (``M <= MAX_ROWS``).

At decode batch sizes the linear layers are weight-bandwidth bound: every weight byte is
read once and used for only ``M`` multiply-adds. Program ``(n, s)`` owns the ``BLOCK_N``
output columns ``[n * BLOCK_N, (n + 1) * BLOCK_N)`` (contiguous weight rows) and the
``s``-th of ``SPLIT_K`` chunks of K, which it walks in ``[BLOCK_N, BLOCK_K]`` weight tiles
(row-contiguous loads, pipelined ``num_stages`` deep) against the ``[BLOCK_M, BLOCK_K]``
tile of x. Two inner products, chosen by the config:

- FMA (``use_dot=False``): ``BLOCK_M = next_pow2(M)``; a float32 ``[BLOCK_N, BLOCK_M, BLOCK_K]``
  accumulator takes elementwise products, reduced over K once after the loop.
- dot (``use_dot=True``): x is padded to 16 rows (``tl.dot``'s minimum) and each tile is one
  ``[BLOCK_N, BLOCK_K] @ [BLOCK_K, 16]`` tensor-core product into a float32 accumulator.

With one split the program adds the bias and stores the output rounded to x's dtype.
With several, it stores float32 partials into a ``[SPLIT_K, M, N]`` buffer and a second
kernel, grid (row, block of N), sums them in split order, adds the bias and rounds: no
atomics, so results are bit-reproducible. Configs are explicit (``_config`` or the caller's
``config=``), never autotuned, so a launch is deterministic and CUDA-graph capturable.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import (
    check_last_dim_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
    upcast_dots,
)
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to

MAX_ROWS = 16
DOT_ROWS = 16        # tl.dot needs at least 16 rows: the dot path pads x to this
MAX_SPLIT_K = 16
H100_SMS = 132
REDUCE_BLOCK = 1024
FMA_ACC_BUDGET = 64  # float32 accumulator registers a thread that default and swept FMA configs stay within


class SkinnyConfig(NamedTuple):
    """Launch parameters of ``skinny_gemm``.

    block_n: output columns (weight rows) a program owns; block_k: the K tile; split_k: K chunks,
    an upper bound (no split is left without K tiles, see ``split_layout``); num_warps, num_stages:
    as in Triton (num_stages also pipelines the FMA path's loads); use_dot: the tensor-core path
    (x padded to 16 rows) instead of the FMA path.
    """
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    use_dot: bool = False


@triton.jit
def _load_weight_tile(w_ptrs, offs_k, k0, K, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr):
    """The weight tile at K offset ``k0``: [BLOCK_N, BLOCK_K] on the dot path, [BLOCK_N, 1, BLOCK_K] on FMA."""
    if EVEN_K:
        return tl.load(w_ptrs + k0, eviction_policy="evict_first")
    k_ok = (k0 + offs_k) < K
    w_mask = k_ok[None, :] if USE_DOT else k_ok[None, None, :]
    return tl.load(w_ptrs + k0, mask=w_mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _accumulate_tile(acc, w, x_ptrs, offs_k, k0, K, m_mask,
                     EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """acc += the products of the weight tile ``w`` and the x tile [BLOCK_M, BLOCK_K] at K offset ``k0``."""
    if EVEN_K:
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
    if USE_DOT:
        if UPCAST:  # IEEE fp32 dots, not TF32 (and the interpreter's bf16 dot is broken)
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :, :]
    return acc


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_split,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr, WHILE_LOOP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = (offs_n % N).to(tl.int64)  # past-the-end columns re-read valid rows (no N mask on the weight loads)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    # On the FMA path the weight load is 3-D like the accumulator, so the accumulator takes
    # its vectorised layout and the loop converts only the small x tile.
    if USE_DOT:
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        w_ptrs = w_ptr + rows[:, None, None] * stride_wn + offs_k[None, None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    # The first weight tile is read before waiting for the previous kernel (weights are never
    # written), so with PDL its load overlaps that kernel's tail; every split has at least one tile.
    # Reading 2 or 4 tiles before the wait was slower on one H200 (stop 63, every one-row config, A P2 P4 twice):
    # Qwen3-30B-A3B's 16-layer bench.moe_bench 1,047.3 / 1,047.7 -> 1,041.7 / 1,038.4 (2) and 1,005.2 / 1,004.6
    # (4) tokens/s; Llama-2-7B's batch-1 step (bench.profile_step) 3.647 -> 3.697 (2) and 3.939 ms (4).
    w_first = _load_weight_tile(w_ptrs, offs_k, k_begin, K, EVEN_K, USE_DOT)
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    acc = _accumulate_tile(acc, w_first, x_ptrs, offs_k, k_begin, K, m_mask, EVEN_K, USE_DOT, UPCAST)
    if WHILE_LOOP:  # the CPU interpreter cannot take runtime `range` bounds (numpy >= 2.4)
        k0 = k_begin + BLOCK_K
        while k0 < k_end:
            w = _load_weight_tile(w_ptrs, offs_k, k0, K, EVEN_K, USE_DOT)
            acc = _accumulate_tile(acc, w, x_ptrs, offs_k, k0, K, m_mask, EVEN_K, USE_DOT, UPCAST)
            k0 += BLOCK_K
    else:  # an explicit num_stages also pipelines the loads of the FMA path (no dot in the loop)
        for k0 in tl.range(k_begin + BLOCK_K, k_end, BLOCK_K, num_stages=NUM_STAGES):
            w = _load_weight_tile(w_ptrs, offs_k, k0, K, EVEN_K, USE_DOT)
            acc = _accumulate_tile(acc, w, x_ptrs, offs_k, k0, K, m_mask, EVEN_K, USE_DOT, UPCAST)
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)

    # acc is [BLOCK_N, BLOCK_M]: out[m, n] = acc[n, m]
    out_offs = offs_m[None, :] * stride_om + offs_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * stride_split + out_offs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + out_offs, round_to(acc, out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr, bias_ptr, out_ptr, N, stride_split, stride_pm, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, cols] = sum over s in order of partial[s, m, cols] (+ bias), rounded to out's dtype."""
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + s * stride_split + m * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, round_to(acc, out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _properties(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def _cuda_properties(device: torch.device):
    """The CUDA device's properties (read once per device), None off CUDA."""
    if device.type != "cuda":
        return None
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


def device_name(device: torch.device) -> str:
    """The CUDA device's name ("NVIDIA H200"), "" off CUDA (``TUNED`` keys)."""
    props = _cuda_properties(device)
    return props.name if props is not None else ""


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the H100's 132 off CUDA, so CPU runs pick GPU configs)."""
    props = _cuda_properties(device)
    return props.multi_processor_count if props is not None else H100_SMS


def default_split_k(N: int, K: int, block_n: int, block_k: int, num_sms: int = H100_SMS) -> int:
    """1 while the column blocks alone keep ~3/4 of the SMs busy; else enough splits to give every SM a
    program (not more: splits cost a second launch), each split keeping at least 4 K tiles."""
    n_blocks, k_tiles = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    if n_blocks * 4 >= num_sms * 3:
        return 1
    split = 1
    while n_blocks * split < num_sms and split < MAX_SPLIT_K and k_tiles >= 8 * split:
        split *= 2
    return split


# Configs per device and shape where ``bench.gemm_bench``'s sweep on that device beat ``_config``'s rules (the
# rules come from one H100). Keyed by (path, N, K): path 1 is M = 1 (the FMA path), "dot" every M > 2, which the
# dot path runs on the same 16-row tiles (timed at M = 5, a verify row with 4 drafts). One H200, stop 52,
# ``python -m bench.gemm_bench --rows 1,5`` on Llama-2-7B's projections, (qkv + o_proj + gate_up + down) x 32 +
# lm_head: M = 1 3.705 -> 3.207 ms a step (cuBLAS 3.777), M = 5 3.653 -> 3.497 (cuBLAS 3.778); each config's
# output checked against cuBLAS there. Qwen3-30B-A3B's (stop 61, one H200, ``--rows 1 --shapes
# 5120x2048,2048x4096,128x2048,151936x2048``): qkv 7.15 -> 6.10 us, o_proj 6.32 -> 5.91, router 2.35 -> 1.99 (cuBLAS
# 8.07, 9.57, 5.35); its lm_head's best was within 0.3% of the default (not added).
TUNED: dict[str, dict[tuple, SkinnyConfig]] = {
    "NVIDIA H200": {
        (1, 12288, 4096): SkinnyConfig(32, 256, 1, 8, 1, False),
        (1, 4096, 4096): SkinnyConfig(16, 512, 1, 8, 4, False),
        (1, 22016, 4096): SkinnyConfig(8, 512, 1, 4, 1, False),
        (1, 4096, 11008): SkinnyConfig(16, 512, 1, 8, 3, False),
        (1, 32000, 4096): SkinnyConfig(32, 256, 1, 4, 3, False),
        (1, 5120, 2048): SkinnyConfig(8, 512, 1, 8, 1, False),
        (1, 2048, 4096): SkinnyConfig(8, 512, 1, 4, 4, False),
        (1, 128, 2048): SkinnyConfig(8, 512, 1, 4, 4, False),
        ("dot", 12288, 4096): SkinnyConfig(32, 128, 1, 4, 4, True),
        ("dot", 4096, 4096): SkinnyConfig(32, 512, 1, 4, 4, True),
        ("dot", 22016, 4096): SkinnyConfig(64, 128, 1, 4, 2, True),
        ("dot", 4096, 11008): SkinnyConfig(32, 512, 1, 4, 4, True),
        ("dot", 32000, 4096): SkinnyConfig(64, 128, 1, 4, 4, True),
    },
}


def _config(M: int, N: int, K: int, num_sms: int = H100_SMS, device: str = "") -> SkinnyConfig:
    """Default config for an [M, K] x [N, K]^T product on ``device`` (its name): ``TUNED``'s where it has the
    shape, else these rules from ``bench.gemm_bench`` on one H100.

    M = 1: FMA path, 8 weight rows x 512 columns a tile, 4 warps, 3 stages: the best, or within 2%
    of it, on all five Llama-2-7B shapes (4.72 ms of weights a decode step against cuBLAS's 5.22).
    M = 2: FMA path with a [16, 2, 256] accumulator (not measured). Larger M: the dot path (x padded
    to 16 rows), 32 x 256 tiles 4 stages deep: 5.00 ms a step at M = 4 against cuBLAS's 5.22.
    SPLIT_K only where the column blocks leave SMs idle (``default_split_k``).
    """
    path = 1 if M == 1 else "dot" if M > 2 else None       # M = 2 (FMA over 2 rows) has no tuned configs
    tuned = TUNED.get(device, {}).get((path, N, K))
    if tuned is not None:
        return tuned
    if M == 1:
        block_n, block_k, num_warps, num_stages, use_dot = 8, 512, 4, 3, False
    elif M == 2:
        block_n, block_k, num_warps, num_stages, use_dot = 16, 256, 8, 3, False
    else:
        block_n, block_k, num_warps, num_stages, use_dot = 32, 256, 4, 4, True
    split = default_split_k(N, K, block_n, block_k, num_sms)
    return SkinnyConfig(block_n, block_k, split, num_warps, num_stages, use_dot)


def _is_pow2(v) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


def _validate_config(config) -> SkinnyConfig:
    try:
        cfg = SkinnyConfig(*config)
    except TypeError:
        raise ValueError(f"config must be (block_n, block_k, split_k, num_warps, num_stages[, use_dot]), "
                         f"got {config!r}") from None
    min_block_n = 16 if cfg.use_dot else 1
    if not (_is_pow2(cfg.block_n) and cfg.block_n >= min_block_n):
        raise ValueError(f"block_n must be a power of two >= {min_block_n} "
                         f"({'dot' if cfg.use_dot else 'FMA'} path), got {cfg.block_n!r}")
    if not (_is_pow2(cfg.block_k) and cfg.block_k >= 16):
        raise ValueError(f"block_k must be a power of two >= 16, got {cfg.block_k!r}")
    if not (isinstance(cfg.split_k, int) and 1 <= cfg.split_k <= MAX_SPLIT_K):
        raise ValueError(f"split_k must be an int in 1..{MAX_SPLIT_K}, got {cfg.split_k!r}")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {cfg.num_warps!r}")
    if not (isinstance(cfg.num_stages, int) and 1 <= cfg.num_stages <= 8):
        raise ValueError(f"num_stages must be an int in 1..8, got {cfg.num_stages!r}")
    return cfg


def _check(x, weight, bias) -> None:
    check_tensor("x", x, 2)
    device = x.device
    check_tensor("weight", weight, 2, device=device)
    check_same_dtype("weight", weight, x.dtype)
    check_shape("weight", weight, (None, x.shape[1]))
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if bias is not None:
        check_tensor("bias", bias, 1, device=device)
        check_same_dtype("bias", bias, x.dtype)
        check_shape("bias", bias, (weight.shape[0],))
        check_last_dim_contiguous("bias", bias)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_gemm takes at most {MAX_ROWS} rows of x (decode batches), got {x.shape[0]}; "
                         "use torch.nn.functional.linear for larger batches")


def split_layout(K: int, cfg: SkinnyConfig) -> tuple[int, int]:
    """(splits, K columns per split): whole BLOCK_K tiles per split, no split left empty."""
    k_tiles = triton.cdiv(K, cfg.block_k)
    tiles_per_split = max(1, triton.cdiv(k_tiles, cfg.split_k))
    return max(1, triton.cdiv(k_tiles, tiles_per_split)), tiles_per_split * cfg.block_k


def split_k_partials(out: torch.Tensor, splits: int) -> torch.Tensor:
    """Where split-K programs write: ``out`` itself for one split, else float32 partials [splits, M, N]."""
    if splits == 1:
        return out
    return torch.empty((splits, *out.shape), dtype=torch.float32, device=out.device)


def reduce_split_k(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                   pdl: dict | None = None) -> None:
    """``out`` = the partials summed in split order (+ bias), rounded to out's dtype (no atomics:
    bit-reproducible); nothing to do when the programs wrote ``out`` itself. ``pdl``: launch_options'."""
    if partial is out:
        return
    M, N = out.shape
    _split_k_reduce_kernel[(M, triton.cdiv(N, REDUCE_BLOCK))](
        partial, bias if bias is not None else out, out, N, partial.stride(0), partial.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=partial.shape[0], BLOCK=REDUCE_BLOCK, num_warps=4,
        **(pdl or {"PDL": False}))


def _launch(x, weight, bias, out, cfg: SkinnyConfig, compile_only: bool = False) -> None:
    M, K = x.shape
    N = weight.shape[0]
    splits, k_per_split = split_layout(K, cfg)
    partial = split_k_partials(out, splits)
    block_m = DOT_ROWS if cfg.use_dot else triton.next_power_of_2(M)
    has_bias = bias is not None
    bias_arg = bias if has_bias else out  # never read
    grid = (triton.cdiv(N, cfg.block_n), splits)
    pdl = launch_options(x)
    args = (x, weight, bias_arg, partial, M, N, K, k_per_split,
            x.stride(0), weight.stride(0), partial.stride(-2), partial.stride(0) if splits > 1 else 0)
    meta = {
        "HAS_BIAS": has_bias, "SPLIT": splits > 1, "BLOCK_M": block_m, "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k, "EVEN_K": K > 0 and K % cfg.block_k == 0, "USE_DOT": cfg.use_dot,
        "UPCAST": upcast_dots(x),
        "NUM_STAGES": cfg.num_stages, "WHILE_LOOP": not x.is_cuda,
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **pdl,
    }
    if compile_only:
        _skinny_gemm_kernel.warmup(*args, grid=grid, **meta)
        return
    _skinny_gemm_kernel[grid](*args, **meta)
    reduce_split_k(partial, bias, out, pdl)


def _prepare(x, weight, bias, config) -> tuple[torch.Tensor, SkinnyConfig | None]:
    """Checks; the output; the config, or None when there is nothing to compute."""
    _check(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out, None
    if config is not None:
        return out, _validate_config(config)
    return out, _config(M, N, K, device_sms(x.device), device_name(x.device))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: SkinnyConfig | tuple | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> new [M, N] in x's dtype.

    Same semantics as ``F.linear(x, weight, bias)``, accumulated in float32. ``config`` is a
    ``SkinnyConfig`` or a tuple ``(block_n, block_k, split_k, num_warps, num_stages[, use_dot])``;
    by default ``_config`` picks one from the shape.
    """
    out, cfg = _prepare(x, weight, bias, config)
    if cfg is not None:
        _launch(x, weight, bias, out, cfg)
    return out


def precompile_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           config: SkinnyConfig | tuple | None = None) -> None:
    """Compile, without launching, the main kernel that ``skinny_gemm`` with these arguments runs.

    Inside ``triton.AsyncCompileMode(executor)`` the compile runs on the executor, so a benchmark
    can compile its whole sweep in parallel before timing it. CUDA only.
    """
    out, cfg = _prepare(x, weight, bias, config)
    if cfg is not None:
        _launch(x, weight, bias, out, cfg, compile_only=True)


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    config: SkinnyConfig | tuple | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


# ---- the linear op of the model -------------------------------------------------------------

# Up to here the skinny GEMM takes the product. Measured on one H100 at M = 1 (4.72 ms of weights a Llama-2-7B
# step, cuBLAS 5.22) and M = 4 (5.00, cuBLAS 5.22); M > 2 is the dot path, x padded to 16 rows, so M = 5..8
# loads and multiplies exactly what M = 4 does. 8 covers a verify step at batch 1 (1 + 4 drafts = 5 rows),
# which took cuBLAS at 4: about 0.5 of the 1.16 ms it cost over a decode step on the H100 (ratio 1.20).
SKINNY_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``: the skinny GEMM for the few-row products of small decode batches (half
    precision on CUDA), cuBLAS for everything else."""
    if x.shape[0] <= SKINNY_ROWS and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)

