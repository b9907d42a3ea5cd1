"""The batched generation API: sampling reproducibility, aborts, limits, configs."""
import json
from dataclasses import replace

import pytest
import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.models import load_model_config
from engine.models.config import ModelConfigError
from engine.protocol.messages import FED_BACK, SamplingParams
from engine.worker.model_worker import resolve_dtype
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("ckpt") / "llama"))


@pytest.fixture()
def engine(tiny_llama):
    return Engine(EngineConfig(model_dir=tiny_llama, device="cpu", kernel_backend="torch", num_slots=300,
                               max_requests=6, max_prefill_tokens=16))


def sampled(rid, prompt, seed, n=12, **kw):
    params = SamplingParams(do_sample=True, temperature=1.3, top_k=40, top_p=0.95, seed=seed, **kw)
    return GenerationRequest(rid, prompt, n, params, stop_token_ids=[])


def tokens(events):
    return [e.token_id for e in events]


def test_seeded_sampling_reproduces_alone_and_in_a_crowd(engine):
    alone = tokens(engine.generate([sampled(1, [5, 6, 7], seed=11)])[1])
    crowd = engine.generate([sampled(2, [9, 9], seed=3), sampled(3, [5, 6, 7], seed=11),
                             sampled(4, list(range(3, 40)), seed=5, repetition_penalty=1.3)])
    assert tokens(crowd[3]) == alone
    assert tokens(crowd[2]) != alone
    assert all(e.seed == 11 for e in crowd[3])
    assert len({tuple(tokens(engine.generate([sampled(10 + s, [5, 6, 7], seed=s)])[10 + s])) for s in range(6)}) > 3


def test_unseeded_sampling_reports_a_seed_and_greedy_reports_none(engine):
    out = engine.generate([GenerationRequest(1, [4, 5], 3, SamplingParams(do_sample=True), stop_token_ids=[]),
                           GenerationRequest(2, [4, 5], 3, SamplingParams(), stop_token_ids=[])])
    assert isinstance(out[1][0].seed, int) and out[2][0].seed is None


def test_abort_mid_generation_frees_every_slot(engine):
    engine.add_request(GenerationRequest(1, list(range(3, 50)), 100, stop_token_ids=[]))
    engine.add_request(GenerationRequest(2, [3, 4], 100, stop_token_ids=[]))
    for _ in range(6):
        engine.step()
    assert engine.kv_usage()[0] > 0
    assert engine.abort(1) and engine.abort(2)
    assert engine.kv_usage()[0] == 0
    engine.allocator.check_integrity()
    steps = 0
    while engine.has_work():     # the step still in flight ends; its tokens make no events
        assert engine.step() == []
        steps += 1
    assert steps <= 2
    assert engine.step() == []   # the release reaches the worker
    assert engine.worker._sampling == {}


def test_eos_token_finishes_a_request(engine):
    first = tokens(engine.generate([GenerationRequest(1, [7, 8, 9], 5, stop_token_ids=[])])[1])
    out = engine.generate([GenerationRequest(2, [7, 8, 9], 5, stop_token_ids=[first[2]])])[2]
    assert tokens(out) == first[:3] and out[-1].finish_reason == "eos_token"


def test_many_requests_share_a_small_cache_without_running_out(engine):
    requests = [GenerationRequest(i, list(range(3, 3 + 10 + 7 * i)), 20 + i, stop_token_ids=[]) for i in range(12)]
    out = engine.generate(requests)
    assert [len(out[i]) for i in range(12)] == [20 + i for i in range(12)]
    assert engine.kv_usage() == (0, 300)


def test_requests_over_the_limits_are_refused(engine):
    with pytest.raises(ValueError, match="exceeds the limit"):
        engine.add_request(GenerationRequest(1, list(range(3, 290)), 20))
    assert not engine.has_work()


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8}))
    with pytest.raises(ModelConfigError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        load_model_config(tmp_path)
    with pytest.raises(ModelConfigError, match="config.json not found"):
        load_model_config(tmp_path / "missing")


def test_default_dtype_follows_the_device_and_the_checkpoint(tiny_llama):
    config = load_model_config(tiny_llama)
    half = replace(config, checkpoint_dtype=torch.float16)
    full = replace(config, checkpoint_dtype=torch.float32)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(None, half, cpu) == torch.float32
    assert resolve_dtype(None, half, cuda) == torch.float16
    assert resolve_dtype(None, full, cuda) == torch.bfloat16
    assert resolve_dtype("bfloat16", half, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype 'int8'"):
        resolve_dtype("int8", half, cuda)


def test_steps_are_pipelined_one_deep_and_decode_rows_feed_the_workers_tokens(engine):
    shards = engine.router.shards
    calls, submit, collect = [], shards.submit, shards.collect

    def recording_submit(step):
        calls.append(("submit", [r.input_ids for r in step.rows]))
        submit(step)

    def recording_collect(timeout=None):
        calls.append(("collect", None))
        return collect(timeout)

    shards.submit, shards.collect = recording_submit, recording_collect
    try:
        engine.add_request(GenerationRequest(1, [3, 4, 5], 4, stop_token_ids=[]))
        events = []
        while engine.has_work():
            events.extend(engine.step())
    finally:
        del shards.submit, shards.collect
    assert [e.finish_reason for e in events] == [None, None, None, "length"]
    assert [kind for kind, _ in calls] == ["submit", "submit", "collect", "submit", "collect", "submit",
                                           "collect", "collect"]
    assert [inputs for kind, inputs in calls if kind == "submit"] == [[[3, 4, 5]], [[FED_BACK]], [[FED_BACK]],
                                                                      [[FED_BACK]]]
