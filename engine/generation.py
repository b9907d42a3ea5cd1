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

from engine.assembly import EngineConfig, build_router, plan_engine, start_local_shard
from engine.protocol.messages import GenerationRequest, TokenEvent

__all__ = ["Engine", "EngineConfig", "GenerationRequest", "TokenEvent"]


class Engine:
    """With ``num_shards`` > 1 the model runs tensor-parallel in shard processes; call
    ``close()`` (or use ``with Engine(...) as engine``) to stop them."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.plan = plan_engine(config)
        self.model_config = self.plan.model_config
        self.worker = None
        self._processes: list = []
        if self.plan.num_shards == 1:
            shards, capacity = start_local_shard(self.plan)
            self.worker = shards.worker
        else:
            shards, capacity = self._start_shards()
        self.router = build_router(self.plan, shards, capacity)
        self.allocator = self.router.scheduler.allocator

    def _start_shards(self):
        from engine.processes import spawn_shards
        from engine.router.process import PipeShards

        self._processes, ends = spawn_shards(self.plan, "WARNING")
        shards = PipeShards(ends)
        try:
            return shards, shards.wait_ready()
        except Exception:
            self._stop_processes(shards)
            raise

    def close(self) -> None:
        if self._processes:
            self._stop_processes(self.router.shards)

    def _stop_processes(self, shards) -> None:
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
