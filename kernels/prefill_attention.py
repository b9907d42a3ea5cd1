"""Ragged causal attention for prefill (and chunked prefill) over the TokenAttention table.

Request ``b`` brings ``b_q_len[b]`` new tokens at ``q[b_q_start[b]:]``; its total length is
``b_seq_len[b]``, so new token ``i`` sits at position ``p = b_seq_len[b] - b_q_len[b] + i``
and attends to positions ``0..p``, whose keys and values live in
``kv_layer[req_to_token[b_req_row[b], pos]]`` (K heads first, then V heads). GQA: q head
``h`` reads kv head ``h // (Hq // Hk)``. Flash-attention style online softmax in float32.

Grid: (request, q head, block of BLOCK_M new tokens); each program walks key blocks of
BLOCK_N positions up to the last position its query block can see.

Shared prefix (``shared = (b_prefix_len [B], source [2])``, see ``kernels.shared_prefix``):
the new tokens of the requests whose first P positions hold the same slots attend to those
positions in the shared-prefix kernel first (each prefix K/V block loaded once for a tile
of tokens of many requests); this kernel then starts each such token's online softmax from
that partial result (max = its log2-sum-exp, sum = 1, accumulator = its normalised output)
and walks only positions ``P..``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._checks import (
    check_last_dim_contiguous,
    check_same_dtype,
    check_shape,
    check_tensor,
    upcast_dots,
)
from . import shared_prefix
from ._online_softmax import attend_block
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to


@triton.jit
def _prefill_attention_kernel(
    q_ptr, kv_ptr, req_to_token_ptr, out_ptr,
    b_req_row_ptr, b_q_start_ptr, b_q_len_ptr, b_seq_len_ptr,
    scale_log2,
    stride_q_token, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
    stride_out_token, stride_out_head,
    kv_heads, group_size, head_dim,
    b_first_ptr, mid_out_ptr, mid_lse_ptr, stride_mid_token, stride_mid_head, stride_lse_token, stride_lse_head,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    WHILE_LOOP: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    q_len = tl.load(b_q_len_ptr + b)
    if block_m * BLOCK_M >= q_len:
        return
    q_start = tl.load(b_q_start_ptr + b).to(tl.int64)
    seq_len = tl.load(b_seq_len_ptr + b)
    table_row = req_to_token_ptr + tl.load(b_req_row_ptr + b).to(tl.int64) * stride_table_row
    prefix = seq_len - q_len
    kv_head = head // group_size

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    m_mask = offs_m < q_len
    q_rows = (q_start + offs_m)[:, None] * stride_q_token + head * stride_q_head
    q = tl.load(q_ptr + q_rows + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first = 0
    if SHARED:      # start from the shared prefix's partial result (kernels.shared_prefix)
        first = tl.load(b_first_ptr + b)
        member = (offs_m * 0 + first) > 0
        tokens = (q_start + offs_m)
        lse = tl.load(mid_lse_ptr + tokens * stride_lse_token + head * stride_lse_head, mask=m_mask & member,
                      other=float("-inf"))
        partial = tl.load(mid_out_ptr + tokens[:, None] * stride_mid_token + head * stride_mid_head + offs_d[None, :],
                          mask=(m_mask & member)[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.where(member, lse, m_i)
        l_i = tl.where(member, 1.0, l_i)
        acc = tl.where(member[:, None], partial, acc)
    k_base = kv_ptr + kv_head * stride_kv_head + offs_d[None, :]
    v_base = k_base + kv_heads * stride_kv_head
    # the last position any query of this block sees
    key_end = tl.minimum(seq_len, prefix + (block_m + 1) * BLOCK_M)
    if WHILE_LOOP:  # the CPU interpreter cannot take runtime `range` bounds (numpy >= 2.4)
        start_n = first
        while start_n < key_end:
            m_i, l_i, acc = attend_block(q, m_i, l_i, acc, start_n, key_end, q_pos, table_row, k_base, v_base,
                                         stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, CAUSAL=True)
            start_n += BLOCK_N
    else:
        for start_n in range(first, key_end, BLOCK_N):
            m_i, l_i, acc = attend_block(q, m_i, l_i, acc, start_n, key_end, q_pos, table_row, k_base, v_base,
                                         stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, CAUSAL=True)

    acc = acc / l_i[:, None]
    out_rows = (q_start + offs_m)[:, None] * stride_out_token + head * stride_out_head
    tl.store(out_ptr + out_rows + offs_d[None, :], round_to(acc, out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def _check(q, kv_layer, req_to_token, b_req_row, b_q_start, b_q_len, b_seq_len, max_q_len) -> None:
    check_tensor("q", q, 3)
    device = q.device
    check_tensor("kv_layer", kv_layer, 3, device=device)
    check_same_dtype("kv_layer", kv_layer, q.dtype)
    q_heads, head_dim = q.shape[1:]
    if kv_layer.shape[1] % 2 or kv_layer.shape[2] != head_dim:
        raise ValueError(f"kv_layer has shape {tuple(kv_layer.shape)}; expected (slots, 2 * kv_heads, {head_dim})")
    kv_heads = kv_layer.shape[1] // 2
    if q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    check_tensor("req_to_token", req_to_token, 2, dtypes=(torch.int32,), device=device)
    batch = b_req_row.shape[0] if isinstance(b_req_row, torch.Tensor) else -1
    for name, t in (("b_req_row", b_req_row), ("b_q_start", b_q_start), ("b_q_len", b_q_len),
                    ("b_seq_len", b_seq_len)):
        check_tensor(name, t, 1, dtypes=(torch.int32,), device=device)
        check_shape(name, t, (batch,))
    for name, t in (("q", q), ("kv_layer", kv_layer), ("req_to_token", req_to_token)):
        check_last_dim_contiguous(name, t)
    if not isinstance(max_q_len, int) or max_q_len < 0:
        raise ValueError(f"max_q_len must be a host int >= 0 (max of b_q_len), got {max_q_len!r}")


def prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, req_to_token: torch.Tensor,
                      b_req_row: torch.Tensor, b_q_start: torch.Tensor, b_q_len: torch.Tensor,
                      b_seq_len: torch.Tensor, sm_scale: float, max_q_len: int,
                      shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, Hq, D]; kv_layer [S+1, 2*Hk, D]; returns out [T, Hq, D] contiguous, q's dtype.

    ``shared``: ``(b_prefix_len [B] int32, source [2] int32)``, a prefix that several requests
    share (see the module's docstring); the result is the same as without it."""
    _check(q, kv_layer, req_to_token, b_req_row, b_q_start, b_q_len, b_seq_len, max_q_len)
    tokens, q_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[1] // 2
    batch = b_req_row.shape[0]
    if shared is not None:
        shared_prefix.check(shared, batch, q.device)
    out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or batch == 0 or max_q_len == 0:
        return out
    scale_log2 = float(sm_scale) * math.log2(math.e)
    mid_out = mid_lse = b_first = b_seq_len            # unread without SHARED
    mid_strides = (0, 0, 0, 0)
    if shared is not None:
        b_first = shared[0]
        token_first = torch.repeat_interleave(b_first, b_q_len, output_size=tokens)
        mid_out = torch.empty((tokens, q_heads, 1, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((tokens, q_heads, 1), dtype=torch.float32, device=q.device)
        shared_prefix.launch(q, kv_layer, req_to_token, (token_first, shared[1]), mid_out, mid_lse, scale_log2,
                             first_split=0, splits=1, params=shared_prefix.default_launch(q.device))
        mid_strides = (mid_out.stride(0), mid_out.stride(1), mid_lse.stride(0), mid_lse.stride(1))
    block_d = max(16, triton.next_power_of_2(head_dim))
    on_gpu = q.device.type == "cuda"
    block_m, block_n = (64, 64) if on_gpu else (32, 32)
    grid = (batch, q_heads, triton.cdiv(max_q_len, block_m))
    _prefill_attention_kernel[grid](
        q, kv_layer, req_to_token, out,
        b_req_row, b_q_start, b_q_len, b_seq_len,
        scale_log2,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1),
        kv_heads, q_heads // kv_heads, head_dim,
        b_first, mid_out, mid_lse, *mid_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, UPCAST=upcast_dots(q), WHILE_LOOP=not on_gpu,
        SHARED=shared is not None, num_warps=4, num_stages=2, **launch_options(q),
    )
    return out


def prefill_attention_ref(q: torch.Tensor, kv_layer: torch.Tensor, req_to_token: torch.Tensor,
                          b_req_row: torch.Tensor, b_q_start: torch.Tensor, b_q_len: torch.Tensor,
                          b_seq_len: torch.Tensor, sm_scale: float, max_q_len: int, shared=None) -> torch.Tensor:
    """Every new token over all the positions it sees (``shared`` changes only how the kernel walks them)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[1] // 2
    out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    for row, start, q_len, seq_len in zip(b_req_row.tolist(), b_q_start.tolist(), b_q_len.tolist(),
                                          b_seq_len.tolist()):
        slots = req_to_token[row, :seq_len].long()
        k = kv_layer[slots, :kv_heads].float().repeat_interleave(q_heads // kv_heads, dim=1)
        v = kv_layer[slots, kv_heads:].float().repeat_interleave(q_heads // kv_heads, dim=1)
        qr = q[start:start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", qr, k) * sm_scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
