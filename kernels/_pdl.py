"""Programmatic dependent launch (PDL): let a kernel start while the one before it finishes.

On Hopper and newer GPUs a kernel launched with ``launch_pdl=True`` may become resident
before the previous kernel in the stream has completed. Every kernel of this package that
takes ``PDL`` follows one rule, which keeps that safe in any order of kernels:

- ``wait_for_prior_kernel`` (``griddepcontrol.wait``) runs before the program reads or
  writes any tensor that another kernel may write or read, with two exceptions:
  - weights, which no kernel writes (the skinny GEMM prefetches its first weight tile, the
    norms their weights, the rotary kernel its cos/sin rows);
  - what launches at least two back wrote (or the stream before them: a copy, an earlier
    forward), read through L2 only (``cache_modifier=".cg"``: the L1 cache is not kept
    coherent). When this kernel starts, every program of the launch just before it has
    passed its own wait (the rule below), or that launch, not ours, has completed; either
    way every launch before it has completed and its writes are in L2. The one-token MoE
    down kernel reads the chosen experts (the routing's, with the gate|up launch between)
    and their first weight tile before its wait; the rotary kernel its positions and slots,
    and the decode attention its requests' rows and lengths (the step's inputs, written
    before the layer's norm and projection). ``tests/gpu/test_pdl_reads.py`` races delayed
    writers against the decode attention, the rotary kernel and that down kernel on the GPU.
- ``allow_next_kernel`` (``griddepcontrol.launch_dependents``) runs right after the wait:
  once every program of this kernel has passed it, the next kernel may launch, take the
  SMs this kernel has left idle, and prefetch its own weights.

Because each kernel waits for the complete previous one, and that one waited for its own
predecessor, the order of the stream is kept transitively. Kernels that are not ours
(cuBLAS, torch, NCCL) are launched without the attribute and serialise as usual.
``ENGINE_PDL=0`` turns PDL off (for measuring what it brings); it is off on the CPU.

Prefetching more of a launch's weights before its wait, into L2 only (no registers held), was slower on one
H200 (stop 70, ``bench.profile_step`` batch-1 GPU step, the skinny GEMM, the 4-bit one-row walks and the one-token
MoE down kernel each prefetching their whole slice; two runs each): per 128-byte line (``prefetch.global.L2``)
bfloat16 Llama-2-7B 3.678 -> 4.694 ms, GPTQ Llama-2-7B 2.209 -> 2.593, Qwen3-30B-A3B (16 layers) 0.927 -> 1.033; per
row (``cp.async.bulk.prefetch.L2``) 3.723 -> 8.931, 2.209 -> 2.590 and 0.930 -> 1.391. The early reads take
bandwidth from the launch still running and the L2 space its data needs.

Nor did prefetching a later launch's weights into L2 while the launches before it leave the DRAM idle (stop 76, one
H200, Qwen3-30B-A3B 16 layers, ``bench.profile_step`` batch 1, GPU ms a step; ``.diag/s76_prefetch.py``, not kept): a
PDL launch of ``prefetch.global.L2`` per 128-byte line (it lets the next kernel launch at once and waits before it
ends) after the rotary launch, for the layer's o_proj (the attention runs meanwhile), took the step 0.930 -> 0.988
(base and this: two runs each); after the router's product, for the next layer's q|k|v (past the expert launches),
0.974 with ``L2::evict_last`` and 0.962 without it (one run each); both 1.032 (two runs).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .pdl_switch import ENV_SWITCH, SWITCH_VALUES

MIN_CAPABILITY = 9


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


@functools.cache
def _switched_on(value: str | None) -> bool:
    """``ENGINE_PDL``'s meaning: unset, empty or 1 is on, 0 is off; anything else is an error."""
    if value not in SWITCH_VALUES:
        raise ValueError(f"{ENV_SWITCH}={value!r} is not understood; set it to 1 (the default, PDL on Hopper "
                         f"and newer) or 0 (off), or unset it")
    return SWITCH_VALUES[value]


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on ``t`` launch with PDL: CUDA, compute capability >= 9, not switched off."""
    if not _switched_on(os.environ.get(ENV_SWITCH)) or not t.is_cuda:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _capability_major(index) >= MIN_CAPABILITY


def launch_options(t: torch.Tensor) -> dict:
    """The kernel arguments that switch PDL on or off: ``PDL`` (constexpr) and ``launch_pdl``."""
    pdl = use_pdl(t)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_for_prior_kernel(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def allow_next_kernel(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has called this."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
