"""The quantized KV cache through the engine: capacity from the real bytes, scales from the checkpoint,
quality on the demo model, chunked prefill and the prefix cache, the kernels against the references."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.kv_quant_quality import PROMPTS, greedy, heldout_loss
from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.worker.kv_cache import KVCache, kv_cache_dtype, read_kv_scales
from tgi_compat.launch_config import LaunchConfig, LaunchError
from tgi_compat.routes import info_json
from tgi_compat.settings import ServerSettings
from weights.checkpoint import open_checkpoint

DEMO = Path(__file__).resolve().parents[2] / "weights" / "demo"
QUANTIZED = ("int8", "fp8_e4m3fn", "fp8_e5m2")


def demo_engine(kv: str | None, backend: str = "torch", **kw) -> Engine:
    settings = {"num_slots": 8192, "max_requests": 16, "max_prefill_tokens": 2048, **kw}
    return Engine(EngineConfig(model_dir=str(DEMO), device="cpu", kernel_backend=backend, kv_cache_dtype=kv,
                               **settings))


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(DEMO)


def test_a_slot_takes_its_real_bytes_and_llama_7b_gets_about_twice_the_slots():
    """Llama-2-7B's shape: 32 layers of 32 KV heads of 128; int8 adds one float32 scale per token and head."""
    bf16 = KVCache.bytes_per_slot(32, 32, 128, torch.bfloat16)
    int8 = KVCache.bytes_per_slot(32, 32, 128, torch.int8)
    fp8 = KVCache.bytes_per_slot(32, 32, 128, torch.float8_e4m3fn)
    assert (bf16, int8, fp8) == (32 * 2 * 32 * 128 * 2, 32 * 2 * 32 * (128 + 4), 32 * 2 * 32 * 128)
    assert bf16 / int8 >= 1.9 and bf16 / fp8 == 2


def test_the_cache_holds_the_dtype_and_the_scales_each_scheme_needs():
    int8 = KVCache(2, 10, 3, 8, 4, 16, torch.float32, "cpu", torch.int8)
    assert int8.kv_buffer.dtype == torch.int8 and int8.layer(1).scales.shape == (11, 6)
    fp8 = KVCache(2, 10, 3, 8, 4, 16, torch.float32, "cpu", torch.float8_e5m2, torch.tensor([[0.5, 2.0], [1, 1]]))
    assert fp8.layer(0).scales.tolist() == [0.5, 2.0] and fp8.layer(1).scales.tolist() == [1.0, 1.0]
    plain = KVCache(2, 10, 3, 8, 4, 16, torch.bfloat16, "cpu")
    assert plain.kv_buffer.dtype == torch.bfloat16 and plain.layer(0).scales is None
    assert kv_cache_dtype(None, torch.float16) == torch.float16
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp4' is not supported; use one of fp8_e4m3fn, "):
        kv_cache_dtype("fp4", torch.float16)


def test_the_launcher_accepts_the_kv_dtypes_and_refuses_others():
    assert LaunchConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(LaunchError, match="--kv-cache-dtype must be one of fp8_e4m3fn, fp8_e5m2, int8"):
        LaunchConfig(kv_cache_dtype="fp8")


def test_info_shows_the_kv_dtype_and_slots():
    settings = ServerSettings("m", 10, 20, kv_cache_dtype="int8")
    info = info_json(settings, {"kv_capacity": 1234})
    assert info["kv_cache_dtype"] == "int8" and info["kv_cache_slots"] == 1234
    plain = info_json(ServerSettings("m", 10, 20, model_dtype="bfloat16"), {"kv_capacity": 617})
    assert plain["kv_cache_dtype"] == "bfloat16" and plain["kv_cache_slots"] == 617


def test_fp8_scales_are_read_from_the_checkpoint_under_each_name(tmp_path):
    layers = {0: {"self_attn.k_scale": 0.5, "self_attn.v_scale": 0.25},      # vLLM / llm-compressor
              1: {"self_attn.kv_scale": 2.0},                                 # older AutoFP8
              2: {"self_attn.k_proj.output_scale": 3.0, "self_attn.v_proj.output_scale": 4.0},
              3: {}}                                                          # none: 1.0
    tensors = {f"model.layers.{i}.{name}": torch.tensor(value) for i, names in layers.items()
               for name, value in names.items()}
    save_file(tensors, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as checkpoint:
        assert read_kv_scales(checkpoint, 4).tolist() == [[0.5, 0.25], [2.0, 2.0], [3.0, 4.0], [1.0, 1.0]]
    save_file({"model.layers.0.self_attn.kv_scale": torch.tensor([0.0])}, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as checkpoint, pytest.raises(ValueError, match="a KV scale must be one positive"):
        read_kv_scales(checkpoint, 1)


def test_quantized_caches_keep_the_demo_models_quality(tokenizer):
    """The held-out loss of the first 8 windows (4,096 tokens): int8 within +0.02 nats of the unquantized
    cache, fp8_e4m3fn within +0.05 (bench.kv_quant_quality measures all of heldout.txt); the greedy tokens
    of the prompts without a near-tie are the same."""
    ids = tokenizer((DEMO / "heldout.txt").read_text())["input_ids"][:4096]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:4]]
    losses, tokens = {}, {}
    for kv in (None, "int8", "fp8_e4m3fn"):
        engine = demo_engine(kv)
        losses[kv], tokens[kv] = heldout_loss(engine, ids), greedy(engine, prompts, 32)[0]
    assert losses["int8"] - losses[None] < 0.02 and losses["fp8_e4m3fn"] - losses[None] < 0.05, losses
    assert losses["int8"] != losses[None]                       # the cache was quantized
    assert tokens["int8"] == tokens[None] and tokens["fp8_e4m3fn"] == tokens[None]


@pytest.mark.parametrize("kv", QUANTIZED)
def test_chunked_prefill_and_the_prefix_cache_give_the_same_tokens(tokenizer, kv):
    """Chunks and cached prefixes only move slots: a prompt prefilled in 16-token chunks, then again
    through the prefix cache, continues as the same prompt prefilled at once."""
    prompt = tokenizer("class Parser:\n    def __init__(self, text):\n        self.text = text\n")["input_ids"]
    once = demo_engine(kv, prefix_caching=False)
    want = [e.token_id for e in once.generate([GenerationRequest(0, prompt, 12, stop_token_ids=[])])[0]]
    chunked = demo_engine(kv, max_prefill_tokens=16)
    for rid in (1, 2):                                         # the second one reuses the cached prefix
        got = [e.token_id for e in chunked.generate([GenerationRequest(rid, prompt, 12, stop_token_ids=[])])[rid]]
        assert got == want, (rid, kv)
    assert chunked.router.scheduler.prefix_cache_status()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3fn"])
def test_the_kernels_generate_what_the_references_do(tokenizer, kv):
    """Triton (the interpreter on the CPU: tests/conftest.py) against the torch references, end to end: the
    prefill, then three decode steps reading the quantized cache."""
    prompt = tokenizer("def parse(")["input_ids"]
    out = {}
    for backend in ("torch", "triton"):
        engine = demo_engine(kv, backend, num_slots=256)
        out[backend] = [e.token_id for e in engine.generate([GenerationRequest(0, prompt, 4, stop_token_ids=[])])[0]]
    assert out["triton"] == out["torch"]


def test_two_shards_with_an_int8_cache_generate_what_one_does(tokenizer):
    """Tensor parallelism: each shard quantizes its own KV heads (int8 scales per head stay local)."""
    from tests.e2e.server import free_port

    prompt = tokenizer("class Parser:\n    def __init__(self")["input_ids"]
    out = {}
    for shards in (1, 2):
        with demo_engine("int8", num_slots=1024, max_requests=4, num_shards=shards, master_port=free_port()) as engine:
            events = engine.generate([GenerationRequest(0, prompt, 12, stop_token_ids=[])])[0]
        out[shards] = [e.token_id for e in events]
    assert out[2] == out[1]
