"""A grammar that fails in the worker (there: the grammar engine could not load the tokenizer)
is an error answer in TGI's shape, in-band when streaming, never a 200 with an empty text; the
server keeps serving and the request's KV slots are freed."""
from __future__ import annotations

import json

import pytest
import requests

from engine.sampling.grammar import GrammarMatcher

from .conftest import make_settings, serve

GRAMMAR = {"type": "regex", "value": "(yes|no)"}


@pytest.fixture
def failing_grammars(engine_backend, monkeypatch):
    grammars = engine_backend.engine.worker.sampler.grammars
    failure = "the grammar engine could not load the tokenizer: test"
    monkeypatch.setattr(grammars, "matcher", lambda kind, text: GrammarMatcher(None, grammars.eos_ids, failure))
    return engine_backend


def test_a_worker_side_grammar_failure_is_an_error_answer(failing_grammars, hf_tokenizer):
    from tgi_compat import create_app

    body = {"inputs": "hello", "parameters": {"max_new_tokens": 4, "grammar": GRAMMAR}}
    with serve(create_app(make_settings(), hf_tokenizer, failing_grammars)) as url:
        whole = requests.post(url + "/generate", json=body, timeout=30)
        assert whole.status_code == 424, whole.text
        assert whole.json()["error_type"] == "generation" and "the grammar failed" in whole.json()["error"]
        lines = requests.post(url + "/generate_stream", json=body, timeout=30).iter_lines()
        events = [json.loads(line[5:]) for line in lines if line.startswith(b"data:")]
        assert events[-1]["error_type"] == "generation" and "the grammar failed" in events[-1]["error"]
        plain = requests.post(url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2,
                                                                                         "details": True}},
                              timeout=30)
        assert plain.status_code == 200 and plain.json()["details"]["generated_tokens"] >= 1
    engine = failing_grammars.engine
    assert engine.kv_usage()[0] == 0
    engine.router.scheduler.check_integrity()
