"""Tiny quantized checkpoints for tests, each with its dequantized float32 twin.

``save_quantized_pair`` takes a tiny transformers checkpoint (``tests.tiny_models``), writes every
decoder linear layer in a quantized format (``weights.quant_formats.quantize_linear``: integer weights,
zeros and scales packed as the format specifies, ``quantization_config`` in config.json) and the same
model with those layers dequantized to float32 as a plain checkpoint: transformers on the twin is the
reference for our engine on the quantized one.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_gemm import quantize_per_token
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer
from weights.quant_formats import (QuantConfig, act_order_g_idx, config_json, dequantize_linear, input_name,
                                   quantize_linear)

FORMATS = {
    # GPTQ v1 (stored zero - 1), act-order with groups of 16 (whole groups on each of 2 shards)
    "gptq_act_order": QuantConfig("gptq", group_size=16, desc_act=True, zero_offset=1),
    "gptq_g32": QuantConfig("gptq", group_size=32, zero_offset=0),          # gptq_v2, no act-order
    "gptq_per_column": QuantConfig("gptq", group_size=-1, zero_offset=1),   # one group over all rows
    "awq_g16": QuantConfig("awq", group_size=16),
    "awq_g32": QuantConfig("awq", group_size=32),
    "fp8_tensor": QuantConfig("fp8", per_channel=False),                    # quant_method fp8
    "fp8_channel": QuantConfig("fp8", per_channel=True),                    # compressed-tensors
}


def save_quantized_pair(fmt: str, path: Path, family: str = "llama", seed: int = 0, tokenizer: bool = False,
                        quant: QuantConfig | None = None) -> tuple[Path, Path]:
    """(quantized checkpoint dir, dequantized float32 twin dir) under ``path``; the float model they come
    from is in ``path / "float"`` (with ``tokenizer``, all three get one). ``quant``: the format ``fmt``
    with layers left unquantized (its ``skip`` / ``ignore``), else ``FORMATS[fmt]``."""
    q = quant or FORMATS[fmt]
    base = save_tiny_model(family, path / "float", seed)
    if tokenizer:
        save_tiny_tokenizer(base)
    quantized, twin = path / fmt, path / (fmt + "_dequantized")
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(base / "model.safetensors"))
    packed, dense, g_idx = {}, {}, {}
    for name, tensor in tensors.items():
        if not q.quantizes(name):
            packed[name] = dense[name] = tensor
            continue
        in_features = tensor.shape[1]
        group = in_features if q.group_size == -1 else q.group_size
        key = input_name(name)
        if q.desc_act and key not in g_idx:
            g_idx[key] = act_order_g_idx(in_features, group, generator)
        parts = quantize_linear(tensor, q, g_idx=g_idx.get(key))
        module = name.removesuffix(".weight")
        packed.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
        dense[name] = dequantize_linear(parts, q)
    config = json.loads((base / "config.json").read_text())
    for directory, weights, quantization in ((quantized, packed, config_json(q)), (twin, dense, None)):
        directory.mkdir(parents=True)
        save_file({n: t.contiguous() for n, t in weights.items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        written = {**config, "quantization_config": quantization} if quantization else config
        (directory / "config.json").write_text(json.dumps(written, indent=2))
        shutil.copy(base / "generation_config.json", directory / "generation_config.json")
        if tokenizer:
            save_tiny_tokenizer(directory)
    return quantized, twin


def add_zero_biases(quantized: Path) -> list[str]:
    """Give every 4-bit layer of the checkpoint in ``quantized`` that has no bias a float16 zero one, as
    AutoGPTQ writes them (e.g. TheBloke's Llama-2-7B-GPTQ); returns the names added."""
    path = quantized / "model.safetensors"
    tensors = load_file(str(path))
    added = {name.removesuffix("scales") + "bias": torch.zeros(t.shape[1], dtype=torch.float16)
             for name, t in tensors.items() if name.endswith(".scales")}
    added = {name: t for name, t in added.items() if name not in tensors}
    save_file({**tensors, **added}, str(path), metadata={"format": "pt"})
    return sorted(added)


ROW_PARALLEL = ("o_proj", "down_proj", "c_proj")


def fake_quantize_activations(model, num_shards: int = 1, q: QuantConfig | None = None) -> None:
    """Make transformers' float32 model quantize the input of every decoder linear layer (with ``q``: every
    one ``q`` quantizes) per token to FP8 and back, as our FP8 GEMM does (the reference maths of an FP8
    checkpoint with dynamic activation scales). On ``num_shards`` shards a row-parallel layer (o, down)
    quantizes each shard's input columns on their own."""
    def fake_quantize(x, parts):
        chunks = []
        for chunk in x.reshape(-1, x.shape[-1]).chunk(parts, dim=1):
            x_fp8, scale = quantize_per_token(chunk)
            chunks.append(x_fp8.float() * scale[:, None])
        return torch.cat(chunks, dim=1).reshape(x.shape).to(x.dtype)

    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")
                and (q is None or q.quantizes(name + ".weight"))):
            parts = num_shards if name.rsplit(".", 1)[-1] in ROW_PARALLEL else 1
            module.register_forward_pre_hook(lambda m, args, parts=parts: (fake_quantize(args[0], parts),))
