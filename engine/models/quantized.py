"""Quantized linear layers: this shard's slice of a GPTQ / AWQ / FP8 layer, in the kernels' layout.

``read_linear`` stands in for reading ``<module>.weight`` with its tensor-parallel ``Slice`` (dim 0:
output rows, column-parallel; dim 1: input columns, row-parallel) and returns what the layer holds
(``kernels.quant_gemm.Int4Weight``, ``kernels.fp8_gemm.Fp8Weight``). Which checkpoint axis a slice
cuts (``weights.quant_formats`` has the layouts):

| tensor | output-row slice (column-parallel) | input slice (row-parallel) |
| --- | --- | --- |
| GPTQ qweight [K/8, N] | dim 1 | dim 0 (words of 8 rows) |
| AWQ qweight [K, N/8] | dim 1 (words of 8 columns) | dim 0 |
| qzeros [G, N/8], scales [G, N] | dim 1 | dim 0 on group boundaries; all groups with act-order or one group |
| GPTQ g_idx [K] | whole | dim 0 |
| FP8 weight [N, K] | dim 0 | dim 1 |
| FP8 weight_scale | per channel: dim 0; per tensor: whole | whole |

A row-parallel slice must hold whole groups: ``K / shards`` a multiple of ``group_size``, else
``ShardingError``. AWQ is repacked to GPTQ's packing (one 4-bit layout for the kernel); zeros are
unpacked to the model dtype; act-order layers are sorted by group (``sorted_by_group``). ``fuse`` joins
parts of a fused layer (q|k|v, gate|up) along N (dense where the checkpoint left only some parts unquantized);
``read_fused_linear`` reads the parts of a layer that the checkpoint fuses (Phi-3's ``qkv_proj``,
``gate_up_proj``), each part's output rows through ``OutputRows``.
``drop_zero_biases`` checks the biases 4-bit writers add to layers that have none (AutoGPTQ: zeros).
"""
from __future__ import annotations

import logging

import torch

from engine.models.parallel import FULL, ShardingError, Slice, fused_ranges, read
from kernels.fp8_gemm import Fp8Weight
from kernels.quant_gemm import Int4Weight, int4_dequantize
from weights.checkpoint import CheckpointError
from weights.quant_formats import AWQ_ORDER, PACK, QuantConfig, fp8_quantize, pack_int4, unpack_int4

LinearWeight = torch.Tensor | Int4Weight | Fp8Weight
log = logging.getLogger(__name__)


def read_linear(checkpoint, module: str, piece: Slice, q: QuantConfig, dtype, device) -> Int4Weight | Fp8Weight:
    """This shard's ``piece`` of the quantized linear layer ``module`` (its name without ``.weight``)."""
    if q.method == "fp8":
        return _read_fp8(checkpoint, module, piece, q, device)
    return _read_int4(checkpoint, module, piece, q, dtype, device)


def read_weight(checkpoint, name: str, piece: Slice, q: QuantConfig | None, dtype, device) -> LinearWeight:
    """This shard's ``piece`` of the tensor ``name``: a quantized linear layer's weight from its quantized
    tensors, any other tensor as stored (cast to ``dtype``)."""
    if q is not None and q.quantizes(name):
        return read_linear(checkpoint, name.removesuffix(".weight"), piece, q, dtype, device)
    return read(checkpoint, name, piece, dtype, device)


def _along(piece: Slice, dim: int) -> Slice:
    return Slice(dim, piece.part, piece.parts)


def _read(checkpoint, name: str, piece: Slice | None, device, dtype=None) -> torch.Tensor:
    if piece is None or piece.dim is None:
        return checkpoint.read(name, dtype=dtype, device=device)
    return checkpoint.read_slice(name, piece.dim, piece.part, piece.parts, dtype=dtype, device=device)


def _group_slice(module: str, piece: Slice, q: QuantConfig, in_features: int) -> Slice | None:
    """How the [G, ...] scales and zeros are cut: along dim 1 for an output slice; for an input slice along
    dim 0 on group boundaries, or not at all (act-order: g_idx points into all groups; one group)."""
    if piece.dim == 0:
        return _along(piece, 1)
    if piece.dim is None or q.desc_act or q.group_size == -1:
        return None
    local = in_features // piece.parts
    if local % q.group_size:
        raise ShardingError(f"{module}: {in_features} input rows split over {piece.parts} shards are {local} rows "
                            f"a shard, not a multiple of the quantization group_size {q.group_size}; choose a "
                            f"--num-shard that keeps whole groups on each shard")
    return _along(piece, 0)


def _read_int4(checkpoint, module: str, piece: Slice, q: QuantConfig, dtype, device) -> Int4Weight:
    awq = q.method == "awq"
    in_features = checkpoint.shape(module + ".qweight")[0] * (1 if awq else PACK)
    groups = _group_slice(module, piece, q, in_features)
    word_dim = {None: None, 0: 1, 1: 0}[piece.dim]
    qweight = _read(checkpoint, module + ".qweight", _along(piece, word_dim) if word_dim is not None else None, device)
    scales = _read(checkpoint, module + ".scales", groups, device, dtype)
    qzeros = _read(checkpoint, module + ".qzeros", groups, device)
    order = AWQ_ORDER if awq else tuple(range(PACK))
    zeros = (unpack_int4(qzeros, 1, order) + q.zero_offset).to(dtype)
    if awq:
        qweight = pack_int4(unpack_int4(qweight, 1, AWQ_ORDER), 0)
    local_rows = qweight.shape[0] * PACK
    group_size = local_rows if q.group_size == -1 else q.group_size
    weight = Int4Weight(qweight.contiguous(), scales.contiguous(), zeros.contiguous(), None, group_size)
    if not q.desc_act:
        return weight
    rows = _along(piece, 0) if piece.dim == 1 else None
    return sorted_by_group(weight, _read(checkpoint, module + ".g_idx", rows, device, torch.int32))


def sorted_by_group(weight: Int4Weight, g_idx: torch.Tensor) -> Int4Weight:
    """An act-order layer with its rows sorted by group (x's columns read through ``perm`` instead): where
    every group then holds ``group_size`` consecutive rows (one shard, or column-parallel ones) the kernel
    takes a group's scale once per tile; a row-parallel shard's uneven groups keep the sorted g_idx."""
    perm = torch.argsort(g_idx, stable=True)
    sorted_groups = g_idx[perm]
    qweight = pack_int4(unpack_int4(weight.qweight, 0)[perm], 0)
    counts = torch.bincount(sorted_groups.long(), minlength=weight.scales.shape[0])
    uniform = bool((counts == weight.group_size).all())
    return Int4Weight(qweight, weight.scales, weight.zeros, None if uniform else sorted_groups.contiguous(),
                      weight.group_size, perm.to(torch.int32))


def _read_fp8(checkpoint, module: str, piece: Slice, q: QuantConfig, device) -> Fp8Weight:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"FP8 weights need FP8 tensor cores (compute capability 8.9+: Ada, Hopper), "
                         f"{torch.cuda.get_device_name(device)} has none: serve a GPTQ / AWQ or float checkpoint")
    if q.at_load:    # --quantize fp8: a float checkpoint, quantized per output channel here
        weight, scale = fp8_quantize(_read(checkpoint, module + ".weight", piece, device, torch.float32))
        return Fp8Weight(weight, scale)
    weight = _read(checkpoint, module + ".weight", piece, device)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{module}.weight has dtype {weight.dtype}; an FP8 checkpoint holds float8_e4m3fn "
                         f"weights: use an FP8 checkpoint, or a float one with --quantize fp8")
    rows = weight.shape[0]
    scale = _read(checkpoint, module + ".weight_scale", piece if q.per_channel and piece.dim == 0 else None,
                  device, torch.float32).reshape(-1)
    return Fp8Weight(weight, scale.expand(rows).contiguous() if scale.numel() == 1 else scale.contiguous())


def fuse(parts: list[LinearWeight]) -> LinearWeight:
    """Parts of one layer (q, k, v or gate, up) joined along the output rows. Where the checkpoint leaves some
    parts unquantized (modules_to_not_convert / ignore) and quantizes others, the quantized ones are
    dequantized to the dense parts' dtype and the layer runs dense."""
    dense = [p for p in parts if isinstance(p, torch.Tensor)]
    if dense and len(dense) < len(parts):
        log.info("a fused layer (q/k/v or gate/up) of parts %s is partly unquantized in the checkpoint: its "
                 "quantized parts are dequantized to %s and it runs dense", [_kind(p) for p in parts], dense[0].dtype)
        parts = [p if isinstance(p, torch.Tensor) else dequantized(p, dense[0].dtype) for p in parts]
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, Fp8Weight):
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))
    for name in ("g_idx", "perm"):
        if getattr(first, name) is not None and any(not torch.equal(getattr(p, name), getattr(first, name))
                                                    for p in parts[1:]):
            raise ValueError("the fused parts of a GPTQ act-order layer (q/k/v or gate/up) have different g_idx; "
                             "such a checkpoint cannot be served with fused projections")
    if any(p.group_size != first.group_size or p.scales.shape[0] != first.scales.shape[0] for p in parts[1:]):
        raise ValueError("the fused parts of a 4-bit layer (q/k/v or gate/up) have different groups")
    return Int4Weight(torch.cat([p.qweight for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1),
                      torch.cat([p.zeros for p in parts], dim=1), first.g_idx, first.group_size, first.perm)


def dequantized(weight: Int4Weight | Fp8Weight, dtype) -> torch.Tensor:
    """The quantized layer as ``dtype`` [N, K] (act-order: input columns back in x's order, from ``perm``)."""
    if isinstance(weight, Fp8Weight):
        return (weight.weight.float() * weight.scale[:, None]).to(dtype)
    stored = int4_dequantize(weight)                # [N, K], row k multiplies x[:, perm[k]]
    if weight.perm is None:
        return stored.to(dtype)
    dense = torch.empty_like(stored)
    dense[:, weight.perm.long()] = stored
    return dense.to(dtype)


def _kind(weight: LinearWeight) -> str:
    kind = {Int4Weight: "int4", Fp8Weight: "fp8"}.get(type(weight), "dense")
    return f"{kind} {list(weight.shape)}"


# ---- fused checkpoint tensors ----------------------------------------------------------------------

# (output axis, values per stored element along it) of each tensor of a quantized layer; None: not cut
OUTPUT_AXES = {
    "gptq": {"qweight": (1, 1), "qzeros": (1, PACK), "scales": (1, 1), "g_idx": None},
    "awq": {"qweight": (1, PACK), "qzeros": (1, PACK), "scales": (1, 1)},
    "fp8": {"weight": (0, 1), "weight_scale": (0, 1)},
}


class OutputRows:
    """The checkpoint as one part of a fused quantized layer sees it: the layer's tensors cut to output rows
    ``start:stop`` (packed tensors: their words; a per-tensor FP8 scale: whole), for ``read_linear``."""

    def __init__(self, checkpoint, module: str, start: int, stop: int, q: QuantConfig):
        packed = q.method != "fp8"
        if packed and (start % PACK or stop % PACK):
            raise CheckpointError(f"{module}: a fused part holds output rows {start}:{stop} (on this shard), not "
                                  f"on multiples of {PACK}, the 4-bit packing of the zeros (and AWQ's weights) "
                                  f"along the output rows: this fused layer cannot be cut into its parts; serve "
                                  f"it on fewer shards or an unquantized checkpoint")
        self.checkpoint, self.module, self.start, self.stop, self.q = checkpoint, module, start, stop, q

    def _axis(self, name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
        axis = OUTPUT_AXES[self.q.method][name.rsplit(".", 1)[-1]]
        if axis is None or len(shape) <= axis[0] or shape[axis[0]] == 1:
            return None     # g_idx, a per-tensor FP8 scale
        return axis

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self.checkpoint.shape(name)
        axis = self._axis(name, shape)
        if axis is None:
            return shape
        dim, pack = axis
        return shape[:dim] + ((self.stop - self.start) // pack,) + shape[dim + 1:]

    def read(self, name: str, dtype=None, device=None) -> torch.Tensor:
        tensor = self.checkpoint.read(name, dtype=dtype, device=device)
        axis = self._axis(name, tuple(tensor.shape))
        if axis is None:
            return tensor
        dim, pack = axis
        return tensor.narrow(dim, self.start // pack, (self.stop - self.start) // pack).contiguous()


def read_fused_linear(checkpoint, module: str, part_rows: list[int], slices: list[Slice], q: QuantConfig,
                      dtype, device) -> LinearWeight:
    """This rank's parts of a quantized layer the checkpoint fuses along its output rows (Phi-3's q | k | v,
    gate | up; ``parallel.read_fused`` for a float one), joined (``fuse``)."""
    return fuse([read_linear(OutputRows(checkpoint, module, start, stop, q), module, FULL, q, dtype, device)
                 for start, stop in fused_ranges(part_rows, slices)])


# ---- biases the model has no place for --------------------------------------------------------------

def drop_zero_biases(checkpoint, expected, q: QuantConfig | None) -> None:
    """The biases 4-bit writers put on every quantized layer (AutoGPTQ: zeros where the model has none) are
    dropped where the family's layer has no bias; a non-zero one would change the model: a clear error."""
    if q is None:
        return
    for name in q.unused_biases(checkpoint.names(), expected):
        if torch.count_nonzero(checkpoint.read(name)):
            raise CheckpointError(f"{name} is a non-zero bias of a quantized layer, but this model's layer has no "
                                  f"bias (the config enables none): the checkpoint does not match its config.json")
