"""The online-softmax block the attention kernels run over a block of cached keys.

One block of BLOCK_N key positions ``[start_n, start_n + BLOCK_N)`` updates the running
state of each query row: ``m_i`` the running max of the scaled scores (log2 units), ``l_i``
the running sum of ``exp2(score - m_i)``, ``acc`` the running ``sum p * v``. Keys and values
are read through the request's ``req_to_token`` row (``table_row``): position -> slot ->
``k_base`` / ``v_base + slot * stride_kv_slot``.

A quantized cache (``kernels._kv_quant``, ``KV_SCALES`` > 0) is dequantized as each block is
gathered (``load_kv``): ``k_scale_base`` / ``v_scale_base`` point at this kv head's K / V scales,
one per slot (``stride_scale_slot`` apart) or one for the tensor.

Two masks, each compiled in only where needed:
- ``BOUNDED``: the block may reach past ``key_end``; positions from there on are not read.
  ``attend_range`` walks its full blocks without it and only its last, partial block with it.
- ``CAUSAL`` (prefill's diagonal): each query row also ignores the keys after its own
  position ``q_pos``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._kv_quant import load_kv


@triton.jit
def attend_block(q, m_i, l_i, acc, start_n, key_end, q_pos, table_row, k_base, v_base, stride_kv_slot,
                 d_mask, scale_log2, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, CAUSAL: tl.constexpr,
                 BOUNDED: tl.constexpr, k_scale_base=None, v_scale_base=None, stride_scale_slot=0,
                 KV_SCALES: tl.constexpr = 0):
    """Online-softmax update of (m_i, l_i, acc) with the keys at positions [start_n, start_n + BLOCK_N),
    cut at ``key_end`` when BOUNDED (without it every position of the block must be a key)."""
    pos = start_n + tl.arange(0, BLOCK_N)
    if BOUNDED:
        n_mask = pos < key_end
        slots = tl.load(table_row + pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        n_mask = start_n      # unread
        slots = tl.load(table_row + pos).to(tl.int64)
        kv_mask = d_mask[None, :]
    k = load_kv(k_base, slots, stride_kv_slot, kv_mask, k_scale_base, stride_scale_slot, n_mask, q.dtype, KV_SCALES,
                BOUNDED)
    if UPCAST:  # IEEE fp32 dots, not TF32
        qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * scale_log2
    if CAUSAL:
        visible = pos[None, :] <= q_pos[:, None]
        if BOUNDED:
            visible = visible & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    elif BOUNDED:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv(v_base, slots, stride_kv_slot, kv_mask, v_scale_base, stride_scale_slot, n_mask, q.dtype, KV_SCALES,
                BOUNDED)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def attend_range(q, m_i, l_i, acc, start, end, table_row, k_base, v_base, stride_kv_slot, d_mask, scale_log2,
                 BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, WHILE_LOOP: tl.constexpr, k_scale_base=None,
                 v_scale_base=None, stride_scale_slot=0, KV_SCALES: tl.constexpr = 0):
    """``attend_block`` over the key positions [start, end), every one visible to every query row:
    the full blocks without a mask, then the partial block left at the end (if any) with the bounds mask."""
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    if WHILE_LOOP:  # the CPU interpreter cannot take runtime `range` bounds (numpy >= 2.4)
        start_n = start
        while start_n < full_end:
            m_i, l_i, acc = attend_block(q, m_i, l_i, acc, start_n, end, 0, table_row, k_base, v_base,
                                         stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, CAUSAL=False,
                                         BOUNDED=False, k_scale_base=k_scale_base, v_scale_base=v_scale_base,
                                         stride_scale_slot=stride_scale_slot, KV_SCALES=KV_SCALES)
            start_n += BLOCK_N
    else:
        for start_n in range(start, full_end, BLOCK_N):
            m_i, l_i, acc = attend_block(q, m_i, l_i, acc, start_n, end, 0, table_row, k_base, v_base,
                                         stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, CAUSAL=False,
                                         BOUNDED=False, k_scale_base=k_scale_base, v_scale_base=v_scale_base,
                                         stride_scale_slot=stride_scale_slot, KV_SCALES=KV_SCALES)
    if full_end < end:
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, full_end, end, 0, table_row, k_base, v_base,
                                     stride_kv_slot, d_mask, scale_log2, BLOCK_N, UPCAST, CAUSAL=False, BOUNDED=True,
                                     k_scale_base=k_scale_base, v_scale_base=v_scale_base,
                                     stride_scale_slot=stride_scale_slot, KV_SCALES=KV_SCALES)
    return m_i, l_i, acc
