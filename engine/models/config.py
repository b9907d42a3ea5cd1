"""Model configuration read from a Hugging Face ``config.json``.

Handles both the transformers 4.x spelling (``rope_theta`` + ``rope_scaling``,
``torch_dtype``) and the 5.x one (``rope_parameters``, ``dtype``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class ModelConfigError(ValueError):
    """config.json describes a model this engine cannot run, or is malformed."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: torch.dtype | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_context(self) -> int:
        """Longest sequence served exactly: a sliding window caps it (keys beyond it
        would need window masking, which the attention kernels do not do)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        architecture = _architecture(raw)
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act={raw['hidden_act']!r} is not supported; only 'silu' is")
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        sliding = raw.get("sliding_window") if (not is_qwen2 or raw.get("use_sliding_window")) else None
        return cls(
            architecture=architecture,
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", is_qwen2)),
            qkv_bias=bool(raw.get("attention_bias", False)) or is_qwen2,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
            checkpoint_dtype=_DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "")),
        )


def load_model_config(model_dir: str | Path, rope_scaling: tuple[str, float] | None = None) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path} not found: a model directory needs the Hugging Face config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
    if rope_scaling is not None:
        kind, factor = rope_scaling
        raw = {**raw, "rope_scaling": {"rope_type": kind, "factor": factor}, "rope_parameters": None}
    try:
        return ModelConfig.from_dict(raw)
    except KeyError as e:
        raise ModelConfigError(f"{path} lacks the field {e.args[0]!r}") from e


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    name = archs[0] if archs else None
    if name not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"unsupported architecture {name!r} (config.json `architectures`); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return name


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**params, **scaling}
    theta = float(raw.get("rope_theta") or merged.get("rope_theta") or 10000.0)
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    original = merged.get("original_max_position_embeddings")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original else None,
    )


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
