"""Architecture registry: config.json's ``architectures[0]`` -> model class.

One implementation per family: Llama, Mistral and Qwen2 differ only in flags that
``ModelConfig`` reads (GQA, q/k/v bias, tied embeddings, rope variant), so all three
map to ``LlamaFamilyModel``.
"""
from __future__ import annotations

from engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError
from engine.models.llama import LlamaFamilyModel

MODEL_REGISTRY = {name: LlamaFamilyModel for name in SUPPORTED_ARCHITECTURES}


def model_class_for(config: ModelConfig):
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ModelConfigError(
            f"unsupported architecture {config.architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
