"""TokenAttention's device memory: the KV buffer and the request->token table.

  kv_buffer     [num_layers, num_slots + 1, 2 * kv_heads, head_dim]
                K heads at [..., :kv_heads, :], V heads at [..., kv_heads:, :];
                slot ``num_slots`` is the dummy slot that padded rows write into.
  req_to_token  [max_requests + 1, max_seq_len] int32: (request row, position) -> slot;
                row ``max_requests`` is the dummy row.

The router's SlotAllocator decides which slots and rows are used; this class only
holds the tensors and writes the table entries a Step brings. The model reaches one
layer's cache through a ``KVLayer`` (made once per layer, so CUDA graphs see the same
tensors every step), which ``engine.ops`` hands to the rotary/store and attention kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayer:
    """One layer's KV cache as the kernels read and write it.

    ``data``: [num_slots + 1, 2 * kv_heads, head_dim], K heads then V heads per slot. A
    quantized cache adds its scales here (a field beside ``data``), so the model's calls
    stay as they are; only ``engine.ops`` and the kernels read them.
    """
    data: torch.Tensor


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 max_requests: int, max_seq_len: int, dtype: torch.dtype, device):
        self.num_slots = num_slots
        self.max_requests = max_requests
        self.max_seq_len = max_seq_len
        self.kv_heads = kv_heads
        self.kv_buffer = torch.empty(num_layers, num_slots + 1, 2 * kv_heads, head_dim, dtype=dtype, device=device)
        self.req_to_token = torch.full((max_requests + 1, max_seq_len), num_slots, dtype=torch.int32, device=device)
        self.layers = tuple(KVLayer(self.kv_buffer[i]) for i in range(num_layers))

    def layer(self, index: int) -> KVLayer:
        return self.layers[index]

    def write_table(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[t], positions[t]] = slots[t] for every new token t."""
        self.req_to_token[rows.long(), positions.long()] = slots.to(torch.int32)

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8
