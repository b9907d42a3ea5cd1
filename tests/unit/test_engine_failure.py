"""A step that raises (an out-of-memory error in a forward, say) ends every request with the error and the
engine for good: the worker still holds that step's half-done launch, and a later request's step would be
paired with it (its first token was the failed pipeline's, every later one shifted by a step)."""
import asyncio

import pytest

from engine.client import InProcessBackend
from engine.generation import Engine, EngineConfig, EngineFailed, GenerationRequest
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("ckpt") / "llama"))


def new_engine(model_dir: str) -> Engine:
    return Engine(EngineConfig(model_dir=model_dir, device="cpu", kernel_backend="torch", num_slots=300,
                               max_requests=6, max_prefill_tokens=16))


def request(rid: int, prompt: list[int], n: int = 6) -> GenerationRequest:
    return GenerationRequest(rid, prompt, n, stop_token_ids=[])


def fail_launch(engine: Engine, at_call: int) -> None:
    """The worker's ``at_call``-th launch raises; the others run."""
    launch, calls = engine.worker.launch, [0]

    def flaky(step, *args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected: CUDA out of memory")
        return launch(step, *args, **kwargs)
    engine.worker.launch = flaky


def test_a_failed_step_ends_the_requests_frees_their_slots_and_the_engine(tiny_llama):
    engine = new_engine(tiny_llama)
    fail_launch(engine, at_call=3)
    engine.add_request(request(1, [3, 4, 5], n=20))
    engine.add_request(request(2, list(range(3, 30)), n=20))
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(10):
            engine.step()
    events = engine.fail_all("the step failed")
    assert sorted(e.request_id for e in events) == [1, 2] and all(e.error == "the step failed" for e in events)
    assert engine.kv_usage()[0] == 0 and not engine.has_work()
    engine.allocator.check_integrity()
    with pytest.raises(EngineFailed, match="injected: CUDA out of memory"):
        engine.add_request(request(3, [7, 8, 9]))
    with pytest.raises(EngineFailed, match="start a new Engine"):
        engine.step()


def test_the_in_process_backend_answers_requests_after_a_failed_step_with_its_error(tiny_llama):
    engine = new_engine(tiny_llama)
    fail_launch(engine, at_call=3)

    async def run():
        backend = InProcessBackend(engine)

        async def events(r):
            async def collect():
                return [e async for e in backend.generate(r)]
            return await asyncio.wait_for(collect(), 60)
        return await events(request(1, [3, 4, 5], n=20)), backend.healthy(), await events(request(3, [7, 8, 9, 10]))

    first, healthy, later = asyncio.run(run())
    assert "injected: CUDA out of memory" in first[-1].error and not healthy
    assert len(later) == 1 and later[0].error == first[-1].error     # never the failed pipeline's tokens
    assert engine.kv_usage()[0] == 0
