"""The explicit input of one forward pass over a ragged batch (no padding).

Per-token tensors have T entries (all new tokens of all rows, row after row);
per-row tensors have B entries. Row b's new tokens are
``input_ids[q_start[b] : q_start[b] + q_len[b]]`` at positions
``seq_len[b] - q_len[b] ... seq_len[b] - 1``; keys of earlier positions are already
in the KV cache (chunked prefill, decode).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


SHARED_PREFIX_MIN_ROWS = 8    # smaller batches (and CUDA graph buckets) attend to every prefix per row


def shared_prefix_inputs(rows) -> tuple[list[int], list[int]]:
    """The host values of ``shared_prefix`` for a step's rows: ([P or 0 per row], [source row, P])."""
    lengths = [r.shared_prefix_len for r in rows]
    source = next((r for r in rows if r.shared_prefix_len), None)
    return lengths, ([source.row, source.shared_prefix_len] if source is not None else [0, 0])


def one_token_rows(rows) -> tuple[list[list[int]], list[int]]:
    """A step of decode and verify rows as one-token rows, for the decode kernels (CUDA graphs):
    ([input ids, positions, slots, request rows, shared prefix lengths], each per token; the shared
    prefix source). A verify row's token j becomes a row of its own request at position start + j:
    the step writes every token's K/V before any attention reads it, so token j attends through
    ``req_to_token`` to exactly positions 0 .. start + j (causal), as in the prefill kernel."""
    lengths, source = shared_prefix_inputs(rows)
    columns: list[list[int]] = [[], [], [], [], []]
    for r, shared in zip(rows, lengths):
        n = len(r.input_ids)
        columns[0].extend(r.input_ids)
        columns[1].extend(range(r.start_pos, r.start_pos + n))
        columns[2].extend(r.slots)
        columns[3].extend([r.row] * n)
        columns[4].extend([shared] * n)
    return columns, source
