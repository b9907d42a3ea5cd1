"""Ragged causal attention for prefill (and chunked prefill) over the TokenAttention table.

Request ``b`` brings ``b_q_len[b]`` new tokens at ``q[b_q_start[b]:]``; its total length is
``b_seq_len[b]``, so new token ``i`` sits at position ``p = b_seq_len[b] - b_q_len[b] + i``
and attends to positions ``0..p``, whose keys and values live in
``kv_layer[req_to_token[b_req_row[b], pos]]`` (K heads first, then V heads). GQA: q head
``h`` reads kv head ``h // G`` (``G = Hq // Hk``). Flash-attention style online softmax in float32.

Grid: (block of TOKENS new tokens x split, block of HEADS q heads, request). HEADS is the
largest power of two dividing G (G itself for Llama-3's G = 4, 1 for G = 1 or an odd G: no
padded rows), so a program's heads share one kv head and every K/V block it gathers (with
its slots from ``req_to_token``) serves all of them. Its query tile is TOKENS * HEADS rows,
token-major (``tile_shape``; ``block_m`` rows of the launch):

| tile row r | new token                     | q head                          |
| ---------- | ----------------------------- | ------------------------------- |
| r          | block * TOKENS + r // HEADS   | program_id(1) * HEADS + r % HEADS |

A query block at positions ``[s, s + TOKENS)`` walks two key ranges, BLOCK_N positions a step;
``d`` is ``s`` rounded down to whole blocks from ``first``:
1. ``[first, d)``: visible to every row, walked without the causal mask or the bounds mask
   (``_online_softmax.attend_range``; whole blocks, but where a window moves ``first``);
2. ``[d, min(seq_len, s + TOKENS))``, the diagonal and the keys before it that did not fill a
   block, with the causal mask (``attend_bounded_blocks``: one or two blocks, in a ``while`` loop).
   One H200, Llama-3.1-8B heads, against ``[s, ...)`` here and range 1's partial block walked
   on its own, in one run (``bench.prefill_attention_bench``, two runs each): a whole 32k-token
   prompt 481 / 477 -> 495 / 493 TFLOP/s, 100k 482 / 484 -> 489 / 490; inside a 32k-token prefill
   of the model, the 32 layers' attention 663-670 -> 650-658 ms (three runs each).
With a sliding window (``kernels.score_mods``) range 1 starts at the block's first row's window
start (earlier keys are not visited) and only its blocks that some row's window start cuts
take the window mask (the diagonal always does).
Later keys are never visited. ``first`` is 0, or the shared prefix's length (below).

Context (``context``, ``kernels.context_attention``): a long prompt's chunk may have taken its first ``K`` keys
from cuDNN (K a multiple of its bucket); its rows start from that result as behind a shared prefix (``first`` =
K, the partial output in the model's dtype) and walk the rest; the kernel then takes the plan's rows in place of the
step's (a row's tail short of a piece may be a row of its own, from key 0). Not beside a shared prefix, score
modifications or a quantized cache (their rows walk every key here).

A chunk late in a long prompt has few query blocks but a long first range: ``splits`` > 1
cuts that range into parts walked by separate programs (the last also walks the diagonal),
each writing its normalised partial output and log2-sum-exp, which
``kernels.decode_attention``'s merge kernel combines (the split-KV of flash decoding).
``default_splits`` asks for them when the blocks alone would leave the GPU idle.

Shared prefix (``shared = (b_prefix_len [B], source [2])``, see ``kernels.shared_prefix``):
the new tokens of the requests whose first P positions hold the same slots attend to those
positions in the shared-prefix kernel first (each prefix K/V block loaded once for a tile
of tokens of many requests); this kernel then starts each such token's online softmax from
that partial result (max = its log2-sum-exp, sum = 1, accumulator = its normalised output)
and walks only positions ``P..`` (``first = P``; in split 0 only).

Grid order: the GPU starts programs in grid order, x fastest, and x holds the query blocks (with
their splits) last first. So a kv head's query blocks run side by side, each walking the same K/V
blocks from position 0 while they are in L2, and the longest walks (the last blocks) start first,
the short ones filling the GPU at the end. In the order before (requests, then heads, then blocks
first to last) the programs in flight spread over every kv head's K/V. One H200, Llama-3.1-8B heads,
bf16, ``bench.prefill_attention_bench`` in one run: a whole 32k-token prompt 387 -> 465 TFLOP/s, 100k
378 -> 453 (478 and 481 with ``attend_block``'s fused scale; SDPA 651 and 605 there).

Where a long prompt's prefill goes: one H200, random Llama-3.1-8B, one step of a 4,096-token chunk at
28,672 tokens of context (``bench.profile_step --prompt-chunk 4096 --chunk-context 28672 --table-dir``, PDL
off, 2026-11-30): this kernel 4.49 ms a layer, 65% of the step's kernel time; cuBLAS's GEMMs 32%; SiLU, the
norms and rotary 2.7%. On such chunk shapes torch's fused SDPA backends are slower than this kernel
(``bench.prefill_attention_bench``'s SDPA column: flash 302-351 TFLOP/s against 437-477 here); cuDNN's leads
only on whole prompts, which a step of the default budget never holds.

Launch parameters (rows, BLOCK_N, warps, stages) come from ``prefill_launch``: a table by
head dim on CUDA (``bench.prefill_attention_bench`` sweeps them), small blocks on the CPU
interpreter.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import score_mods, shared_prefix
from .context_attention import ContextPlan
from ._checks import (  # noqa: F401  (aligned_width: the row arrays' layout, for the engine)
    aligned_width,
    check_last_dim_contiguous,
    check_shape,
    check_tensor,
    upcast_dots,
)
from ._kv_quant import KV_DTYPES, check_kv, dot_query, gather_kv_ref, scale_args, wide_slots
from ._online_softmax import attend_block, attend_bounded_blocks, attend_range
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to
from .decode_attention import _decode_merge_kernel
from .score_mods import ScoreMods
from .skinny_gemm import device_sms


# One compiled kernel for every split count (the worker's warm-up compiles each variant once, so none
# compiles while requests wait: engine.worker.model_worker)
UNSPECIALISED = ("num_splits",)


@triton.jit(do_not_specialize=list(UNSPECIALISED))
def _prefill_attention_kernel(
    q_ptr, kv_ptr, req_to_token_ptr, out_ptr,
    b_req_row_ptr, b_q_start_ptr, b_q_len_ptr, b_seq_len_ptr,
    scale_log2,
    stride_q_token, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
    stride_out_token, stride_out_head,
    kv_heads, group_size, head_dim,
    b_first_ptr, mid_out_ptr, mid_lse_ptr, stride_mid_token, stride_mid_head, stride_lse_token, stride_lse_head,
    split_out_ptr, split_lse_ptr, stride_split_token, stride_split_head, stride_split_split, stride_slse_token,
    stride_slse_head, num_splits,
    TOKENS: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, WHILE_LOOP: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr, SPLIT: tl.constexpr,
    window, softcap_log2, alibi_ptr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    scales_ptr, stride_scale_slot, stride_scale_head, v_scale_offset, KV_SCALES: tl.constexpr,
    WIDE_SLOTS: tl.constexpr,
):
    """One program: TOKENS new tokens x HEADS q heads of one kv head (the module's tile table)."""
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    b = tl.program_id(2)
    task = tl.num_programs(0) - 1 - tl.program_id(0)     # the grid's order: the module's docstring
    block_m = task // num_splits
    split = task % num_splits
    q_len = tl.load(b_q_len_ptr + b)
    if block_m * TOKENS >= q_len:
        return
    q_start = tl.load(b_q_start_ptr + b).to(tl.int64)
    seq_len = tl.load(b_seq_len_ptr + b)
    table_row = req_to_token_ptr + tl.load(b_req_row_ptr + b).to(tl.int64) * stride_table_row
    prefix = seq_len - q_len

    offs_r = tl.arange(0, TOKENS * HEADS)
    offs_m = block_m * TOKENS + offs_r // HEADS             # each row's new token
    heads = tl.program_id(1) * HEADS + offs_r % HEADS       # and q head
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    m_mask = offs_m < q_len
    tokens = q_start + offs_m
    q_rows = tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head
    q = tl.load(q_ptr + q_rows + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = dot_query(q, UPCAST, KV_SCALES)

    m_i = tl.full([TOKENS * HEADS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([TOKENS * HEADS], dtype=tl.float32)
    acc = tl.zeros([TOKENS * HEADS, BLOCK_D], dtype=tl.float32)
    first = 0
    if SHARED:
        first = tl.load(b_first_ptr + b)
        m_i, l_i, acc = _start_from_shared_prefix(m_i, l_i, acc, tl.where(split == 0, first, 0), tokens, heads,
                                                  m_mask, offs_d, d_mask, mid_out_ptr, mid_lse_ptr, stride_mid_token,
                                                  stride_mid_head, stride_lse_token, stride_lse_head)
    kv_head = tl.program_id(1) * HEADS // group_size
    k_base = kv_ptr + kv_head * stride_kv_head + offs_d[None, :]
    v_base = k_base + kv_heads * stride_kv_head
    k_scale_base = scales_ptr + kv_head * stride_scale_head
    v_scale_base = k_scale_base + v_scale_offset
    # range 1, [first, diag_start): visible to every row (this split's part of it); range 2, the diagonal
    diag_start = tl.maximum(first, prefix + block_m * TOKENS)
    diag_start = first + (diag_start - first) // BLOCK_N * BLOCK_N     # range 1 in whole blocks: the rest is masked
    key_end = tl.minimum(seq_len, prefix + (block_m + 1) * TOKENS)
    if WINDOW:      # keys before the block's first row's window are seen by none of its rows: not walked
        first = tl.maximum(first, tl.minimum(prefix + block_m * TOKENS - window + 1, diag_start))
    q_pos = prefix + offs_m
    alibi_log2 = tl.load(alibi_ptr + heads) * 1.4426950408889634 if ALIBI else 0.0
    if SPLIT:
        lo, hi = _split_part(first, diag_start, split, num_splits, BLOCK_N)
    else:           # one split: the walk starts at `first` (0 unless SHARED or WINDOW: a constant start)
        lo, hi = first, diag_start
    if WINDOW:      # blocks before `seen_by_all` straddle some row's window start: masked; the rest are not
        last_row = prefix + tl.minimum(q_len, (block_m + 1) * TOKENS) - 1
        seen_by_all = tl.minimum(lo + tl.cdiv(tl.maximum(last_row - window + 1 - lo, 0), BLOCK_N) * BLOCK_N, hi)
        m_i, l_i, acc = attend_range(q, m_i, l_i, acc, lo, seen_by_all, table_row, k_base, v_base, stride_kv_slot,
                                     d_mask, scale_log2, BLOCK_N, UPCAST, WHILE_LOOP, q_pos, window, softcap_log2,
                                     alibi_log2, True, SOFTCAP, ALIBI, k_scale_base, v_scale_base,
                                     stride_scale_slot, KV_SCALES, PREFETCH, WIDE_SLOTS)
        lo = seen_by_all
    m_i, l_i, acc = attend_range(q, m_i, l_i, acc, lo, hi, table_row, k_base, v_base, stride_kv_slot, d_mask,
                                 scale_log2, BLOCK_N, UPCAST, WHILE_LOOP, q_pos, window, softcap_log2, alibi_log2,
                                 False, SOFTCAP, ALIBI, k_scale_base, v_scale_base, stride_scale_slot, KV_SCALES,
                                 PREFETCH, WIDE_SLOTS)
    if split == num_splits - 1:
        m_i, l_i, acc = attend_bounded_blocks(q, m_i, l_i, acc, diag_start, key_end, q_pos, table_row, k_base,
                                              v_base, stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, True,
                                              window, softcap_log2, alibi_log2, WINDOW, SOFTCAP, ALIBI,
                                              k_scale_base, v_scale_base, stride_scale_slot, KV_SCALES, WIDE_SLOTS)
    if SPLIT:       # a partial result for the merge kernel
        _store_split(m_i, l_i, acc, split, tokens, heads, m_mask, offs_d, d_mask, split_out_ptr, split_lse_ptr,
                     stride_split_token, stride_split_head, stride_split_split, stride_slse_token, stride_slse_head)
    else:
        acc = acc / tl.where(m_mask, l_i, 1.0)[:, None]
        out_rows = tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head
        tl.store(out_ptr + out_rows + offs_d[None, :], round_to(acc, out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _start_from_shared_prefix(m_i, l_i, acc, shared_len, tokens, heads, m_mask, offs_d, d_mask, mid_out_ptr,
                              mid_lse_ptr, stride_mid_token, stride_mid_head, stride_lse_token, stride_lse_head):
    """The online-softmax state of each row after the shared prefix (``kernels.shared_prefix``'s partial
    output and log2-sum-exp) where ``shared_len`` (a scalar) > 0, else the empty state unchanged."""
    rows = m_mask & (tokens * 0 + shared_len > 0)   # a row-wise test: the interpreter mis-types a scalar bool
    lse = tl.load(mid_lse_ptr + tokens * stride_lse_token + heads * stride_lse_head, mask=rows,
                  other=float("-inf"))
    partial = tl.load(mid_out_ptr + tokens[:, None] * stride_mid_token + heads[:, None] * stride_mid_head
                      + offs_d[None, :], mask=rows[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    return tl.where(rows, lse, m_i), tl.where(rows, 1.0, l_i), tl.where(rows[:, None], partial, acc)


@triton.jit
def _split_part(start, end, split, num_splits, BLOCK_N: tl.constexpr):
    """Split ``split``'s part of the key positions [start, end): whole blocks, the last part shorter (or empty)."""
    per = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    lo = tl.minimum(start + split * per, end)
    return lo, tl.minimum(lo + per, end)


@triton.jit
def _store_split(m_i, l_i, acc, split, tokens, heads, m_mask, offs_d, d_mask, split_out_ptr, split_lse_ptr,
                 stride_split_token, stride_split_head, stride_split_split, stride_slse_token, stride_slse_head):
    """A split's normalised partial output and log2-sum-exp (-inf for a split without keys)."""
    has_keys = l_i > 0
    partial = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    rows = tokens[:, None] * stride_split_token + heads[:, None] * stride_split_head + split * stride_split_split
    tl.store(split_out_ptr + rows + offs_d[None, :], partial, mask=m_mask[:, None] & d_mask[None, :])
    tl.store(split_lse_ptr + tokens * stride_slse_token + heads * stride_slse_head + split, lse, mask=m_mask)


def _check(q, kv_layer, req_to_token, b_req_row, b_q_start, b_q_len, b_seq_len, max_q_len, kv_scales) -> None:
    check_tensor("q", q, 3)
    device = q.device
    check_tensor("kv_layer", kv_layer, 3, dtypes=KV_DTYPES, device=device)
    check_kv(kv_layer, kv_scales, q.dtype)
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
    if batch > MAX_GRID_REQUESTS:
        raise ValueError(f"{batch} requests in one prefill attention call; at most {MAX_GRID_REQUESTS} "
                         f"(the grid's z): lower --max-batch-size")
    if not isinstance(max_q_len, int) or max_q_len < 0:
        raise ValueError(f"max_q_len must be a host int >= 0 (max of b_q_len), got {max_q_len!r}")


class PrefillLaunch(NamedTuple):
    block_m: int        # query rows per program: new tokens x q heads (tile_shape)
    block_n: int        # key positions per step of its walk
    num_warps: int
    num_stages: int
    prefetch: bool = False  # each full key block's slots loaded a block ahead (``attend_range``'s PREFETCH)


# CUDA launches by head dim (rounded up to a power of two, at least 64; above 256 takes 256's). With GQA
# the group size does not enter: a tile's rows split into tokens x heads (tile_shape) and each K/V block
# serves every row whatever the split, so one row count fits every group.
# - 128 (Llama, Mistral, Qwen2): 128 rows, 128 keys, 8 warps, 3 stages, with each block's slots loaded a block
#   ahead (``attend_range``'s PREFETCH). One H200, bf16, Llama-3.1-8B heads, the 32k-token prompt: the launch
#   before it (128 rows, 64 keys, 4 warps, 2 stages, no prefetch: the best of 20 configs in an earlier sweep on
#   an H100, 343 TFLOP/s there) ran 326 TFLOP/s; 128 keys over 8 warps, 3 stages, 358 without the prefetch
#   (a probe outside the repository); this launch, in bench.prefill_attention_bench against the one before in
#   the same run: whole 32k 326 -> 388 TFLOP/s, 100k 325 -> 382, 2,048-token chunks at 32k / 100k keys
#   241 -> 338 / 298 -> 431, whole 4k 226 -> 220. 4 stages do not fit in shared memory with the prefetch.
#   float32 (IEEE dots: the parity tests) runs 64 rows: 128 made the GPU parity tests too slow to finish.
#   Tried and not kept (stop 65): a program walking two query tiles' common keys together, ordered so one tile's
#   softmax runs while the other's P.V dot is in flight (Triton waits on each scores dot at once). A stand-alone
#   toy on contiguous K/V went 575 -> 647 TFLOP/s with it (one H200), but this kernel did not: whole 32k
#   500 -> 492-500, 100k 495 -> 497-501, sweeping 9 such launches (the best 128 rows x 2, 64 keys, 8 warps, 3
#   stages; no spill in its loop). The patch and numbers: stop 65's note.
#   Tried and not kept (stop 67, one H200, Triton 3.6, a copy of this kernel whose range 1 reads K/V through a TMA
#   tensor descriptor, the slots assumed one run): whole 32k 494-513 -> 510-511 TFLOP/s, a 4,096-token chunk at
#   100k keys 490-497 -> 491-508, 100k 496 -> 503, at this launch; with `tl.range(..., warp_specialize=True)` 515
#   and 508 (4 warps failed to compile). Not worth a second walk and the slot-run bookkeeping it needs.
#   A chunk's own keys (its causal walk behind a cuDNN context, 16 blocks a program on average) run at 330-350
#   TFLOP/s against 480-495 on long walks. Tried and not kept (stop 75, one H200, one run; ms for a whole 4,096-token
#   prompt / a 4,096-token chunk's walk behind 28,672 cuDNN keys / a whole 32k prompt, launch included): the other
#   launches (bench.prefill_attention_bench's sweep on the whole 4k: its best 0.48, this launch 0.41 timed first and
#   0.50 within the sweep; in a probe, this launch 0.389 / 0.415, 128 rows x 64 keys with the prefetch 0.388 /
#   0.414, 64-row tiles 0.474 / 0.498 at best); the grid's query blocks interleaved across head groups (every
#   group's longest walks first) 0.392 / 0.511 / 18.39 against 18.27; range 1 and the diagonal in one pipelined loop
#   with the causal mask on every block (another run) 0.475 / 0.573 / 21.52 against 0.413 / 0.462 / 17.82.
# - 64 and 256: not timed yet; from ptxas's report for sm_90a (no spill: 8 warps, 64 / 32 keys a step;
#   float32 smaller tiles).
CUDA_LAUNCHES = {64: PrefillLaunch(128, 64, 8, 2), 128: PrefillLaunch(128, 128, 8, 3, prefetch=True),
                 256: PrefillLaunch(128, 32, 8, 2)}
# Without GQA (group 1: Llama-2-7B) a tile's rows are all tokens, and the one-token decode rows of a mixed step
# would waste most of 128 of them: 64 rows, with the launches these had before stop 45. The GQA launch above
# with 64 rows gave the 512-request load on Llama-2-7B 6,065 output tokens/s against 7,069 before it (one H200,
# HTTP, one pair of runs; the same load gave 5,844 before / 5,785 with this table on another machine).
CUDA_LAUNCHES_NO_GQA = {64: PrefillLaunch(64, 64, 8, 2), 128: PrefillLaunch(64, 64, 4, 2),
                        256: PrefillLaunch(64, 32, 8, 2)}
CUDA_LAUNCHES_FP32 = {64: PrefillLaunch(32, 32, 8, 1), 128: PrefillLaunch(64, 64, 4, 2),
                      256: PrefillLaunch(16, 16, 8, 1)}
CPU_LAUNCH = PrefillLaunch(32, 32, 4, 1, prefetch=True)   # the interpreter: small tiles keep the tests fast
MAX_GRID_REQUESTS = 65535   # the grid's z (requests) is at most this (CUDA)
MAX_SPLITS = 32         # a multiple of 16 (the split lse rows' width: ``launch``)
MIN_SPLIT_KEYS = 1024   # a split walks at least this many keys (its partial result costs a merge)
MERGE_BLOCK_S = triton.next_power_of_2(MAX_SPLITS)   # one merge kernel for every split count


def prefill_launch(head_dim: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                   group: int = 4) -> PrefillLaunch:
    """The launch parameters ``prefill_attention`` uses for this head dim on ``device`` (the tables above):
    ``CUDA_LAUNCHES_NO_GQA`` without GQA (``group`` 1) in bfloat16 / float16, float32 at most 64 rows then."""
    if device.type != "cuda":
        return CPU_LAUNCH
    key = min(256, max(64, triton.next_power_of_2(head_dim)))
    if dtype == torch.float32:
        params = CUDA_LAUNCHES_FP32[key]
        return params._replace(block_m=min(params.block_m, 64)) if group == 1 else params
    return CUDA_LAUNCHES_NO_GQA[key] if group == 1 else CUDA_LAUNCHES[key]


def tile_shape(params: PrefillLaunch, group: int) -> tuple[int, int]:
    """(q heads, new tokens) of one program's tile for a GQA group of ``group`` q heads per kv head: the
    largest power of two dividing the group (no padded rows; 1 for an odd group), then tokens filling
    ``params.block_m`` rows (at least one)."""
    heads = min(group & -group, params.block_m)
    return heads, max(1, params.block_m // heads)


def default_splits(batch: int, q_heads: int, kv_heads: int, max_q_len: int, max_seq_len: int | None,
                   params: PrefillLaunch, device: torch.device) -> int:
    """Splits of each query block's keys: enough programs to fill the GPU about twice over (rounded up to
    a power of two) when the query blocks alone do not and the context is long (1 on the CPU or when
    ``max_seq_len`` is unknown)."""
    if device.type != "cuda" or not max_seq_len:
        return 1
    heads, tokens = tile_shape(params, q_heads // kv_heads)
    programs = batch * (q_heads // heads) * triton.cdiv(max_q_len, tokens)
    sms = device_sms(device)
    wanted = min(MAX_SPLITS, triton.cdiv(2 * sms, programs), max_seq_len // MIN_SPLIT_KEYS)
    return triton.next_power_of_2(wanted) if wanted > 1 else 1     # powers of two: few compiled variants


def prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, req_to_token: torch.Tensor,
                      b_req_row: torch.Tensor, b_q_start: torch.Tensor, b_q_len: torch.Tensor,
                      b_seq_len: torch.Tensor, sm_scale: float, max_q_len: int,
                      shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                      max_seq_len: int | None = None, mods: ScoreMods | None = None,
                      kv_scales: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      context: ContextPlan | None = None) -> torch.Tensor:
    """q [T, Hq, D]; kv_layer [S+1, 2*Hk, D]; returns out [T, Hq, D] contiguous, q's dtype (``out``: that tensor,
    written in place).

    ``shared``: ``(b_prefix_len [B] int32, source [2] int32)``, a prefix that several requests
    share (see the module's docstring); ``max_seq_len``: the host's max of ``b_seq_len``, which
    lets a long context be split (``default_splits``). The result is the same with or without them.
    ``mods``: the layer's sliding window, soft-cap, ALiBi (``kernels.score_mods``); with a window or
    ALiBi the shared prefix is not used (its kernel knows no row positions). ``kv_scales``: a quantized
    cache's scales (``kernels._kv_quant``). ``context``: the step's rows whose long contexts go to cuDNN
    (``kernels.context_attention``); not taken beside a shared prefix, score modifications or a quantized cache."""
    call = PrefillCall(q, kv_layer, req_to_token, b_req_row, b_q_start, b_q_len, b_seq_len, sm_scale, max_q_len,
                       shared, max_seq_len, mods, kv_scales, out, context)
    return call(q, kv_layer, kv_scales)


class PrefillCall:
    """``prefill_attention`` of one step's rows, checked and planned once and then run on any layer of the same
    shapes (``call(q, kv_layer, kv_scales)``, each writing ``call.out``). The piecewise CUDA graphs
    (``engine.worker.piecewise``) run every layer's attention eagerly between two replays: on one H200 the
    checks, the launch plan and the split buffers were about a third of that call's host time (cProfile of
    mixed steps, a 32-token chunk at 90,000 keys beside one stream, Llama-3.1-8B)."""

    def __init__(self, q: torch.Tensor, kv_layer: torch.Tensor, req_to_token: torch.Tensor,
                 b_req_row: torch.Tensor, b_q_start: torch.Tensor, b_q_len: torch.Tensor,
                 b_seq_len: torch.Tensor, sm_scale: float, max_q_len: int,
                 shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                 max_seq_len: int | None = None, mods: ScoreMods | None = None,
                 kv_scales: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 context: ContextPlan | None = None):
        _check(q, kv_layer, req_to_token, b_req_row, b_q_start, b_q_len, b_seq_len, max_q_len, kv_scales)
        check_out(out, q)
        score_mods.check(mods, q.shape[1], q.device)
        if mods is not None and mods.needs_positions:
            shared = None
        if mods is not None and mods.window is not None and max_seq_len:
            max_seq_len = min(max_seq_len, mods.window + max_q_len)     # the most keys a query block walks
        if shared is not None:
            shared_prefix.check(shared, b_req_row.shape[0], q.device)
        context = usable_context(context, shared, mods, kv_scales)
        if context is not None:
            max_seq_len = context.max_walk      # the keys the kernel walks past the context's
        kv_heads = kv_layer.shape[1] // 2
        self.params = prefill_launch(q.shape[2], q.device, q.dtype, q.shape[1] // kv_heads)
        self.splits = default_splits(b_req_row.shape[0], q.shape[1], kv_heads, max_q_len, max_seq_len, self.params,
                                     q.device)
        self.sm_scale, self.max_q_len, self.shared, self.mods, self.context = sm_scale, max_q_len, shared, mods, context
        self.rows = (req_to_token, b_req_row, b_q_start, b_q_len, b_seq_len)
        self.out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
        self.split_out, self.split_lse = split_buffers(q, self.splits)
        self.layer = _layer_shapes(q, kv_layer, kv_scales)

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """This layer's attention into ``self.out`` (returned): q and ``kv_layer`` shaped as the planned ones."""
        if _layer_shapes(q, kv_layer, kv_scales) != self.layer:
            raise ValueError(f"q {tuple(q.shape)} {q.dtype}, kv_layer {tuple(kv_layer.shape)} {kv_layer.dtype} (scales: "
                             f"{kv_scales is not None}) is not the layer this call was planned for")
        check_kv(kv_layer, kv_scales, q.dtype)
        return _run(q, kv_layer, *self.rows, self.sm_scale, self.max_q_len, self.params, self.splits,
                    self.shared, self.mods, kv_scales, self.out, self.split_out, self.split_lse, self.context)


def _layer_shapes(q: torch.Tensor, kv_layer: torch.Tensor, kv_scales: torch.Tensor | None) -> tuple:
    """What a planned ``PrefillCall`` holds fixed of a layer's tensors."""
    return (q.shape, q.stride(), q.dtype, q.device, kv_layer.shape, kv_layer.stride(), kv_layer.dtype,
            kv_scales is None)


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> None:
    """An ``out`` given to the attention: q's shape, dtype and device, contiguous."""
    if out is None:
        return
    check_tensor("out", out, 3, dtypes=(q.dtype,), device=q.device)
    check_shape("out", out, tuple(q.shape))
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")


def launch(q, kv_layer, req_to_token, b_req_row, b_q_start, b_q_len, b_seq_len, sm_scale: float, max_q_len: int,
           params: PrefillLaunch, splits: int = 1, shared=None, mods: ScoreMods | None = None,
           kv_scales=None, out: torch.Tensor | None = None, context: ContextPlan | None = None) -> torch.Tensor:
    """The kernels with explicit launch parameters (``prefill_attention`` picks them; benchmarks sweep them)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split_out, split_lse = split_buffers(q, splits)
    return _run(q, kv_layer, req_to_token, b_req_row, b_q_start, b_q_len, b_seq_len, sm_scale, max_q_len, params,
                splits, shared, mods, kv_scales, out, split_out, split_lse,
                usable_context(context, shared, mods, kv_scales))


def usable_context(context: ContextPlan | None, shared, mods: ScoreMods | None, kv_scales) -> ContextPlan | None:
    """``context`` unless a shared prefix, a score modification or a quantized cache sets it aside (cuDNN's plain
    attention cannot take the latter two; the shared-prefix start takes the kernel's one start)."""
    if shared is not None or kv_scales is not None or (mods is not None and mods.any):
        return None
    return context


def split_buffers(q: torch.Tensor, splits: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The splits' partial outputs and log2-sum-exps (None with one split)."""
    if splits <= 1:
        return None, None
    tokens, q_heads, head_dim = q.shape
    # lse rows MAX_SPLITS wide whatever the count: Triton compiles one kernel per class of each integer
    # argument (1, a multiple of 16, other), and rows ``splits`` wide put 16 and 32 splits (a short
    # chunk at a long context) in another class than the warm-up's 2: both kernels compiled mid-serving,
    # a 1.25 s stall of a stream beside a 16k-token prompt on one H100 (stop 43's note)
    return (torch.empty((tokens, q_heads, splits, head_dim), dtype=torch.float32, device=q.device),
            torch.empty((tokens, q_heads, MAX_SPLITS), dtype=torch.float32, device=q.device))


def _run(q, kv_layer, req_to_token, b_req_row, b_q_start, b_q_len, b_seq_len, sm_scale: float, max_q_len: int,
         params: PrefillLaunch, splits: int, shared, mods: ScoreMods | None, kv_scales, out: torch.Tensor,
         split_out: torch.Tensor | None, split_lse: torch.Tensor | None,
         context: ContextPlan | None = None) -> torch.Tensor:
    """The kernels (and the splits' merge) into ``out``, with the split buffers given; each row's start from a
    shared prefix or its context (``shared`` / ``context``, not both) where given."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[1] // 2
    batch = b_req_row.shape[0]
    if tokens == 0 or batch == 0 or max_q_len == 0:
        return out
    scale_log2 = float(sm_scale) * math.log2(math.e)
    mid_out = mid_lse = b_first = b_seq_len            # unread without SHARED
    mid_strides = (0, 0, 0, 0)
    if shared is not None:
        b_first = shared[0]
        mid_out, mid_lse = _shared_prefix_start(q, kv_layer, req_to_token, shared, b_q_len, scale_log2, mods,
                                                kv_scales)
    elif context is not None:       # its rows in place of the step's (a row's tail apart: ``context_attention``)
        (b_req_row, b_q_start, b_q_len, b_seq_len, b_first), mid_out, mid_lse = context.start(q, kv_layer,
                                                                                             req_to_token, sm_scale)
        batch = b_req_row.shape[0]
    if shared is not None or context is not None:
        mid_strides = (mid_out.stride(0), mid_out.stride(1), mid_lse.stride(0), mid_lse.stride(1))
    split_strides = (0, 0, 0, 0, 0)
    if splits > 1:
        split_strides = (*split_out.stride()[:3], *split_lse.stride()[:2])
    else:
        split_out = split_lse = out                     # unwritten with one split
    block_d = max(16, triton.next_power_of_2(head_dim))
    heads, block_tokens = tile_shape(params, q_heads // kv_heads)
    mod_args, mod_flags = score_mods.kernel_args(mods, unread=b_seq_len)
    grid = (triton.cdiv(max_q_len, block_tokens) * splits, q_heads // heads, batch)
    _prefill_attention_kernel[grid](
        q, kv_layer, req_to_token, out,
        b_req_row, b_q_start, b_q_len, b_seq_len,
        scale_log2,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1),
        kv_heads, q_heads // kv_heads, head_dim,
        b_first, mid_out, mid_lse, *mid_strides,
        split_out, split_lse, *split_strides, splits,
        TOKENS=block_tokens, HEADS=heads, BLOCK_N=params.block_n, PREFETCH=params.prefetch, BLOCK_D=block_d,
        UPCAST=upcast_dots(q),
        WHILE_LOOP=not q.is_cuda, SHARED=shared is not None or context is not None, SPLIT=splits > 1, **mod_args, **mod_flags,
        num_warps=params.num_warps, num_stages=params.num_stages, **launch_options(q),
        **scale_args(kv_layer, kv_scales), WIDE_SLOTS=wide_slots(kv_layer),
    )
    if splits > 1:
        _decode_merge_kernel[(tokens, q_heads)](
            split_out, split_lse, out, b_seq_len, *split_strides, out.stride(0), out.stride(1), head_dim, splits,
            splits, BLOCK_S=MERGE_BLOCK_S, BLOCK_D=block_d, SHARED=False, num_warps=4,
            **launch_options(q),
        )
    return out


def _shared_prefix_start(q, kv_layer, req_to_token, shared, b_q_len, scale_log2: float, mods=None, kv_scales=None):
    """Each member token's attention to the shared prefix (``kernels.shared_prefix``, one split): its
    normalised partial output [T, Hq, 1, D] and log2-sum-exp [T, Hq, 1], both float32."""
    tokens, q_heads, head_dim = q.shape
    token_first = torch.repeat_interleave(shared[0], b_q_len, output_size=tokens)
    mid_out = torch.empty((tokens, q_heads, 1, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((tokens, q_heads, 1), dtype=torch.float32, device=q.device)
    params = shared_prefix.default_launch(q.device, head_dim, q.dtype)
    shared_prefix.launch(q, kv_layer, req_to_token, (token_first, shared[1]), mid_out, mid_lse, scale_log2,
                         first_split=0, splits=1, params=params, mods=mods, kv_scales=kv_scales)
    return mid_out, mid_lse


def prefill_attention_ref(q: torch.Tensor, kv_layer: torch.Tensor, req_to_token: torch.Tensor,
                          b_req_row: torch.Tensor, b_q_start: torch.Tensor, b_q_len: torch.Tensor,
                          b_seq_len: torch.Tensor, sm_scale: float, max_q_len: int, shared=None,
                          max_seq_len: int | None = None, mods: ScoreMods | None = None,
                          kv_scales: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every new token over all the positions it sees (``shared`` and ``max_seq_len`` change only how the
    kernel walks them), the scores modified by ``mods`` (``score_mods.apply_ref``)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[1] // 2
    check_out(out, q)
    if out is None:
        out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    for row, start, q_len, seq_len in zip(b_req_row.tolist(), b_q_start.tolist(), b_q_len.tolist(),
                                          b_seq_len.tolist()):
        slots = req_to_token[row, :seq_len].long()
        k, v = (x.repeat_interleave(q_heads // kv_heads, dim=1) for x in gather_kv_ref(kv_layer, kv_scales, slots))
        qr = q[start:start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", qr, k) * sm_scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        scores = score_mods.apply_ref(scores, q_pos, torch.arange(seq_len, device=q.device), mods)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
