"""TokenAttention's device memory: the KV buffer and the request->token table.

  kv_buffer     [num_layers, num_slots + 1, 2 * kv_heads, head_dim]
                K heads at [..., :kv_heads, :], V heads at [..., kv_heads:, :];
                slot ``num_slots`` is the dummy slot that padded rows write into.
  req_to_token  [max_requests + 1, max_seq_len] int32: (request row, position) -> slot;
                row ``max_requests`` is the dummy row.

A quantized cache (``--kv-cache-dtype``, ``kernels._kv_quant`` owns the format) stores
``kv_buffer`` as int8 or fp8 beside ``kv_scales``:
  int8   [num_layers, num_slots + 1, 2 * kv_heads] float32, one scale per token and KV head,
         written by the rotary/store kernel with the token;
  fp8    [num_layers, 2] float32, each layer's K and V scale, from the checkpoint (else 1.0).

The router's SlotAllocator decides which slots and rows are used; this class only
holds the tensors and writes the table entries a Step brings. The model reaches one
layer's cache through a ``KVLayer`` (made once per layer, so CUDA graphs see the same
tensors every step), which ``engine.ops`` hands to the rotary/store and attention kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


# --kv-cache-dtype values (TGI's fp8 names, int8 as LightLLM's int8kv)
KV_CACHE_DTYPES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
# Per-tensor KV scales of quantized checkpoints (vLLM's and TGI's names, newest first), per layer prefix
KV_SCALE_NAMES = (("self_attn.k_scale", "self_attn.v_scale"), ("self_attn.kv_scale", "self_attn.kv_scale"),
                  ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"))
KV_SCALE_PATTERNS = (r"self_attn\.(k_scale|v_scale|kv_scale|[kv]_proj\.output_scale)$",)


def kv_cache_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for ``--kv-cache-dtype`` (None: the model's)."""
    if name is None:
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def read_kv_scales(checkpoint, num_layers: int) -> torch.Tensor:
    """[num_layers, 2] float32: each layer's K and V scale from the checkpoint (``KV_SCALE_NAMES``), 1.0 where
    it has none (as TGI and vLLM do)."""
    scales = torch.ones(num_layers, 2, dtype=torch.float32)
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        for k_name, v_name in KV_SCALE_NAMES:
            if prefix + k_name in checkpoint and prefix + v_name in checkpoint:
                for i, name in enumerate((k_name, v_name)):
                    value = checkpoint.read(prefix + name, torch.float32).reshape(-1)
                    if value.numel() != 1 or not (value[0] > 0 and value[0].isfinite()):
                        raise ValueError(f"{prefix + name} holds {value.tolist()}; a KV scale must be one positive "
                                         f"finite number (fix the checkpoint or drop --kv-cache-dtype)")
                    scales[layer, i] = value[0]
                break
    return scales


@dataclass(frozen=True)
class KVLayer:
    """One layer's KV cache as the kernels read and write it.

    ``data``: [num_slots + 1, 2 * kv_heads, head_dim], K heads then V heads per slot;
    ``scales``: a quantized cache's (int8: [num_slots + 1, 2 * kv_heads]; fp8: [2], K's and V's),
    else None. Only ``engine.ops`` and the kernels read them; the model's calls are the same.
    """
    data: torch.Tensor
    scales: torch.Tensor | None = None


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 max_requests: int, max_seq_len: int, dtype: torch.dtype, device,
                 kv_dtype: torch.dtype | None = None, tensor_scales: torch.Tensor | None = None):
        """``kv_dtype``: the storage dtype (None: ``dtype``); ``tensor_scales`` [num_layers, 2]: an fp8
        cache's per-layer K and V scales (None: 1.0)."""
        self.num_slots = num_slots
        self.max_requests = max_requests
        self.max_seq_len = max_seq_len
        self.kv_heads = kv_heads
        self.kv_dtype = kv_dtype = kv_dtype or dtype
        self.kv_buffer = torch.empty(num_layers, num_slots + 1, 2 * kv_heads, head_dim, dtype=kv_dtype,
                                     device=device)
        self.kv_scales = self._new_scales(num_layers, num_slots, kv_heads, kv_dtype, tensor_scales, device)
        self.req_to_token = torch.full((max_requests + 1, max_seq_len), num_slots, dtype=torch.int32, device=device)
        self.layers = tuple(KVLayer(self.kv_buffer[i], None if self.kv_scales is None else self.kv_scales[i])
                            for i in range(num_layers))

    @staticmethod
    def _new_scales(num_layers, num_slots, kv_heads, kv_dtype, tensor_scales, device) -> torch.Tensor | None:
        if kv_dtype == torch.int8:
            return torch.ones(num_layers, num_slots + 1, 2 * kv_heads, dtype=torch.float32, device=device)
        if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if tensor_scales is None:
                return torch.ones(num_layers, 2, dtype=torch.float32, device=device)
            return tensor_scales.to(device=device, dtype=torch.float32).contiguous()
        return None

    def layer(self, index: int) -> KVLayer:
        return self.layers[index]

    def write_table(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[t], positions[t]] = slots[t] for every new token t (the three broadcast together)."""
        self.req_to_token[rows.long(), positions.long()] = slots.to(torch.int32)

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Device bytes one token's K and V take in every layer: data, plus int8's per-head scales."""
        data = num_layers * 2 * kv_heads * head_dim * dtype.itemsize
        scales = num_layers * 2 * kv_heads * 4 if dtype == torch.int8 else 0
        return data + scales
