"""From TGI's launcher flags to the processes to start: the launcher's plan.

``plan_server`` resolves the weights, checks the checkpoint and every limit before any
process starts (a ValueError names what is wrong), turns the flags into the engine's
``EngineConfig`` (the engine decides the rest in ``engine.assembly.plan_engine``, the same
path the in-process ``Engine`` takes) and returns a ``ServerPlan`` whose ``start()`` spawns
the shards, the router and the front end, in that order.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.assembly import EngineConfig, EnginePlan, plan_engine
from engine.processes import LogSetup, process_context, spawn_router, spawn_shards, start_process

from .frontend_group import FrontendGroup, auto_frontend_processes
from .frontend_process import FrontendSpec, frontend_main
from .launch_config import (ARRIVAL_WINDOW_S, STALL_FREE_ROW_TOKENS, STALL_FREE_TOKENS, LaunchConfig, Limits,
                            resolve_limits, resolve_num_shard)

log = logging.getLogger("launcher")


@dataclass(frozen=True)
class ServerPlan:
    engine: EnginePlan
    frontend: FrontendSpec
    log_level: LogSetup = LogSetup()        # how every process logs (--log-level, --json-output)

    def start(self, group: FrontendGroup) -> list:
        """Spawn the shards, the router and the front ends (``group``: what they share), wired with pipes;
        in that order."""
        processes, router_ends = spawn_shards(self.engine, self.log_level)
        pipes = [process_context().Pipe(duplex=True) for _ in range(group.count)]
        router = spawn_router(self.engine, [router_end for router_end, _ in pipes], router_ends, self.log_level)
        frontends = []
        for index, (_, front_end) in enumerate(pipes):
            member = group.member(index)
            frontends.append(start_process(frontend_main, (self.frontend, front_end, self.log_level, member),
                                           member.process_name))
        return processes + [router] + frontends

    def frontend_group(self) -> FrontendGroup:
        return FrontendGroup(self.frontend.processes, process_context())


def plan_server(config: LaunchConfig) -> ServerPlan:
    """From the launcher's config to the processes to start; ValueError on any bad input."""
    from engine.models import load_model_config
    from weights.hub import model_info, resolve_model

    offline = _offline(config)
    log.info("resolving the weights of %s%s", config.model_id, " (offline: the hub cache only)" if offline else "")
    model_dir = str(resolve_model(config.model_id, config.revision, config.huggingface_hub_cache, config.hf_token,
                                  offline=offline))
    model_dir, heads_dir = _resolve_medusa(config, model_dir, offline)
    model_config = load_model_config(model_dir, rope_scaling=config.rope, quantize=config.quantize)
    log.info("checking the checkpoint in %s", model_dir)
    _check_checkpoint(model_dir, model_config)
    _check_tokenizer_files(model_dir)
    _check_tokenizer_config(config.tokenizer_config_path)
    limits = resolve_limits(config, model_config.max_context, None)
    engine = plan_engine(engine_config(config, limits, model_dir, heads_dir))
    _check_master_address(config.master_addr, config.master_port, engine.num_shards)
    sha, pipeline_tag = model_info(config.model_id, config.revision, config.hf_token, offline=offline)
    frontend = FrontendSpec(model_dir, config.hostname, config.port, _settings(config, limits, sha, pipeline_tag, engine),
                            config.tokenizer_config_path, config.frontend_processes or auto_frontend_processes())
    return ServerPlan(engine, frontend, LogSetup(config.log_level or "INFO", config.json_output))


def _offline(config: LaunchConfig) -> bool | None:
    """--hf-hub-offline for the hub code: True, or None to leave it to huggingface_hub (HF_HUB_OFFLINE)."""
    return True if config.hf_hub_offline else None


def _resolve_medusa(config: LaunchConfig, model_dir: str, offline: bool | None) -> tuple[str, str | None]:
    """(the model's directory, the Medusa heads' directory or None). A --model-id of Medusa heads (TGI's
    way: config.json's ``medusa_num_heads`` and ``base_model_name_or_path``) serves the base model they
    name (resolved like --model-id, at its default revision) with the heads drafting; with
    ``--speculate 0`` the heads are not loaded."""
    from engine.models.medusa import is_medusa_dir, read_medusa_config
    from weights.hub import resolve_model

    if not is_medusa_dir(model_dir):
        return model_dir, None
    medusa = read_medusa_config(model_dir)
    if medusa.base_model is None:
        raise ValueError(f"{config.model_id} holds Medusa heads but its config.json names no "
                         f"base_model_name_or_path: add the id or path of the model the heads were trained on")
    log.info("%s holds %d Medusa heads for %s: resolving the base model", config.model_id, medusa.num_heads,
             medusa.base_model)
    beside = Path(model_dir) / medusa.base_model        # a relative path: beside the heads first (weights/demo/medusa)
    where = str(beside) if not Path(medusa.base_model).is_absolute() and beside.is_dir() else medusa.base_model
    base = str(resolve_model(where, None, config.huggingface_hub_cache, config.hf_token, offline=offline))
    if config.speculate == 0:
        log.info("--speculate 0: the Medusa heads are not loaded")
        return base, None
    return base, model_dir


def speculate_drafts(config: LaunchConfig, heads_dir: str | None) -> int:
    """--speculate, or without it the Medusa heads' count (TGI's default), else 0."""
    if config.speculate is not None:
        return config.speculate
    if heads_dir is not None:
        from engine.models.medusa import read_medusa_config

        return read_medusa_config(heads_dir).num_heads
    return 0


def engine_config(config: LaunchConfig, limits: Limits, model_dir: str, heads_dir: str | None = None) -> EngineConfig:
    """TGI's flags as the engine's settings (what the engine derives itself stays unset)."""
    watermark = {"watermark_gamma": config.watermark_gamma, "watermark_delta": config.watermark_delta}
    speculate = speculate_drafts(config, heads_dir)
    return EngineConfig(
        model_dir=model_dir, dtype=config.dtype, kernel_backend="torch" if config.disable_custom_kernels else None,
        max_requests=config.max_batch_size or min(config.max_concurrent_requests * config.max_best_of, 1024),
        max_seq_len=limits.max_total_tokens, num_slots=limits.max_batch_total_tokens,
        memory_fraction=0.9 * config.cuda_memory_fraction, max_prefill_tokens=limits.max_batch_prefill_tokens,
        stall_free_tokens=STALL_FREE_TOKENS if config.max_batch_prefill_tokens is None else None,
        stall_free_row_tokens=STALL_FREE_ROW_TOKENS if config.max_batch_prefill_tokens is None else 0,
        waiting_served_ratio=config.waiting_served_ratio, max_waiting_steps=config.max_waiting_tokens,
        admission=config.admission, cuda_graphs=config.cuda_graphs, prefix_caching=config.prefix_caching,
        num_shards=resolve_num_shard(config, _visible_gpus()), master_addr=config.master_addr,
        master_port=config.master_port, rope_scaling=config.rope, step_timeout_s=config.step_timeout,
        kv_cache_dtype=config.kv_cache_dtype, quantize=config.quantize,
        speculate=speculate, draft_heads=heads_dir, arrival_window_s=0.0 if speculate else ARRIVAL_WINDOW_S,
        **{k: v for k, v in watermark.items() if v is not None})


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_checkpoint(model_dir: str, model_config) -> None:
    """Strict name and shape check before any process starts (reads the headers only)."""
    from engine.models import check_checkpoint
    from weights.checkpoint import open_checkpoint

    with open_checkpoint(model_dir) as checkpoint:
        check_checkpoint(checkpoint, model_config)


# Files one of which a tokenizer that transformers loads comes from (fast, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model", "tiktoken.model")


def _check_tokenizer_files(model_dir: str) -> None:
    """A model without any tokenizer file is refused before a process starts (the front end would fail
    only once the shards were loading the weights)."""
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): the server needs "
                         f"the model's tokenizer; use a repository that ships one, or copy tokenizer.json and "
                         f"tokenizer_config.json of the base model into it")


def _check_tokenizer_config(path: str | None) -> None:
    """--tokenizer-config-path must name a readable JSON object (it is read again by the front end)."""
    import json
    from pathlib import Path

    if path is None:
        return
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer-config-path {path!r} cannot be read as JSON ({e}); point it at a "
                         f"tokenizer_config.json") from None
    if not isinstance(value, dict):
        raise ValueError(f"--tokenizer-config-path {path!r} holds a JSON {type(value).__name__}, not an object "
                         f"like tokenizer_config.json")


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


def _settings(config: LaunchConfig, limits: Limits, sha, pipeline_tag, engine: EnginePlan):
    from tgi_compat.settings import ServerSettings

    return ServerSettings(
        model_id=config.model_id, model_sha=sha, model_pipeline_tag=pipeline_tag,
        max_input_tokens=limits.max_input_tokens, max_total_tokens=limits.max_total_tokens,
        max_concurrent_requests=config.max_concurrent_requests, max_best_of=config.max_best_of,
        max_stop_sequences=config.max_stop_sequences, max_top_n_tokens=config.max_top_n_tokens,
        max_client_batch_size=config.max_client_batch_size, validation_workers=config.validation_workers,
        api_key=config.api_key, payload_limit=config.payload_limit,
        disable_grammar_support=config.disable_grammar_support,
        model_dtype=str(engine.worker.dtype).removeprefix("torch."), model_device_type=engine.worker.device.type,
        num_shards=engine.num_shards,
        max_batch_total_tokens=limits.max_batch_total_tokens, waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens, max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
        cors_allow_origin=config.cors_allow_origin, stream_shutdown_grace_s=config.graceful_termination_timeout,
        otlp_endpoint=config.otlp_endpoint,
        otlp_service_name=config.otlp_service_name,
        kv_cache_dtype=config.kv_cache_dtype,
    )
