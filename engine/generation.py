"""The batched generation API: one process, no HTTP.

    engine = Engine(EngineConfig(model_dir="/path/to/checkpoint"))
    engine.add_request(GenerationRequest(request_id=1, prompt_ids=[...], max_new_tokens=32))
    while engine.has_work():
        for event in engine.step():    # prefill chunks of new requests + one decode token each
            ...                        # event.token_id, event.logprob, event.finish_reason

Requests can be added at any step; finished requests release their KV slots
themselves, ``abort`` releases them early. The server's router process runs the same
``Router`` against worker processes. A step that raises fails every request and the engine
for good (``EngineFailed`` from then on): the worker may hold that step's half-done work, and a
later step would be paired with it.
"""
from __future__ import annotations

from engine.assembly import EngineConfig, build_router, plan_engine, start_local_shard
from engine.protocol.messages import GenerationRequest, TokenEvent

__all__ = ["Engine", "EngineConfig", "EngineFailed", "GenerationRequest", "TokenEvent"]


class EngineFailed(RuntimeError):
    """A step of this engine raised earlier; start a new ``Engine``."""


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
        self.failure: str | None = None     # why a step raised; the engine takes no more work after it

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
        """Queue a request; ValueError if prompt + max_new_tokens exceeds the limits, EngineFailed
        after a failed step."""
        self._check_not_failed()
        self.router.submit(request)

    def abort(self, request_id: int) -> bool:
        return self.router.abort(request_id)

    def has_work(self) -> bool:
        return self.router.has_work()

    def kv_usage(self) -> tuple[int, int]:
        return self.allocator.used_slots, self.allocator.num_slots

    def step(self) -> list[TokenEvent]:
        """One step's events. If the step raises, every queued and running request is ended (its
        error event is ``fail_all``'s, which the caller that catches the exception delivers) and the
        exception propagates; the engine is failed from then on."""
        self._check_not_failed()
        try:
            return self.router.step()
        except Exception as e:
            self.failure = f"{type(e).__name__}: {e}"
            raise

    def fail_all(self, message: str) -> list[TokenEvent]:
        """Error events for every request left after a failed step (their slots released)."""
        return self.router.fail_all(message)

    def _check_not_failed(self) -> None:
        if self.failure is not None:
            raise EngineFailed(f"a step of this engine failed ({self.failure}); start a new Engine")

    def generate(self, requests: list[GenerationRequest]) -> dict[int, list[TokenEvent]]:
        """Run the given requests to completion; events per request id."""
        results: dict[int, list[TokenEvent]] = {r.request_id: [] for r in requests}
        for request in requests:
            self.add_request(request)
        while self.has_work():
            for event in self.step():
                results[event.request_id].append(event)
        return results
