"""From TGI's launcher flags to the processes to start: the launcher's plan.

``plan_server`` resolves the weights, checks the checkpoint and every limit before any
process starts (a ValueError names what is wrong), and returns a ``ServerPlan`` whose
``start()`` spawns the shards, the router and the front end, in that order.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.processes import spawn_context, spawn_router, spawn_shards
from engine.router.process import RouterSpec
from engine.worker.process import ShardSpec

from .frontend_process import FrontendSpec, frontend_main


@dataclass(frozen=True)
class ServerPlan:
    shards: tuple[ShardSpec, ...]
    router: RouterSpec
    frontend: FrontendSpec
    log_level: str = "INFO"

    def start(self) -> list:
        """Spawn the shards, the router and the front end, wired with pipes; in that order."""
        ctx = spawn_context()
        processes, router_ends = spawn_shards(self.shards, self.log_level)
        front_router, front_end = ctx.Pipe(duplex=True)
        router = spawn_router(self.router, front_router, router_ends, self.log_level)
        frontend = ctx.Process(target=frontend_main, args=(self.frontend, front_end, self.log_level), name="frontend")
        frontend.start()
        return processes + [router, frontend]


def plan_server(config) -> ServerPlan:
    """From the launcher's config to the processes to start; ValueError on any bad input."""
    import torch

    from engine.models.config import load_model_config
    from engine.models.parallel import TensorParallel
    from engine.worker.model_worker import resolve_dtype
    from tgi_compat.launch_config import resolve_limits
    from weights.hub import model_info, resolve_model

    model_dir = str(resolve_model(config.model_id, config.revision, config.huggingface_hub_cache, config.hf_token))
    model_config = load_model_config(model_dir)
    _check_checkpoint(model_dir, model_config)
    limits = resolve_limits(config, model_config.max_context, None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_shards = _num_shards(config, device)
    TensorParallel(0, num_shards).check(model_config)
    _check_master_address(config.master_addr, config.master_port, num_shards)
    dtype = resolve_dtype(config.dtype, model_config, device)
    max_requests = config.max_batch_size or min(config.max_concurrent_requests * config.max_best_of, 1024)
    worker = _worker_config(config, limits, model_dir, dtype, device, max_requests)
    shards = tuple(ShardSpec(rank, num_shards, config.master_addr, config.master_port, worker)
                   for rank in range(num_shards))
    router = _router_spec(config, limits, max_requests, _eos_ids(model_dir, model_config))
    sha, pipeline_tag = model_info(config.model_id, config.revision)
    settings = _settings(config, limits, sha, pipeline_tag, dtype, device, num_shards)
    return ServerPlan(shards, router, FrontendSpec(model_dir, config.hostname, config.port, settings),
                      config.log_level or "INFO")


def _check_checkpoint(model_dir: str, model_config) -> None:
    """Strict name and shape check before any process starts (reads the headers only)."""
    from engine.models.llama import IGNORED_CHECKPOINT_NAMES, checkpoint_shapes
    from weights.checkpoint import open_checkpoint

    with open_checkpoint(model_dir) as checkpoint:
        checkpoint.check(checkpoint_shapes(model_config), ignore_unexpected=IGNORED_CHECKPOINT_NAMES)


def _worker_config(config, limits, model_dir, dtype, device, max_requests):
    from engine.worker.model_worker import WorkerConfig
    from tgi_compat.launch_config import cuda_graph_sizes

    watermark = {"watermark_gamma": config.watermark_gamma, "watermark_delta": config.watermark_delta}
    return WorkerConfig(model_dir=model_dir, dtype=dtype, device=device,
                        kernel_backend="triton" if device.type == "cuda" else "torch",
                        max_requests=max_requests, max_seq_len=limits.max_total_tokens,
                        num_slots=limits.max_batch_total_tokens, memory_fraction=0.9 * config.cuda_memory_fraction,
                        warmup_tokens=limits.max_batch_prefill_tokens, cuda_graphs=cuda_graph_sizes(config),
                        **{k: v for k, v in watermark.items() if v is not None})


def _router_spec(config, limits, max_requests, eos_ids) -> RouterSpec:
    from engine.router.scheduler import SchedulerConfig

    scheduler = SchedulerConfig(
        max_prefill_tokens=limits.max_batch_prefill_tokens, waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_steps=config.max_waiting_tokens, max_seq_len=limits.max_total_tokens,
        admission=config.admission)
    return RouterSpec(max_requests=max_requests, scheduler_config=scheduler, eos_token_ids=eos_ids,
                      max_batch_total_tokens=limits.max_batch_total_tokens)


def _num_shards(config, device) -> int:
    """--num-shard, else every visible GPU (1 on a CPU); more shards than GPUs is an error."""
    import torch

    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    shards = config.num_shard or max(visible, 1)
    if config.sharded is False and shards > 1:
        raise ValueError(f"--sharded false contradicts --num-shard {shards}")
    if config.sharded and shards < 2:
        raise ValueError("--sharded true needs at least 2 shards: set --num-shard or make more GPUs visible")
    if device.type == "cuda" and shards > visible:
        raise ValueError(f"--num-shard {shards} needs {shards} GPUs but {visible} are visible "
                         f"(CUDA_VISIBLE_DEVICES); lower --num-shard")
    return shards


def _check_master_address(host: str, port: int, num_shards: int) -> None:
    """Fail fast on a master address that does not resolve (the shards would wait for it)."""
    import socket

    if num_shards < 2:
        return
    try:
        socket.getaddrinfo(host, port)
    except OSError as e:
        raise ValueError(f"--master-addr {host!r} cannot be resolved ({e}); use an address of this host, "
                         f"e.g. localhost") from None


def _eos_ids(model_dir: str, model_config) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (Llama 3 lists several there)."""
    import json
    from pathlib import Path

    ids = list(model_config.eos_token_ids)
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)


def _settings(config, limits, sha, pipeline_tag, dtype, device, num_shards):
    from tgi_compat.settings import ServerSettings

    return ServerSettings(
        model_id=config.model_id, model_sha=sha, model_pipeline_tag=pipeline_tag,
        max_input_tokens=limits.max_input_tokens, max_total_tokens=limits.max_total_tokens,
        max_concurrent_requests=config.max_concurrent_requests, max_best_of=config.max_best_of,
        max_stop_sequences=config.max_stop_sequences, max_top_n_tokens=config.max_top_n_tokens,
        max_client_batch_size=config.max_client_batch_size, validation_workers=config.validation_workers,
        api_key=config.api_key, payload_limit=config.payload_limit,
        disable_grammar_support=config.disable_grammar_support,
        model_dtype=str(dtype).removeprefix("torch."), model_device_type=device.type, num_shards=num_shards,
        max_batch_total_tokens=limits.max_batch_total_tokens, waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens, max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
    )
