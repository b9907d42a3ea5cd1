"""Tensor parallelism: which slice of each weight a rank holds, and the collectives.

Column-parallel (split the output rows): q/k/v, gate/up, the vocab-parallel embedding
and lm head. Row-parallel (split the input columns): o_proj and down_proj, followed by
one all-reduce each. A model with fewer KV heads than shards replicates each KV head
on the ranks whose query heads use it. Collectives are torch.distributed (NCCL on
GPUs, gloo on the CPU); with one shard every method is a no-op.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.config import ModelConfig


class ShardingError(ValueError):
    """The model cannot be split over the requested number of shards."""


@dataclass(frozen=True)
class Slice:
    """Part ``part`` of ``parts`` equal parts along ``dim`` (None: the whole tensor)."""
    dim: int | None = None
    part: int = 0
    parts: int = 1


FULL = Slice()


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1

    def check(self, c: ModelConfig) -> None:
        w = self.world_size
        checks = [(size % w == 0, f"{name}={size}") for name, size in c.sharded_sizes().items()]
        checks.append((c.num_kv_heads % w == 0 or w % c.num_kv_heads == 0, f"num_key_value_heads={c.num_kv_heads}"))
        for ok, what in checks:
            if not ok:
                raise ShardingError(f"{what} does not divide over --num-shard {w}: choose a shard count that "
                                    f"divides the model's heads, intermediate size and vocabulary")

    # ---- local sizes ----------------------------------------------------------------

    def heads(self, c: ModelConfig) -> int:
        return c.num_heads // self.world_size

    def kv_heads(self, c: ModelConfig) -> int:
        return max(c.num_kv_heads // self.world_size, 1)

    def vocab_start(self, c: ModelConfig) -> int:
        return self.rank * (c.vocab_size // self.world_size)

    # ---- slices ---------------------------------------------------------------------

    def column(self) -> Slice:
        return Slice(0, self.rank, self.world_size) if self.world_size > 1 else FULL

    def row(self) -> Slice:
        return Slice(1, self.rank, self.world_size) if self.world_size > 1 else FULL

    def kv_column(self, c: ModelConfig) -> Slice:
        """K/V rows: an equal split, or the one KV head this rank's query heads share."""
        if self.world_size == 1:
            return FULL
        if c.num_kv_heads >= self.world_size:
            return Slice(0, self.rank, self.world_size)
        return Slice(0, self.rank * c.num_kv_heads // self.world_size, c.num_kv_heads)

    # ---- collectives ----------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, V/w] on each rank -> [N, V] (rank order) on every rank."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def read(checkpoint, name: str, piece: Slice, dtype, device) -> torch.Tensor:
    """Read a whole tensor or only the bytes of one slice."""
    if piece.dim is None:
        return checkpoint.read(name, dtype=dtype, device=device)
    return checkpoint.read_slice(name, piece.dim, piece.part, piece.parts, dtype=dtype, device=device)


def read_fused(checkpoint, name: str, part_rows: list[int], slices: list[Slice], dtype, device) -> torch.Tensor:
    """This rank's rows of a checkpoint tensor that fuses parts along dim 0 (Phi-3's ``qkv_proj`` =
    q | k | v, ``gate_up_proj`` = gate | up): part i has ``part_rows[i]`` rows and the rank holds its
    ``slices[i]`` of them; the pieces come back concatenated in part order. (An equal split of the
    fused rows would hand rank 0 only q rows.)"""
    return torch.cat([checkpoint.read_rows(name, start, stop, dtype=dtype, device=device)
                      for start, stop in fused_ranges(part_rows, slices)])


def fused_ranges(part_rows: list[int], slices: list[Slice]) -> list[tuple[int, int]]:
    """(start, stop) rows of the fused tensor that a rank holds, one per part (``read_fused``)."""
    ranges, offset = [], 0
    for rows, piece in zip(part_rows, slices):
        if piece.dim is None:
            ranges.append((offset, offset + rows))
        else:
            step = rows // piece.parts
            ranges.append((offset + piece.part * step, offset + (piece.part + 1) * step))
        offset += rows
    return ranges
