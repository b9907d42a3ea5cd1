"""Medusa draft heads: speculation with heads that ship beside the model (TGI loads them).

A Medusa repository holds ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
``base_model_name_or_path``: the model the heads were trained on) and
``medusa_lm_head.safetensors``. Head ``k`` (0-based) reads the model's last hidden state
(after the final norm) at a token's position ``t``, where the model's own head predicts the
token at ``t + 1``, and predicts the token at ``t + 2 + k``:

    x = h_t;  for each of its ``medusa_num_layers`` blocks:  x = x + silu(x @ W.T + b)
    logits_k = x @ out.T          (``{k}.{layers}.weight``; TGI's "v1" files)
             = lm_head(x)         (no out weight: the model's own head, TGI's "v2" files)

Tensor names: ``{k}.{j}.linear.weight`` [hidden, hidden] and ``.bias`` [hidden] for block ``j``,
``{k}.{layers}.weight`` [vocab, hidden] for the out projection, as FasterDecoding's Medusa and
TGI save them. The blocks are replicated on every shard (small); an out projection is split by
vocabulary rows like the model's head, and its logits are gathered (a collective: every rank
runs the heads). The drafts are each head's greedy choice: the worker verifies them exactly,
so they decide only how many tokens a forward pass may produce, never which.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models.config import ModelConfig
from engine.models.layers import Linear, LMHead
from engine.models.parallel import FULL, TensorParallel, read
from weights.checkpoint import MEDUSA_FILE, Checkpoint, CheckpointError, read_config

MEDUSA_KEY = "medusa_num_heads"


@dataclass(frozen=True)
class MedusaConfig:
    directory: str           # holds config.json and MEDUSA_FILE
    num_heads: int
    num_layers: int          # residual blocks per head
    base_model: str | None   # ``base_model_name_or_path``: the model the heads read


def is_medusa_dir(directory: str | Path) -> bool:
    """Whether ``directory``'s config.json describes Medusa heads (``medusa_num_heads``)."""
    try:
        return MEDUSA_KEY in read_config(directory)
    except CheckpointError:       # no config.json, or not a JSON object: not heads (the model's checks say why)
        return False


def read_medusa_config(directory: str | Path) -> MedusaConfig:
    """The heads' config; CheckpointError (what is wrong, what to do) for anything unusable."""
    directory = Path(directory)
    raw = read_config(directory)
    heads, layers = raw.get(MEDUSA_KEY), raw.get("medusa_num_layers", 1)
    for name, value in ((MEDUSA_KEY, heads), ("medusa_num_layers", layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == MEDUSA_KEY else 0):
            raise CheckpointError(f"{directory}/config.json: {name} is {value!r}, expected a whole number "
                                  f"(>= 1 heads, >= 0 layers): fix the Medusa config")
    if (directory / "medusa_lm_head.pt").is_file() and not (directory / MEDUSA_FILE).is_file():
        raise CheckpointError(f"{directory} holds Medusa heads as medusa_lm_head.pt (a pickle) only; this engine reads "
                              f"safetensors: convert it (safetensors.torch.save_file(torch.load(...), "
                              f"'{MEDUSA_FILE}')) or use a repo that ships {MEDUSA_FILE}")
    if not (directory / MEDUSA_FILE).is_file():
        raise CheckpointError(f"{directory}/config.json describes Medusa heads but {MEDUSA_FILE} is missing: "
                              f"download the whole Medusa repository")
    base = raw.get("base_model_name_or_path")
    return MedusaConfig(str(directory), heads, layers, base if isinstance(base, str) and base else None)


def check_head_count(medusa: MedusaConfig, count: int) -> None:
    """One draft per head: ``count`` (--speculate) must be 1 to the heads' number."""
    if not 1 <= count <= medusa.num_heads:
        raise ValueError(f"--speculate {count} with the {medusa.num_heads} Medusa heads of {medusa.directory}: "
                         f"use 1 to {medusa.num_heads} (one draft per head)")


def head_shapes(medusa: MedusaConfig, c: ModelConfig, with_out: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of the heads' file with its shape (``with_out``: each head has its own out projection)."""
    shapes = {}
    for k in range(medusa.num_heads):
        for j in range(medusa.num_layers):
            shapes[f"{k}.{j}.linear.weight"] = (c.hidden_size, c.hidden_size)
            shapes[f"{k}.{j}.linear.bias"] = (c.hidden_size,)
        if with_out:
            shapes[f"{k}.{medusa.num_layers}.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def open_heads(medusa: MedusaConfig, c: ModelConfig) -> tuple[Checkpoint, bool]:
    """The heads' file, checked (names and shapes, headers only): (its checkpoint, whether each head has
    its own out projection)."""
    checkpoint = Checkpoint(Path(medusa.directory), None, files=[MEDUSA_FILE])
    with_out = f"0.{medusa.num_layers}.weight" in checkpoint
    try:
        checkpoint.check(head_shapes(medusa, c, with_out))
    except CheckpointError as e:
        checkpoint.close()
        raise CheckpointError(f"the Medusa heads in {medusa.directory} do not fit the model (hidden size "
                              f"{c.hidden_size}, vocabulary {c.vocab_size}): {e}") from None
    return checkpoint, with_out


class DraftHeads:
    """The first ``count`` Medusa heads of one shard: ``__call__(ops, hidden)`` -> [rows, count] drafts."""

    def __init__(self, blocks: list[list[Linear]], outs: list[LMHead] | None, model):
        self.blocks = blocks          # per head, its residual blocks
        self.outs = outs              # per head, its out projection; None: the model's own head
        self.model = model

    @classmethod
    def load(cls, medusa: MedusaConfig, c: ModelConfig, model, count: int, dtype: torch.dtype,
             device: torch.device, tp: TensorParallel = TensorParallel()) -> "DraftHeads":
        check_head_count(medusa, count)
        checkpoint, with_out = open_heads(medusa, c)
        with checkpoint:
            blocks = [[Linear(read(checkpoint, f"{k}.{j}.linear.weight", FULL, dtype, device),
                              read(checkpoint, f"{k}.{j}.linear.bias", FULL, dtype, device))
                       for j in range(medusa.num_layers)] for k in range(count)]
            outs = [LMHead(read(checkpoint, f"{k}.{medusa.num_layers}.weight", tp.column(), dtype, device), tp)
                    for k in range(count)] if with_out else None
        return cls(blocks, outs, model)

    @property
    def count(self) -> int:
        return len(self.blocks)

    def __call__(self, ops, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, count] int64: head k's greedy token for position t + 2 + k, from the hidden states at t."""
        states = []
        for blocks in self.blocks:
            x = hidden
            for block in blocks:
                x = x + torch.nn.functional.silu(block(ops, x))
            states.append(x)
        if self.outs is None:      # the model's head over every head's state at once (one collective)
            logits = self.model.compute_logits(torch.cat(states)).view(self.count, hidden.shape[0], -1)
        else:
            logits = torch.stack([out(ops, x) for out, x in zip(self.outs, states)])
        return logits.argmax(dim=-1).T.contiguous()


def reference_drafts(path: str | Path, hidden: torch.Tensor, lm_head: torch.Tensor, count: int) -> torch.Tensor:
    """Plain torch over the heads' file (tests): [rows, count] drafts from float32 hidden states [rows, hidden],
    with ``lm_head`` [vocab, hidden] for heads without their own out projection."""
    from safetensors.torch import load_file

    medusa = read_medusa_config(path)
    tensors = {k: v.float() for k, v in load_file(str(Path(path) / MEDUSA_FILE)).items()}
    drafts = []
    for k in range(count):
        x = residual_blocks(tensors, k, medusa.num_layers, hidden.float())
        out = tensors.get(f"{k}.{medusa.num_layers}.weight", lm_head.float())
        drafts.append((x @ out.T).argmax(dim=-1))
    return torch.stack(drafts, dim=1)


def residual_blocks(tensors: dict[str, torch.Tensor], head: int, num_layers: int, x: torch.Tensor) -> torch.Tensor:
    """Head ``head``'s residual blocks over ``x`` in plain torch, from the file's named tensors."""
    for j in range(num_layers):
        weight, bias = tensors[f"{head}.{j}.linear.weight"], tensors[f"{head}.{j}.linear.bias"]
        x = x + torch.nn.functional.silu(x @ weight.T + bias)
    return x
