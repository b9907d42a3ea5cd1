"""The one place that picks how an operation runs: a Triton kernel or its torch reference.

Every kernel in ``kernels/`` has a launcher and a ``*_ref`` with the same signature.
The model receives a ``KernelOps`` at construction (no global switch): on CUDA it runs
the Triton launchers; on the CPU it runs the references by default, or the Triton
kernels themselves when ``TRITON_INTERPRET=1`` (how CI proves the kernels end to end).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import decode_attention as _decode
from kernels import penalties as _penalties
from kernels import prefill_attention as _prefill
from kernels import rmsnorm as _rmsnorm
from kernels import rotary as _rotary
from kernels import silu_and_mul as _silu
from kernels import skinny_gemm as _gemm

BACKENDS = ("triton", "torch")


def default_backend(device: torch.device) -> str:
    """Triton on CUDA, or on the CPU under the Triton interpreter; else torch."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "torch"


@dataclass(frozen=True)
class KernelOps:
    backend: str
    rmsnorm: Callable
    add_rmsnorm: Callable
    rotary_store_kv: Callable      # rotate q in place; rotated k and v into the KV cache
    prefill_attention: Callable
    decode_attention: Callable
    silu_and_mul: Callable
    apply_penalties: Callable
    linear: Callable               # F.linear semantics; small decode batches take the skinny GEMM

    @classmethod
    def create(cls, backend: str) -> "KernelOps":
        if backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        ref = backend == "torch"

        def pick(module, name):
            return getattr(module, name + "_ref" if ref else name)

        return cls(
            backend=backend,
            rmsnorm=pick(_rmsnorm, "rmsnorm"),
            add_rmsnorm=pick(_rmsnorm, "add_rmsnorm"),
            rotary_store_kv=pick(_rotary, "rotary_store_kv"),
            prefill_attention=pick(_prefill, "prefill_attention"),
            decode_attention=pick(_decode, "decode_attention"),
            silu_and_mul=pick(_silu, "silu_and_mul"),
            apply_penalties=pick(_penalties, "apply_penalties"),
            linear=pick(_gemm, "linear"),
        )
