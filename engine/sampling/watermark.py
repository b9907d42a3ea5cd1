"""TGI's ``watermark``: Kirchenbauer et al. 2023, "A Watermark for Large Language Models".

For every generated token, the previous token seeds a "green list" holding a fraction
``gamma`` of the vocabulary; ``delta`` is added to the logits of green tokens before
sampling. A detector that knows the hash counts how many tokens are green: plain text
has a fraction ``gamma`` of them, watermarked text clearly more, measured as

    z = (green - gamma * T) / sqrt(T * gamma * (1 - gamma))      over T scored tokens.

The green list is a counter-based hash, vectorised over the batch and the vocabulary on
the device: token ``v`` after token ``p`` is green when ``hash(p, v) < gamma * 2**32``
(TGI draws a ``torch.randperm`` seeded with ``15485863 * p`` per row instead; its lists
are device-dependent and not reproduced here, so detect with this module).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling.hashing import MASK32, fmix32
from engine.transfer import to_device

HASH_KEY = 15485863          # TGI's key: the millionth prime


@dataclass(frozen=True)
class WatermarkConfig:
    gamma: float = 0.5        # fraction of the vocabulary that is green
    delta: float = 2.0        # bias added to green logits

    def __post_init__(self):
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"watermark gamma must be in (0, 1), got {self.gamma}")
        if self.delta < 0.0:
            raise ValueError(f"watermark delta must be >= 0, got {self.delta}")


@dataclass(frozen=True)
class WatermarkScore:
    z_score: float
    green: int                # scored tokens that are green
    scored: int               # tokens scored (each needs a previous token)


def is_green(prev_tokens: torch.Tensor, token_ids: torch.Tensor, gamma: float) -> torch.Tensor:
    """Whether each ``token_ids`` entry is green after the matching ``prev_tokens`` entry
    (int64 tensors that broadcast: [B, 1] x [1, V] gives the green lists of a batch)."""
    seed = fmix32(((prev_tokens & MASK32) * 0x2545F491 + HASH_KEY) & MASK32)
    x = fmix32((seed ^ ((token_ids & MASK32) * 0x27D4EB2F)) & MASK32)
    return x < int(gamma * 2**32)


def apply_watermark(scores: torch.Tensor, rows: list[int], prev_tokens: list[int], config: WatermarkConfig) -> None:
    """Add ``delta`` to the green logits of ``scores[rows]``, in place; one previous token per row."""
    device = scores.device
    prev = to_device(prev_tokens, torch.int64, device)[:, None]
    vocab = torch.arange(scores.shape[1], dtype=torch.int64, device=device)[None, :]
    index = to_device(rows, torch.int64, device)
    scores[index] = scores[index] + config.delta * is_green(prev, vocab, config.gamma).to(scores.dtype)


def detect(token_ids: list[int], vocab_size: int, gamma: float = 0.5,
           context_token: int | None = None) -> WatermarkScore:
    """Score generated tokens: ``context_token`` (the last prompt token) precedes the first;
    without it the first token only serves as the previous token of the second."""
    ids = list(token_ids) if context_token is None else [context_token, *token_ids]
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    if len(ids) < 2:
        return WatermarkScore(math.nan, 0, 0)
    tokens = torch.tensor(ids, dtype=torch.int64)
    green = int(is_green(tokens[:-1], tokens[1:], gamma).sum())
    scored = len(ids) - 1
    z = (green - gamma * scored) / math.sqrt(scored * gamma * (1 - gamma))
    return WatermarkScore(z, green, scored)
