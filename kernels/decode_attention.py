"""Split-K flash-decoding over the TokenAttention table, GQA-aware.

Request ``b`` has one query ``q[b]`` at position ``b_seq_len[b] - 1``; it attends to
positions ``0..b_seq_len[b] - 1`` whose K/V rows are ``kv_layer[req_to_token[b_req_row[b], pos]]``.

Stage 1, grid (request, kv head, split): the program loads the ``Hq // Hk`` q heads that
share its kv head (padded to 16 rows for ``tl.dot``), so each K/V row is read once, and
walks its chunk of positions ``[split * chunk, (split + 1) * chunk)`` with
``chunk = max(ceil(b_seq_len[b] / num_splits), min_chunk)``; it writes the normalised partial output and
the log2-sum-exp of its chunk (an empty chunk only its ``-inf``).
Stage 2, grid (request, q head): merges the splits by their log-sum-exp.
The chunk is derived on the device from ``b_seq_len``, so no host lengths are needed and
the launch can be captured in a CUDA graph.

A quantized cache (int8 or fp8) without GQA (one q head per kv head) and without score modifications is
walked without ``tl.dot`` where the batch gives the GPU enough (request, kv head) programs
(``rowwise_applies``, ``default_rowwise``, split by ``rowwise_splits``): the one query row's scores and
weighted values are products and sums in float32 (``_attend_row``), where the dot walk pads the row to 16
and moves every block through shared memory as float16; the values are read as float32 with integer ops
(``int8_as_float32``, ``fp8_as_float32``). One H200, random Llama-2-7B, through HTTP, the 512-request load
(``bench.serving_bench --workloads batch``, the trees in turn in one call, twice): int8 9,652 / 9,628 ->
10,438 / 10,463 output tokens/s (stop 67), fp8 e4m3 9,220 / 9,211 -> 10,462 / 10,426 (stop 68).

A few requests with an int8 cache take their own launch (``cuda_launch``): where ``default_num_splits``
gives 4 to 32 splits, twice as many splits of 32-key blocks over one warp, each split's keys after its
last full block walked in 16-key blocks (``attend_range``'s TAIL_N); elsewhere 64-key blocks with 32-key
tails. One H200, random Llama-2-7B, batch-1 decode through HTTP (``bench.serving_bench --workloads
batch1``, one call): 254.3 tokens/s with the tails alone, 259.2 with this launch, 263.4 with a bfloat16
cache (98.4%).

Shared prefix (cascade attention, ``kernels.shared_prefix``). With ``shared = (b_prefix_len [B],
source [2])`` the requests whose first P positions hold the same slots attend to them in the
shared-prefix kernel (each prefix K/V block loaded once for a tile of requests), whose
splits follow the split kernel's in ``mid_out``; the split kernel then walks only positions
``b_prefix_len[b]..b_seq_len[b] - 1``, and the merge takes both kernels' splits.

| buffer   | shape                      | dtype   |
| -------- | -------------------------- | ------- |
| mid_out  | [B, Hq, num_splits, D]     | float32 |
| mid_lse  | [B, Hq, num_splits] (log2) | float32 |
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import score_mods, shared_prefix
from ._checks import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_shape,
    check_tensor,
    upcast_dots,
)
from ._kv_quant import (
    FP8_AS_FLOAT32,
    KV_DTYPES,
    QUANTIZED_DTYPES,
    check_kv,
    dot_query,
    fp8_as_float32,
    gather_kv_ref,
    int8_as_float32,
    scale_args,
)
from ._online_softmax import attend_range
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to
from .score_mods import ScoreMods
from .skinny_gemm import device_sms

MAX_SPLITS = 64
CPU_SPLITS = 1     # under the interpreter a program costs the same whatever it reads: one split (3 before) cut the
                   # interpreted parity runs 148 -> 101 s; the kernel tests give split counts of their own
# (BLOCK_N, num_warps, num_stages) on CUDA: BLOCK_N 32 with 2 warps is 0.5-1.4 us a layer faster than
# 64 with 4 at batch 1 (bench.attention_bench, one H100)
CUDA_LAUNCH = (32, 2, 2)
# an int8 cache moves half the bytes a block, so longer blocks keep as many in flight: on one H100 with Llama-2-7B
# heads, 547 us a layer at batch 256 x 512 keys against 704 with bf16's launch (a bf16 cache: 735), and 19.2
# against 21.5 us at batch 1 x 4096 keys (bf16 cache: 26.8); the best of 8 launches at both shapes
CUDA_LAUNCH_INT8 = (64, 2, 2)
# a split of a bf16 (float) cache walks at least one BLOCK_N of keys: at short contexts fewer splits (the rest empty)
# than default_num_splits' count, which the CUDA graphs fix for every context. One H200, 32 launches replayed from a
# CUDA graph, default count and launch, us a layer without -> with (.diag/s61_min_chunk.py, stop 61): Qwen3-30B-A3B
# heads (32 q / 4 kv, 64 splits) at batch 1 x 128 keys 5.53 -> 4.61, x 512 5.56 -> 4.68, batch 4 x 128 6.65 -> 5.41;
# Llama-3.1-8B heads batch 1 x 128 6.39 -> 5.06; Llama-2-7B heads batch 1 x 128 5.37 -> 4.58; the same (within
# 0.1) from 2,048 keys up, and at every other measured shape. 64 keys a split was slower than 32 below 2,048 keys.
# Not taken with an int8 cache, where its launches lost up to 1 us (Llama-2-7B heads batch 1 x 512 6.81 -> 7.68),
# nor with fp8 (not measured).
MIN_CHUNK_FLOAT = CUDA_LAUNCH[0]
# the rowwise walk (int8 or fp8, no GQA) from this many (request, kv head) programs per SM, in splits that make at
# most ROWWISE_PROGRAMS_PER_SM programs an SM (``rowwise_splits``); below it the dot walk. One H200, Llama-2-7B heads,
# 32 launches replayed from a CUDA graph, us a layer, the dot walk (default splits and launch) -> rowwise in 1 / 2 /
# 4 splits (.diag/fp8row/small_bench.py, stop 68):
#   int8: 16 x 1024 keys 59.0 -> 101.8 / 57.2 / 48.3; 24 x 1024 108.0 -> 108.2 / 79.0 / 75.6; 32 x 1024 113.2 ->
#   114.3 / 82.9 / 87.7; 40 x 1024 161.8 -> 128.1 / 129.3 / 113.4; 16 x 4096 215.0 -> 393.0 / 216.2 / 171.8;
#   8 x 1024 33.9 -> 98.0 / 50.4 / 34.1 (1.9 programs an SM: the dot walk);
#   fp8 e4m3: 16 x 1024 74.6 -> 141.6 / 80.0 / 57.4; 24 x 1024 84.1 -> 149.2 / 88.4 / 95.0; 32 x 1024 153.9 ->
#   153.4 / 100.6 / 104.4; 40 x 1024 159.1 -> 165.0 / 168.3 / 140.4; 8 x 1024 37.8 -> 140.1 / 74.1 / 44.3;
#   in one split (.diag/fp8row/walk_bench.py; fp8's dot walk as it was before it read float16, ``load_kv``):
#   48 x 1024 int8 167.6 -> 133.9, e4m3 242.9 -> 170.3; 512 x 416 int8 918.3 -> 645.3, e4m3 1083.3 -> 625.4,
#   e5m2 1074.4 -> 621.3 (a bf16 cache: 855.4)
ROWWISE_MIN_PROGRAMS_PER_SM = 3
ROWWISE_PROGRAMS_PER_SM = 16
# (BLOCK_N, num_warps, num_stages) of the rowwise walk: one warp, 32 keys a step. One H200, Llama-2-7B heads, us a
# layer (32 launches replayed from a CUDA graph; .diag/int8row, stop 67), CUDA_LAUNCH_INT8 -> this launch, each
# with int8_as_float32: 512 x 416 keys 752.1 -> 527.1 (a bf16 cache: 826.1), 256 x 512 425.8 -> 326.5 (509.9);
# the best of 18 launches (32 / 64 / 128 keys, 1 / 2 / 4 warps, 2 / 3 stages) at both shapes
CUDA_LAUNCH_ROWWISE = (32, 1, 2)
# an int8 cache where default_num_splits gives a request 4 to MAX_SPLITS // 2 splits (few requests: short chunks at
# short contexts, where a 64-key block cost about 4 us more than a 32-key one): twice the splits, 32-key blocks over
# one warp, the keys after a split's last full block walked in 16-key blocks. One H200, 32 launches replayed from a
# CUDA graph, each reading its own layer's cache (colder than the L2), us a layer, (64, 2, 2) -> this launch (bf16's
# cache and launch):
#   Llama-2-7B heads, batch 1 x 128 keys 9.7 -> 7.1 (5.7), x 384 10.7 -> 7.4 (6.5), x 1024 11.0 -> 10.0 (9.3),
#   x 4096 21.6 -> 20.3 (21.6), x 32768 114.1 -> 117.6 (135.3); batch 4 x 384 17.7 -> 13.6 (11.4);
#   Llama-3.1-8B heads, batch 2 x 384 13.4 -> 7.8 (7.1), batch 4 x 4096 25.0 -> 21.2 (22.9), batch 8 x 384
#   14.6 -> 10.1 (10.2)
CUDA_LAUNCH_INT8_FEW = (32, 1, 2)
FEW_MIN_SPLITS = 4
TAIL_N_INT8_FEW = 16
# (64, 2, 2)'s tail block with an int8 cache; Llama-3.1-8B heads at batch 1 (64 splits), without -> with it:
# x 128 keys 10.0 -> 8.4 us, x 384 10.1 -> 8.5, x 4096 11.1 both, x 32768 35.4 -> 36.0
TAIL_N_INT8 = 32


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, req_to_token_ptr, b_req_row_ptr, b_seq_len_ptr, mid_out_ptr, mid_lse_ptr,
    scale_log2,
    stride_q_batch, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
    stride_mid_batch, stride_mid_head, stride_mid_split, stride_lse_batch, stride_lse_head,
    kv_heads, group_size, head_dim, num_splits, min_chunk,
    b_first_ptr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    WHILE_LOOP: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr,
    window, softcap_log2, alibi_ptr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    scales_ptr, stride_scale_slot, stride_scale_head, v_scale_offset, KV_SCALES: tl.constexpr,
    ROWWISE: tl.constexpr = False, TAIL_N: tl.constexpr = 0, FP8_SHIFT: tl.constexpr = 0,
    FP8_UNBIAS: tl.constexpr = 1.0,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the PDL wait (kernels._pdl): the request's length, row and shared prefix, the step's inputs (written
    # before the layer's first launch, two or more back: read through L2); the table, q and the cache after it
    seq_len = tl.load(b_seq_len_ptr + b, cache_modifier=".cg")
    table_row = req_to_token_ptr + tl.load(b_req_row_ptr + b, cache_modifier=".cg").to(tl.int64) * stride_table_row
    # positions before it: the shared-prefix kernel
    first = tl.load(b_first_ptr + b, cache_modifier=".cg") if SHARED else 0
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    if WINDOW:      # the window's keys are one contiguous range for the one query: a bound, no mask
        first = tl.maximum(first, seq_len - window)
    chunk = tl.maximum(tl.cdiv(seq_len - first, num_splits), min_chunk)
    start = first + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * group_size + offs_h
    h_mask = offs_h < group_size
    d_mask = offs_d < head_dim
    q_offs = b.to(tl.int64) * stride_q_batch + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if ROWWISE:     # one row: products and sums in float32, q in log2 units
        q = q.to(tl.float32) * scale_log2
    else:
        q = dot_query(q, UPCAST, KV_SCALES)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    k_base = kv_ptr + kv_head * stride_kv_head + offs_d[None, :]
    v_base = k_base + kv_heads * stride_kv_head
    k_scale_base = scales_ptr + kv_head * stride_scale_head
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + seq_len - 1
    alibi_log2 = tl.load(alibi_ptr + heads, mask=h_mask, other=0.0) * 1.4426950408889634 if ALIBI else 0.0
    if ROWWISE:
        m_i, l_i, acc = _attend_row(q, m_i, l_i, acc, start, end, table_row, k_base, v_base, stride_kv_slot, d_mask,
                                    k_scale_base, k_scale_base + v_scale_offset, stride_scale_slot, BLOCK_N,
                                    WHILE_LOOP, KV_SCALES, FP8_SHIFT, FP8_UNBIAS)
    else:
        m_i, l_i, acc = attend_range(q, m_i, l_i, acc, start, end, table_row, k_base, v_base, stride_kv_slot, d_mask,
                                     scale_log2, BLOCK_N, UPCAST, WHILE_LOOP, q_pos, window, softcap_log2, alibi_log2,
                                     WINDOW=False, SOFTCAP=SOFTCAP, ALIBI=ALIBI, k_scale_base=k_scale_base,
                                     v_scale_base=k_scale_base + v_scale_offset, stride_scale_slot=stride_scale_slot,
                                     KV_SCALES=KV_SCALES, TAIL_N=TAIL_N)

    has_keys = l_i > 0
    partial = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    mid_offs = b.to(tl.int64) * stride_mid_batch + heads[:, None] * stride_mid_head + split * stride_mid_split
    # an empty chunk writes only its -inf (the merge reads no partial behind one)
    tl.store(mid_out_ptr + mid_offs + offs_d[None, :], partial, mask=(h_mask & has_keys)[:, None] & d_mask[None, :])
    lse_offs = b.to(tl.int64) * stride_lse_batch + heads * stride_lse_head + split
    tl.store(mid_lse_ptr + lse_offs, lse, mask=h_mask)


@triton.jit
def _attend_row(q, m_i, l_i, acc, start, end, table_row, k_base, v_base, stride_kv_slot, d_mask, k_scale_base,
                v_scale_base, stride_scale_slot, BLOCK_N: tl.constexpr, WHILE_LOOP: tl.constexpr,
                KV_SCALES: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_UNBIAS: tl.constexpr):
    """The online softmax of one query row ``q`` [1, D] (float32, log2 units) over a quantized cache's positions
    [start, end): each block's scores and weighted values as products and sums in float32 (no ``tl.dot``, whose
    16 rows would hold this one; ``rowwise_applies``). int8 values are read as float32 integers, their per-slot
    scales applied to the scores and the probabilities; fp8 values as float32 times 2**-bias (``fp8_as_float32``,
    ``FP8_SHIFT`` its shift), with ``ROW_LIFT`` on q and on the probabilities, so that no product leaves float32's
    normal range, and the per-tensor scales and the rest of the offset (``FP8_UNBIAS``, ``fp8_row_read``'s)
    applied to q before the walk and to the accumulator after it."""
    unbias = 1.0
    if KV_SCALES == 2:
        unbias = FP8_UNBIAS
        q = q * (tl.load(k_scale_base) * ROW_LIFT)
    if WHILE_LOOP:  # the CPU interpreter cannot take runtime `range` bounds (numpy >= 2.4)
        start_n = start
        while start_n < end:
            m_i, l_i, acc = _row_block(q, m_i, l_i, acc, start_n, end, table_row, k_base, v_base, stride_kv_slot,
                                       d_mask, k_scale_base, v_scale_base, stride_scale_slot, unbias, BLOCK_N,
                                       KV_SCALES, FP8_SHIFT)
            start_n += BLOCK_N
    else:
        for start_n in range(start, end, BLOCK_N):
            m_i, l_i, acc = _row_block(q, m_i, l_i, acc, start_n, end, table_row, k_base, v_base, stride_kv_slot,
                                       d_mask, k_scale_base, v_scale_base, stride_scale_slot, unbias, BLOCK_N,
                                       KV_SCALES, FP8_SHIFT)
    if KV_SCALES == 2:
        acc = acc * (tl.load(v_scale_base) * unbias)
    return m_i, l_i, acc


# fp8's rowwise walk: q and the probabilities are lifted by 2**64 against values read 2**-120 (e4m3) or 2**-112
# (e5m2) small (``fp8_as_float32``), so products keep float32's normal range; the scores and the accumulator are
# brought back by 2**56 or 2**48 (``fp8_row_read``)
ROW_LIFT_LOG2 = 64
ROW_LIFT: tl.constexpr = tl.constexpr(2.0 ** ROW_LIFT_LOG2)


def fp8_row_read(dtype: torch.dtype) -> tuple[int, float]:
    """(FP8_SHIFT, FP8_UNBIAS) of the rowwise walk over a ``dtype`` cache: ``fp8_as_float32``'s shift, and
    2**(its bias offset - ``ROW_LIFT_LOG2``), which brings the lifted scores and accumulator back; (0, 1.0) for a
    cache that is not fp8. Both from ``FP8_AS_FLOAT32``, so a format's shift and offset cannot disagree."""
    if dtype not in FP8_AS_FLOAT32:
        return 0, 1.0
    shift, offset = FP8_AS_FLOAT32[dtype]
    return shift, 2.0 ** (offset - ROW_LIFT_LOG2)


@triton.jit
def _row_values(x, KV_SCALES: tl.constexpr, FP8_SHIFT: tl.constexpr):
    """A gathered block of stored values as float32: int8's integers, or fp8's values times 2**-bias."""
    if KV_SCALES == 1:
        return int8_as_float32(x)
    else:
        return fp8_as_float32(x, FP8_SHIFT)


@triton.jit
def _row_block(q, m_i, l_i, acc, start_n, end, table_row, k_base, v_base, stride_kv_slot, d_mask, k_scale_base,
               v_scale_base, stride_scale_slot, unbias, BLOCK_N: tl.constexpr, KV_SCALES: tl.constexpr,
               FP8_SHIFT: tl.constexpr):
    """``_attend_row``'s update with the positions [start_n, start_n + BLOCK_N) before ``end``: int8's scale of
    each key on its score and of each value on its probability (``l_i`` sums them unscaled); fp8's offsets."""
    pos = start_n + tl.arange(0, BLOCK_N)
    n_mask = pos < end
    slots = tl.load(table_row + pos, mask=n_mask, other=0).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = _row_values(tl.load(k_base + slots[:, None] * stride_kv_slot, mask=kv_mask, other=0.0), KV_SCALES,
                    FP8_SHIFT)
    if KV_SCALES == 1:
        k_scale = tl.load(k_scale_base + slots * stride_scale_slot, mask=n_mask, other=0.0)
        v_scale = tl.load(v_scale_base + slots * stride_scale_slot, mask=n_mask, other=0.0)
    else:
        k_scale = unbias
        v_scale = ROW_LIFT
    qk = tl.where(n_mask, tl.sum(k * q, 1) * k_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 0))
    p = tl.exp2(qk - m_new)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 0)
    v = _row_values(tl.load(v_base + slots[:, None] * stride_kv_slot, mask=kv_mask, other=0.0), KV_SCALES,
                    FP8_SHIFT)
    acc = acc * alpha[:, None] + tl.sum((p * v_scale)[:, None] * v, 0)[None, :]
    return m_new, l_i, acc


# The split counts are not specialised: every count shares one compiled kernel (no compile mid-serving)
MERGE_UNSPECIALISED = ("num_splits", "total_splits")


@triton.jit(do_not_specialize=list(MERGE_UNSPECIALISED))
def _decode_merge_kernel(
    mid_out_ptr, mid_lse_ptr, out_ptr, b_first_ptr,
    stride_mid_batch, stride_mid_head, stride_mid_split, stride_lse_batch, stride_lse_head,
    stride_out_batch, stride_out_head,
    head_dim, num_splits, total_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr,
):
    """Splits ``0..num_splits-1`` (the split kernel's), then the shared prefix's up to ``total_splits``
    for a member of the group."""
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    if SHARED:
        s_mask = s_mask | ((offs_s < total_splits) & (offs_s * 0 + tl.load(b_first_ptr + b) > 0))
    d_mask = offs_d < head_dim
    lse = tl.load(mid_lse_ptr + b * stride_lse_batch + head * stride_lse_head + offs_s,
                  mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a request with no keys
    weight = tl.exp2(lse - lse_max)
    mid_offs = b * stride_mid_batch + head * stride_mid_head + offs_s[:, None] * stride_mid_split
    has_keys = lse > float("-inf")      # an empty split wrote no partial (``_decode_split_kernel``)
    partial = tl.load(mid_out_ptr + mid_offs + offs_d[None, :], mask=(s_mask & has_keys)[:, None] & d_mask[None, :],
                      other=0.0)
    total = tl.sum(weight, 0)
    merged = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_out_batch + head * stride_out_head + offs_d,
             round_to(merged, out_ptr.dtype.element_ty), mask=d_mask)


def default_num_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Enough (request, kv head, split) programs to fill the GPU about twice over, rounded up to a power of two.

    On one H100 with Llama-2-7B heads (``bench.attention_bench``) that is 16 splits at batch 1, best or
    within 2% of the best at 384 to 4096 keys, and 2 at batch 8, the best at 128 to 4096 keys.
    """
    if device.type != "cuda":
        return CPU_SPLITS
    sms = device_sms(device)
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(2 * sms, max(1, batch * kv_heads)))))


def rowwise_applies(kv_layer: torch.Tensor, group: int, mods: ScoreMods | None) -> bool:
    """Whether the split kernel can walk one query row without ``tl.dot`` (``_attend_row``): an int8 or fp8
    cache, one q head per kv head, no score modification."""
    return kv_layer.dtype in QUANTIZED_DTYPES and group == 1 and (mods is None or not mods.any)


def default_rowwise(kv_layer: torch.Tensor, batch: int, group: int, mods: ScoreMods | None, sms: int | None) -> bool:
    """``launch``'s walk when not told: rowwise where it applies and the (request, kv head) programs number
    ``ROWWISE_MIN_PROGRAMS_PER_SM`` per SM of a GPU with ``sms`` SMs or more (the constant's comment: where it is
    faster). With ``sms`` None (the CPU interpreter) wherever it applies, so that the tests cover it."""
    kv_heads = kv_layer.shape[1] // 2
    fills = sms is None or batch * kv_heads >= ROWWISE_MIN_PROGRAMS_PER_SM * sms
    return rowwise_applies(kv_layer, group, mods) and fills


def rowwise_splits(batch: int, kv_heads: int, sms: int) -> int:
    """The rowwise walk's split count on a GPU of ``sms`` SMs: the largest power of two that keeps the (request,
    kv head, split) programs within ``ROWWISE_PROGRAMS_PER_SM`` an SM, at least 1 (one warp a program)."""
    fit = ROWWISE_PROGRAMS_PER_SM * sms // max(1, batch * kv_heads)
    return min(MAX_SPLITS, 1 << max(0, fit.bit_length() - 1))


def cuda_launch(kv_layer: torch.Tensor, splits: int) -> tuple[int, int, int, int, int]:
    """(splits, BLOCK_N, num_warps, num_stages, tail BLOCK_N) of the split kernel's dot walk on CUDA for this cache's
    dtype and ``default_num_splits``' count (the module's constants say where each is faster)."""
    if kv_layer.dtype != torch.int8:
        return (splits, *CUDA_LAUNCH, CUDA_LAUNCH[0])
    if FEW_MIN_SPLITS <= splits <= MAX_SPLITS // 2:
        return (2 * splits, *CUDA_LAUNCH_INT8_FEW, TAIL_N_INT8_FEW)
    return (splits, *CUDA_LAUNCH_INT8, TAIL_N_INT8)


def cuda_walk(kv_layer: torch.Tensor, batch: int, group: int, mods: ScoreMods | None, splits: int,
              sms: int) -> tuple[int, int, int, int, int, bool]:
    """(splits, BLOCK_N, num_warps, num_stages, tail BLOCK_N, rowwise) of the split kernel on a GPU of ``sms`` SMs:
    the rowwise walk (``default_rowwise``) in ``rowwise_splits`` over ``CUDA_LAUNCH_ROWWISE``, else the dot walk's
    ``cuda_launch`` for ``default_num_splits``' count ``splits``."""
    if default_rowwise(kv_layer, batch, group, mods, sms):
        return (rowwise_splits(batch, kv_layer.shape[1] // 2, sms), *CUDA_LAUNCH_ROWWISE, CUDA_LAUNCH_ROWWISE[0],
                True)
    return (*cuda_launch(kv_layer, splits), False)


def default_min_chunk(kv_layer: torch.Tensor) -> int:
    """The fewest keys a split walks on CUDA with this cache (``MIN_CHUNK_FLOAT``'s comment: where it is faster)."""
    return MIN_CHUNK_FLOAT if kv_layer.dtype in FLOAT_DTYPES else 0


def _check(q, kv_layer, req_to_token, b_req_row, b_seq_len, num_splits, kv_scales) -> None:
    check_tensor("q", q, 3)
    device = q.device
    check_tensor("kv_layer", kv_layer, 3, dtypes=KV_DTYPES, device=device)
    check_kv(kv_layer, kv_scales, q.dtype)
    batch, q_heads, head_dim = q.shape
    if kv_layer.shape[1] % 2 or kv_layer.shape[2] != head_dim:
        raise ValueError(f"kv_layer has shape {tuple(kv_layer.shape)}; expected (slots, 2 * kv_heads, {head_dim})")
    if q_heads % (kv_layer.shape[1] // 2):
        raise ValueError(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_layer.shape[1] // 2})")
    check_tensor("req_to_token", req_to_token, 2, dtypes=(torch.int32,), device=device)
    for name, t in (("b_req_row", b_req_row), ("b_seq_len", b_seq_len)):
        check_tensor(name, t, 1, dtypes=(torch.int32,), device=device)
        check_shape(name, t, (batch,))
    for name, t in (("q", q), ("kv_layer", kv_layer), ("req_to_token", req_to_token)):
        check_last_dim_contiguous(name, t)
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int in 1..{MAX_SPLITS}, got {num_splits!r}")


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, req_to_token: torch.Tensor,
                     b_req_row: torch.Tensor, b_seq_len: torch.Tensor, sm_scale: float,
                     num_splits: int | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                     mods: ScoreMods | None = None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; kv_layer [S+1, 2*Hk, D]; returns out [B, Hq, D] in q's dtype.

    ``shared``: ``(b_prefix_len [B] int32, source [2] int32)``, a prefix that several requests
    share (see the module's docstring); the result is the same as without it.
    ``mods``: the layer's sliding window, soft-cap, ALiBi (``kernels.score_mods``); with a window
    or ALiBi the shared prefix is not used (its kernel knows no row positions). ``kv_scales``: a
    quantized cache's scales (``kernels._kv_quant``)."""
    _check(q, kv_layer, req_to_token, b_req_row, b_seq_len, num_splits, kv_scales)
    score_mods.check(mods, q.shape[1], q.device)
    if mods is not None and mods.needs_positions:
        shared = None
    if shared is not None:
        shared_prefix.check(shared, q.shape[0], q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    kv_heads = kv_layer.shape[1] // 2
    splits = num_splits or default_num_splits(q.shape[0], kv_heads, q.device)
    # a split count the caller gives is kept, every split walked; the launch is that count's
    min_chunk = default_min_chunk(kv_layer) if q.is_cuda and not num_splits else 0
    rowwise = None
    if q.is_cuda:
        chosen, block_n, num_warps, num_stages, tail_n, rowwise = cuda_walk(
            kv_layer, q.shape[0], q.shape[1] // kv_heads, mods, splits, device_sms(q.device))
        splits = num_splits or chosen
    else:
        block_n, num_warps, num_stages, tail_n = 32, 4, 1, None
    launch(q, kv_layer, req_to_token, b_req_row, b_seq_len, sm_scale, out, splits, block_n, num_warps, num_stages,
           shared=shared, mods=mods, kv_scales=kv_scales, rowwise=rowwise, tail_n=tail_n, min_chunk=min_chunk)
    return out


def launch(q, kv_layer, req_to_token, b_req_row, b_seq_len, sm_scale, out, splits: int, block_n: int,
           num_warps: int, num_stages: int, shared=None, shared_launch: tuple[int, int, int, int] | None = None,
           mods: ScoreMods | None = None, kv_scales=None, rowwise: bool | None = None,
           tail_n: int | None = None, min_chunk: int = 0) -> None:
    """The stages with explicit launch parameters (``decode_attention`` picks them; benchmarks sweep them).
    ``rowwise``: the split kernel's walk without ``tl.dot`` (None: ``default_rowwise``; True only where it
    applies). ``tail_n``: a split's keys after its last full block walked in blocks of this many when shorter than
    ``block_n`` (None: one bounded block of ``block_n``). ``min_chunk``: the fewest keys a split walks, so that a
    short context takes fewer splits than ``splits`` (the rest find no keys and write only their ``-inf``)."""
    if not (isinstance(min_chunk, int) and min_chunk >= 0):
        raise ValueError(f"min_chunk must be an int >= 0 (keys a split walks at least), got {min_chunk!r}")
    batch, q_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[1] // 2
    group = q_heads // kv_heads
    if rowwise and not rowwise_applies(kv_layer, group, mods):
        raise ValueError("the rowwise walk takes an int8 or fp8 cache without GQA and without score modifications")
    if rowwise is None:
        rowwise = default_rowwise(kv_layer, batch, group, mods, device_sms(q.device) if q.is_cuda else None)
    params = shared_launch or shared_prefix.default_launch(q.device, head_dim, q.dtype)
    prefix_splits = 0 if shared is None else shared_prefix.default_splits(batch, kv_heads, group, q.device, params[0])
    total = splits + prefix_splits
    mid_out = torch.empty((batch, q_heads, total, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, q_heads, total), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    mid_strides = (mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    scale_log2 = float(sm_scale) * math.log2(math.e)
    fp8_shift, fp8_unbias = fp8_row_read(kv_layer.dtype) if rowwise else (0, 1.0)
    pdl = launch_options(q)
    first = b_seq_len if shared is None else shared[0]     # unread without SHARED
    mod_args, mod_flags = score_mods.kernel_args(mods, unread=mid_lse)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, kv_layer, req_to_token, b_req_row, b_seq_len, mid_out, mid_lse,
        scale_log2,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), req_to_token.stride(0),
        *mid_strides,
        kv_heads, group, head_dim, splits, min_chunk, first,
        BLOCK_H=1 if rowwise else max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast_dots(q), WHILE_LOOP=not q.is_cuda, SHARED=shared is not None,
        **mod_args, **mod_flags, **scale_args(kv_layer, kv_scales), ROWWISE=rowwise,
        TAIL_N=tail_n if tail_n is not None and tail_n < block_n else 0,
        FP8_SHIFT=fp8_shift, FP8_UNBIAS=fp8_unbias,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    if shared is not None:
        shared_prefix.launch(q, kv_layer, req_to_token, shared, mid_out, mid_lse, scale_log2,
                             first_split=splits, splits=prefix_splits, params=params, mods=mods, kv_scales=kv_scales)
    _decode_merge_kernel[(batch, q_heads)](
        mid_out, mid_lse, out, first, *mid_strides, out.stride(0), out.stride(1), head_dim, splits, total,
        BLOCK_S=triton.next_power_of_2(total), BLOCK_D=block_d, SHARED=shared is not None, num_warps=4, **pdl,
    )


def decode_attention_ref(q: torch.Tensor, kv_layer: torch.Tensor, req_to_token: torch.Tensor,
                         b_req_row: torch.Tensor, b_seq_len: torch.Tensor, sm_scale: float,
                         num_splits: int | None = None, shared=None, mods: ScoreMods | None = None,
                         kv_scales=None) -> torch.Tensor:
    """Every request over all its positions (``num_splits`` and ``shared`` change only how the kernel walks them),
    the scores modified by ``mods`` (``score_mods.apply_ref``)."""
    q_heads = q.shape[1]
    kv_heads = kv_layer.shape[1] // 2
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for b, (row, seq_len) in enumerate(zip(b_req_row.tolist(), b_seq_len.tolist())):
        slots = req_to_token[row, :seq_len].long()
        k, v = (x.repeat_interleave(q_heads // kv_heads, dim=1) for x in gather_kv_ref(kv_layer, kv_scales, slots))
        scores = torch.einsum("hd,khd->hk", q[b].float(), k)[:, None] * sm_scale
        positions = torch.arange(seq_len, device=q.device)
        probs = score_mods.apply_ref(scores, positions[-1:], positions, mods)[:, 0].softmax(-1)
        out[b] = torch.einsum("hk,khd->hd", probs, v).to(q.dtype)
    return out

