"""The server's processes and their lifecycle (spawned by ``launcher.py``).

    supervisor (launcher) --spawn--> shard 0..N-1   (ModelWorker; torch.distributed when N > 1)
                          --spawn--> router         (Router: scheduler + allocator + step loop)
                          --spawn--> front end      (uvicorn + tgi_compat), binds its port only
                                                    after the router reported every shard Ready
Pipes (multiprocess, spawn context, msgpack via engine.ipc):
    front end <-> router : GenerationRequest / Abort  ->   <- Events / RouterStatus
    router <-> shard r   : Step / Shutdown  ->             <- Ready, ShardError; StepResult (rank 0)
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from .ipc import Events, Ready, RouterStatus, ShardError, Shutdown, decode, encode
from .step import Abort, GenerationRequest, Step, StepResult, TokenEvent

log = logging.getLogger("engine.server")

STATUS_INTERVAL_S = 0.25          # the router's status (health, queue, batch, KV) at least this often
STATUS_CHANGE_S = 0.01            # and within this long after it changed (what /metrics shows)
RENDEZVOUS_S = 60


class ShardFailure(RuntimeError):
    """A shard died or reported an error; the message names the rank and cause."""


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    worker_config: object          # engine.worker.WorkerConfig


# ---- shard process -------------------------------------------------------------------

def shard_main(spec: ShardSpec, conn, log_level: str = "INFO") -> None:
    _child_setup(log_level)
    try:
        from .parallel import TensorParallel
        from .worker import ModelWorker

        worker_config = _join_group(spec)
        worker = ModelWorker(worker_config, tp=TensorParallel(spec.rank, spec.world_size))
        conn.send_bytes(encode(Ready(spec.rank, worker.num_slots)))
        log.info("shard %d ready: %d KV slots", spec.rank, worker.num_slots)
        serve_steps(worker, conn, reply=spec.rank == 0)
    except (EOFError, KeyboardInterrupt):
        return
    except BaseException as e:
        log.error("shard %d failed: %s: %s", spec.rank, type(e).__name__, e)
        try:
            conn.send_bytes(encode(ShardError(spec.rank, f"{type(e).__name__}: {e}")))
        except OSError:
            pass
        os._exit(1)


def serve_steps(worker, conn, reply: bool) -> None:
    """Run Steps until Shutdown; one StepResult per Step, in order (rank 0 only).

    A step's result goes out as soon as the next Step has been launched behind it (the
    device never waits for the router), or as soon as it is done if no Step came first.
    """
    launched = None                 # the newest launched step whose result is not sent yet
    while True:
        if launched is not None and not _next_step_first(conn, launched):
            _reply(conn, launched, reply)
            launched = None
            continue
        message = decode(conn.recv_bytes())
        if isinstance(message, Shutdown):
            return
        newer = worker.launch(message)
        if launched is not None:
            _reply(conn, launched, reply)
        launched = newer


def _next_step_first(conn, launched) -> bool:
    """Wait until a message arrives (True) or the launched step is done on the device (False)."""
    while True:
        if conn.poll(0):
            return True
        if launched.ready():
            return False


def _reply(conn, launched, reply: bool) -> None:
    result = launched.result()
    if reply:
        conn.send_bytes(encode(result))


def _join_group(spec: ShardSpec):
    """Pick this rank's device and join torch.distributed (NCCL on GPUs, gloo on the CPU)."""
    from dataclasses import replace
    from datetime import timedelta

    import torch

    config = spec.worker_config
    if config.device.type == "cuda":
        torch.cuda.set_device(spec.rank)
        config = replace(config, device=torch.device("cuda", spec.rank))
    else:
        _limit_cpu_threads(spec.world_size)
    if spec.world_size > 1:
        backend = "nccl" if config.device.type == "cuda" else "gloo"
        address = f"tcp://{spec.master_addr}:{spec.master_port}"
        try:
            torch.distributed.init_process_group(backend, init_method=address, rank=spec.rank,
                                                 world_size=spec.world_size, timeout=timedelta(seconds=RENDEZVOUS_S))
        except Exception as e:
            raise RuntimeError(f"shard {spec.rank} could not join the group at {address} "
                               f"(--master-addr/--master-port) within {RENDEZVOUS_S} s: {e}") from None
    return config


def _limit_cpu_threads(world_size: int) -> None:
    """CPU shards share the cores and leave one to the router and the front end: OpenMP
    threads that outnumber the free cores spin-wait on each other (measured on 2 cores:
    24 demo tokens in 2.7-3.6 s with 2 threads, 0.2 s with 1). OMP_NUM_THREADS wins."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, (cores - 1) // world_size))


class PipeShards:
    """The router's view of the shards: the same Step bytes to all, the result from rank 0."""

    def __init__(self, conns):
        self.conns = conns

    def wait_ready(self) -> int:
        """The KV capacity every shard can hold (the minimum over ranks)."""
        slots = [self._receive(rank, Ready).num_slots for rank in range(len(self.conns))]
        return min(slots)

    def submit(self, step: Step) -> None:
        data = encode(step)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise ShardFailure(f"shard {rank} is gone ({e})") from e

    def collect(self) -> StepResult:
        return self._receive(0, StepResult)

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(encode(Shutdown()))
            except OSError:
                pass

    def _receive(self, rank: int, expected: type):
        try:
            message = decode(self.conns[rank].recv_bytes())
        except (EOFError, OSError) as e:
            raise ShardFailure(f"shard {rank} died") from e
        if isinstance(message, ShardError):
            raise ShardFailure(f"shard {message.rank} failed: {message.message}")
        if not isinstance(message, expected):
            raise ShardFailure(f"shard {rank} sent {type(message).__name__}, expected {expected.__name__}")
        return message


# ---- router process ------------------------------------------------------------------

@dataclass(frozen=True)
class RouterSpec:
    max_requests: int
    scheduler_config: object       # engine.scheduler.SchedulerConfig
    eos_token_ids: tuple[int, ...]
    max_batch_total_tokens: int | None = None


def router_main(spec: RouterSpec, frontend_conn, shard_conns, log_level: str = "INFO") -> None:
    _child_setup(log_level)
    shards = PipeShards(shard_conns)
    try:
        capacity = shards.wait_ready()
    except ShardFailure as e:
        log.error("startup failed: %s", e)
        frontend_conn.send_bytes(encode(RouterStatus(healthy=False, error=str(e))))
        return
    if spec.max_batch_total_tokens:
        capacity = min(capacity, spec.max_batch_total_tokens)
    loop = RouterLoop(spec, capacity, shards, frontend_conn)
    log.info("router ready: %d KV slots, %d request rows", capacity, spec.max_requests)
    try:
        loop.run()
    finally:
        shards.shutdown()


class RouterLoop:
    def __init__(self, spec: RouterSpec, capacity: int, shards: PipeShards, conn):
        from .allocator import SlotAllocator
        from .router import Router
        from .scheduler import Scheduler

        self.allocator = SlotAllocator(capacity, spec.max_requests)
        self.router = Router(Scheduler(self.allocator, spec.scheduler_config), shards, spec.eos_token_ids)
        self.conn = conn
        self.healthy = True
        self.error: str | None = None
        self._last_status = 0.0
        self._last_sent: RouterStatus | None = None

    def run(self) -> None:
        self._send_status(force=True)
        while True:
            if not self._read_inbox(timeout=0 if self.router.has_work() else STATUS_INTERVAL_S):
                return
            if self.healthy and self.router.has_work():
                self._step()
            elif self.healthy:
                self.allocator.check_integrity()
            self._send_status()

    def _read_inbox(self, timeout: float) -> bool:
        """Handle every waiting message; False when the front end is gone."""
        try:
            ready = self.conn.poll(timeout)
            while ready:
                self._handle(decode(self.conn.recv_bytes()))
                ready = self.conn.poll(0)
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, message) -> None:
        if isinstance(message, Abort):
            if self.router.abort(message.request_id):
                log.info("request %s aborted", message.request_id)
        elif isinstance(message, GenerationRequest):
            if not self.healthy:
                self._send_events([TokenEvent(request_id=message.request_id, error=self.error)])
                return
            try:
                self.router.submit(message)
            except ValueError as e:
                self._send_events([TokenEvent(request_id=message.request_id, error=f"Input validation error: {e}")])

    def _step(self) -> None:
        try:
            events = self.router.step()
        except ShardFailure as e:
            log.error("%s", e)
            self.healthy = False
            self.error = f"Request failed during generation: {e}"
            self._send_status(force=True)          # /health answers 503 from now on
            events = self.router.fail_all(self.error)
        if events:
            self._send_events(events)

    def _send_events(self, events: list[TokenEvent]) -> None:
        self.conn.send_bytes(encode(Events(events)))

    def _send_status(self, force: bool = False) -> None:
        scheduler = self.router.scheduler
        status = RouterStatus(
            healthy=self.healthy, queue_size=len(scheduler.waiting), batch_size=len(scheduler.running),
            kv_used=self.allocator.used_slots, kv_capacity=self.allocator.num_slots, error=self.error)
        since = time.monotonic() - self._last_status
        changed = status != self._last_sent
        if force or since >= STATUS_INTERVAL_S or (changed and since >= STATUS_CHANGE_S):
            self._last_status, self._last_sent = time.monotonic(), status
            self.conn.send_bytes(encode(status))


def _child_setup(log_level: str) -> None:
    """Children leave Ctrl-C to the supervisor, which stops them in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---- front end process ---------------------------------------------------------------

@dataclass(frozen=True)
class FrontendSpec:
    model_dir: str
    hostname: str
    port: int
    settings: object               # tgi_compat.settings.ServerSettings


def frontend_main(spec: FrontendSpec, conn, log_level: str = "INFO") -> None:
    """Load the tokenizer, wait for the router's Ready, then bind the port and serve."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the supervisor stops us with SIGTERM
    import uvicorn
    from transformers import AutoTokenizer

    from tgi_compat.app import create_app

    from .client import RouterClient

    client = RouterClient(conn)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
    status = client.wait_ready()
    if not status.healthy:
        log.error("not serving: %s", status.error)
        raise SystemExit(1)
    app = create_app(spec.settings, tokenizer, client)
    log.info("serving on http://%s:%d", spec.hostname, spec.port)
    uvicorn.run(app, host=spec.hostname, port=spec.port, log_level="warning", timeout_graceful_shutdown=2)


def spawn_context():
    import multiprocess as mp

    return mp.get_context("spawn")


def spawn_shards(specs, log_level: str = "INFO") -> tuple[list, list]:
    """Start one shard process per spec; returns (processes, the router's pipe ends)."""
    ctx = spawn_context()
    router_ends, shard_ends = zip(*(ctx.Pipe(duplex=True) for _ in specs))
    processes = [ctx.Process(target=shard_main, args=(spec, end, log_level), name=f"shard-{spec.rank}")
                 for spec, end in zip(specs, shard_ends)]
    for p in processes:
        p.start()
    return processes, list(router_ends)


# ---- the plan the supervisor starts --------------------------------------------------

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
        others = [ctx.Process(target=router_main, name="router",
                              args=(self.router, front_router, router_ends, self.log_level)),
                  ctx.Process(target=frontend_main, args=(self.frontend, front_end, self.log_level), name="frontend")]
        for p in others:
            p.start()
        return processes + others


def plan_server(config) -> ServerPlan:
    """From the launcher's config to the processes to start; ValueError on any bad input."""
    import torch

    from weights.hub import model_info, resolve_model

    from .launch_config import resolve_limits
    from .model_config import load_model_config
    from .parallel import TensorParallel
    from .worker import resolve_dtype

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
    from weights.checkpoint import open_checkpoint

    from .models.llama import IGNORED_CHECKPOINT_NAMES, checkpoint_shapes

    with open_checkpoint(model_dir) as checkpoint:
        checkpoint.check(checkpoint_shapes(model_config), ignore_unexpected=IGNORED_CHECKPOINT_NAMES)


def _worker_config(config, limits, model_dir, dtype, device, max_requests):
    from .launch_config import cuda_graph_sizes
    from .worker import WorkerConfig

    watermark = {"watermark_gamma": config.watermark_gamma, "watermark_delta": config.watermark_delta}
    return WorkerConfig(model_dir=model_dir, dtype=dtype, device=device,
                        kernel_backend="triton" if device.type == "cuda" else "torch",
                        max_requests=max_requests, max_seq_len=limits.max_total_tokens,
                        num_slots=limits.max_batch_total_tokens, memory_fraction=0.9 * config.cuda_memory_fraction,
                        warmup_tokens=limits.max_batch_prefill_tokens, cuda_graphs=cuda_graph_sizes(config),
                        **{k: v for k, v in watermark.items() if v is not None})


def _router_spec(config, limits, max_requests, eos_ids) -> RouterSpec:
    from .scheduler import SchedulerConfig

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
