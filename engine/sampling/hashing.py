"""Counter-based 32-bit hashing on the device (murmur3's finaliser): reproducible random
numbers for seeded sampling and the watermark's green lists, with no generator state."""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from a murmur3-style mix of (seed, step, vocab id)."""
    device = seeds.device
    ids = torch.arange(vocab_size, device=device, dtype=torch.int64)[None, :]
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    x = (lo[:, None] * 0x9E3779B1 + hi[:, None] * 0x85EBCA77 + steps[:, None] * 0xC2B2AE3D) & MASK32
    x = (fmix32(x) + ids * 0x27D4EB2F) & MASK32
    x = fmix32(x ^ (hi[:, None] * 0x165667B1 & MASK32))
    return (x.double() + 0.5) / 4294967296.0


def fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)
