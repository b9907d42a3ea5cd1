"""Per-layer modifications of the attention scores: sliding window, logit soft-capping, ALiBi.

One ``ScoreMods`` value travels from the model's ``Attention`` block through ``engine.ops`` to
the attention kernels (``kernels._online_softmax`` applies them inside the online softmax,
each compiled in only when set) and to their torch references (``apply_ref`` below, the
definition the kernels are tested against):

| field          | a key at k_pos is seen by the query at q_pos ... | score (natural units)          |
| -------------- | ------------------------------------------------ | ------------------------------ |
| ``window``     | only if ``q_pos - k_pos < window`` (transformers) |                                |
| ``softcap``    |                                                  | ``cap * tanh(score / cap)``    |
| ``alibi_slopes`` ([q heads] float32, this shard's) |              | ``+ slope[h] * (k_pos - q_pos)`` |

Soft-capping comes before the bias and the masks, as in transformers' Gemma 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG2E = math.log2(math.e)


@dataclass(frozen=True, eq=False)       # eq=False: a tensor field has no truth value to compare by
class ScoreMods:
    window: int | None = None
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None

    def __post_init__(self):
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"the sliding window must be an int >= 1, got {self.window!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"the attention soft-cap must be > 0, got {self.softcap!r}")

    @property
    def any(self) -> bool:
        return self.window is not None or self.softcap is not None or self.alibi_slopes is not None

    @property
    def needs_positions(self) -> bool:
        """The window and ALiBi depend on each row's position, which the shared-prefix kernel does not
        know: callers attend without the shared prefix then (the result is the same)."""
        return self.window is not None or self.alibi_slopes is not None


NONE = ScoreMods()


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Bloom's per-head slopes (transformers' ``build_alibi_tensor``): a geometric sequence from
    2^(-8/n) for the largest power of two n <= heads, then the odd steps of the next power's sequence."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** i for i in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def kernel_args(mods: ScoreMods | None, unread: torch.Tensor) -> tuple[dict, dict]:
    """(runtime arguments, constexprs) of the attention kernels for ``mods``; ``unread`` stands in for
    the slopes' pointer when there is no ALiBi."""
    mods = mods or NONE
    args = dict(window=mods.window or 0, softcap_log2=(mods.softcap or 1.0) * LOG2E,
                alibi_ptr=mods.alibi_slopes if mods.alibi_slopes is not None else unread)
    flags = dict(WINDOW=mods.window is not None, SOFTCAP=mods.softcap is not None,
                 ALIBI=mods.alibi_slopes is not None)
    return args, flags


def check(mods: ScoreMods | None, q_heads: int, device) -> None:
    if mods is None or mods.alibi_slopes is None:
        return
    slopes = mods.alibi_slopes
    if slopes.shape != (q_heads,) or slopes.dtype != torch.float32 or slopes.device != torch.device(device):
        raise ValueError(f"alibi_slopes must be float32 [{q_heads}] on {device}, got {slopes.dtype} "
                         f"{tuple(slopes.shape)} on {slopes.device}")


def apply_ref(scores: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, mods: ScoreMods | None,
              causal: bool = True) -> torch.Tensor:
    """``scores`` [H, Q, K] (already times sm_scale, float32) with the modifications and the causal mask."""
    mods = mods or NONE
    if mods.softcap is not None:
        scores = torch.tanh(scores / mods.softcap) * mods.softcap
    distance = q_pos[:, None] - k_pos[None, :]                     # [Q, K]
    if mods.alibi_slopes is not None:
        scores = scores - mods.alibi_slopes.to(scores.device)[:, None, None] * distance.to(scores.dtype)
    visible = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    if mods.window is not None:
        visible = visible & (distance < mods.window)
    return scores.masked_fill(~visible, float("-inf"))
