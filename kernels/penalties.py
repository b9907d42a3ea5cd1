"""Repetition, frequency and presence penalties, in place on float32 logits.

Request ``b`` owns entries ``b_token_start[b] : b_token_start[b + 1]`` of ``token_ids`` /
``token_counts`` (its unique previous tokens and how often each occurred). For each
(b, token t, count c): ``l = logits[b, t]``; ``l = l * rep if l < 0 else l / rep`` (HF
``RepetitionPenaltyLogitsProcessor``); ``l -= freq * c + presence``.
Grid: (request,); each program walks its entries in blocks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor


@triton.jit
def _penalties_kernel(
    logits_ptr, token_ids_ptr, token_counts_ptr, b_token_start_ptr,
    repetition_ptr, frequency_ptr, presence_ptr, stride_logits,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(b_token_start_ptr + b)
    end = tl.load(b_token_start_ptr + b + 1)
    rep = tl.load(repetition_ptr + b)
    freq = tl.load(frequency_ptr + b)
    presence = tl.load(presence_ptr + b)
    row = logits_ptr + b.to(tl.int64) * stride_logits
    block_start = start
    while block_start < end:  # not `for ... range`: the interpreter (numpy 2.4) rejects runtime bounds
        offs = block_start + tl.arange(0, BLOCK)
        mask = offs < end
        tokens = tl.load(token_ids_ptr + offs, mask=mask, other=0)
        counts = tl.load(token_counts_ptr + offs, mask=mask, other=0).to(tl.float32)
        logit = tl.load(row + tokens, mask=mask, other=0.0)
        logit = tl.where(logit < 0, logit * rep, logit / rep)
        logit = logit - (freq * counts + presence)
        tl.store(row + tokens, logit, mask=mask)
        block_start += BLOCK


def _check(logits, token_ids, token_counts, b_token_start, repetition, frequency, presence) -> None:
    check_tensor("logits", logits, 2, dtypes=(torch.float32,))
    device = logits.device
    batch = logits.shape[0]
    check_tensor("token_ids", token_ids, 1, dtypes=(torch.int32,), device=device)
    check_tensor("token_counts", token_counts, 1, dtypes=(torch.int32,), device=device)
    check_shape("token_counts", token_counts, tuple(token_ids.shape))
    check_tensor("b_token_start", b_token_start, 1, dtypes=(torch.int32,), device=device)
    check_shape("b_token_start", b_token_start, (batch + 1,))
    for name, t in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        check_tensor(name, t, 1, dtypes=(torch.float32,), device=device)
        check_shape(name, t, (batch,))
    if logits.stride(-1) != 1:
        raise ValueError(f"logits must have a contiguous last dim, got strides {logits.stride()}")
    for name, t in (("token_ids", token_ids), ("token_counts", token_counts), ("b_token_start", b_token_start)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def apply_penalties(logits: torch.Tensor, token_ids: torch.Tensor, token_counts: torch.Tensor,
                    b_token_start: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> None:
    """In place on logits [B, V] float32; see the module docstring for the formula."""
    _check(logits, token_ids, token_counts, b_token_start, repetition, frequency, presence)
    batch = logits.shape[0]
    if batch == 0:
        return
    _penalties_kernel[(batch,)](
        logits, token_ids, token_counts, b_token_start,
        repetition.contiguous(), frequency.contiguous(), presence.contiguous(), logits.stride(0),
        BLOCK=256, num_warps=4,
    )


def apply_penalties_ref(logits: torch.Tensor, token_ids: torch.Tensor, token_counts: torch.Tensor,
                        b_token_start: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                        presence: torch.Tensor) -> None:
    entries_per_request = (b_token_start[1:] - b_token_start[:-1]).long()
    request = torch.repeat_interleave(torch.arange(logits.shape[0], device=logits.device), entries_per_request)
    ids = token_ids.long()
    logit = logits[request, ids]
    logit = torch.where(logit < 0, logit * repetition[request], logit / repetition[request])
    logits[request, ids] = logit - (frequency[request] * token_counts.float() + presence[request])
