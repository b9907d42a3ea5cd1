"""The batched generation API: one process, no HTTP.

    engine = Engine(EngineConfig(model_dir="/path/to/checkpoint"))
    engine.add_request(GenerationRequest(request_id=1, prompt_ids=[...], max_new_tokens=32))
    while engine.has_work():
        for event in engine.step():    # prefill chunks of new requests + one decode token each
            ...                        # event.token_id, event.logprob, event.finish_reason

Requests can be added at any step; finished requests release their KV slots
themselves, ``abort`` releases them early. The server's router process runs the same
``Router`` against worker processes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.config import load_model_config
from engine.ops import default_backend
from engine.protocol.messages import GenerationRequest, TokenEvent
from engine.router.allocator import SlotAllocator
from engine.router.router import LocalShards, Router
from engine.router.scheduler import Scheduler, SchedulerConfig
from engine.worker.model_worker import ModelWorker, WorkerConfig, resolve_dtype

__all__ = ["Engine", "EngineConfig", "GenerationRequest", "TokenEvent"]


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: str | None = None              # float16 | bfloat16 | float32; None: the device's default
    device: str | None = None             # None: cuda if available else cpu
    kernel_backend: str | None = None     # triton | torch; None: see engine.ops.default_backend
    max_requests: int = 256
    max_seq_len: int | None = None        # None: the model's context length
    num_slots: int | None = None          # KV capacity in tokens; None: sized from free memory
    max_prefill_tokens: int = 4096
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 20
    cuda_graphs: tuple[int, ...] | None = None   # decode batch sizes to capture (None: defaults; (): eager)
    num_shards: int = 1                   # > 1: tensor parallel over shard processes
    master_addr: str = "localhost"
    master_port: int = 29500

    def worker_config(self, model_config) -> WorkerConfig:
        device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return WorkerConfig(
            model_dir=self.model_dir,
            dtype=resolve_dtype(self.dtype, model_config, device),
            device=device,
            kernel_backend=self.kernel_backend or default_backend(device),
            max_requests=self.max_requests,
            max_seq_len=self.max_seq_len or model_config.max_context,
            num_slots=self.num_slots,
            warmup_tokens=self.max_prefill_tokens,
            cuda_graphs=self.cuda_graphs,
        )

    def scheduler_config(self, max_seq_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_prefill_tokens=self.max_prefill_tokens, waiting_served_ratio=self.waiting_served_ratio,
            max_waiting_steps=self.max_waiting_steps, max_seq_len=max_seq_len,
        )


class Engine:
    """With ``num_shards`` > 1 the model runs tensor-parallel in shard processes; call
    ``close()`` (or use ``with Engine(...) as engine``) to stop them."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = load_model_config(config.model_dir)
        worker_config = config.worker_config(self.model_config)
        self.worker = None
        self._processes: list = []
        if config.num_shards == 1:
            self.worker = ModelWorker(worker_config, self.model_config)
            shards, capacity = LocalShards(self.worker), self.worker.num_slots
        else:
            shards, capacity = self._start_shards(worker_config)
        self.allocator = SlotAllocator(capacity, config.max_requests)
        scheduler = Scheduler(self.allocator, config.scheduler_config(worker_config.max_seq_len))
        self.router = Router(scheduler, shards, self.model_config.eos_token_ids)

    def _start_shards(self, worker_config):
        from engine.models.parallel import TensorParallel
        from engine.processes import spawn_shards
        from engine.router.process import PipeShards
        from engine.worker.process import ShardSpec

        TensorParallel(0, self.config.num_shards).check(self.model_config)
        specs = [ShardSpec(rank, self.config.num_shards, self.config.master_addr, self.config.master_port,
                           worker_config) for rank in range(self.config.num_shards)]
        self._processes, ends = spawn_shards(specs, "WARNING")
        shards = PipeShards(ends)
        try:
            return shards, shards.wait_ready()
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        if self._processes:
            from engine.router.process import PipeShards

            shards = self.router.shards if hasattr(self, "router") else None
            if isinstance(shards, PipeShards):
                shards.shutdown()
            for p in self._processes:
                p.join(10)
                if p.is_alive():
                    p.kill()
            self._processes = []

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; ValueError if prompt + max_new_tokens exceeds the limits."""
        self.router.submit(request)

    def abort(self, request_id: int) -> bool:
        return self.router.abort(request_id)

    def has_work(self) -> bool:
        return self.router.has_work()

    def kv_usage(self) -> tuple[int, int]:
        return self.allocator.used_slots, self.allocator.num_slots

    def step(self) -> list[TokenEvent]:
        return self.router.step()

    def generate(self, requests: list[GenerationRequest]) -> dict[int, list[TokenEvent]]:
        """Run the given requests to completion; events per request id."""
        results: dict[int, list[TokenEvent]] = {r.request_id: [] for r in requests}
        for request in requests:
            self.add_request(request)
        while self.has_work():
            for event in self.step():
                results[event.request_id].append(event)
        return results
