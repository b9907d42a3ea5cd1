"""The online-softmax block the attention kernels run over a block of cached keys.

One block of BLOCK_N key positions ``[start_n, start_n + BLOCK_N)`` updates the running
state of each query row: ``m_i`` the running max of the scaled scores (log2 units), ``l_i``
the running sum of ``exp2(score - m_i)``, ``acc`` the running ``sum p * v``. Keys and values
are read through the request's ``req_to_token`` row (``table_row``): position -> slot ->
``k_base`` / ``v_base + slot * stride_kv_slot``.

A quantized cache (``kernels._kv_quant``, ``KV_SCALES`` > 0) is read as each block is gathered
(``load_kv``): ``k_scale_base`` / ``v_scale_base`` point at this kv head's K / V scales, one per
slot (``stride_scale_slot`` apart) or one for the tensor. Both come unscaled in float16 (the dots
then take q in float16: ``dot_query``): int8 blocks as float16 integers, whose per-slot scales
multiply the block's column of scores (K) and of probabilities (V); fp8 blocks as their own values
(float16 holds both formats exactly), whose per-tensor scales multiply the scores (K) and the
block's weighted values (V).

A full block without a mask or score modification (the bulk of a long walk) leaves the scores
unscaled and applies ``scale_log2`` in the exponent's multiply-add: one multiply less per score.
One H200, the prefill kernel on a whole 32k / 100k-token prompt (Llama-3.1-8B heads): 465 -> 478 /
453 -> 481 TFLOP/s in one run.

Two masks, each compiled in only where needed:
- ``BOUNDED``: the block may reach past ``key_end``; positions from there on are not read.
  ``attend_range`` walks its full blocks without it and only its last, partial block with it.
- ``CAUSAL`` (prefill's diagonal): each query row also ignores the keys after its own
  position ``q_pos``.

Score modifications (``kernels.score_mods``), each a constexpr so a model without it (Llama)
compiles the block exactly as before; their arguments come last in every signature:
- ``SOFTCAP``: the score (natural units) becomes ``cap * tanh(score / cap)`` before the softmax
  (``softcap_log2`` = cap * log2(e), so the log2-unit score is ``softcap_log2 * tanh(...)``);
- ``ALIBI``: each row adds ``slope * (k_pos - q_pos)`` (``alibi_log2`` = its head's slope * log2(e));
  relative to the row's own position, so every split of a row shares the same offset and the
  values stay small at long contexts;
- ``WINDOW``: a row sees a key only if ``q_pos - k_pos < window`` (transformers'
  ``sliding_window_overlay``). The callers start their walks at the window's first key (a bound);
  this mask only cuts the keys of the blocks that straddle a row's window start. A row can then
  see no key of a block while its running max is still -inf: the exponentials subtract 0 instead.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._kv_quant import load_kv
from ._math import tanh


@triton.jit
def widen(slots, WIDE_SLOTS: tl.constexpr):
    """Slots (int32) as their offsets' type: int64 when WIDE_SLOTS."""
    if WIDE_SLOTS:
        slots = slots.to(tl.int64)
    return slots


@triton.jit
def attend_block(q, m_i, l_i, acc, start_n, key_end, q_pos, table_row, k_base, v_base, stride_kv_slot,
                 d_mask, scale_log2, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, CAUSAL: tl.constexpr,
                 BOUNDED: tl.constexpr, window, softcap_log2, alibi_log2, WINDOW: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, k_scale_base=None, v_scale_base=None,
                 stride_scale_slot=0, KV_SCALES: tl.constexpr = 0, given_slots=0, GIVEN: tl.constexpr = False,
                 WIDE_SLOTS: tl.constexpr = True):
    """Online-softmax update of (m_i, l_i, acc) with the keys at positions [start_n, start_n + BLOCK_N),
    cut at ``key_end`` when BOUNDED (without it every position of the block must be a key). GIVEN (with
    BOUNDED off): the block's slots are ``given_slots`` [BLOCK_N], loaded by the caller, not here.
    WIDE_SLOTS: the slots' offsets in int64 (``kernels._kv_quant.wide_slots``), else int32."""
    pos = start_n + tl.arange(0, BLOCK_N)
    if BOUNDED:
        n_mask = pos < key_end
        slots = widen(tl.load(table_row + pos, mask=n_mask, other=0), WIDE_SLOTS)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        n_mask = start_n      # unread
        if GIVEN:
            slots = widen(given_slots, WIDE_SLOTS)
        else:
            slots = widen(tl.load(table_row + pos), WIDE_SLOTS)
        kv_mask = d_mask[None, :]
    k, k_scale = load_kv(k_base, slots, stride_kv_slot, kv_mask, k_scale_base, stride_scale_slot, n_mask, q.dtype,
                         KV_SCALES, BOUNDED)
    if UPCAST:  # IEEE fp32 dots, not TF32
        qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if KV_SCALES == 1:      # int8: each key's scale on its column of scores
        qk = qk * k_scale[None, :]
    elif KV_SCALES == 2:    # fp8: the tensor's
        qk = qk * k_scale
    if SOFTCAP:
        qk = softcap_log2 * tanh(qk * (scale_log2 / softcap_log2))
    elif CAUSAL or BOUNDED or WINDOW or ALIBI:
        qk = qk * scale_log2
    # else (a full block of plain scores): the scale is applied below, in the exponent's multiply-add
    if ALIBI:
        qk += alibi_log2[:, None] * (pos[None, :] - q_pos[:, None]).to(tl.float32)
    if WINDOW:
        qk = tl.where(q_pos[:, None] - pos[None, :] < window, qk, float("-inf"))
    if CAUSAL:
        visible = pos[None, :] <= q_pos[:, None]
        if BOUNDED:
            visible = visible & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    elif BOUNDED:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    if SOFTCAP or CAUSAL or BOUNDED or WINDOW or ALIBI:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = m_new
        if WINDOW:  # a row without a visible key so far: subtract 0, not -inf (the module's docstring)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_sub[:, None])
    else:           # scale_log2 > 0: max(qk) * scale is max(qk * scale)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        m_sub = m_new
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    v, v_scale = load_kv(v_base, slots, stride_kv_slot, kv_mask, v_scale_base, stride_scale_slot, n_mask, q.dtype,
                         KV_SCALES, BOUNDED)
    p_v = p
    if KV_SCALES == 1:      # int8: each value row's scale on its column of probabilities (l_i sums p unscaled)
        p_v = p * v_scale[None, :]
    if UPCAST:
        weighted = tl.dot(p_v, v.to(tl.float32), input_precision="ieee")
    else:
        weighted = tl.dot(p_v.to(v.dtype), v)
    if KV_SCALES == 2:      # fp8: the tensor's scale on the block's weighted values
        weighted = weighted * v_scale
    acc = acc * alpha[:, None] + weighted
    return m_new, l_i, acc


@triton.jit
def attend_range(q, m_i, l_i, acc, start, end, table_row, k_base, v_base, stride_kv_slot, d_mask, scale_log2,
                 BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, WHILE_LOOP: tl.constexpr, q_pos, window, softcap_log2,
                 alibi_log2, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, k_scale_base=None,
                 v_scale_base=None, stride_scale_slot=0, KV_SCALES: tl.constexpr = 0, PREFETCH: tl.constexpr = False,
                 WIDE_SLOTS: tl.constexpr = True, TAIL_N: tl.constexpr = 0):
    """``attend_block`` over the key positions [start, end), every one visible to every query row:
    the full blocks without a mask, then the partial block left at the end (if any) with the bounds mask
    (WINDOW: every block with the window mask; ``q_pos`` [rows] is read only by ALIBI and WINDOW).

    PREFETCH: each full block's slots are loaded one block ahead (carried through the loop), so its K/V
    gathers do not wait on its own ``req_to_token`` load. The prefill kernel's launch for GQA sets it
    (``kernels.prefill_attention.CUDA_LAUNCHES``): on one H200, Llama-3.1-8B heads, a 32k-token prompt,
    128 rows x 128 keys over 8 warps and 3 stages ran 358 TFLOP/s without it and 388 with it (two runs on
    two machines; ``bench.prefill_attention_bench``'s sweep times both). Over 4 warps a stripped-down copy
    of the walk ran at half the speed with it.
    The decode and shared-prefix kernels, bound by memory, were not timed with it and keep loading each
    block's slots in the block.

    TAIL_N (0: BLOCK_N): the keys after the last full block are walked in bounded blocks of TAIL_N, a smaller
    block than BLOCK_N (the decode kernel's int8 launches: ``kernels.decode_attention.cuda_launch``)."""
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    slots = 0
    if PREFETCH:
        slots = tl.load(table_row + start + offs_n, mask=start + offs_n < full_end, other=0)
    if WHILE_LOOP:  # the CPU interpreter cannot take runtime `range` bounds (numpy >= 2.4)
        start_n = start
        while start_n < full_end:
            if PREFETCH:
                ahead = tl.load(table_row + start_n + BLOCK_N + offs_n, mask=start_n + BLOCK_N + offs_n < full_end,
                                other=0)
            m_i, l_i, acc = attend_block(q, m_i, l_i, acc, start_n, end, q_pos, table_row, k_base, v_base,
                                         stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, CAUSAL=False,
                                         BOUNDED=False, window=window, softcap_log2=softcap_log2,
                                         alibi_log2=alibi_log2, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                                         k_scale_base=k_scale_base, v_scale_base=v_scale_base,
                                         stride_scale_slot=stride_scale_slot, KV_SCALES=KV_SCALES,
                                         given_slots=slots, GIVEN=PREFETCH, WIDE_SLOTS=WIDE_SLOTS)
            if PREFETCH:
                slots = ahead
            start_n += BLOCK_N
    else:
        for start_n in range(start, full_end, BLOCK_N):
            if PREFETCH:
                ahead = tl.load(table_row + start_n + BLOCK_N + offs_n, mask=start_n + BLOCK_N + offs_n < full_end,
                                other=0)
            m_i, l_i, acc = attend_block(q, m_i, l_i, acc, start_n, end, q_pos, table_row, k_base, v_base,
                                         stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, CAUSAL=False,
                                         BOUNDED=False, window=window, softcap_log2=softcap_log2,
                                         alibi_log2=alibi_log2, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                                         k_scale_base=k_scale_base, v_scale_base=v_scale_base,
                                         stride_scale_slot=stride_scale_slot, KV_SCALES=KV_SCALES,
                                         given_slots=slots, GIVEN=PREFETCH, WIDE_SLOTS=WIDE_SLOTS)
            if PREFETCH:
                slots = ahead
    if TAIL_N == 0 or TAIL_N >= BLOCK_N:
        if full_end < end:
            m_i, l_i, acc = attend_block(q, m_i, l_i, acc, full_end, end, q_pos, table_row, k_base, v_base,
                                         stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, CAUSAL=False,
                                         BOUNDED=True, window=window, softcap_log2=softcap_log2,
                                         alibi_log2=alibi_log2, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                                         k_scale_base=k_scale_base, v_scale_base=v_scale_base,
                                         stride_scale_slot=stride_scale_slot, KV_SCALES=KV_SCALES,
                                         WIDE_SLOTS=WIDE_SLOTS)
    else:
        m_i, l_i, acc = attend_bounded_blocks(q, m_i, l_i, acc, full_end, end, q_pos, table_row, k_base, v_base,
                                              stride_kv_slot, d_mask, scale_log2, TAIL_N, UPCAST, False, window,
                                              softcap_log2, alibi_log2, WINDOW, SOFTCAP, ALIBI, k_scale_base,
                                              v_scale_base, stride_scale_slot, KV_SCALES, WIDE_SLOTS)
    return m_i, l_i, acc


@triton.jit
def attend_bounded_blocks(q, m_i, l_i, acc, start, end, q_pos, table_row, k_base, v_base, stride_kv_slot, d_mask,
                          scale_log2, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, CAUSAL: tl.constexpr, window,
                          softcap_log2, alibi_log2, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                          ALIBI: tl.constexpr, k_scale_base, v_scale_base, stride_scale_slot, KV_SCALES: tl.constexpr,
                          WIDE_SLOTS: tl.constexpr):
    """``attend_block`` with the bounds mask (and the causal one with CAUSAL) over the key positions [start, end)
    in blocks of BLOCK_N: a ``while`` loop on every device (one or two blocks: a pipelined ``for`` adds a prologue
    and a drain around them). ``attend_range``'s keys after its full blocks (TAIL_N), the prefill kernel's
    diagonal."""
    start_n = start
    while start_n < end:
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, start_n, end, q_pos, table_row, k_base, v_base,
                                     stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, CAUSAL=CAUSAL,
                                     BOUNDED=True, window=window, softcap_log2=softcap_log2,
                                     alibi_log2=alibi_log2, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                                     k_scale_base=k_scale_base, v_scale_base=v_scale_base,
                                     stride_scale_slot=stride_scale_slot, KV_SCALES=KV_SCALES,
                                     WIDE_SLOTS=WIDE_SLOTS)
        start_n += BLOCK_N
    return m_i, l_i, acc
