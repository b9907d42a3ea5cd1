"""HTTP statuses and bodies of every error class: 422, 400, 413, 415, 401, 429, 424."""
from __future__ import annotations

import json
import threading

import pytest
import requests

VALIDATION = "Input validation error: "
STATUS_MATRIX = [
    # (id, raw body or JSON, status, exact error message)
    ("temperature", {"inputs": "a", "parameters": {"temperature": 0}}, 422,
     VALIDATION + "`temperature` must be strictly positive"),
    ("top_p", {"inputs": "a", "parameters": {"top_p": 1.0}}, 422, VALIDATION + "`top_p` must be > 0.0 and < 1.0"),
    ("stop-count", {"inputs": "a", "parameters": {"stop": ["1", "2", "3", "4", "5"]}}, 422,
     VALIDATION + "`stop` supports up to 4 stop sequences. Given: 5"),
    ("empty-inputs", {"inputs": "", "parameters": {}}, 422, VALIDATION + "`inputs` cannot be empty"),
    ("best_of-greedy", {"inputs": "a", "parameters": {"best_of": 2}}, 422,
     VALIDATION + "you must use sampling when `best_of` is > 1"),
    ("best_of-max", {"inputs": "a", "parameters": {"best_of": 3, "do_sample": True}}, 422,
     VALIDATION + "`best_of` must be > 0 and <= 2. Given: 3"),
    ("prompt-too-long", {"inputs": "hello " * 70, "parameters": {"max_new_tokens": 1}}, 422, None),
    ("wrong-type", {"inputs": "a", "parameters": {"max_new_tokens": "ten"}}, 422,
     VALIDATION + "`parameters.max_new_tokens` must be an integer, got a string"),
    ("missing-inputs", {"parameters": {}}, 422, VALIDATION + "missing field `inputs`"),
    ("grammar", {"inputs": "a", "parameters": {"grammar": {"type": "json", "value": {"type": "object"}}}}, 422,
     VALIDATION + "grammar is not valid: Grammar must have a 'properties' field"),
    ("malformed-json", b'{"inputs": "a",', 400, None),
    ("parameters-null", {"inputs": "a", "parameters": None}, 422,
     VALIDATION + "`parameters` must be an object, got null"),
    ("temperature-underflows", b'{"inputs": "a", "parameters": {"temperature": 1e-320}}', 422,
     VALIDATION + "`temperature` must be strictly positive"),
    ("temperature-infinite", b'{"inputs": "a", "parameters": {"temperature": 1e309}}', 422,
     VALIDATION + "`parameters.temperature` must be a finite number within float32's range (|x| <= 3.403e+38), got inf"),
    ("nested-970", b'{"inputs": "a", "parameters": {"stop": ' + b"[" * 970 + b"]" * 970 + b"}}", 400,
     "Failed to parse the request body as JSON: nesting deeper than 128"),
    ("lone-surrogate", b'{"inputs": "a\\ud800"}', 400,
     "Failed to parse the request body as JSON: lone surrogate in a string at character 1"),
]


@pytest.mark.parametrize("route", ["/generate", "/"])
@pytest.mark.parametrize("body,status,message", [c[1:] for c in STATUS_MATRIX], ids=[c[0] for c in STATUS_MATRIX])
def test_error_status_and_body(server_url, route, body, status, message):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = requests.post(server_url + route, data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"error", "error_type"}
    if status == 422:
        assert error["error_type"] == "validation"
    if message is not None:
        assert error["error"] == message
    elif status == 400:
        assert error["error"].startswith("Failed to parse the request body as JSON: ")
    else:
        assert error["error"].startswith(VALIDATION + "`inputs` must have less than 64 tokens. Given: ")


def test_missing_content_type_is_415(server_url):
    response = requests.post(server_url + "/generate", data=b'{"inputs":"a"}', timeout=10)
    assert response.status_code == 415
    assert response.json() == {"error": "Expected request with `Content-Type: application/json`",
                               "error_type": "unsupported_media_type"}


def test_oversized_body_is_413(serve_app):
    with serve_app(payload_limit=1000) as url:
        response = requests.post(url + "/generate", json={"inputs": "a" * 2000}, timeout=10)
        assert response.status_code == 413 and response.json()["error_type"] == "payload_too_large"
        assert requests.post(url + "/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}},
                             timeout=30).status_code == 200


PROTECTED = [("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/"), ("POST", "/tokenize")]
OPEN = [("GET", "/health"), ("GET", "/"), ("GET", "/ping"), ("GET", "/info"), ("GET", "/metrics")]


def test_api_key(serve_app):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 1}}
    with serve_app(api_key="S3cret") as url:
        for method, path in PROTECTED:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "S3cret"}):
                response = requests.request(method, url + path, json=body, headers=headers, timeout=30)
                assert response.status_code == 401 and response.content == b"", (path, headers)
            ok = requests.request(method, url + path, json=body, headers={"Authorization": "bearer s3CRET"},
                                  timeout=30)
            assert ok.status_code == 200, (path, ok.text)
        for method, path in OPEN:
            assert requests.request(method, url + path, timeout=30).status_code == 200, path


def start_stream(url: str, results: list) -> threading.Thread:
    """POST a stream in a thread (it blocks at the gate, holding its permit)."""
    def run():
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 3}}
        results.append(requests.post(url + "/generate_stream", json=body, timeout=60))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_overloaded_is_429_or_an_in_band_event(gated_app):
    overloaded = {"error": "Model is overloaded", "error_type": "overloaded"}
    with gated_app(max_concurrent_requests=1) as (url, gated):
        results: list = []
        holder = start_stream(url, results)
        gated.wait_for_waiting(1)
        response = requests.post(url + "/generate", json={"inputs": "a"}, timeout=10)
        assert response.status_code == 429 and response.json() == overloaded
        streamed = requests.post(url + "/generate_stream", json={"inputs": "a"}, timeout=10)
        assert streamed.status_code == 200
        assert streamed.content == b"data:" + json.dumps(overloaded, separators=(",", ":")).encode() + b"\n\n"
        gated.gate.set()
        holder.join(30)
        assert results[0].status_code == 200 and b'"finish_reason"' not in results[0].content  # no details asked
        assert results[0].content.count(b"data:") == 3
        metrics = requests.get(url + "/metrics", timeout=10).text
        assert 'tgi_request_failure{err="overloaded"} 2' in metrics
        ok = requests.post(url + "/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1}}, timeout=30)
        assert ok.status_code == 200                              # the permit came back


def test_best_of_takes_one_permit_per_sequence(gated_app):
    with gated_app(max_concurrent_requests=2) as (url, gated):
        results: list = []
        holder = start_stream(url, results)
        gated.wait_for_waiting(1)
        body = {"inputs": "a", "parameters": {"best_of": 2, "do_sample": True, "max_new_tokens": 2}}
        response = requests.post(url + "/generate", json=body, timeout=10)
        assert response.status_code == 429
        gated.gate.set()
        holder.join(30)
        assert requests.post(url + "/generate", json=body, timeout=30).status_code == 200


def test_engine_failure_is_424(serve_app):
    # The front end allows more tokens than the engine's context (512): the engine refuses.
    with serve_app(max_input_tokens=64, max_total_tokens=4096) as url:
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 1000}}
        response = requests.post(url + "/generate", json=body, timeout=30)
        assert response.status_code == 424, response.text
        error = response.json()
        assert error["error_type"] == "generation"
        assert error["error"].startswith("Request failed during generation: ")
        streamed = requests.post(url + "/generate_stream", json=body, timeout=30)
        assert streamed.status_code == 200 and b'"error_type":"generation"' in streamed.content


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/chat_tokenize",
                                   "/generate_stream"])
@pytest.mark.parametrize("body,message", [
    (b'{"model": "tgi", "messages": [], "tool_choice": "\\udc80"}', "lone surrogate"),
    (b'{"inputs": ' + b"[" * 970 + b"]" * 970 + b"}", "nesting deeper than 128"),
])
def test_hostile_json_is_400_on_every_route(server_url, route, body, message):
    response = requests.post(server_url + route, data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]


def test_request_text_stays_out_of_the_info_log(server_url, caplog):
    """A refused grammar's regex (and any other quoted request text) is logged at DEBUG only."""
    secret = "zq(secret-pattern"
    body = {"inputs": "a", "parameters": {"grammar": {"type": "regex", "value": secret}}}
    with caplog.at_level("INFO"):
        response = requests.post(server_url + "/generate", json=body, timeout=30)
    assert response.status_code == 422 and secret in response.json()["error"]
    assert "request" in caplog.text and "failed (422 validation" in caplog.text
    assert secret not in caplog.text
