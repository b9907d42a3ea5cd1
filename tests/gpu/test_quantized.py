"""Quantized linear layers on one GPU (issue 19): the 4-bit and FP8 GEMMs on Llama-2-7B's shapes against
their references, and float32 greedy parity with transformers on a dequantized twin.

- kernels (and ``int4_linear`` / ``fp8_linear``, which route many rows to cuBLAS): every Llama-2-7B projection
  shape (fused qkv, o, fused gate_up, down) at decode (1, 4, 16 rows)
  and prefill (512 rows) sizes, GPTQ groups of 128 (act-order gathered per row or sorted by group as
  loaded, without act-order, one group) and FP8,
  in bfloat16 and float16, against ``int4_gemm_ref`` / ``fp8_gemm_ref``;
- Phi-3 and StarCoder2: tiny GPTQ / AWQ / FP8 checkpoints (tests.quant_models), greedy parity as below;
- parity: a random Llama-2-7B-shaped model cut to QUANT_LAYERS layers (default 4) written as GPTQ
  (act-order), AWQ and FP8 checkpoints beside their dequantized float32 twins; our engine (Triton
  kernels, float32) on the quantized one gives transformers' greedy tokens on the twin (FP8: the
  twin's linear inputs rounded to FP8 per token, as our GEMM does).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.quantized import sorted_by_group
from kernels.fp8_gemm import Fp8Weight, fp8_gemm, fp8_gemm_ref, fp8_linear
from kernels.quant_gemm import Int4Weight, int4_gemm, int4_gemm_ref, int4_linear
from tests.gpu.greedy import (describe, engine_greedy, engine_greedy_batch_and_alone, greedy_runs, near_tie_problem,
                              prompts, release_memory, transformers_greedy)
from tests.quant_models import fake_quantize_activations, save_quantized_pair
from weights.quant_formats import (AWQ_ORDER, QuantConfig, act_order_g_idx, dequantize_linear, fp8_quantize, pack_int4,
                                   unpack_int4)
from weights.random_checkpoint import quant_config, write_random_checkpoint

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
ROWS = [1, 4, 16, 512]
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}     # relative to the output's largest magnitude


def int4_weight(n, k, dtype, act_order=False, group=128):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    groups = k // group
    values = torch.randint(0, 16, (k, n), generator=g, device="cuda")
    scales = (torch.rand(groups, n, generator=g, device="cuda") * 0.002 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=g, device="cuda").to(dtype)
    g_idx = act_order_g_idx(k, group, g) if act_order else None
    return Int4Weight(pack_int4(values, 0), scales, zeros, g_idx, group)


def assert_close(out, ref, dtype):
    scale = ref.float().abs().max().item()
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype] * scale


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["group128", "act_order", "act_order_sorted", "one_group"])
def test_int4_gemm_on_7b_shapes(name, rows, dtype, variant):
    """act_order: g_idx gathered per row; act_order_sorted: the same weight as the loader holds it (rows sorted
    by group, x read through perm)."""
    n, k = SHAPES[name]
    weight = int4_weight(n, k, dtype, act_order=variant.startswith("act_order"),
                         group=k if variant == "one_group" else 128)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    served = weight
    if variant == "act_order_sorted":
        served = sorted_by_group(replace(weight, g_idx=None), weight.g_idx)
        assert served.g_idx is None and served.perm is not None
    expected = int4_gemm_ref(x, weight)
    assert_close(int4_gemm(x, served), expected, dtype)
    assert_close(int4_linear(x, served), expected, dtype)      # past FUSED_ROWS: dequantized, then cuBLAS


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemm_on_7b_shapes(name, rows, dtype):
    n, k = SHAPES[name]
    weight, scale = fp8_quantize(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    expected = fp8_gemm_ref(x, Fp8Weight(weight, scale))
    assert_close(fp8_gemm(x, Fp8Weight(weight, scale)), expected, dtype)
    assert_close(fp8_linear(x, Fp8Weight(weight, scale)), expected, dtype)    # bf16 past FUSED_ROWS: _scaled_mm


def test_awq_repacking_matches_the_gptq_layout():
    """An AWQ qweight [K, N/8] unpacked in AWQ's order and packed along K is the GPTQ word layout the kernel reads."""
    values = torch.randint(0, 16, (4096, 512), device="cuda")
    awq = pack_int4(values, 1, AWQ_ORDER)
    assert torch.equal(pack_int4(unpack_int4(awq, 1, AWQ_ORDER), 0), pack_int4(values, 0))


# ---- float32 greedy parity on a 7B-shaped model ---------------------------------------------------------

FORMATS = {"gptq": ("gptq", True), "awq": ("awq", False), "fp8": ("fp8", False)}


@pytest.fixture(scope="module")
def quantized_pairs(tmp_path_factory):
    """(quantized dir, dequantized float32 twin dir) per format, from random Llama-2-7B-shaped checkpoints."""
    root = tmp_path_factory.mktemp("quantized")
    layers = int(os.environ.get("QUANT_LAYERS", 4))
    pairs = {}
    for name, (quantize, desc_act) in FORMATS.items():
        quantized = write_random_checkpoint(root / name, "llama-2-7b", dtype="float32", device="cuda",
                                            num_layers=layers, quantize=quantize, desc_act=desc_act)
        pairs[name] = (quantized, dequantized_twin(quantized, root / f"{name}_dequantized",
                                                   quant_config(quantize, desc_act=desc_act)))
    yield pairs
    shutil.rmtree(root, ignore_errors=True)


def dequantized_twin(quantized, twin, q: QuantConfig):
    """The quantized checkpoint's linear layers dequantized to float32, saved as a plain checkpoint."""
    twin.mkdir()
    for item in quantized.iterdir():
        if not item.name.startswith("model") and item.is_file():
            shutil.copy(item, twin / item.name)
    config = json.loads((quantized / "config.json").read_text())
    config.pop("quantization_config")
    (twin / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for shard in sorted(quantized.glob("*.safetensors")):
        tensors.update(load_file(str(shard), device="cuda"))
    dense, modules = {}, {n.rsplit(".", 1)[0] for n in tensors if n.endswith((".qweight", ".weight_scale"))}
    for module in modules:
        parts = {n.rsplit(".", 1)[1]: tensors.pop(n) for n in list(tensors) if n.rsplit(".", 1)[0] == module}
        dense[module + ".weight"] = dequantize_linear(parts, q).cpu()
    dense.update({n: t.float().cpu() for n, t in tensors.items()})
    save_file(dense, str(twin / "model.safetensors"), metadata={"format": "pt"})
    return twin


def fp8_reference(model_dir, all_prompts, new_tokens):
    """transformers' float32 twin with FP8-rounded linear inputs (tests.quant_models), greedy."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cuda")
    fake_quantize_activations(model)
    runs = greedy_runs(model, all_prompts, new_tokens)
    del model
    release_memory()
    return runs


@pytest.mark.parametrize("name", list(FORMATS))
def test_float32_greedy_tokens_equal_transformers_on_the_dequantized_twin(name, quantized_pairs):
    """4-bit: the same float32 weights, tokens identical. FP8: float32 sums in another order can round a
    linear input that sits on an FP8 rounding boundary the other way, so as for bf16 (tests/gpu/greedy.py)
    the runs may part only at a near-tie."""
    quantized, twin = quantized_pairs[name]
    all_prompts = prompts()[:2]
    new_tokens = 32
    if name == "fp8":
        ref = fp8_reference(str(twin), all_prompts, new_tokens)
    else:
        ref = transformers_greedy(str(twin), torch.float32, all_prompts, new_tokens=new_tokens)
    ours = engine_greedy(all_prompts, new_tokens=new_tokens, model_dir=str(quantized), dtype="float32")
    print(f"\n{name}: " + describe(ours, ref, "ours fp32", "transformers fp32"))
    if name == "fp8":
        assert [near_tie_problem(a, b, "ours", "transformers") for a, b in zip(ours, ref)] == [None] * len(ours)
    else:
        assert [g.tokens for g in ours] == [g.tokens for g in ref]


@pytest.mark.parametrize("name", ["gptq", "awq"])
def test_bfloat16_4bit_greedy_tokens_are_close_to_transformers_on_the_dequantized_twin(name, quantized_pairs):
    """bfloat16, the two prompts batched (batch-2 decode: the integer walk on every projection) and each alone
    (batch 1: on gate_up and down), x rounded to 15-bit integers a tile: transformers bfloat16 on the dequantized
    twin, parting only at a near-tie."""
    quantized, twin = quantized_pairs[name]
    all_prompts = prompts()[:2]
    ref = transformers_greedy(str(twin), torch.bfloat16, all_prompts, new_tokens=32)
    batch, alone = engine_greedy_batch_and_alone(all_prompts, new_tokens=32, model_dir=str(quantized),
                                                 dtype="bfloat16")
    for label, ours in (("batched", batch), ("alone", alone)):
        print(f"\n{name} {label}: " + describe(ours, ref, "ours bf16", "transformers bf16"))
        assert [near_tie_problem(a, b, "ours", "transformers") for a, b in zip(ours, ref)] == [None] * len(ours)


# ---- Phi-3 (fused packed tensors) and StarCoder2 (biases, GeLU MLP) through the GPU kernels ---------------

FAMILY_FORMATS = [("phi3", "gptq_act_order"), ("phi3", "awq_g16"), ("phi3", "fp8_tensor"),
                  ("starcoder2", "awq_g32"), ("starcoder2", "gptq_g32"), ("starcoder2", "fp8_channel")]


@pytest.mark.parametrize("family,fmt", FAMILY_FORMATS)
def test_phi3_and_starcoder2_quantized_greedy_tokens_equal_transformers(family, fmt, tmp_path):
    """Tiny checkpoints (tests.quant_models) through the Triton GEMMs on the GPU, float32: Phi-3's parts cut
    from its fused packed tensors, StarCoder2's biased layers. Prompt + generation stay under Phi-3's
    original context (64), where transformers uses the short rope factors as we do."""
    quantized, twin = save_quantized_pair(fmt, tmp_path, family=family)
    generator = torch.Generator().manual_seed(1)
    all_prompts = [torch.randint(3, 384, (n,), generator=generator).tolist() for n in (7, 30)]
    new_tokens = 24
    if fmt.startswith("fp8"):
        ref = fp8_reference(str(twin), all_prompts, new_tokens)
    else:
        ref = transformers_greedy(str(twin), torch.float32, all_prompts, new_tokens=new_tokens)
    ours = engine_greedy(all_prompts, new_tokens=new_tokens, model_dir=str(quantized), dtype="float32")
    print(f"\n{family} {fmt}: " + describe(ours, ref, "ours fp32", "transformers fp32"))
    if fmt.startswith("fp8"):
        assert [near_tie_problem(a, b, "ours", "transformers") for a, b in zip(ours, ref)] == [None] * len(ours)
    else:
        assert [g.tokens for g in ours] == [g.tokens for g in ref]
