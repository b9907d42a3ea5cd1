"""`/v1/chat/completions` and `/chat_tokenize` against the real server (the bundled demo
model with its chat template), driven by the real `openai` SDK and TGI's `text_generation`
client, plus the raw wire format and TGI's errors."""
import json

import openai
import pytest
import requests
import torch
import transformers

from tests.e2e.demo_server import DEMO, DEMO_MODEL_ID, demo_tokenizer, serve_demo

CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function that reverses a string."}]


def transformers_greedy(messages, max_new_tokens: int) -> str:
    tokenizer = demo_tokenizer()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO, torch_dtype=torch.float32).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True), len(ids)


def sse_payloads(response) -> list[str]:
    """The `data:` values of a raw SSE body, checking TGI's framing on the way."""
    body = response.content.decode()
    events = [e for e in body.split("\n\n") if e and not e.startswith(":")]
    assert all(e.startswith("data:") and "\n" not in e for e in events), body
    return [e[len("data:"):].removeprefix(" ") for e in events]   # SSE: one space may follow the colon


def test_chat_completion_is_transformers_greedy_on_the_templated_prompt(client):
    expected, prompt_tokens = transformers_greedy(CHAT, 16)
    reply = client.chat.completions.create(model="tgi", messages=CHAT, max_tokens=16, temperature=0)
    assert reply.object == "chat.completion" and reply.id == "" and reply.model == DEMO_MODEL_ID
    assert reply.system_fingerprint == "0.1.0-native"
    (choice,) = reply.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == expected
    assert choice.finish_reason == "length" and choice.logprobs is None
    # the template already holds <s>: no second BOS is added
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 16)
    assert reply.usage.total_tokens == prompt_tokens + 16


def test_chat_stream_with_usage_equals_the_non_stream_answer(client):
    kwargs = dict(model="tgi", messages=CHAT, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *token_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].delta.content for c in token_chunks) == whole.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.choices[0].delta.role == "assistant" for c in token_chunks)
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 11 + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    without_usage = list(client.chat.completions.create(**kwargs, stream=True))
    assert len(without_usage) == 12 and all(c.usage is None for c in without_usage)


def test_wire_format_of_a_chat_stream(url):
    body = {"model": "tgi", "messages": CHAT, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    response = requests.post(url + "/v1/chat/completions", json=body, stream=True)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-accel-buffering"] == "no"
    *events, done = sse_payloads(response)
    assert done == "[DONE]"
    first = json.loads(events[0])
    assert list(first) == ["object", "id", "created", "model", "system_fingerprint", "choices", "usage"]
    assert first["choices"][0]["logprobs"] is None and first["usage"] is None
    assert list(first["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
    assert json.loads(events[-1])["choices"] == []


def test_n_choices_are_seeded_samples_also_when_streamed(client):
    kwargs = dict(model="tgi", messages=CHAT, max_tokens=10, temperature=1.0, seed=7, n=3)
    reply = client.chat.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1                       # seed, seed + 1, seed + 2: not one text three times
    assert [c.message.content for c in client.chat.completions.create(**kwargs).choices] == texts
    assert reply.usage.completion_tokens == 30 and reply.usage.prompt_tokens == transformers_greedy(CHAT, 1)[1]
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content
    assert [streamed[i] for i in range(3)] == texts


def test_logprobs_and_top_logprobs(client):
    reply = client.chat.completions.create(model="tgi", messages=CHAT, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token                    # greedy took the best one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    streamed = [c.choices[0].logprobs.content[0] for c in client.chat.completions.create(
        model="tgi", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True)]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_stop_sequences_and_list_content(client):
    plain = client.chat.completions.create(model="tgi", messages=CHAT, max_tokens=16, temperature=0, logprobs=True)
    tokens = [t.token for t in plain.choices[0].logprobs.content]
    k = next(k for k in range(2, 16) if tokens[k].strip() and tokens[k] not in "".join(tokens[:k]))
    parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": "Write a function "},
                                                   {"type": "text", "text": "that reverses a string."}]}]
    stopped = client.chat.completions.create(model="tgi", messages=parts, max_tokens=16, temperature=0,
                                             stop=tokens[k])
    assert stopped.choices[0].finish_reason == "stop_sequence"
    assert stopped.choices[0].message.content == "".join(tokens[:k + 1])     # TGI keeps the stop sequence
    assert stopped.usage.completion_tokens == k + 1


def test_text_generation_client_chat(url, client):
    from text_generation import Client
    from text_generation.types import Message

    expected = client.chat.completions.create(model="tgi", messages=CHAT, max_tokens=8, temperature=0)
    reply = Client(url).chat([Message(**m) for m in CHAT], max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == expected.choices[0].message.content
    assert reply.choices[0].finish_reason == "length" and reply.usage["completion_tokens"] == 8


def test_chat_tokenize_returns_the_templated_prompt_and_its_tokens(url):
    response = requests.post(url + "/chat_tokenize", json={"model": "tgi", "messages": CHAT})
    assert response.status_code == 200
    body = response.json()
    tokenizer = demo_tokenizer()
    assert body["templated_text"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert [t["id"] for t in body["tokenize_response"]] == tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    first = body["tokenize_response"][0]
    assert first == {"id": 1, "text": "<s>", "start": 0, "stop": 3}


def error_of(response) -> tuple[int, dict]:
    return response.status_code, response.json()


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "Input validation error: `messages` must contain at least one message"),
    ({"messages": [{"role": 1, "content": "x"}]}, "Input validation error: `messages[0].role` must be a string, got an integer"),
    ({"messages": CHAT, "n": 0}, "Input validation error: `n` must be >= 1 and <= 4 (--max-client-batch-size). Given: 0"),
    ({"messages": CHAT, "n": 5}, "Input validation error: `n` must be >= 1 and <= 4 (--max-client-batch-size). Given: 5"),
    ({"messages": CHAT, "temperature": -1}, "Input validation error: `temperature` must be strictly positive"),
    ({"messages": CHAT, "top_logprobs": 6}, "Input validation error: `top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"messages": CHAT, "max_tokens": 5000},
     "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 2048. Given: 30 `inputs` tokens and 5000 `max_new_tokens`"),
])
def test_validation_errors_are_tgis_422(url, body, message):
    assert error_of(requests.post(url + "/v1/chat/completions", json=body)) == \
        (422, {"error": message, "error_type": "validation"})


def test_tools_with_response_format_is_tgis_tool_error(url):
    body = {"messages": CHAT, "response_format": {"type": "json_object"},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    assert error_of(requests.post(url + "/v1/chat/completions", json=body)) == \
        (422, {"error": "Tool error: Grammar and tools are mutually exclusive", "error_type": "tool_error"})


def test_stream_errors_are_openai_events_then_done(url, client):
    body = {"messages": CHAT, "temperature": -1, "stream": True}
    response = requests.post(url + "/v1/chat/completions", json=body, stream=True)
    assert response.status_code == 200
    assert sse_payloads(response) == [
        '{"error":{"message":"Input validation error: `temperature` must be strictly positive","http_status_code":422}}',
        "[DONE]"]
    with pytest.raises(openai.APIError, match="`temperature` must be strictly positive"):
        list(client.chat.completions.create(model="tgi", messages=CHAT, temperature=-1, stream=True))


def test_no_chat_template_is_tgis_template_error(server_url):
    """The tiny test tokenizer has no chat template."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/chat/completions", "/chat_tokenize"):
        assert error_of(requests.post(server_url + path, json=body)) == \
            (422, {"error": "Template error: template not found", "error_type": "template_error"})
    with pytest.raises(openai.UnprocessableEntityError):
        openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="tgi", messages=body["messages"], stream=True)


def test_api_key_protects_chat_but_not_chat_tokenize():
    """TGI lists /chat_tokenize among the routes that never need the key."""
    with serve_demo(api_key="s3cret") as url:
        body = {"messages": CHAT, "max_tokens": 2}
        denied = requests.post(url + "/v1/chat/completions", json=body)
        assert (denied.status_code, denied.content) == (401, b"")
        allowed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert allowed.chat.completions.create(model="tgi", **body).usage.completion_tokens == 2
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s3cret"}):
            response = requests.post(url + "/chat_tokenize", json=body, headers=headers)
            assert response.status_code == 200, (headers, response.text)
            assert response.json()["tokenize_response"]


def test_chat_tokenize_has_no_input_token_bound(url):
    """TGI's chat_tokenize checks no length: a conversation beyond --max-input-tokens (1,024 here) and
    past the 4,096 tokens a response piece holds is tokenized whole."""
    messages = [{"role": "user", "content": " ".join(f"item{i} é" for i in range(3000))}]
    response = requests.post(url + "/chat_tokenize", json={"model": "tgi", "messages": messages}, timeout=60)
    assert response.status_code == 200, response.text[:300]
    body = response.json()
    tokenizer = demo_tokenizer()
    assert body["templated_text"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=False)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) > 4096 and [t["id"] for t in body["tokenize_response"]] == ids
    raw = body["templated_text"].encode()
    assert all(t["text"] == raw[t["start"]:t["stop"]].decode("utf-8", errors="replace")
               for t in body["tokenize_response"])
    chat = requests.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60)
    assert chat.status_code == 422             # the prompt limits stay on generation


def test_payload_limit_and_metrics_apply(url):
    with serve_demo(payload_limit=100) as small:
        too_big = requests.post(small + "/v1/chat/completions", json={"messages": CHAT})
        assert too_big.status_code == 413 and too_big.json()["error_type"] == "payload_too_large"

    def successes() -> float:
        text = requests.get(url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("tgi_request_success"))
    before = successes()
    requests.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "n": 2}).raise_for_status()
    assert successes() == before + 2         # one generation request per choice


def test_streamed_chat_and_completion_prompts_start_tokenizing_before_their_responses():
    """As /generate_stream: each choice's prompt goes to the tokenizer when the request is parsed, before its
    SSE response starts (under a burst the tokenizer threads then work while the event loop starts the other
    responses), and validation takes that encoding: the tokens of the templated chat / the completion prompt."""
    from tests.e2e.conftest import make_settings, serve
    from tests.e2e.demo_server import demo_backend
    from tgi_compat import create_app

    app = create_app(make_settings(model_id=DEMO_MODEL_ID, max_input_tokens=1024, max_total_tokens=2048),
                     demo_tokenizer(), demo_backend())
    service, given = app.state.service, []
    stream_steps = service.stream_steps

    def recording_stream_steps(request, full_text_default, templated=False, started=None):
        given.append(started)
        return stream_steps(request, full_text_default, templated=templated, started=started)
    service.stream_steps = recording_stream_steps
    prompts = ["def reverse(s):", "import os"]
    with serve(app) as url:
        chat = requests.post(f"{url}/v1/chat/completions", json={
            "model": "tgi", "messages": CHAT, "max_tokens": 4, "stream": True, "n": 2, "seed": 1})
        completion = requests.post(f"{url}/v1/completions", json={
            "model": "tgi", "prompt": prompts, "max_tokens": 4, "stream": True})
    assert sse_payloads(chat)[-1] == sse_payloads(completion)[-1] == "[DONE]"
    assert len(given) == 4 and all(started is not None and started.done() for started in given)
    tokenizer = demo_tokenizer()
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [started.result().ids for started in given] == [chat_ids, chat_ids] + [
        tokenizer(p)["input_ids"] for p in prompts]
