"""Token scores that are not numbers (a float16 overflow of the logits, or a temperature so near 0
that it makes them infinite) end the request with an error in TGI's shape, not a stream of
arbitrary tokens; the server keeps serving and the request's KV slots are freed. A verify row
whose failing token is a kept draft ends the same way."""
from __future__ import annotations

import json
import math

import pytest
import requests

from engine.protocol.messages import FED_BACK, RowResult, SamplingParams, StepRow
from engine.sampling.sampler import RowSampling, SampleOutput
from engine.worker.model_worker import ModelWorker

from .conftest import make_settings, serve, wait_idle

NAN_ERROR = "the token scores were NaN at new token 1"


@pytest.fixture
def poisoned(engine_backend, monkeypatch):
    """The engine, with every row's logits NaN while ``poisoned.on``."""
    model = engine_backend.engine.worker.model
    real = model.compute_logits
    switch = type("Switch", (), {"on": False, "backend": engine_backend})()
    monkeypatch.setattr(model, "compute_logits",
                        lambda hidden: real(hidden).fill_(math.nan) if switch.on else real(hidden))
    return switch


def test_nan_logits_are_an_error_answer_and_free_the_slots(poisoned, hf_tokenizer):
    from tgi_compat import create_app

    body = {"inputs": "hello", "parameters": {"max_new_tokens": 4}}
    with serve(create_app(make_settings(), hf_tokenizer, poisoned.backend)) as url:
        poisoned.on = True
        whole = requests.post(url + "/generate", json=body, timeout=30)
        assert whole.status_code == 424, whole.text
        assert whole.json()["error_type"] == "generation" and NAN_ERROR in whole.json()["error"]
        assert "--dtype bfloat16" in whole.json()["error"]
        lines = requests.post(url + "/generate_stream", json=body, timeout=30).iter_lines()
        events = [json.loads(line[5:]) for line in lines if line.startswith(b"data:")]
        assert len(events) == 1 and events[0]["error_type"] == "generation" and NAN_ERROR in events[0]["error"]
        poisoned.on = False
        plain = requests.post(url + "/generate", json={**body, "parameters": {"max_new_tokens": 2, "details": True}},
                              timeout=30)
        assert plain.status_code == 200 and plain.json()["details"]["generated_tokens"] >= 1
    engine = poisoned.backend.engine
    assert engine.kv_usage()[0] == 0
    engine.router.scheduler.check_integrity()


def test_a_temperature_that_makes_the_scores_infinite_is_the_same_error(server_url, engine_backend):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 4, "temperature": 1e-38, "seed": 1}}
    answer = requests.post(server_url + "/generate", json=body, timeout=30)
    assert answer.status_code == 424 and NAN_ERROR in answer.json()["error"], answer.text
    assert "a temperature this close to 0" in answer.json()["error"]
    wait_idle(engine_backend)                      # its KV slots are back
    engine_backend.engine.router.scheduler.check_integrity()
    again = requests.post(server_url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}},
                          timeout=30)
    assert again.status_code == 200, again.text


@pytest.mark.parametrize("nan_at", [0, 1, 2])
def test_a_verify_rows_nan_ends_the_request_whichever_kept_token_has_it(nan_at):
    """Drafts 7, 8 against choices 7, 8, 9: all three positions are kept; the NaN is at one of them. The row
    gives the kept tokens before it, then the failed one with its error and nothing after it (the router ends
    the request there: plain decoding's tokens, then its error)."""
    row = StepRow(request_id=5, row=0, start_pos=10, input_ids=[FED_BACK, 7, 8], slots=[10, 11, 12], sample=True)
    logprobs = [-0.5, -0.25, -0.125]
    logprobs[nan_at] = math.nan
    out = SampleOutput(token_ids=[7, 8, 9], logprobs=logprobs, top_ids=[[], [], []], top_logprobs=[[], [], []])
    results = [RowResult(5)]
    ModelWorker._record_tokens([0], [row], out, [RowSampling(SamplingParams(), seed=0, step=0)], results, None)
    tokens = [results[0], *results[0].following]
    assert [r.token_id for r in tokens] == [7, 8, 9][: nan_at + 1]
    assert all(r.error is None for r in tokens[:nan_at])
    assert tokens[nan_at].error is not None and f"NaN at new token {nan_at + 1}:" in tokens[nan_at].error


def test_a_verify_row_without_nan_has_no_error():
    row = StepRow(request_id=5, row=0, start_pos=10, input_ids=[FED_BACK, 7, 8], slots=[10, 11, 12], sample=True)
    out = SampleOutput(token_ids=[7, 8, 9], logprobs=[-0.5, -0.25, -0.125], top_ids=[[], [], []],
                       top_logprobs=[[], [], []])
    results = [RowResult(5)]
    ModelWorker._record_tokens([0], [row], out, [RowSampling(SamplingParams(), seed=0, step=0)], results, None)
    assert results[0].error is None and [r.token_id for r in [results[0], *results[0].following]] == [7, 8, 9]
