"""Inputs shared by the kernel tests: the device, dtype tolerances and a scattered KV cache.

On a machine without CUDA the top-level conftest has set ``TRITON_INTERPRET=1``, so the
Triton launchers run in the interpreter on the CPU (small shapes there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# (atol, rtol) for attention outputs of magnitude ~1
ATTENTION_TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2), torch.float32: (2e-5, 2e-5)}


@dataclass
class KVCache:
    """One layer of a TokenAttention cache holding ``seq_lens[b]`` tokens for each request.

    Slots are a random permutation (scattered, not contiguous); every slot no request owns,
    the dummy slot 0 included, and every table entry past a request's length is NaN-poisoned
    or points at the dummy slot, so a kernel that reads outside its keys produces NaN.
    """
    kv_layer: torch.Tensor      # [S + 1, 2 * Hk, D]
    req_to_token: torch.Tensor  # [R, M] int32
    b_req_row: torch.Tensor     # [B] int32
    b_seq_len: torch.Tensor     # [B] int32


def build_kv_cache(seq_lens, kv_heads, head_dim, dtype, device, spare_slots=7) -> KVCache:
    batch = len(seq_lens)
    num_slots = sum(seq_lens) + spare_slots
    kv_layer = torch.full((num_slots + 1, 2 * kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    rows = torch.randperm(batch + 3)[:batch]
    max_len = max(seq_lens) + 5
    req_to_token = torch.zeros((batch + 3, max_len), dtype=torch.int32)
    slots = torch.randperm(num_slots)[: sum(seq_lens)] + 1
    offset = 0
    for row, length in zip(rows.tolist(), seq_lens):
        req_to_token[row, :length] = slots[offset:offset + length].int()
        offset += length
    used = slots.to(device)
    kv_layer[used] = torch.randn((len(slots), 2 * kv_heads, head_dim), device=device).to(dtype)
    return KVCache(kv_layer, req_to_token.to(device), rows.int().to(device),
                   torch.tensor(seq_lens, dtype=torch.int32, device=device))
