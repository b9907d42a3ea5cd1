"""Structured output over HTTP: TGI's `grammar` on /generate, /generate_stream and `/`, served by
the real front end over the real engine running the bundled demo model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.grammar_cases import REGEXES, SCHEMAS, check_output

from .conftest import make_settings, serve, wait_idle
from .test_http_stream import events_of, stream_raw

DEMO = Path(__file__).resolve().parents[2] / "weights" / "demo"
VALIDATION = "Input validation error: "


@pytest.fixture(scope="module")
def demo_backend():
    from engine.client import InProcessBackend
    from engine.generation import Engine, EngineConfig

    return InProcessBackend(Engine(EngineConfig(model_dir=str(DEMO), device="cpu", kernel_backend="torch",
                                                num_slots=8192, max_requests=16, max_prefill_tokens=2048)))


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


def demo_app(tokenizer, backend, **overrides):
    from tgi_compat import create_app

    settings = make_settings(model_id="demo", max_input_tokens=256, max_total_tokens=512, **overrides)
    return serve(create_app(settings, tokenizer, backend))


@pytest.fixture(scope="module")
def demo_url(demo_tokenizer, demo_backend):
    with demo_app(demo_tokenizer, demo_backend) as url:
        yield url


def generate(url, prompt, route="/generate", **parameters) -> requests.Response:
    return requests.post(url + route, json={"inputs": prompt, "parameters": parameters}, timeout=120)


@pytest.mark.parametrize("name,prompt,schema", [SCHEMAS[i] for i in (1, 11, 13, 19)],
                         ids=[SCHEMAS[i][0] for i in (1, 11, 13, 19)])
def test_generate_with_a_json_schema_returns_a_valid_instance(demo_url, name, prompt, schema):
    response = generate(demo_url, prompt, max_new_tokens=128, details=True, grammar={"type": "json", "value": schema})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["details"]["finish_reason"] == "eos_token"
    assert result["details"]["tokens"][-1]["special"] is True          # the EOS ended it, as in TGI
    check_output("json", schema, result["generated_text"])


def test_json_schema_and_json_object_types_and_the_compat_route(demo_url):
    name, prompt, schema = SCHEMAS[0]
    shaped = generate(demo_url, prompt, max_new_tokens=64,
                      grammar={"type": "json_schema", "value": {"name": name, "schema": schema}})
    alias = generate(demo_url, prompt, route="/", max_new_tokens=64, return_full_text=False,
                     grammar={"type": "json_object", "value": schema})
    assert shaped.status_code == alias.status_code == 200, (shaped.text, alias.text)
    check_output("json", schema, shaped.json()["generated_text"])
    assert alias.json()[0]["generated_text"] == shaped.json()["generated_text"]    # greedy: the same output


def test_generate_stream_with_a_regex_streams_a_full_match(demo_url):
    _, prompt, pattern = REGEXES[3]
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 64, "details": True,
                                             "grammar": {"type": "regex", "value": pattern}}}
    events = events_of(stream_raw(demo_url, body).content)
    text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert events[-1]["generated_text"] == text and events[-1]["details"]["finish_reason"] == "eos_token"
    check_output("regex", pattern, text)


def test_text_generation_client_sends_grammars_as_tgi_clients_do(demo_url):
    client = Client(demo_url, timeout=120)
    _, prompt, pattern = REGEXES[2]
    response = client.generate(prompt, max_new_tokens=32, grammar=Grammar(type=GrammarType.Regex, value=pattern))
    check_output("regex", pattern, response.generated_text)
    _, prompt, schema = SCHEMAS[8]
    tokens = [r.token.text for r in client.generate_stream(prompt, max_new_tokens=64,
                                                           grammar=Grammar(type=GrammarType.Json, value=schema))
              if not r.token.special]
    check_output("json", schema, "".join(tokens))


def test_best_of_sampled_grammar_requests_all_validate(demo_url):
    _, prompt, schema = SCHEMAS[3]
    response = generate(demo_url, prompt, max_new_tokens=64, best_of=2, do_sample=True, details=True,
                        repetition_penalty=1.1, grammar={"type": "json", "value": schema})
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    outputs = [response.json()["generated_text"]] + [s["generated_text"] for s in details["best_of_sequences"]]
    assert len(outputs) == 2
    for text in outputs:
        check_output("json", schema, text)


BAD = [
    ("bad-regex", {"type": "regex", "value": "[0-9"}, VALIDATION + "grammar is not valid: invalid regex"),
    ("bad-schema", {"type": "json", "value": {"properties": {"a": {"type": "integr"}}}},
     VALIDATION + "grammar is not valid: Invalid type: integr"),
    ("no-properties", {"type": "json", "value": {"type": "object"}},
     VALIDATION + "grammar is not valid: Grammar must have a 'properties' field"),
]


@pytest.mark.parametrize("grammar,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_an_invalid_grammar_is_a_422_or_an_in_band_error_and_reaches_no_engine(demo_url, demo_backend, grammar,
                                                                               message):
    response = generate(demo_url, "x = ", max_new_tokens=8, grammar=grammar)
    assert response.status_code == 422 and response.json()["error_type"] == "validation"
    assert response.json()["error"].startswith(message), response.text
    body = {"inputs": "x = ", "parameters": {"max_new_tokens": 8, "grammar": grammar}}
    (event,) = events_of(stream_raw(demo_url, body).content)
    assert event["error"].startswith(message) and event["error_type"] == "validation"
    assert wait_idle(demo_backend)["kv_used"] == 0


def test_disable_grammar_support_refuses_grammars(demo_tokenizer, demo_backend):
    with demo_app(demo_tokenizer, demo_backend, disable_grammar_support=True) as url:
        response = generate(url, "x = ", max_new_tokens=8, grammar={"type": "regex", "value": "[0-9]+"})
        plain = generate(url, "x = ", max_new_tokens=4)
    assert response.status_code == 422
    assert response.json() == {"error": VALIDATION + "grammar is not supported", "error_type": "validation"}
    assert plain.status_code == 200


def test_top_n_tokens_are_those_of_the_constrained_distribution(demo_url):
    response = generate(demo_url, "answer = '", max_new_tokens=4, details=True, top_n_tokens=5,
                        grammar={"type": "regex", "value": "(yes|no)"})
    first_top = response.json()["details"]["top_tokens"][0]
    allowed = [t for t in first_top if t["logprob"] is not None]          # -inf (disallowed) becomes null
    assert allowed and all("yes".startswith(t["text"]) or "no".startswith(t["text"]) for t in allowed)
    assert abs(sum(2.718281828459045 ** t["logprob"] for t in allowed) - 1) < 1e-3
    assert json.loads(json.dumps(response.json())) == response.json()
