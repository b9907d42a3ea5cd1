"""Repetition, frequency and presence penalties, in place on float32 logits.

Logits row ``b`` reads its token counts from row ``pool_rows[b]`` of ``counts`` (how often
each vocabulary id occurred in the request so far, prompt and generated; the counts stay
on the device and are updated there); ``pool_rows[b] < 0``: no penalties for that row.
For each token t with count c > 0: ``l = logits[b, t]``; ``l = l * rep if l < 0 else l / rep``
(HF ``RepetitionPenaltyLogitsProcessor``); ``l -= freq * c + presence``.
Grid: (row, vocabulary block).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor

BLOCK = 1024


@triton.jit
def _penalties_kernel(
    logits_ptr, counts_ptr, pool_rows_ptr, repetition_ptr, frequency_ptr, presence_ptr,
    stride_logits, stride_counts, vocab,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    pool_row = tl.load(pool_rows_ptr + b)
    if pool_row < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    counts = tl.load(counts_ptr + pool_row.to(tl.int64) * stride_counts + offs, mask=offs < vocab, other=0)
    seen = (offs < vocab) & (counts > 0)
    rep = tl.load(repetition_ptr + b)
    freq = tl.load(frequency_ptr + b)
    presence = tl.load(presence_ptr + b)
    row = logits_ptr + b.to(tl.int64) * stride_logits
    logit = tl.load(row + offs, mask=seen, other=0.0)
    logit = tl.where(logit < 0, logit * rep, logit / rep)
    logit = logit - (freq * counts.to(tl.float32) + presence)
    tl.store(row + offs, logit, mask=seen)


def _check(logits, counts, pool_rows, repetition, frequency, presence) -> None:
    check_tensor("logits", logits, 2, dtypes=(torch.float32,))
    device = logits.device
    batch, vocab = logits.shape
    check_tensor("counts", counts, 2, dtypes=(torch.int32,), device=device)
    if counts.shape[1] != vocab:
        raise ValueError(f"counts must have one column per vocabulary id ({vocab}), got shape {tuple(counts.shape)}")
    check_tensor("pool_rows", pool_rows, 1, dtypes=(torch.int32,), device=device)
    check_shape("pool_rows", pool_rows, (batch,))
    for name, t in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        check_tensor(name, t, 1, dtypes=(torch.float32,), device=device)
        check_shape(name, t, (batch,))
    for name, t in (("logits", logits), ("counts", counts)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, pool_rows: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """In place on logits [B, V] float32; counts [P, V] int32; see the module docstring."""
    _check(logits, counts, pool_rows, repetition, frequency, presence)
    batch, vocab = logits.shape
    if batch == 0:
        return
    _penalties_kernel[(batch, triton.cdiv(vocab, BLOCK))](
        logits, counts, pool_rows.contiguous(), repetition.contiguous(), frequency.contiguous(),
        presence.contiguous(), logits.stride(0), counts.stride(0), vocab, BLOCK=BLOCK, num_warps=4,
    )


def apply_penalties_ref(logits: torch.Tensor, counts: torch.Tensor, pool_rows: torch.Tensor,
                        repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> None:
    _check(logits, counts, pool_rows, repetition, frequency, presence)
    rows = (pool_rows >= 0).nonzero()[:, 0]
    count = counts[pool_rows[rows].long()]
    logit = logits[rows]
    rep, freq, pres = repetition[rows, None], frequency[rows, None], presence[rows, None]
    penalised = torch.where(logit < 0, logit * rep, logit / rep) - (freq * count.float() + pres)
    logits[rows] = torch.where(count > 0, penalised, logit)
