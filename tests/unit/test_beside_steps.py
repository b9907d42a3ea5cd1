"""bench.beside_steps on the CPU: the steps it times are the scheduler's, chunk by chunk (no timing assertion).
The torch kernels: the scheduler's steps are under test here, and the interpreter would take minutes."""
import dataclasses
import json

import pytest

from bench import beside_steps
from engine.assembly import EngineConfig, plan_engine
from engine.router.scheduler import MIN_PROMPT_CHUNK, chunk_cost
from engine.worker.model_worker import ModelWorker


@pytest.fixture(scope="module")
def demo():
    plan = plan_engine(EngineConfig(model_dir="weights/demo", max_requests=2, stall_free_tokens=16,
                                    max_seq_len=4096, prefix_caching=False, kernel_backend="torch"))
    return plan, ModelWorker(plan.worker, plan.model_config)


@pytest.mark.parametrize("per_row", [0, 40])
def test_each_timed_step_carries_the_next_chunk_within_the_cap(demo, per_row):
    plan, worker = demo
    config = dataclasses.replace(plan.scheduler, stall_free_tokens=16, stall_free_row_tokens=per_row)
    steps = beside_steps.beside(worker, config, 300)
    assert [s.position for s in steps] == [sum(s.tokens for s in steps[:i]) for i in range(len(steps))]
    assert sum(s.tokens for s in steps) == 300 and all(s.ms > 0 for s in steps)
    stream_context = len(beside_steps.STREAM_PROMPT) + beside_steps.STREAM_WARM_STEPS
    for i, s in enumerate(steps):      # the stream holds one more token each step
        cap = 16 * (1 + (stream_context + i) / config.kv_weight_tokens) + per_row
        assert s.tokens <= MIN_PROMPT_CHUNK or chunk_cost(s.position, s.tokens, config.attention_span) <= cap
    assert worker.kv_cache is not None and beside_steps.beside(worker, config, 40)    # the rows were released


def test_the_command_reports_each_policy(tmp_path, capsys):
    out = tmp_path / "beside.json"
    results = beside_steps.main(["--model-dir", "weights/demo", "--prompt-tokens", "120", "--policies", "16:0,16:64",
                                 "--kernel-backend", "torch", "--json", str(out)])
    assert [r["policy"] for r in results] == [[16, 0], [16, 64]] and json.loads(out.read_text()) == results
    assert results[0]["steps"] > results[1]["steps"] >= 1      # the per-request share: larger chunks
    for r in results:
        assert sum(t["steps"] for t in r["by_tenth"]) == r["steps"]
        assert r["ms_p50"] <= r["ms_p99"] <= r["ms_max"]
    assert "policy 16:64: " in capsys.readouterr().out


@pytest.mark.parametrize("text,message", [("704", None), ("704:x", "expected S:R"), ("0:4", "S must be >= 1")])
def test_policies_parse_or_say_what_is_wrong(text, message):
    if message is None:
        assert beside_steps.parse_policies(text) == [(704, 0)]
    else:
        with pytest.raises(ValueError, match=message):
            beside_steps.parse_policies(text)
