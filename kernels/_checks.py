"""Argument checks shared by the launchers: each raises with what was wrong and what was expected."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# int32 values in 16 bytes. Triton compiles a kernel per pointer alignment class: per-row arrays packed back to back
# (a row count not a multiple of 4) compiled the prefill attention anew mid-serving, 4.2 s on the H100 (stop 44)
ALIGN_INT32 = 4


def aligned_width(rows: int) -> int:
    """``rows`` rounded up to whole 16-byte groups of int32: the stride that starts each of several per-row int32
    arrays packed in one tensor 16-byte aligned."""
    return -(-rows // ALIGN_INT32) * ALIGN_INT32


def check_tensor(name: str, t, ndim: int, dtypes=FLOAT_DTYPES, device=None) -> None:
    """Raise if ``t`` is not a tensor of ``ndim`` dims, one of ``dtypes``, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {allowed}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}; move it there")


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    """Raise unless ``t.shape`` equals ``shape`` (``None`` entries match anything)."""
    ok = len(t.shape) == len(shape) and all(e is None or e == s for s, e in zip(t.shape, shape))
    if not ok:
        want = ", ".join("*" if e is None else str(e) for e in shape)
        want = f"({want},)" if len(shape) == 1 else f"({want})"
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def check_same_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but must match {dtype}")


def check_bias(bias: torch.Tensor | None, n: int, device) -> None:
    """A GEMM's optional bias: one value per output column, on the input's device."""
    if bias is not None:
        check_tensor("bias", bias, 1, device=device)
        check_shape("bias", bias, (n,))


def upcast_dots(t: torch.Tensor) -> bool:
    """Whether attention kernels must run ``tl.dot`` on float32 operands.

    True for float32 tensors (IEEE fp32 dots, no TF32) and off CUDA: the Triton CPU
    interpreter returns garbage for bfloat16 ``tl.dot``.
    """
    return t.dtype == torch.float32 or t.device.type != "cuda"
