"""The quantized KV cache at tensor parallelism 2 (gloo on the CPU): each shard stores and reads only its own
KV heads, so two shards give one shard's greedy tokens and logprobs with the same --kv-cache-dtype (int8: the
per-token, per-head scales stay on the shard of their head; fp8: every shard uses the checkpoint's per-tensor
K and V scales of each layer, which are the same for all of a layer's heads).

``generate`` (tests/unit/test_tensor_parallel.py): four prompts, one of 37 tokens prefilled in 16-token chunks,
16 new tokens each, as (token, logprob), compared by ``same_outputs``: the tokens exactly, the logprobs within
its tolerance (two shards' float32 sums in another order). A shard with a wrong scale or dtype moves them by far
more."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.router.process import ShardFailure
from tests.tiny_models import save_tiny_model
from tests.unit.test_tensor_parallel import far, generate, same_outputs


def with_kv_scales(model, path, scales: dict):
    """A copy of the checkpoint ``model`` in ``path`` with the KV scale tensors ``scales`` (name: value) added."""
    shutil.copytree(model, path)
    tensors = load_file(str(model / "model.safetensors"))
    tensors.update({name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def changed(a, b) -> int:
    """How many of the generated (token, logprob) pairs differ (``far``) between two ``generate`` outputs."""
    return sum(far(x, y) for i in a for x, y in zip(a[i], b[i]))


@pytest.mark.parametrize("family,kv", [("llama3", "fp8_e4m3fn"), ("llama3", "int8"), ("qwen2", "fp8_e4m3fn")])
def test_two_shards_with_a_quantized_cache_give_one_shards_tokens_and_logprobs(family, kv, tmp_path):
    """llama3: 2 KV heads, one on each shard; qwen2: its one KV head replicated on both. The quantized cache
    changes the outputs (the dtype reached the cache), the same way on one shard and on two."""
    path = save_tiny_model(family, tmp_path / family)
    one = generate(path, 1, kv_cache_dtype=kv)
    assert same_outputs(generate(path, 2, kv_cache_dtype=kv), one)
    assert changed(one, generate(path, 1)) > 0


# vLLM / llm-compressor names in layer 0, AutoFP8's one kv_scale in layer 1; values far from 1.0 and from powers
# of two: K and V divided by them land on another fp8 grid, and the small ones clamp the largest values
CHECKPOINT_SCALES = {"model.layers.0.self_attn.k_scale": 0.37, "model.layers.0.self_attn.v_scale": 0.0061,
                     "model.layers.1.self_attn.kv_scale": 0.013}


def test_two_shards_use_the_checkpoints_fp8_kv_scales_as_one_shard_does(tmp_path):
    """Per-tensor scales hold for every head of a layer: each shard reads them and divides its own KV heads by
    them (a shard that kept 1.0, or used another layer's or the other tensor's scale, gives other outputs). The
    scales change the outputs against the same weights without them, so they are not a no-op here."""
    plain = save_tiny_model("llama3", tmp_path / "llama3")
    scaled = with_kv_scales(plain, tmp_path / "scaled", CHECKPOINT_SCALES)
    one = generate(scaled, 1, kv_cache_dtype="fp8_e4m3fn")
    assert same_outputs(generate(scaled, 2, kv_cache_dtype="fp8_e4m3fn"), one)
    assert changed(one, generate(plain, 1, kv_cache_dtype="fp8_e4m3fn")) > 0


def test_per_head_kv_scales_are_refused_on_every_shard_not_applied_unsliced(tmp_path):
    """A checkpoint with one K and V scale per KV head (shape [num_kv_heads]) is not read as per-tensor scales,
    nor handed whole to shards that hold half of the heads: two shards fail at startup with the loader's message."""
    plain = save_tiny_model("llama3", tmp_path / "llama3")            # 2 KV heads
    scaled = with_kv_scales(plain, tmp_path / "per_head", {"model.layers.0.self_attn.k_scale": [0.5, 0.25],
                                                            "model.layers.0.self_attn.v_scale": [0.5, 0.25]})
    with pytest.raises(ShardFailure, match=r"model\.layers\.0\.self_attn\.k_scale holds \[0\.5, 0\.25\]; a KV scale "
                                           r"must be one positive finite number"):
        generate(scaled, 2, kv_cache_dtype="fp8_e4m3fn")
