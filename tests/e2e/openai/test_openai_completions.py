"""`/v1/completions` and `/v1/models` against the real server (in-process over the demo
model, and once through the real launcher), driven by the real `openai` SDK."""
import json

import openai
import pytest
import requests

from tests.e2e.demo_server import DEMO, DEMO_MODEL_ID
from tests.e2e.server import LaunchedServer
from tests.e2e.openai.test_openai_chat import sse_payloads

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"]


def generate(url, prompt, max_new_tokens):
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    return requests.post(url + "/generate", json=body).json()


def test_list_of_prompts_equals_generate_per_prompt(url, client):
    reply = client.completions.create(model="tgi", prompt=PROMPTS, max_tokens=8, temperature=0)
    assert reply.object == "text_completion" and reply.model == DEMO_MODEL_ID
    expected = [generate(url, p, 8) for p in PROMPTS]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [e["generated_text"] for e in expected]
    assert all(c.finish_reason == "length" and c.logprobs is None for c in reply.choices)
    tokens = requests.post(url + "/tokenize", json={"inputs": PROMPTS[0]}).json()
    single = client.completions.create(model="tgi", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[0]["generated_text"]
    assert (single.usage.prompt_tokens, single.usage.completion_tokens) == (len(tokens), 8)
    assert reply.usage.completion_tokens == 24


def test_stream_interleaves_prompts_and_ends_with_done(url, client):
    whole = client.completions.create(model="tgi", prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    texts, finals = {0: "", 1: ""}, {}
    for chunk in client.completions.create(model="tgi", prompt=PROMPTS[:2], max_tokens=6, temperature=0, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finals[choice.index] = (choice.finish_reason, chunk.usage.completion_tokens)
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert finals == {0: ("length", 6), 1: ("length", 6)}
    raw = requests.post(url + "/v1/completions", json={"prompt": "x = ", "max_tokens": 2, "stream": True}, stream=True)
    *events, done = sse_payloads(raw)
    assert done == "[DONE]"
    middle, last = json.loads(events[0]), json.loads(events[-1])
    assert list(middle) == ["object", "id", "created", "choices", "model", "system_fingerprint"]
    assert middle["choices"][0]["finish_reason"] == "" and "usage" not in middle
    assert list(last) == ["object", "id", "created", "model", "system_fingerprint", "choices", "usage"]


def test_n_samples_per_prompt_are_indexed_prompt_major(client):
    reply = client.completions.create(model="tgi", prompt=PROMPTS[:2], max_tokens=5, seed=3, n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    again = client.completions.create(model="tgi", prompt=PROMPTS[:2], max_tokens=5, seed=3, n=2)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]


def test_models(url, client):
    assert requests.get(url + "/v1/models").json() == {
        "object": "list", "data": [{"id": DEMO_MODEL_ID, "object": "model", "created": 0, "owned_by": DEMO_MODEL_ID}]}
    assert [m.id for m in client.models.list()] == [DEMO_MODEL_ID]


def test_suffix_and_too_many_prompts_are_tgis_errors(url):
    cases = [({"prompt": "a", "suffix": "b"}, {
                 "error": "Suffix is not supported and can be achieved by preprocessing the prompt.",
                 "error_type": "suffix not supported"}),
             ({"prompt": ["a"] * 5, "stream": True}, {
                 "error": "Number of prompts exceeds the maximum allowed batch size of 4",
                 "error_type": "batch size exceeded"}),
             ({"prompt": []}, {"error": "Input validation error: Empty array detected. Do not use an empty array "
                                        "for the prompt.", "error_type": "validation"}),
             ({"prompt": "a", "top_p": 1.0}, {"error": "Input validation error: `top_p` must be > 0.0 and < 1.0",
                                             "error_type": "validation"})]
    for body, error in cases:
        response = requests.post(url + "/v1/completions", json=body)
        assert (response.status_code, response.json()) == (422, error), body


def test_a_failing_prompt_in_a_stream_is_an_in_band_error_the_others_finish(url):
    body = {"prompt": ["def f(", "x" * 3000], "max_tokens": 3, "temperature": 0, "stream": True}
    payloads = sse_payloads(requests.post(url + "/v1/completions", json=body, stream=True))
    errors = [json.loads(p) for p in payloads if p.startswith('{"error"')]
    assert len(errors) == 1 and errors[0]["error"]["http_status_code"] == 422
    assert errors[0]["error"]["message"].startswith("Input validation error: `inputs` ")
    finals = [json.loads(p) for p in payloads[:-1] if "usage" in json.loads(p)]
    assert [f["choices"][0]["index"] for f in finals] == [0] and payloads[-1] == "[DONE]"


def test_through_the_real_launcher():
    server = LaunchedServer(DEMO, "--max-total-tokens", "512", "--max-input-tokens", "256",
                            "--max-client-batch-size", "2").wait_healthy()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == [str(DEMO)]
        chat = client.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Sort a list."}],
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens == 4 and chat.choices[0].message.content
        done = client.completions.create(model="tgi", prompt=["a = ", "b = "], max_tokens=3, temperature=0)
        assert len(done.choices) == 2
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            client.completions.create(model="tgi", prompt=["a", "b", "c"], max_tokens=1)
        assert caught.value.response.json()["error_type"] == "batch size exceeded"
        assert "maximum allowed batch size of 2" in caught.value.response.json()["error"]
    finally:
        assert server.stop() == 0, server.output()
