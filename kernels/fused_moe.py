"""Fused mixture-of-experts MLP: every token's top-k experts in one grouped GEMM per projection.

    out[t] = sum_j  w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = ids[t, j]

The T * k (token, choice) pairs are sorted by expert and each expert's run is padded to a
multiple of ``BLOCK_M`` (``align_by_expert``): a block of ``BLOCK_M`` sorted pairs belongs to
one expert, so one launch covers all experts (grid: blocks x output columns), and a block
reads only its expert's weights: at decode, only the chosen experts' bytes are read. The
padded layout has a fixed upper bound, T * k + min(E, T * k) * (BLOCK_M - 1) rows (at decode a
few blocks, not one per expert), so nothing waits on the host and CUDA graphs can capture it;
blocks past the used length return at once.

Launch 1: gate|up of every pair ([T*k, 2I]); the existing ``silu_and_mul`` kernel; launch 2:
down of every pair, scaled by its router weight ([T*k, H]); the k rows of a token are then
summed. Float32 inputs use exact (IEEE) dot products, like the other GEMM kernels.

One token (batch-1 decode: its k experts are distinct, so nothing is shared between pairs)
takes two matrix-vector kernels instead, with no alignment and no padded rows:
``_one_token_gate_up_kernel`` (grid: k pairs, plus the shared expert if any, x blocks of I)
writes silu(gate) * up of each pair, and ``_one_token_down_kernel`` (grid: blocks of H) reads
the k experts' rows side by side, scales each output by its router weight, sums them and adds
the shared expert's gated output. Both round as the two-launch path does.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import skinny_gemm
from ._checks import check_last_dim_contiguous, check_tensor, upcast_dots
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to
from .silu_and_mul import silu_and_mul, silu_and_mul_ref


class SharedExpert(NamedTuple):
    """Qwen2-MoE's shared expert, which every token takes: ``sigmoid(gate_logits) * down(silu(gate(x)) * up(x))``."""
    gate_up: torch.Tensor        # [2 * I_shared, H]: gate rows, then up rows
    down: torch.Tensor           # [H, I_shared]
    gate_logits: torch.Tensor    # [T, 1]: x @ shared_expert_gate.T, in x's dtype


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, used_ptr, weights_ptr,
    num_pairs, n, k, a_row_div,
    stride_a, stride_we, stride_wn, stride_out,
    MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,  # IEEE: fp32 dots (no TF32; the interpreter lacks bf16 dots)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair] = a[pair // a_row_div] @ w[expert].T (* weights[pair]) for one block of pairs."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows).to(tl.int64)
    valid = pairs < num_pairs
    a_rows = pairs // a_row_div
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if MUL_WEIGHT:
        # round the product to the dtype first, as transformers (expert output, then * weight)
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _align_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, used_ptr, num_pairs, num_experts, capacity,
                  BLOCK_M: tl.constexpr, P_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr,
                  B_BLOCK: tl.constexpr):
    """``align_by_expert`` in one program (``ALIGN_MAX_PAIRS`` pairs at most): the same layout."""
    pairs = tl.arange(0, P_BLOCK)
    is_pair = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=is_pair, other=E_BLOCK - 1).to(tl.int32)   # E_BLOCK > E: a spare bin
    experts = tl.arange(0, E_BLOCK)
    counts = tl.where(experts < num_experts, tl.histogram(ids, E_BLOCK), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    # a pair's row: its expert's first row, then one row per earlier pair of that expert (a stable sort)
    earlier = (ids[:, None] == ids[None, :]) & (pairs[None, :] < pairs[:, None])
    first = tl.sum(tl.where(ids[:, None] == experts[None, :], (end - padded)[None, :], 0), 1)
    rows = first + tl.sum(earlier.to(tl.int32), 1)
    slots = tl.arange(0, C_BLOCK)
    tl.store(sorted_ids_ptr + slots, tl.full([C_BLOCK], 0, tl.int32) + num_pairs, mask=slots < capacity)
    tl.debug_barrier()          # the padding is written before the pairs land on it
    tl.store(sorted_ids_ptr + rows, pairs.to(tl.int32), mask=is_pair)
    blocks = tl.arange(0, B_BLOCK)
    # a block's expert: the experts whose padded runs end at or before the block's first row (searchsorted)
    before = (end[None, :] <= (blocks * BLOCK_M)[:, None]) & (experts[None, :] < num_experts)
    block_expert = tl.minimum(tl.sum(before.to(tl.int32), 1), num_experts - 1)
    tl.store(block_expert_ptr + blocks, block_expert, mask=blocks * BLOCK_M < capacity)
    tl.store(used_ptr + blocks, tl.zeros([B_BLOCK], tl.int32) + tl.sum(padded, 0), mask=blocks == 0)


@triton.jit
def _one_token_gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, inter, hidden, stride_we, stride_wn,
                              shared_w_ptr, shared_act_ptr, shared_inter, shared_stride_wn, top_k,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                              PDL: tl.constexpr):
    """act[j, cols] = silu(x @ gate_e[cols].T) * (x @ up_e[cols].T), e = ids[j], rounded as silu_and_mul;
    pair ``top_k`` (when the grid has it) is the shared expert, into shared_act."""
    pair = tl.program_id(0)
    block = tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    if pair < top_k:
        w_base = w_ptr + tl.load(ids_ptr + pair).to(tl.int64) * stride_we
        n = inter
        stride_n = stride_wn
        out_ptr = act_ptr + pair * inter
    else:
        w_base = shared_w_ptr
        n = shared_inter
        stride_n = shared_stride_wn
        out_ptr = shared_act_ptr
    if block * BLOCK_N >= n:
        return
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (cols % n).to(tl.int64)              # past-the-end columns re-read valid rows (stores are masked)
    gate_ptrs = w_base + rows[:, None] * stride_n + ks[None, :]
    up_ptrs = gate_ptrs + n * stride_n
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k0 + ks) < hidden
        x = tl.load(x_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        acc_gate += tl.load(gate_ptrs + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32) * x
        acc_up += tl.load(up_ptrs + k0, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32) * x
    dtype = act_ptr.dtype.element_ty
    gate = round_to(tl.sum(acc_gate, 1), dtype).to(tl.float32)    # the gate|up output, rounded to the dtype
    up = round_to(tl.sum(acc_up, 1), dtype).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    tl.store(out_ptr + cols, round_to(act * up, dtype), mask=cols < n)


@triton.jit
def _one_token_down_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, hidden, inter, stride_we, stride_wn,
                           shared_act_ptr, shared_w_ptr, shared_gate_ptr, shared_inter, shared_stride_wn,
                           TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           NUM_STAGES: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr):
    """out[cols] = sum_j round(round(act[j] @ down_e[cols].T) * weights[j]), e = ids[j]. The k experts are
    read side by side (one [K_BLOCK, BLOCK_N, BLOCK_K] tile a step), not one after another: a short
    loop per expert would leave the loads unpipelined between experts. ``SHARED``: plus the shared
    expert's output, sigmoid(gate logit) * (shared_act @ shared_down[cols].T), rounded as torch's ops."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (cols % hidden).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, K_BLOCK)
    slot_ok = slots < TOP_K
    dtype = out_ptr.dtype.element_ty
    # Before the PDL wait (kernels._pdl): the chosen experts and their router weights, which the routing wrote two
    # launches back (the gate|up launch comes between), and the first tile of those experts' weights
    experts = tl.load(ids_ptr + slots, mask=slot_ok, other=0, cache_modifier=".cg").to(tl.int64)
    router_weights = tl.load(weights_ptr + slots, mask=slot_ok, other=0.0, cache_modifier=".cg")
    w_ptrs = w_ptr + experts[:, None, None] * stride_we + rows[None, :, None] * stride_wn + ks[None, None, :]
    a_ptrs = act_ptr + slots[:, None] * inter + ks[None, :]
    k_ok = slot_ok[:, None] & (ks < inter)[None, :]
    w = tl.load(w_ptrs, mask=k_ok[:, None, :], other=0.0, eviction_policy="evict_first")
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    acc = tl.zeros([K_BLOCK, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc += w.to(tl.float32) * tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)[:, None, :]
    for k0 in tl.range(BLOCK_K, inter, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = slot_ok[:, None] & ((k0 + ks) < inter)[None, :]
        a = tl.load(a_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * a[:, None, :]
    y = round_to(tl.sum(acc, 2), dtype).to(tl.float32)                  # [K_BLOCK, BLOCK_N]: each expert's output
    y = y * router_weights[:, None]
    out = round_to(tl.sum(round_to(y, dtype).to(tl.float32), 0), dtype)
    if SHARED:
        shared = _row_block_gemv(shared_act_ptr, shared_w_ptr + rows[:, None] * shared_stride_wn, shared_inter,
                                 BLOCK_N, BLOCK_K * K_BLOCK, NUM_STAGES)
        gate = tl.load(shared_gate_ptr).to(tl.float32)
        gate = round_to(1.0 / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
        mixed = round_to(gate * round_to(shared, dtype).to(tl.float32), dtype).to(tl.float32)
        out = round_to(out.to(tl.float32) + mixed, dtype)
    tl.store(out_ptr + cols, out, mask=cols < hidden)


@triton.jit
def _row_block_gemv(x_ptr, w_rows, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """float32 [BLOCK_N]: the weight rows at ``w_rows`` ([BLOCK_N, 1] pointers) times the vector x [k]."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k0 + ks) < k
        x = tl.load(x_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k0 + ks[None, :], mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, 1)


ALIGN_MAX_PAIRS = 128   # (token, choice) pairs that one program aligns (decode batches); more take torch's ops


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_ids, block_expert, used): pair indices (token * k + j) grouped by expert, each
    expert's run padded to a multiple of ``block_m`` with the sentinel T * k; the expert of
    each block; the used length (a 1-element tensor). Sizes depend only on T, k, E. Up to
    ``ALIGN_MAX_PAIRS`` pairs one kernel builds it (``_align_kernel``; torch's ops took about 25
    launches, each a few microseconds of a decode step); more pairs take ``align_by_expert_torch``."""
    pairs = topk_ids.numel()
    capacity = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    if pairs > ALIGN_MAX_PAIRS or pairs == 0:
        return align_by_expert_torch(topk_ids, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(1,)](
        topk_ids.contiguous(), sorted_ids, block_expert, used, pairs, num_experts, capacity,
        BLOCK_M=block_m, P_BLOCK=max(16, triton.next_power_of_2(pairs)),
        E_BLOCK=triton.next_power_of_2(num_experts + 1), C_BLOCK=triton.next_power_of_2(capacity),
        B_BLOCK=max(16, triton.next_power_of_2(capacity // block_m)), num_warps=8)
    return sorted_ids, block_expert, used


def align_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """``align_by_expert`` in torch's ops (any number of pairs)."""
    flat = topk_ids.flatten().to(torch.int64)
    pairs = flat.numel()
    # counted by scatter_add, not bincount (which reads the max id on the host: no graph capture)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts
    dest = (padded_end - padded)[by_expert] + torch.arange(pairs, device=flat.device) - first[by_expert]
    # each expert that has pairs (at most min(E, pairs) of them) pads its run by < block_m rows
    capacity = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def _tiles(block_m: int, n: int, k: int, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_stages). On a GPU, 16-row blocks (decode: weight-bandwidth bound)
    take the skinny GEMM's measured decode tile for M <= 16 (32 weight rows x 256 columns, 4
    stages: many programs, long contiguous loads); 64-row blocks (prompts) a 128 x 64 tile.
    Not yet swept for this kernel (bench.moe_bench reports the result against the floor).
    The interpreter takes small tiles (fast tests)."""
    if not on_gpu:
        return min(max(triton.next_power_of_2(n), 16), 64), min(max(triton.next_power_of_2(k), 16), 64), 1
    if block_m == 16:
        return 32, min(max(triton.next_power_of_2(k), 16), 256), 4
    return min(max(triton.next_power_of_2(n), 16), 128), min(max(triton.next_power_of_2(k), 16), 64), 3


def _grouped_gemm(a, w, out, align, num_pairs: int, a_row_div: int, weights, block_m: int) -> None:
    sorted_ids, block_expert, used = align
    n, k = w.shape[1], w.shape[2]
    block_n, block_k, num_stages = _tiles(block_m, n, k, a.is_cuda)
    if a.dtype == torch.float32:
        num_stages = min(num_stages, 2)        # float32 tiles are twice the bytes: stay within shared memory
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, used, weights if weights is not None else out,
        num_pairs, n, k, a_row_div, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        MUL_WEIGHT=weights is not None, IEEE=upcast_dots(a),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=num_stages)


def _check(x, w_gate_up, w_down, topk_weights, topk_ids, shared: SharedExpert | None = None) -> None:
    check_tensor("x", x, 2)
    check_tensor("w_gate_up", w_gate_up, 3)
    check_tensor("w_down", w_down, 3)
    check_last_dim_contiguous("w_gate_up", w_gate_up)
    check_last_dim_contiguous("w_down", w_down)
    experts, two_inter, hidden = w_gate_up.shape
    if x.shape[1] != hidden or w_down.shape != (experts, hidden, two_inter // 2):
        raise ValueError(f"fused_moe shapes disagree: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, "
                         f"w_down {tuple(w_down.shape)} (expected [E, 2I, H] and [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={x.shape[0]}, k]")
    if shared is not None:
        two_shared, shared_hidden = shared.gate_up.shape
        if (shared_hidden != hidden or two_shared % 2 or shared.down.shape != (hidden, two_shared // 2)
                or shared.gate_logits.shape != (x.shape[0], 1)):
            raise ValueError(f"shared expert shapes disagree: gate_up {tuple(shared.gate_up.shape)}, down "
                             f"{tuple(shared.down.shape)}, gate_logits {tuple(shared.gate_logits.shape)} (expected "
                             f"[2I, H={hidden}], [H, I] and [T={x.shape[0]}, 1])")
        for name in ("gate_up", "down"):
            check_last_dim_contiguous(f"shared {name}", getattr(shared, name))


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared: SharedExpert | None = None) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H] (gate rows, then up rows); w_down [E, H, I];
    topk_weights [T, k] float32, topk_ids [T, k] -> [T, H] in x's dtype; plus the ``shared`` expert's
    output (one token: inside the down kernel; more: the skinny GEMM's launches, then torch's)."""
    _check(x, w_gate_up, w_down, topk_weights, topk_ids, shared)
    tokens, top_k = topk_ids.shape
    experts, two_inter, hidden = w_gate_up.shape
    if tokens == 0:
        return torch.zeros((tokens, hidden), dtype=x.dtype, device=x.device)
    x = x.contiguous()
    if tokens <= ONE_TOKEN_TOKENS:
        return _fused_moe_one_token(x, w_gate_up, w_down, topk_weights, topk_ids, shared)
    pairs = tokens * top_k
    block_m = 16 if pairs <= 4 * experts else 64
    align = align_by_expert(topk_ids, experts, block_m)
    gate_up = torch.empty((pairs, two_inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, gate_up, align, pairs, top_k, None, block_m)
    act = silu_and_mul(gate_up)
    down = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w_down, down, align, pairs, 1, topk_weights.contiguous().float(), block_m)
    out = down.view(tokens, top_k, hidden).sum(dim=1)
    if shared is None:
        return out
    expert = skinny_gemm.linear(silu_and_mul(skinny_gemm.linear(x, shared.gate_up)), shared.down)
    return out + torch.sigmoid(shared.gate_logits) * expert


ONE_TOKEN_TOKENS = 1         # a batch of this many tokens takes the one-token path (benches set 0: never)
# (BLOCK_N, BLOCK_K, num_stages, num_warps) of gate|up and (BLOCK_N, BLOCK_K, num_stages) of down (for 8 experts;
# down's BLOCK_K scales as 8 / k). One MoE block at batch 1 (router, routing, both launches), 16 blocks of their own
# weights in one CUDA graph, one H200 (stop 61, .diag/s61_tiles.py: bench.moe_bench.moe_layer_ab, three rounds, us a
# block): gate|up (2, 1024, 4, 2) against the earlier (2, 512, 3, 4) took Qwen3-30B-A3B's block 29.0-29.1 -> 26.1
# and Qwen1.5-MoE-A2.7B's (with its shared expert) 46.7-47.1 -> 45.0-45.1; of the others tried (4, 256, 2, 2) gave
# 27.9-28.0 / 45.8-45.9, (8, 256, 2, 4) 27.8-28.0 / 44.6-44.7, (2, 512, 3, 2) 27.9-28.0 / 43.0-43.1. Mixtral-8x7B's
# block (4 blocks, two rounds, another call) lost 0.7%: 174.2 -> 175.3-175.7 us (its experts are 14,336 wide).
# The earlier tile was swept while the gate|up launch without a shared expert loaded its weights 2 bytes at a time
# (the stand-in stride in _fused_moe_one_token). Down (4, 256, 2) against the earlier (4, 128, 3), whole blocks as
# above with this gate|up (stop 63, .diag/s63_down_tiles.py, one H200, three rounds): Qwen3 26.0 -> 25.1-25.2 us,
# Qwen1.5-MoE 45.0-45.6 -> 44.4-44.6, Mixtral (two rounds) 176.1-176.3 -> 165.1-165.5; of the others tried
# (4, 256, 3) gave 25.5 / 44.1-44.5 / 165.7-166.1, (8, 128, 3) 26.2-26.3 / 45.4-45.6 / 165.0-165.3, (2, 256, 2)
# 26.2-26.3 / 47.6 / 167.4-167.8. Qwen3's 16-layer bench.moe_bench: 1,045.9 / 1,047.7 -> 1,051.5 / 1,050.4 tokens/s.
# Stop 71 (one H200, .diag/s71_moe_tiles.py: blocks as above, each candidate's output checked against fused_moe_ref)
# kept both: against Qwen3's 25.1-25.3 us and Qwen1.5-MoE's 44.6, whole-K gate|up tiles in registers (one stage:
# (2, 2048, 1, 2), (1, 2048, 1, 1), (4, 2048, 1, 4)) gave 28.5-30.0 and 47.5-61.3 us, (1, 1024, 4, 1) 25.9-28.2 /
# 59.5-70.5; down tiles of one stage ((8, 256, 1), (2, 512, 1), (4, 128, 1)) 25.6-28.5 / 45.4-54.4. Mixtral-8x7B's
# best, (2, 1024, 2, 2) at 165.6, matched this tile's 165.3.
ONE_TOKEN_TILES = (2, 1024, 4, 2)
ONE_TOKEN_DOWN_TILES = (4, 256, 2)


def _fused_moe_one_token(x, w_gate_up, w_down, topk_weights, topk_ids, shared: SharedExpert | None
                         ) -> torch.Tensor:
    """``fused_moe`` of one token: two matrix-vector launches, the shared expert's in them (module docstring)."""
    two_inter, hidden = w_gate_up.shape[1:]
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    block_n, block_k, stages, warps = ONE_TOKEN_TILES if x.is_cuda else (16, 64, 1, 4)
    # ids and weights before the gate|up launch: the down launch reads them before its PDL wait (two launches back)
    ids = topk_ids.reshape(-1).contiguous()
    router_weights = topk_weights.reshape(-1).contiguous().float()
    act = torch.empty((top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((1, hidden), dtype=x.dtype, device=x.device)
    pdl = launch_options(x)
    # the shared expert, when there is one, is the gate|up launch's last pair
    shared_inter = shared.down.shape[1] if shared is not None else 0
    shared_act = torch.empty((1, shared_inter), dtype=x.dtype, device=x.device) if shared is not None else act
    # Without a shared expert its arguments are unread stand-ins. The kernel still picks each pair's row stride at
    # run time from two arguments, and the compiler proves rows 16-byte aligned only when both are multiples of 16:
    # so the stand-in is the experts' own row stride. A stand-in of 1 (Triton compiles an int 1 as the constant 1)
    # lost that proof, and the weights came in 2-byte loads: Qwen3-30B-A3B's launch took 20.5-22.7 us on one H200
    # against 15.2-15.3 with this stride (four turns each, one run; offline SASS for sm_90: LDG.U16 -> LDGSTS.128).
    gate_up_shared = (shared.gate_up, shared_act, shared_inter, shared.gate_up.stride(0)) if shared is not None \
        else (w_gate_up, act, 0, w_gate_up.stride(1))
    _one_token_gate_up_kernel[(top_k + (shared is not None), triton.cdiv(max(inter, shared_inter), block_n))](
        x, w_gate_up, ids, act, inter, hidden, w_gate_up.stride(0), w_gate_up.stride(1), *gate_up_shared, top_k,
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, num_warps=warps, **pdl)
    one_token_down(act, w_down, ids, router_weights, out, (shared, shared_act) if shared is not None else None)
    return out


def one_token_down(act: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor, router_weights: torch.Tensor,
                   out: torch.Tensor, shared: tuple[SharedExpert, torch.Tensor] | None = None) -> None:
    """The one-token path's down launch: ``out`` [1, H] = sum_j act[j] @ w_down[ids[j]].T * router_weights[j]
    (``_one_token_down_kernel``; ``shared``: the shared expert and its gate|up output). It reads ``ids`` and
    ``router_weights`` before its PDL wait, so whatever writes them must be two or more launches before it
    (``kernels._pdl``); ``act`` may come from the launch just before."""
    top_k, inter = act.shape
    hidden = w_down.shape[1]
    k_block = triton.next_power_of_2(top_k)
    if act.is_cuda:
        down_n, down_k, down_stages = ONE_TOKEN_DOWN_TILES
        down_k = max(16, down_k * 8 // k_block)     # for any k, the tile holds as many weights as for 8 experts
    else:
        down_n, down_k, down_stages = 16, 32, 1
    shared_args = (shared[1], shared[0].down, shared[0].gate_logits, shared[0].down.shape[1],
                   shared[0].down.stride(0)) if shared is not None else (act, w_down, ids, 0, 1)
    _one_token_down_kernel[(triton.cdiv(hidden, down_n),)](
        act, w_down, ids, router_weights, out, hidden, inter,
        w_down.stride(0), w_down.stride(1), *shared_args, TOP_K=top_k, K_BLOCK=k_block, BLOCK_N=down_n,
        BLOCK_K=down_k, NUM_STAGES=down_stages, SHARED=shared is not None, num_warps=4, **launch_options(act))


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, shared: SharedExpert | None = None) -> torch.Tensor:
    """The same, one expert at a time (transformers' loop)."""
    _check(x, w_gate_up, w_down, topk_weights, topk_ids, shared)
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        act = silu_and_mul_ref(x[token] @ w_gate_up[expert].T)
        y = (act @ w_down[expert].T) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    if shared is None:
        return out
    return out + torch.sigmoid(shared.gate_logits) * (silu_and_mul_ref(x @ shared.gate_up.T) @ shared.down.T)
