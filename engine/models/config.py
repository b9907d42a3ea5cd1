"""What every model family's config shares, and the helpers families parse theirs with.

A family (``engine.models.llama``, ...) parses config.json into its own frozen config, a
subclass of ``ModelConfig``: the fields here are all the rest of the engine reads (the
worker's KV sizing, tensor-parallel checks, the router's limits and EOS ids). Handles
both the transformers 4.x spelling (``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and
the 5.x one (``rope_parameters``, ``dtype``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from weights.quant_formats import QuantConfig

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")
# rope types transformers reads ``original_max_position_embeddings`` for (default: ``max_position_embeddings``)
ROPE_TYPES_WITH_ORIGINAL = ("llama3", "longrope", "yarn")
# the architecture a config.json without ``architectures`` has, by its ``model_type``
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "bloom": "BloomForCausalLM"}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


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
    extends_context: bool = False        # set by --rope-scaling/--rope-factor: the context grows by ``factor``
    # longrope (Phi-3): per-frequency divisors for sequences within / beyond the original context,
    # and the factor cos and sin are multiplied by
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0        # longrope and yarn: the factor cos and sin are multiplied by
    # yarn: the rotations bounding the ramp from extrapolated to interpolated frequencies, and whether the
    # ramp's ends are rounded (its mscales only make ``attention_factor``, in ``_with_yarn``)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """The fields every family has; a family's config subclass adds its own."""
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope: RopeConfig
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: torch.dtype | None
    quantization: QuantConfig | None = None     # quantized linear layers (quantization_config / --quantize)
    # config.json ties the LM head to the embedding, but the checkpoint stores lm_head.weight too: it is read
    # (the family's config says tie_word_embeddings=False) and served where it differs (``layers.head_weight``)
    head_stored_though_tied: bool = False

    @property
    def max_context(self) -> int:
        """Longest sequence served exactly: the trained context, times the factor of a rope
        scaling asked on the command line (as TGI's launcher). A sliding window does not cap it:
        the attention kernels apply the window (``kernels.score_mods``). Sliding-window models
        still keep every position's KV: TokenAttention frees a request's slots when it ends, and
        freeing the slots that fell out of the window while it runs is a later optimisation."""
        context = self.max_position_embeddings
        if self.rope.extends_context:
            context = int(context * self.rope.factor)
        return context

    def sharded_sizes(self) -> dict[str, int]:
        """Sizes a tensor-parallel split must divide (name in config.json -> value); families add theirs."""
        return {"num_attention_heads": self.num_heads, "vocab_size": self.vocab_size}


@dataclass(frozen=True)
class Family:
    """What a family module registers (``engine.models.FAMILIES``): the ``architectures``
    (config.json ``architectures[0]``) it serves, its config parser, its model class
    (``model(config, ops, dtype, device, max_positions, tp)``), its checkpoint's names and
    full shapes, the checkpoint names it ignores (regular expressions), and ``view``: the checkpoint
    under the names ``checkpoint_shapes`` uses, where checkpoints spell them more than one way
    (Bloom's with or without ``transformer.``; None: as stored)."""
    architectures: tuple[str, ...]
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    model: type
    checkpoint_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    ignored_names: tuple[str, ...] = ()
    view: Callable[[Any], Any] | None = None


def read_config_json(model_dir: str | Path, rope_scaling: tuple[str, float] | None = None) -> dict[str, Any]:
    """config.json as a dict; ``rope_scaling`` = (linear | dynamic, factor) replaces the checkpoint's
    rope scaling (TGI's --rope-scaling / --rope-factor)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path} not found: a model directory needs the Hugging Face config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object of the model's settings")
    raw = with_architecture(raw)
    if rope_scaling is not None:
        kind, factor = rope_scaling
        theta = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}.get("rope_theta")
        scaling = {"rope_type": kind, "factor": factor, "extends_context": True}
        raw = {**raw, "rope_scaling": {**scaling, "rope_theta": theta} if theta else scaling, "rope_parameters": None}
    return raw


def with_architecture(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with ``architectures`` from its ``model_type`` where it names none (transformers' Auto classes
    and TGI pick the model by ``model_type``)."""
    if raw.get("architectures") or raw.get("model_type") not in ARCHITECTURE_OF_MODEL_TYPE:
        return raw
    return {**raw, "architectures": [ARCHITECTURE_OF_MODEL_TYPE[raw["model_type"]]]}


def with_defaults(raw: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """config.json over a family's ``defaults``: the values transformers' config class gives the fields
    config.json omits (a field present, even as null, keeps its value, as in transformers)."""
    return {**defaults, **raw}


def check_positive(**sizes: int) -> None:
    """ModelConfigError naming the first of config.json's ``sizes`` that is not a positive number."""
    for name, value in sizes.items():
        if value <= 0:
            raise ModelConfigError(f"config.json has {name}={value}: it must be a positive number")


def shared_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields as most families spell them in config.json."""
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    check_positive(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                   num_hidden_layers=int(raw["num_hidden_layers"]), vocab_size=int(raw["vocab_size"]),
                   head_dim=int(raw.get("head_dim") or 1))
    if heads % kv_heads:
        raise ModelConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return dict(
        architecture=(raw.get("architectures") or [None])[0],
        hidden_size=hidden, num_layers=int(raw["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=int(raw.get("head_dim") or hidden // heads), vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)), rope=parse_rope(raw),
        sliding_window=None, bos_token_id=raw.get("bos_token_id"), eos_token_ids=as_tuple(raw.get("eos_token_id")),
        checkpoint_dtype=DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "")),
    )


def sliding_layers(raw: dict[str, Any], num_layers: int, default: Callable[[int], bool]) -> tuple[bool, ...]:
    """Per layer, whether the sliding window applies: config.json's ``layer_types`` (transformers 5),
    else ``default(layer index)`` (the family's rule when the config predates ``layer_types``)."""
    types = raw.get("layer_types")
    if not types:
        return tuple(default(i) for i in range(num_layers))
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelConfigError(f"layer_types must list 'sliding_attention' or 'full_attention' for each of the "
                               f"{num_layers} layers, got {types!r}")
    return tuple(t == "sliding_attention" for t in types)


def layer_windows(window: Any, sliding: tuple[bool, ...], source: str) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_layers`` from the window transformers' attention reads and the layers
    that slide; ``source`` says where the window came from, for the error when a layer slides without a
    positive one (transformers then fails to build the mask, or masks every key)."""
    if not any(sliding):
        return {"sliding_window": None, "sliding_layers": ()}
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        layers = [i for i, s in enumerate(sliding) if s]
        raise ModelConfigError(f"layers {layers} slide (sliding_attention) but their window is {window!r} "
                               f"({source}): set sliding_window to a positive number of tokens, or make those "
                               f"layers full_attention")
    return {"sliding_window": window, "sliding_layers": sliding}


def every_layer_window(window: Any, num_layers: int) -> dict[str, Any]:
    """``layer_windows`` for a family whose attention reads ``sliding_window`` on every layer (null: none)."""
    return layer_windows(window, (window is not None,) * num_layers, "sliding_window")


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """The rope as transformers' ``RotaryEmbeddingConfigMixin`` standardises it: ``rope_theta`` inside the rope
    dict before the top-level one; for llama3, longrope and yarn a top-level ``original_max_position_embeddings``
    before the rope dict's (transformers gives the top-level one priority), else ``max_position_embeddings``."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**params, **scaling}
    theta = float(merged.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    partial = float(raw.get("partial_rotary_factor") or merged.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise ModelConfigError(f"partial_rotary_factor={partial} is not supported (the rotary kernel rotates the "
                               f"whole head); only models that rotate every head dimension can be served")
    original = raw.get("original_max_position_embeddings") or merged.get("original_max_position_embeddings")
    if rope_type in ROPE_TYPES_WITH_ORIGINAL and not original:
        original = raw.get("max_position_embeddings", 2048)
    rope = RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor") or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original else None,
        extends_context=bool(merged.get("extends_context", False)),
    )
    if rope_type == "yarn":
        return _with_yarn(rope, merged, raw)
    return _with_longrope(rope, merged, raw) if rope_type == "longrope" else rope


def _with_longrope(rope: RopeConfig, merged: dict[str, Any], raw: dict[str, Any]) -> RopeConfig:
    """The short and long factors and the cos/sin factor, as transformers' ``_compute_longrope_parameters``:
    without ``factor`` the context ratio ``max_position_embeddings / original`` stands in, and without
    ``attention_factor`` it is ``sqrt(1 + ln(factor) / ln(original))`` (1 when factor <= 1)."""
    original = rope.original_max_position_embeddings
    if not original or "short_factor" not in merged or "long_factor" not in merged:
        raise ModelConfigError("longrope rope scaling needs short_factor, long_factor and "
                               "original_max_position_embeddings in config.json")
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    short, long = tuple(map(float, merged["short_factor"])), tuple(map(float, merged["long_factor"]))
    if len(short) != head_dim // 2 or len(long) != head_dim // 2:
        raise ModelConfigError(f"longrope short_factor and long_factor need head_dim / 2 = {head_dim // 2} values "
                               f"each; config.json has {len(short)} and {len(long)}")
    factor = float(merged.get("factor") or int(raw.get("max_position_embeddings", 2048)) / original)
    attention = merged.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return replace(rope, factor=factor, short_factor=short, long_factor=long, attention_factor=float(attention))


def _with_yarn(rope: RopeConfig, merged: dict[str, Any], raw: dict[str, Any]) -> RopeConfig:
    """The factor, ramp bounds and cos/sin factor, as transformers' ``_compute_yarn_parameters``: without
    ``factor`` (null; absent is refused, as transformers does) the context ratio ``max_position_embeddings /
    original`` stands in; ``beta_fast`` and ``beta_slow`` default (when absent or 0) to 32 and 1; ``truncate``
    to true (a null one: false)."""
    if "factor" not in merged:
        raise ModelConfigError("yarn rope scaling needs a factor in config.json (null: max_position_embeddings / "
                               "original_max_position_embeddings)")
    factor = merged.get("factor")
    if factor is None:
        factor = int(raw.get("max_position_embeddings", 2048)) / rope.original_max_position_embeddings
    attention = merged.get("attention_factor")
    if attention is None:
        attention = _yarn_attention_factor(float(factor), merged.get("mscale"), merged.get("mscale_all_dim"))
    return replace(rope, factor=float(factor), attention_factor=float(attention),
                   beta_fast=float(merged.get("beta_fast") or 32), beta_slow=float(merged.get("beta_slow") or 1),
                   truncate=bool(merged.get("truncate", True)))


def _yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """yarn's cos/sin factor when config.json gives none: ``0.1 * ln(factor) + 1`` (1 when factor <= 1), or
    with both ``mscale`` and ``mscale_all_dim`` the ratio of that with ln scaled by each (DeepSeek's)."""
    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
