"""Architecture registry: config.json's ``architectures[0]`` -> model class.

One implementation per family: Llama, Mistral and Qwen2 differ only in flags that
``ModelConfig`` reads (GQA, q/k/v bias, tied embeddings, rope variant), so all three
map to ``LlamaFamilyModel``.
"""
from __future__ import annotations

from engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError, load_model_config
from engine.models.llama import LlamaFamilyModel

__all__ = ["MODEL_REGISTRY", "load_model_config", "model_class_for"]

MODEL_REGISTRY = {name: LlamaFamilyModel for name in SUPPORTED_ARCHITECTURES}


def model_class_for(config: ModelConfig):
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ModelConfigError(
            f"unsupported architecture {config.architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
