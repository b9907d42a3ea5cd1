"""The one composition path: a frozen ``EngineConfig`` -> an ``EnginePlan`` -> a running router.

    plan = plan_engine(EngineConfig(model_dir=...))      # every decision, made once
    shards, capacity = start_local_shard(plan)            # or start_shard_processes(plan)
    router = build_router(plan, shards, capacity)

``plan_engine`` decides what both the in-process ``engine.generation.Engine`` and the
server's router process (``engine.router.process``) need: the model config (with any rope
scaling override), the device, dtype and kernel backend, the shard count, the EOS ids
(config.json's and generation_config.json's), the worker's and the scheduler's configs.
Neither composes the engine any other way.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models import family_for, load_model_config
from engine.models.config import ModelConfig
from engine.models.medusa import check_head_count, is_medusa_dir, open_heads, read_medusa_config
from engine.models.parallel import TensorParallel
from engine.models.rope import plain_rope_length
from engine.ops import BACKENDS, default_backend
from engine.router.allocator import SlotAllocator
from engine.router.router import Router
from engine.router.scheduler import SchedulerConfig, Scheduler, largest_step_tokens
from engine.worker.kv_cache import KVCache, kv_cache_dtype
from engine.worker.model_worker import WorkerConfig, resolve_dtype
from kernels.context_attention import BUCKET as CONTEXT_BUCKET
from kernels.context_attention import PIECE as CONTEXT_PIECE
from kernels.prefill_attention import prefill_launch, tile_shape
from weights.checkpoint import MEDUSA_FILE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: str | None = None              # float16 | bfloat16 | float32; None: the device's default
    device: str | None = None             # None: cuda if available else cpu
    kernel_backend: str | None = None     # triton | torch; None: engine.ops.default_backend
    max_requests: int = 256               # request rows (the largest running batch)
    max_seq_len: int | None = None        # prompt + new tokens of one request; None: the model's context
    num_slots: int | None = None          # KV capacity in tokens; None: sized from free memory
    memory_fraction: float = 0.9          # of the memory free after the weights and the warm-up (CUDA)
    max_prefill_tokens: int = 4096        # tokens per step: decode rows, then prompt chunks (longer ones chunked)
    stall_free_tokens: int | None = None  # while requests decode, cap the prompt chunks' cost (scheduler); None: off
    stall_free_row_tokens: int = 0        # with it: each decoding request adds this to the cap (scheduler)
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 20
    admission: str = "peak"               # peak (LightLLM's rule) | reserve (TGI-style)
    cuda_graphs: tuple[int, ...] | None = None   # decode batch sizes to capture (None: defaults; (): eager)
    num_shards: int | None = 1            # tensor-parallel shards; None: every visible GPU (1 on a CPU)
    master_addr: str = "localhost"
    master_port: int = 29500
    rope_scaling: tuple[str, float] | None = None   # (linear | dynamic, factor) over the checkpoint's
    step_timeout_s: float | None = None   # server watchdog: no step result for this long -> unhealthy
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    prefix_caching: bool = True           # reuse cached prompt prefixes' KV (engine.router.prefix_cache)
    kv_cache_dtype: str | None = None     # int8 | fp8_e4m3fn | fp8_e5m2 (engine.worker.kv_cache); None: dtype
    quantize: str | None = None           # --quantize: fp8 quantizes a float checkpoint at load; gptq / awq /
                                          # compressed-tensors must match its quantization_config (read anyway)
    speculate: int = 0                    # draft tokens per verify row (engine.router.scheduler); 0: off
    draft_heads: str | None = None        # a directory of Medusa heads for model_dir (engine.models.medusa): they
                                          # draft instead of n-gram lookup; speculate picks the first heads
    arrival_window_s: float = 0.0         # requests came this recently: a prompt step in flight is collected before
                                          # the next is planned (engine.router.router); 0: always pipelined
    # (bucket, piece): prompt chunks of ``piece``+ tokens behind ``bucket``+ keys attend to their context through
    # cuDNN where it applies (kernels.context_attention); None: the prefill kernel walks every key
    context_attention: tuple[int, int] | None = (CONTEXT_BUCKET, CONTEXT_PIECE)


@dataclass(frozen=True)
class EnginePlan:
    """Everything decided from an ``EngineConfig``; picklable, so the router process gets it whole."""
    config: EngineConfig
    model_config: ModelConfig
    worker: WorkerConfig
    scheduler: SchedulerConfig
    eos_token_ids: tuple[int, ...]
    num_shards: int

    @property
    def max_requests(self) -> int:
        return self.config.max_requests


def check_context_attention(value) -> None:
    """ValueError unless ``EngineConfig.context_attention`` is None or (bucket, piece), two positive ints: a value
    the worker would otherwise set aside unread on a device where the path does not apply."""
    if value is None:
        return
    if not (isinstance(value, tuple) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"context_attention must be None (off) or (bucket, piece), two positive ints: the keys a "
                         f"cuDNN call takes come in multiples of bucket, its queries in pieces; got {value!r}")


def plan_engine(config: EngineConfig) -> EnginePlan:
    """Decide every engine setting once; ValueError (with what to change) on any that cannot work."""
    if is_medusa_dir(config.model_dir):
        raise ValueError(f"{config.model_dir} holds Medusa heads, not a model: give the model they were trained on "
                         f"as model_dir and this directory as draft_heads (the launcher does so for --model-id)")
    model_config = load_model_config(config.model_dir, rope_scaling=config.rope_scaling, quantize=config.quantize)
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    num_shards = resolve_shards(config.num_shards, device)
    TensorParallel(0, num_shards).check(model_config)
    backend = config.kernel_backend or default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not config.arrival_window_s >= 0:
        raise ValueError(f"arrival_window_s must be >= 0 seconds (0: steps always pipelined), got "
                         f"{config.arrival_window_s!r}")
    check_context_attention(config.context_attention)
    max_seq_len = config.max_seq_len or model_config.max_context
    worker = WorkerConfig(
        model_dir=config.model_dir, dtype=resolve_dtype(config.dtype, model_config, device), device=device,
        kernel_backend=backend, max_requests=config.max_requests, max_seq_len=max_seq_len,
        num_slots=config.num_slots, memory_fraction=config.memory_fraction,
        warmup_tokens=largest_step_tokens(config.max_prefill_tokens, config.max_requests, config.speculate),
        cuda_graphs=config.cuda_graphs,
        watermark_gamma=config.watermark_gamma, watermark_delta=config.watermark_delta,
        kv_cache_dtype=config.kv_cache_dtype, speculate=config.speculate, draft_heads=config.draft_heads,
        context_attention=config.context_attention)
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, worker.dtype)   # a bad name fails here, before any process
    check_draft_heads(config, model_config)
    attention_span, kv_weight_tokens = step_cost_model(model_config, worker.dtype, kv_dtype)
    scheduler = SchedulerConfig(
        max_prefill_tokens=config.max_prefill_tokens, stall_free_tokens=config.stall_free_tokens,
        stall_free_row_tokens=config.stall_free_row_tokens,
        attention_span=attention_span, kv_weight_tokens=kv_weight_tokens,
        attention_tile=attention_tile(model_config, worker),
        waiting_served_ratio=config.waiting_served_ratio, max_waiting_steps=config.max_waiting_steps,
        max_seq_len=max_seq_len, admission=config.admission, prefix_caching=config.prefix_caching,
        speculate=config.speculate, draft_heads=config.draft_heads is not None,
        rope_plain_len=rope_plain_len(model_config, max_seq_len))
    return EnginePlan(config, model_config, worker, scheduler, eos_token_ids(config.model_dir, model_config),
                      num_shards)


def rope_plain_len(model_config: ModelConfig, max_seq_len: int) -> int | None:
    """``SchedulerConfig.rope_plain_len``: the model's ``plain_rope_length`` where requests may outgrow it."""
    plain = plain_rope_length(model_config)
    return plain if plain is not None and max_seq_len > plain else None


# The prefill attention's FLOP rate over the matmuls': bench.prefill_attention_bench on one H100
# (Llama-3.1-8B heads, bf16) measured 340-370 TFLOP/s for whole prompts and 2048-token chunks at
# 32k-100k keys, about half the ~700 TFLOP/s of a bf16 GEMM, and 250-310 for 128-token chunks.
# The scheduler's GPU runs (bench.long_prompt_bench) used 0.6.
ATTENTION_EFFICIENCY = 0.6


def step_cost_model(model_config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                    kv_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(attention_span, kv_weight_tokens) for the scheduler's step budget, from the weight shapes:
    the context length at which a prompt token's attention (4 * heads * head_dim FLOPs per layer
    and position, at ``ATTENTION_EFFICIENCY``) costs as much as its matmuls (2 FLOPs per layer
    weight the token uses: of an MoE layer, its top-k experts), and the context tokens whose KV
    bytes (``KVCache.bytes_per_slot`` in the cache's ``kv_dtype``; None: the model's ``dtype``)
    are as many as those of the weights a decode step reads (all of them: a decode batch's rows
    choose many experts; in ``dtype``, quantized ones in their bits)."""
    c = model_config
    shapes = family_for(c.architecture).checkpoint_shapes(c)
    matrices = {name: math.prod(shape) for name, shape in shapes.items()      # a layer's: its name has the index
                if re.search(r"\.\d+\.", name) and len(shape) == 2}
    q = c.quantization
    layer_bytes = sum(n * (q.bits / 8 if q is not None and q.quantizes(name) else dtype.itemsize)
                      for name, n in matrices.items())
    # a token's matmuls use only its top_k of the num_experts experts (mixture-of-experts families)
    expert_share = getattr(c, "top_k", 1) / max(getattr(c, "num_experts", 1), 1)
    token_weights = sum(n * (expert_share if ".experts." in name else 1) for name, n in matrices.items())
    head_bytes = c.vocab_size * c.hidden_size * dtype.itemsize
    attention_span = int(ATTENTION_EFFICIENCY * token_weights / (2 * c.num_layers * c.num_heads * c.head_dim))
    kv_bytes = KVCache.bytes_per_slot(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype or dtype)
    kv_weight_tokens = int((layer_bytes + head_bytes) // kv_bytes)
    return max(attention_span, 1), max(kv_weight_tokens, 1)


def attention_tile(model_config: ModelConfig, worker: WorkerConfig) -> int:
    """New tokens one program of the prefill attention takes on the worker's device and dtype
    (``kernels.prefill_attention.tile_shape``): 1 with the torch references, which have no tiles."""
    if worker.kernel_backend != "triton":
        return 1
    group = model_config.num_heads // model_config.num_kv_heads
    params = prefill_launch(model_config.head_dim, worker.device, worker.dtype, group)
    return tile_shape(params, group)[1]


def resolve_shards(requested: int | None, device: torch.device) -> int:
    """The shard count: as requested, else every visible GPU (1 on a CPU); never more than the GPUs."""
    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    shards = requested or max(visible, 1)
    if device.type == "cuda" and shards > visible:
        raise ValueError(f"--num-shard {shards} needs {shards} GPUs but {visible} are visible "
                         f"(CUDA_VISIBLE_DEVICES); lower --num-shard")
    return shards


def check_draft_heads(config: EngineConfig, model_config: ModelConfig) -> None:
    """Medusa heads (``draft_heads``) must fit the model and ``speculate`` (headers only, before any process);
    heads the engine was not given are named in a warning."""
    if config.draft_heads is None:
        unused = unused_draft_heads(config.model_dir)
        if unused:
            log.warning("the checkpoint carries draft heads (%s) that this engine does not load; --speculate drafts "
                        "by n-gram lookup in each request's own tokens instead", unused)
        return
    medusa = read_medusa_config(config.draft_heads)
    check_head_count(medusa, config.speculate)
    open_heads(medusa, model_config)[0].close()


def unused_draft_heads(model_dir: str) -> str | None:
    """What marks a model directory as carrying draft heads it is not run with (a Medusa heads file, or
    config.json's ``speculator``: IBM's MLP speculator, which this engine does not load), or None."""
    directory = Path(model_dir)
    marks = [name for name in (MEDUSA_FILE, "medusa_lm_head.pt") if (directory / name).is_file()]
    path = directory / "config.json"
    if path.is_file():
        marks += [f"config.json {key!r}" for key in ("speculator",) if key in json.loads(path.read_text())]
    return ", ".join(marks) or None


def eos_token_ids(model_dir: str, model_config: ModelConfig) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (Llama 3 lists several there)."""
    ids = list(model_config.eos_token_ids)
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)


def start_local_shard(plan: EnginePlan):
    """One in-process worker: (shards, KV capacity)."""
    from engine.router.router import LocalShards
    from engine.worker.model_worker import ModelWorker

    worker = ModelWorker(plan.worker, plan.model_config)
    return LocalShards(worker), worker.num_slots


def build_router(plan: EnginePlan, shards, capacity: int) -> Router:
    """The router over ``shards`` with ``capacity`` KV slots (the minimum over the shards)."""
    allocator = SlotAllocator(capacity, plan.max_requests)
    return Router(Scheduler(allocator, plan.scheduler), shards, plan.eos_token_ids,
                  arrival_window_s=plan.config.arrival_window_s)
