"""`POST /generate_stream` and streaming `POST /`: TGI's SSE bytes, in-band errors,
and a client that goes away."""
from __future__ import annotations

import json
import re

import pytest
import requests

from .conftest import CountingBackend, make_settings, send_raw_post, serve, wait_idle

EVENT = re.compile(rb"data:(\{[^\n]*\})\n\n")


def stream_raw(url, body, route="/generate_stream") -> requests.Response:
    response = requests.post(url + route, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def events_of(raw: bytes) -> list[dict]:
    matches = EVENT.findall(raw)
    assert b"".join(b"data:" + m + b"\n\n" for m in matches) == raw, raw   # nothing else on the wire
    return [json.loads(m) for m in matches]


def test_stream_framing_and_events(server_url):
    body = {"inputs": "hello world", "parameters": {"max_new_tokens": 6, "details": True}}
    response = stream_raw(server_url, body)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["x-compute-type"] == "gpu+optimized"
    assert response.headers["x-compute-characters"] == "11"
    events = events_of(response.content)
    assert b"data: " not in response.content and b"[DONE]" not in response.content
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    for event in events[:-1]:
        assert list(event) == ["index", "token", "generated_text", "details"]
        assert event["generated_text"] is None and event["details"] is None
    last = events[-1]
    assert set(last["details"]) == {"finish_reason", "generated_tokens", "seed", "input_length"}
    assert last["details"]["generated_tokens"] == len(events) and last["details"]["input_length"] == 4
    plain = requests.post(server_url + "/generate", json=body, timeout=60).json()
    # the same tokens; logprobs to float noise (the second run may reuse cached prompt KV or batch differently)
    without_logprob = [{k: v for k, v in t.items() if k != "logprob"} for t in plain["details"]["tokens"]]
    assert [{k: v for k, v in e["token"].items() if k != "logprob"} for e in events] == without_logprob
    assert [e["token"]["logprob"] for e in events] == pytest.approx(
        [t["logprob"] for t in plain["details"]["tokens"]], abs=1e-5)
    assert last["generated_text"] == plain["generated_text"]


def test_stream_without_details_has_null_details_and_top_tokens_per_event(server_url):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 3, "top_n_tokens": 2}}
    events = events_of(stream_raw(server_url, body).content)
    assert events[-1]["details"] is None and isinstance(events[-1]["generated_text"], str)
    assert all(len(e["top_tokens"]) == 2 for e in events)


def test_compat_stream_prepends_the_prompt_by_default(server_url):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 3}, "stream": True}
    events = events_of(stream_raw(server_url, body, route="/").content)
    assert events[-1]["generated_text"].startswith("hello")


def single_error(url, parameters, route="/generate_stream", **extra) -> dict:
    response = stream_raw(url, {"inputs": "hello", "parameters": parameters, **extra}, route=route)
    (event,) = events_of(response.content)
    return event


def test_in_band_errors_on_streams(server_url):
    assert single_error(server_url, {"top_k": 0}) == {
        "error": "Input validation error: `top_k` must be strictly positive", "error_type": "validation"}
    assert single_error(server_url, {"best_of": 2, "do_sample": True}) == {
        "error": "Input validation error: `best_of` != 1 is not supported when streaming tokens",
        "error_type": "validation"}
    assert single_error(server_url, {"decoder_input_details": True}, route="/", stream=True) == {
        "error": "Input validation error: `decoder_input_details` == true is not supported when streaming tokens",
        "error_type": "validation"}
    assert single_error(server_url, {"max_new_tokens": 500})["error"].startswith(
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 128.")


def test_malformed_stream_body_is_an_http_error(server_url):
    response = requests.post(server_url + "/generate_stream", json={"inputs": 3}, timeout=10)
    assert response.status_code == 422 and response.json()["error_type"] == "validation"


def test_client_disconnect_aborts_the_request(hf_tokenizer, engine_backend):
    from tgi_compat import create_app

    backend = CountingBackend(engine_backend)
    app = create_app(make_settings(max_input_tokens=64, max_total_tokens=500), hf_tokenizer, backend)
    with serve(app) as url:
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 480}}
        with send_raw_post(url, "/generate_stream", body) as sock:
            received = b""
            while received.count(b"data:") < 3:
                received += sock.recv(65536)
        request_id = backend.wait_closed()
        assert backend.closed_early[request_id], "the backend iterator ran to the end instead of being closed"
        assert backend.consumed[request_id] < 480
        wait_idle(engine_backend)
        metrics = requests.get(url + "/metrics", timeout=10).text
        assert 'tgi_request_failure{err="dropped"} 1' in metrics
