"""Attention of many query rows to one prefix that their requests share (cascade attention).

Requests behind the same cached prompt prefix hold the same KV slots for its positions
``0..P-1``. ``shared = (first [N], source [2])``: row ``n`` (a decode request, or one new
token of a prompt chunk) is a member when ``first[n] == P > 0``; ``source = (the
req_to_token row of any member, P)``. Grid (block of rows, kv head, split): a program
loads each prefix K/V block once for a tile of (row, q head) pairs (the q heads of one kv
head) and writes each member's normalised partial output and log2-sum-exp of its split of
the prefix into ``mid_out[n, head, first_split + split]`` / ``mid_lse[...]``, the layout
of ``kernels.decode_attention``'s splits. Rows that are not members are neither read nor
written. The decode attention merges these splits with its own; the prefill attention
starts its online softmax from them (one split).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor, upcast_dots
from ._kv_quant import dot_query, scale_args
from ._online_softmax import attend_range
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from .score_mods import LOG2E, ScoreMods

MAX_SPLITS = 64
# The shared-prefix kernel on CUDA: (tile rows, BLOCK_N, num_warps, num_stages). A tile's (request,
# q head) rows all use each prefix K/V block it loads.
SHARED_LAUNCH = (64, 64, 4, 2)
# float32 past head dim 128 (Gemma's 256 in the float32 parity runs): the 64-row tile's IEEE dots unroll
# into more code than ptxas compiles in reasonable time (an H100 run was still in ptxas when its 75 s box cut
# one kernel test; the server compiles this kernel at start-up); the prefill kernel's float32 tile for 256.
SHARED_LAUNCH_FP32_WIDE = (16, 16, 8, 1)
SHARED_LAUNCH_CPU = (64, 32, 4, 1)


def default_splits(batch: int, kv_heads: int, group: int, device: torch.device, tile_rows: int) -> int:
    """Splits of the shared prefix: about two programs per SM (one on the CPU)."""
    if device.type != "cuda":
        return 1
    blocks = triton.cdiv(batch, max(1, tile_rows // triton.next_power_of_2(group)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(2 * sms, blocks * kv_heads))))


def check(shared, batch: int, device) -> None:
    first, source = shared
    check_tensor("shared prefix lengths", first, 1, dtypes=(torch.int32,), device=device)
    check_shape("shared prefix lengths", first, (batch,))
    check_tensor("shared prefix source", source, 1, dtypes=(torch.int32,), device=device)
    check_shape("shared prefix source", source, (2,))


def default_launch(device: torch.device, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """The launch for queries of ``head_dim`` and ``dtype`` on ``device`` (the table above)."""
    if device.type != "cuda":
        return SHARED_LAUNCH_CPU
    return SHARED_LAUNCH_FP32_WIDE if dtype == torch.float32 and head_dim > 128 else SHARED_LAUNCH


# Row and split counts are not specialised: one compiled kernel serves every step
@triton.jit(do_not_specialize=["batch", "num_splits", "first_split"])
def _shared_prefix_kernel(
    q_ptr, kv_ptr, req_to_token_ptr, b_first_ptr, source_ptr, mid_out_ptr, mid_lse_ptr,
    scale_log2, batch,
    stride_q_batch, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
    stride_mid_batch, stride_mid_head, stride_mid_split, stride_lse_batch, stride_lse_head,
    kv_heads, group_size, head_dim, num_splits, first_split,
    BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, WHILE_LOOP: tl.constexpr, PDL: tl.constexpr,
    softcap_log2, SOFTCAP: tl.constexpr,
    scales_ptr, stride_scale_slot, stride_scale_head, v_scale_offset, KV_SCALES: tl.constexpr,
):
    """Rows (request b, q head) of a block of requests x one kv head's q heads, against the
    shared prefix's positions [split * chunk, (split + 1) * chunk) of ``0..P-1``. Only members'
    rows are written (without a group, nothing is read or written)."""
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    shared_len = tl.load(source_ptr + 1)
    table_row = req_to_token_ptr + tl.load(source_ptr).to(tl.int64) * stride_table_row
    chunk = tl.cdiv(shared_len, num_splits)
    start = split * chunk
    end = tl.minimum(start + chunk, shared_len)

    offs_r = tl.arange(0, BLOCK_B * BLOCK_G)
    b = tl.program_id(0) * BLOCK_B + offs_r // BLOCK_G
    g = offs_r % BLOCK_G
    heads = kv_head * group_size + g
    b_mask = b < batch
    first = tl.load(b_first_ptr + b, mask=b_mask, other=0)
    member = b_mask & (first == shared_len) & (first > 0)
    r_mask = member & (g < group_size)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_offs = b.to(tl.int64)[:, None] * stride_q_batch + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    q = dot_query(q, UPCAST, KV_SCALES)

    m_i = tl.full([BLOCK_B * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_B * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_B * BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = kv_ptr + kv_head * stride_kv_head + offs_d[None, :]
    v_base = k_base + kv_heads * stride_kv_head
    k_scale_base = scales_ptr + kv_head * stride_scale_head
    m_i, l_i, acc = attend_range(q, m_i, l_i, acc, start, end, table_row, k_base, v_base, stride_kv_slot, d_mask,
                                 scale_log2, BLOCK_N, UPCAST, WHILE_LOOP, offs_r * 0, 0, softcap_log2, 0.0,
                                 WINDOW=False, SOFTCAP=SOFTCAP, ALIBI=False, k_scale_base=k_scale_base,
                                 v_scale_base=k_scale_base + v_scale_offset, stride_scale_slot=stride_scale_slot,
                                 KV_SCALES=KV_SCALES)

    has_keys = member & (l_i > 0)
    partial = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out_split = first_split + split
    store = r_mask            # the merge reads a shared-prefix split only for members
    mid_offs = b.to(tl.int64)[:, None] * stride_mid_batch + heads[:, None] * stride_mid_head + out_split * stride_mid_split
    tl.store(mid_out_ptr + mid_offs + offs_d[None, :], partial, mask=store[:, None] & d_mask[None, :])
    lse_offs = b.to(tl.int64) * stride_lse_batch + heads * stride_lse_head + out_split
    tl.store(mid_lse_ptr + lse_offs, lse, mask=store)


def launch(q, kv_layer, req_to_token, shared, mid_out, mid_lse, scale_log2: float, first_split: int, splits: int,
           params: tuple[int, int, int, int], mods: ScoreMods | None = None, kv_scales=None) -> None:
    """The kernel over every row of ``q`` [N, Hq, D] (``params``: tile rows, BLOCK_N, warps, stages;
    ``kv_scales``: a quantized cache's, ``kernels._kv_quant``). Of ``mods`` only the soft-cap applies
    here: a window or ALiBi needs each row's position, so the callers do not use the shared prefix with them."""
    if mods is not None and mods.needs_positions:
        raise ValueError("the shared-prefix kernel cannot apply a sliding window or ALiBi (no row positions)")
    softcap = mods.softcap if mods is not None else None
    rows, q_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[1] // 2
    group = q_heads // kv_heads
    tile_rows, block_n, num_warps, num_stages = params
    block_g = triton.next_power_of_2(group)
    block_b = max(1, tile_rows // block_g)
    _shared_prefix_kernel[(triton.cdiv(rows, block_b), kv_heads, splits)](
        q, kv_layer, req_to_token, shared[0], shared[1], mid_out, mid_lse, scale_log2, rows,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), req_to_token.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        kv_heads, group, head_dim, splits, first_split,
        BLOCK_B=block_b, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=upcast_dots(q), WHILE_LOOP=not q.is_cuda, softcap_log2=(softcap or 1.0) * LOG2E,
        SOFTCAP=softcap is not None, num_warps=num_warps, num_stages=num_stages,
        **launch_options(q), **scale_args(kv_layer, kv_scales),
    )
