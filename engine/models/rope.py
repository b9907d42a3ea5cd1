"""Rotary-embedding tables for every rope variant the Llama family uses.

The table has one row per position: ``cat(cos(p * inv_freq), sin(p * inv_freq))``,
``head_dim`` wide, float32 values rounded through the model dtype (Hugging Face casts
cos/sin to the activation dtype before it multiplies, so the kernels see the same
numbers). The rotary kernel is variant-agnostic; only ``inv_freq`` differs (and the
factor longrope and yarn multiply cos and sin by).
"""
from __future__ import annotations

import math

import torch

from engine.models.config import ModelConfig, RopeConfig


def plain_rope_length(config: ModelConfig) -> int | None:
    """The longest sequence whose tokens all take the rotation of their position alone, or None when every
    length does. Past it ``dynamic`` (NTK) and ``longrope`` (Phi-3) rotate a token by the length of the
    forward pass that computes it, as transformers does (``max(position_ids) + 1``): ``generate`` prefills a
    whole prompt in one pass and then decodes a token a pass, so a token at position p of a request whose
    prompt has n tokens takes the rotation of max(n, p + 1) tokens (``layers.Rotary``), whatever chunks the
    engine cuts the prompt into, and the prefix cache holds and gives only tokens within this length
    (``engine.router.scheduler``). The fixed-table ropes (linear, llama3, yarn: its frequencies depend on
    the original context, never on the sequence's length) rotate by position alone."""
    rope = config.rope
    if rope.rope_type == "longrope":
        return rope.original_max_position_embeddings
    if rope.rope_type == "dynamic":
        return config.max_position_embeddings
    return None


def base_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig, max_positions: int) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings or max_positions
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """yarn's blend of the base frequencies (extrapolation) and those divided by ``factor`` (interpolation):
    frequency i is interpolated in proportion to a ramp from 0 to 1 over the dimensions whose wavelengths make
    between ``beta_fast`` and ``beta_slow`` rotations in the original context, in float32 as transformers'
    ``_compute_yarn_parameters``."""
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    low, high = yarn_correction_range(rope, head_dim)
    if low == high:
        high += 0.001       # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_correction_range(rope: RopeConfig, head_dim: int) -> tuple[float, float]:
    """The ramp's ends: the (fractional) frequency indices whose wavelengths make ``beta_fast`` and
    ``beta_slow`` rotations over the original context, rounded outwards when ``truncate``, clamped to
    [0, head_dim - 1] (transformers' ``find_correction_range``)."""
    def dimension(rotations: float) -> float:
        context = rope.original_max_position_embeddings
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))
    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def dynamic_inv_freq(config: ModelConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """NTK-aware inverse frequencies [len(seq_lens), head_dim/2] (HF `dynamic`, in float32 as HF)."""
    rope, dim, max_pos = config.rope, config.head_dim, config.max_position_embeddings
    base = rope.theta * ((rope.factor * seq_lens.float() / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device).float() / dim
    return 1.0 / (base[:, None] ** exponents[None, :])


def cos_sin_rows(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> torch.Tensor:
    """[len(positions), head_dim] rows ``cat(cos, sin)`` of ``p * inv_freq`` (inv_freq [head_dim/2], or
    one row per position), times ``scale`` (longrope's or yarn's attention factor), rounded through ``dtype``
    as transformers casts them."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq
    rows = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    if scale != 1.0:
        rows = rows * scale
    return rows.to(dtype).to(torch.float32)


def longrope_inv_freq(config: ModelConfig, long: bool) -> torch.Tensor:
    """Phi-3's longrope: each base frequency divided by its short (within the original context) or
    long factor, in float32 as transformers' ``1 / (factors * base ** (2i / dim))``."""
    rope, dim = config.rope, config.head_dim
    factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * rope.theta**exponents)


def build_longrope_cache(config: ModelConfig, num_positions: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[2 * num_positions, head_dim]: the short-factor rows of every position, then the long-factor
    rows, both scaled by the attention factor (row ``p + num_positions`` is position p, long)."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    scale = config.rope.attention_factor
    tables = [cos_sin_rows(positions, longrope_inv_freq(config, long), dtype, scale) for long in (False, True)]
    return torch.cat(tables).to(device)


def inv_freq_for(config: ModelConfig) -> torch.Tensor:
    rope = config.rope
    inv_freq = base_inv_freq(rope.theta, config.head_dim)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return llama3_inv_freq(inv_freq, rope, config.max_position_embeddings)
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, config.head_dim)
    return inv_freq


def build_cos_sin_cache(config: ModelConfig, num_positions: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[num_positions, head_dim] float32 table; see the module docstring. ``yarn``'s rows carry its
    attention factor (every other type here has 1).

    ``dynamic`` scaling: positions below ``max_position_embeddings`` use the plain
    base; a position p beyond it uses the NTK base for a sequence of p + 1 tokens,
    which is what Hugging Face applies to each decoded token.
    """
    positions = torch.arange(num_positions, dtype=torch.float32)
    table = cos_sin_rows(positions, inv_freq_for(config), dtype, config.rope.attention_factor)
    start = config.max_position_embeddings
    if config.rope.rope_type == "dynamic" and num_positions > start:
        beyond = positions[start:]
        table[start:] = cos_sin_rows(beyond, dynamic_inv_freq(config, beyond + 1), dtype)
    return table.to(device)
