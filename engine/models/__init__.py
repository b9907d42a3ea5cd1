"""The model registry: config.json's ``architectures[0]`` -> the family that serves it.

A family is one module (e.g. ``llama``: Llama 1/2/3/3.1, Mistral, Qwen2) that parses its own
config into its own frozen config (a ``config.ModelConfig``), owns its checkpoint names,
shapes and tensor-parallel slices, and composes the shared blocks of ``layers``; it
registers one ``config.Family`` in ``FAMILIES`` below. Nothing else names a family: the
engine loads configs, checks checkpoints and builds models through the functions here.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from engine.models import bloom, gemma, llama, mixtral, phi3, qwen2_moe, qwen3, qwen3_moe, starcoder2
from engine.models.config import Family, ModelConfig, ModelConfigError, read_config_json
from weights.checkpoint import CheckpointError, open_checkpoint
from weights.quant_formats import parse_quantization, quantized_shapes

FAMILIES: tuple[Family, ...] = (llama.FAMILY, gemma.FAMILY, phi3.FAMILY, starcoder2.FAMILY, mixtral.FAMILY,
                                qwen2_moe.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, bloom.FAMILY)
# Families whose projections may be GPTQ / AWQ / FP8 (LlamaFamilyModel._read, Phi3Model._read,
# Starcoder2Model._read; tests/unit/test_quantized_parity.py). MoE families are refused (experts stay float).
QUANTIZED_FAMILIES = (llama.FAMILY, qwen3.FAMILY, gemma.FAMILY, phi3.FAMILY, starcoder2.FAMILY)
MODEL_REGISTRY: dict[str, Family] = {arch: family for family in FAMILIES for arch in family.architectures}


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODEL_REGISTRY)


def quantized_architectures() -> tuple[str, ...]:
    """The architectures whose GPTQ / AWQ / FP8 checkpoints (and --quantize fp8) load."""
    return tuple(a for f in QUANTIZED_FAMILIES for a in f.architectures)


def family_for(architecture: str | None) -> Family:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        named = (f"unsupported architecture {architecture!r} (config.json `architectures`)" if architecture else
                 "config.json names no architecture (`architectures`) and no model_type that has one")
        raise ModelConfigError(f"{named}; supported: {', '.join(MODEL_REGISTRY)}") from None


def load_model_config(model_dir: str | Path, rope_scaling: tuple[str, float] | None = None,
                      quantize: str | None = None) -> ModelConfig:
    """The family's frozen config of ``model_dir``; ``rope_scaling`` = (linear | dynamic, factor)
    replaces the checkpoint's rope scaling and extends the context by the factor; ``quantize`` is
    --quantize (checked against the checkpoint's ``quantization_config``, see ``weights.quant_formats``)."""
    raw = read_config_json(model_dir, rope_scaling)
    family = family_for((raw.get("architectures") or [None])[0])
    try:
        config = family.parse_config(raw)
    except KeyError as e:
        raise ModelConfigError(f"{Path(model_dir) / 'config.json'} lacks the field {e.args[0]!r}") from e
    config = with_stored_head(config, model_dir)
    quantization = parse_quantization(raw, quantize, model_dir)
    if quantization is None:
        return config
    if family not in QUANTIZED_FAMILIES:
        raise ModelConfigError(f"quantized weights ({quantization.method}) are supported for "
                               f"{', '.join(quantized_architectures())}, not {config.architecture} (mixture-of-"
                               f"experts models are not quantized): serve an unquantized checkpoint of this model")
    return replace(config, quantization=quantization)


def with_stored_head(config: ModelConfig, model_dir: str | Path) -> ModelConfig:
    """A config that ties the LM head to the embedding, of a checkpoint that stores ``lm_head.weight`` as well:
    that tensor is read (``layers.head_weight`` serves it where it differs from the embedding, as transformers
    5 does), not refused as unexpected. Without weights in ``model_dir`` the config is returned as it is."""
    if not getattr(config, "tie_word_embeddings", False):
        return config
    try:
        with open_checkpoint(model_dir) as checkpoint:
            stored = "lm_head.weight" in checkpoint
    except CheckpointError:
        return config          # no weights here (yet): loading them says what is wrong
    return replace(config, tie_word_embeddings=False, head_stored_though_tied=True) if stored else config


def build_model(config: ModelConfig, ops, dtype, device, max_positions: int, tp):
    """The family's model for ``config``, on this shard (weights not loaded yet)."""
    return family_for(config.architecture).model(config, ops, dtype, device, max_positions, tp)


def check_checkpoint(checkpoint, config: ModelConfig) -> None:
    """Every tensor the family needs, with its full shape, and nothing unexpected (headers only)."""
    family, q = family_for(config.architecture), config.quantization
    view = family.view(checkpoint) if family.view is not None else checkpoint
    view.check(quantized_shapes(family.checkpoint_shapes(config), q),
               ignore_unexpected=family.ignored_names + (q.ignored_names if q else ()))
