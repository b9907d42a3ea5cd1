"""The explicit input of one forward pass over a ragged batch (no padding).

Per-token tensors have T entries (all new tokens of all rows, row after row);
per-row tensors have B entries. Row b's new tokens are
``input_ids[q_start[b] : q_start[b] + q_len[b]]`` at positions
``seq_len[b] - q_len[b] ... seq_len[b] - 1``; keys of earlier positions are already
in the KV cache (chunked prefill, decode).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Callable, NamedTuple

import torch

from engine.transfer import to_device
from kernels.context_attention import ContextAttention, ContextPlan


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor   # [T] int64
    positions: torch.Tensor   # [T] int64
    out_slots: torch.Tensor   # [T] int64, KV slot each new token is written to
    req_rows: torch.Tensor    # [B] int32, row in req_to_token
    q_start: torch.Tensor     # [B] int32
    q_len: torch.Tensor       # [B] int32
    seq_len: torch.Tensor     # [B] int32, cached + new tokens
    max_q_len: int            # host copy of max(q_len)
    is_decode: bool           # every row has exactly one new token
    # (prefix length of each row [B] int32: P or 0, (a member's row, P) [2] int32) of the rows whose
    # first P positions share their slots (kernels.shared_prefix, cascade attention)
    shared_prefix: tuple[torch.Tensor, torch.Tensor] | None = None
    max_seq_len: int | None = None   # host copy of max(seq_len) where known (long contexts split their keys)
    # [T] the sequence length whose rotation each token takes, max(its prompt's length, position + 1), where
    # a row holds prompt tokens and the rope depends on it (``layers.Rotary``; without it: position + 1)
    token_seq_len: torch.Tensor | None = None
    # The layers' prefill attention, when not ``ops.prefill_attention``: piecewise CUDA graphs
    # (``engine.worker.piecewise``) split their capture there and run it eagerly on the step's own rows. With
    # it set, the per-row fields above are placeholders that nothing reads.
    attention: Callable | None = None
    # The tokens whose final hidden states the step reads, where that is not all of them (``OutputRows``)
    output: "OutputRows | None" = None
    # The rows whose long contexts go to cuDNN before the prefill kernel (``kernels.context_attention``)
    context: ContextPlan | None = None


@dataclass(frozen=True)
class OutputRows:
    """The tokens of a step whose final hidden states are read (each row's last few: the logit positions),
    and their attention rows. The last layer writes every token's K and V, then runs its attention, its
    MLP and the final norm on these tokens alone: no later layer reads the others' outputs. A 4,096-token
    chunk of a long prompt reads none (its last token stands in), so it skips 1/L of its attention and MLP
    work (L layers). One H200, a random Llama-3.1-8B, one prompt in process, alternated in one run: 32,768
    tokens 1.306 / 1.308 -> 1.269 / 1.278 s, 100,000 tokens 7.601 / 7.619 -> 7.387 / 7.391 s. The eager
    forward only: the piecewise graphs' steps (up to 2,048 tokens) run every token through captured pieces."""
    index: torch.Tensor       # [K] int64, ascending: the tokens, and the order of the forward's output
    batch: ForwardBatch       # the step's rows over those K tokens (q_start, q_len, max_q_len; per-token fields
                              # indexed); is_decode False: the prefill attention takes any count per row


def read_tokens(q_start: list[int], q_len: list[int], read: list[int]) -> list[int]:
    """The indices of each row's last ``read[b]`` tokens (0 to ``q_len[b]``), row after row (host lists)."""
    return [t for start, n, k in zip(q_start, q_len, read) for t in range(start + n - k, start + n)]


def output_rows(batch: ForwardBatch, q_start: list[int], q_len: list[int], read: list[int]) -> OutputRows:
    """``OutputRows`` of each row's last ``read[b]`` tokens (``read_tokens``)."""
    index = read_tokens(q_start, q_len, read)
    starts = list(accumulate(read, initial=0))[:-1]
    device = batch.req_rows.device
    index_t = to_device(index, torch.int64, device)
    return OutputRows(index_t, replace(
        batch, input_ids=batch.input_ids[index_t], positions=batch.positions[index_t],
        out_slots=batch.out_slots[index_t], q_start=to_device(starts, torch.int32, device),
        q_len=to_device(read, torch.int32, device), max_q_len=max(read), is_decode=False, context=None,
        token_seq_len=None if batch.token_seq_len is None else batch.token_seq_len[index_t]))


class RaggedInputs(NamedTuple):
    """A step's rows as the host lists of a ``ForwardBatch`` (tokens row after row)."""
    input_ids: list[int]      # [T]
    positions: list[int]      # [T]
    slots: list[int]          # [T]
    token_rows: list[int]     # [T] the request row of each token (req_to_token writes)
    req_rows: list[int]       # [B]
    q_start: list[int]        # [B]
    q_len: list[int]          # [B]
    seq_len: list[int]        # [B]


def ragged_inputs(rows) -> RaggedInputs:
    inputs = RaggedInputs([], [], [], [], [], [], [], [])
    for r in rows:
        n = len(r.input_ids)
        inputs.q_start.append(len(inputs.input_ids))
        inputs.input_ids.extend(r.input_ids)
        inputs.positions.extend(range(r.start_pos, r.start_pos + n))
        inputs.slots.extend(r.slots)
        inputs.token_rows.extend([r.row] * n)
        inputs.req_rows.append(r.row)
        inputs.q_len.append(n)
        inputs.seq_len.append(r.start_pos + n)
    return inputs


def rope_lengths(rows) -> list[int]:
    """``ForwardBatch.token_seq_len`` of a step's rows: max(the row's prompt length, position + 1) a token."""
    return [max(r.prompt_len, p + 1) for r in rows for p in range(r.start_pos, r.start_pos + len(r.input_ids))]


def context_plan(context: ContextAttention | None, x: RaggedInputs) -> ContextPlan | None:
    """``ForwardBatch.context`` of a step's rows (``x``): those whose long contexts go to cuDNN, or None."""
    return None if context is None else context.plan(x.req_rows, x.q_start, x.q_len, x.seq_len)


SHARED_PREFIX_MIN_ROWS = 8    # smaller batches (and CUDA graph buckets) attend to every prefix per row


def shared_prefix_inputs(rows) -> tuple[list[int], list[int]]:
    """The host values of ``shared_prefix`` for a step's rows: ([P or 0 per row], [source row, P])."""
    lengths = [r.shared_prefix_len for r in rows]
    source = next((r for r in rows if r.shared_prefix_len), None)
    return lengths, ([source.row, source.shared_prefix_len] if source is not None else [0, 0])


def shared_prefix_tensors(rows, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``ForwardBatch.shared_prefix`` of a step's rows (None below ``SHARED_PREFIX_MIN_ROWS`` rows or with no
    shared prefix)."""
    if len(rows) < SHARED_PREFIX_MIN_ROWS or not any(r.shared_prefix_len for r in rows):
        return None
    lengths, source = shared_prefix_inputs(rows)
    return to_device(lengths, torch.int32, device), to_device(source, torch.int32, device)


@dataclass(frozen=True)
class VerifyLayout:
    """A step of decode and verify rows padded for a CUDA graph of ``rows`` rows of ``width`` tokens
    each (``width`` = 1 + the most drafts a row carries): row b's tokens are ``b * width ..``. A
    real row's padding tokens follow its own, at the next positions, writing the dummy slot (no
    real token attends to them: causal); padding rows are the dummy request row's. Host lists."""
    input_ids: list[int]      # [rows * width]
    positions: list[int]      # [rows * width]
    slots: list[int]          # [rows * width]
    token_rows: list[int]     # [rows * width] request row of each token (req_to_token writes)
    req_rows: list[int]       # [rows]
    seq_len: list[int]        # [rows]
    real: list[int]           # the token indices of the step's own tokens, row after row


def verify_layout(step_rows, rows: int, width: int, dummy_row: int, dummy_slot: int) -> VerifyLayout:
    layout = VerifyLayout([], [], [], [], [], [], [])
    for b in range(rows):
        r = step_rows[b] if b < len(step_rows) else None
        n = len(r.input_ids) if r is not None else 0
        start, row = (r.start_pos, r.row) if r is not None else (0, dummy_row)
        layout.input_ids.extend((r.input_ids if r is not None else []) + [0] * (width - n))
        layout.positions.extend(range(start, start + width))
        layout.slots.extend((r.slots if r is not None else []) + [dummy_slot] * (width - n))
        layout.token_rows.extend([row] * width)
        layout.req_rows.append(row)
        layout.seq_len.append(start + width)
        layout.real.extend(range(b * width, b * width + n))
    return layout


def verify_batch(input_ids, positions, slots, req_rows, seq_len, width: int) -> ForwardBatch:
    """The ForwardBatch of a ``verify_layout`` (device tensors; ``input_ids`` with FED_BACK replaced)."""
    rows = req_rows.shape[0]
    device = req_rows.device
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_slots=slots, req_rows=req_rows.to(torch.int32),
        q_start=torch.arange(0, rows * width, width, dtype=torch.int32, device=device),
        q_len=torch.full((rows,), width, dtype=torch.int32, device=device), seq_len=seq_len.to(torch.int32),
        max_q_len=width, is_decode=width == 1)
