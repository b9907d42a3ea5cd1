"""Greedy choice of one token per row: the first argmax of each float32 logits row and its logprob.

``greedy_pick(logits)`` returns ``(token_ids [N] int64, logprobs [N] float32)`` with
``token_ids = logits.argmax(-1)`` (the first of equal maxima, as torch) and
``logprobs = log_softmax(logits)[token_ids] = -log(sum_v exp(logits[v] - max))``: what the
sampler's ``log_softmax``, ``argmax`` and ``gather`` give for a plain greedy row, reading each
row once. The decode and verify CUDA graphs run it after their logits
(``engine.worker.cuda_graphs.GraphOutputs``), where it costs the device 2.9 us at batch 1 over
a Qwen vocabulary of 151,936 (torch's three ops in a graph: 44.4 us) and 30 us at 512 rows of
32,000 (108.8); one H100. Launched eagerly it costs the host about 130 us against torch's 51,
so the sampler's eager path keeps torch's ops.

Stage 1, grid (row, split): each program walks its chunk of the vocabulary in ``BLOCK``
columns, keeping the running maximum, the first column that holds it and the sum of
``exp(x - max)`` (rescaled when the maximum grows). Stage 2, grid (row,): merges the
splits: the largest maximum, the first split's column among those that hold it, the sums
rescaled to it. A NaN logit counts as the largest value (torch's argmax picks it too); its
row's logprob is NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_tensor
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel

BLOCK = 2048
MAX_SPLITS = 128


@triton.jit
def _greedy_split_kernel(
    logits_ptr, mid_max_ptr, mid_arg_ptr, mid_sum_ptr,
    stride_row, vocab, chunk, splits,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = float("-inf")
    arg = vocab
    total = 0.0
    for first in range(start, end, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < end, other=float("-inf"))
        x = tl.where(x != x, float("inf"), x)                 # NaN: the largest, as torch's argmax
        block_best = tl.max(x, 0)
        block_arg = tl.min(tl.where(x == block_best, offs, vocab), 0)
        arg = tl.where(block_best > best, block_arg, arg)     # an earlier block keeps a tie
        new_best = tl.maximum(best, block_best)
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), 0)
        best = new_best
    out = row * splits + split
    tl.store(mid_max_ptr + out, best)
    tl.store(mid_arg_ptr + out, arg)
    tl.store(mid_sum_ptr + out, total)


@triton.jit
def _greedy_merge_kernel(
    mid_max_ptr, mid_arg_ptr, mid_sum_ptr, token_ptr, logprob_ptr,
    vocab, splits,
    BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < splits
    best = tl.load(mid_max_ptr + row * splits + offs, mask=mask, other=float("-inf"))
    arg = tl.load(mid_arg_ptr + row * splits + offs, mask=mask, other=vocab)
    total = tl.load(mid_sum_ptr + row * splits + offs, mask=mask, other=0.0)
    top = tl.max(best, 0)
    chosen = tl.min(tl.where(best == top, arg, vocab), 0)       # splits are in column order: the first wins
    chosen = tl.where(chosen == vocab, 0, chosen)               # a row of -inf only: column 0, as torch
    shift = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.where(best == float("-inf"), 0.0, tl.exp(best - shift))
    tl.store(token_ptr + row, chosen.to(tl.int64))
    tl.store(logprob_ptr + row, -tl.log(tl.sum(total * weights, 0)))


def split_count(rows: int, vocab: int, device: torch.device) -> int:
    """Programs per row: about two per SM over all rows on CUDA (a lone row spreads over the GPU), at most one
    per ``BLOCK`` columns; one on the interpreter."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, triton.cdiv(vocab, BLOCK), triton.cdiv(2 * sms, max(rows, 1))))


def _check(logits: torch.Tensor) -> None:
    check_tensor("logits", logits, 2, dtypes=(torch.float32,))
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have a contiguous last dim, got strides {logits.stride()}")
    if logits.shape[1] == 0:
        raise ValueError("logits have no columns: there is no token to choose")


def greedy_pick(logits: torch.Tensor, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] float32 -> (token_ids [N] int64, logprobs [N] float32); ``splits``: programs per row
    (default ``split_count``)."""
    _check(logits)
    rows, vocab = logits.shape
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0:
        return tokens, logprobs
    splits = splits or split_count(rows, vocab, device)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    splits = triton.cdiv(vocab, chunk)
    mid_max = torch.empty((rows, splits), dtype=torch.float32, device=device)
    mid_sum = torch.empty((rows, splits), dtype=torch.float32, device=device)
    mid_arg = torch.empty((rows, splits), dtype=torch.int32, device=device)
    pdl = launch_options(logits)
    _greedy_split_kernel[(rows, splits)](logits, mid_max, mid_arg, mid_sum, logits.stride(0), vocab, chunk, splits,
                                         BLOCK=BLOCK, num_warps=4, **pdl)
    _greedy_merge_kernel[(rows,)](mid_max, mid_arg, mid_sum, tokens, logprobs, vocab, splits,
                                  BLOCK_S=triton.next_power_of_2(splits), num_warps=1, **pdl)
    return tokens, logprobs


def greedy_pick_ref(logits: torch.Tensor, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's torch ops for a plain greedy row (``splits`` unused)."""
    _check(logits)
    tokens = logits.argmax(dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
