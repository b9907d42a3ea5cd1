"""`POST /generate` and non-stream `POST /` against the real engine."""
from __future__ import annotations

import math

import requests
import torch

from tests.tiny_models import load_hf

from .conftest import CountingBackend, make_settings, send_raw_post, serve, spanning_stop, wait_idle

PROMPT = "hello world"
TIMING_HEADERS = ["x-compute-type", "x-compute-time", "x-compute-characters", "x-total-time", "x-validation-time",
                  "x-queue-time", "x-inference-time", "x-time-per-token", "x-prompt-tokens", "x-generated-tokens"]


def generate(url, inputs=PROMPT, route="/generate", **parameters):
    response = requests.post(url + route, json={"inputs": inputs, "parameters": parameters}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def test_greedy_tokens_equal_transformers(server_url, tiny_model_dir, hf_tokenizer):
    details = generate(server_url, max_new_tokens=10, details=True).json()["details"]
    prompt_ids = hf_tokenizer(PROMPT).input_ids
    hf = load_hf(tiny_model_dir)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=10, do_sample=False)[0, len(prompt_ids):]
    ids = [t["id"] for t in details["tokens"]]
    assert ids == expected.tolist()[:len(ids)]
    assert details["finish_reason"] in ("length", "eos_token") and details["seed"] is None


def test_details_with_prefill_and_top_tokens(server_url, hf_tokenizer):
    response = generate(server_url, max_new_tokens=6, details=True, decoder_input_details=True, top_n_tokens=3)
    details = response.json()["details"]
    prompt_ids = hf_tokenizer(PROMPT).input_ids
    assert [p["id"] for p in details["prefill"]] == prompt_ids
    assert details["prefill"][0] == {"id": 1, "text": "<s>", "logprob": None}
    assert all(isinstance(p["logprob"], float) and p["logprob"] <= 0 for p in details["prefill"][1:])
    tokens, top = details["tokens"], details["top_tokens"]
    assert len(tokens) == details["generated_tokens"] == len(top) == int(response.headers["x-generated-tokens"])
    for token, candidates in zip(tokens, top):
        assert set(token) == {"id", "text", "logprob", "special"} and token["logprob"] <= 0
        assert len(candidates) == 3
        assert candidates[0]["logprob"] >= candidates[1]["logprob"] >= candidates[2]["logprob"]
        assert math.isclose(candidates[0]["logprob"], token["logprob"], rel_tol=1e-4)   # greedy: the best one
    assert "best_of_sequences" not in details


def test_details_omitted_unless_asked_and_top_tokens_key_omitted(server_url):
    assert set(generate(server_url, max_new_tokens=2).json()) == {"generated_text"}
    details = generate(server_url, max_new_tokens=2, details=True).json()["details"]
    assert "top_tokens" not in details and details["prefill"] == []


def test_generated_text_is_the_tokens_without_special_tokens(server_url):
    details_body = generate(server_url, max_new_tokens=12, details=True).json()
    text = "".join(t["text"] for t in details_body["details"]["tokens"] if not t["special"])
    generated = details_body["generated_text"]
    # the random model emits arbitrary bytes: an incomplete character at the end is never
    # emitted as token text, but the final decode shows it as U+FFFD
    assert generated.startswith(text) and set(generated[len(text):]) <= {"\ufffd"}


def test_headers(server_url, hf_tokenizer):
    response = generate(server_url, max_new_tokens=4)
    for name in TIMING_HEADERS:
        assert name in response.headers, name
    assert response.headers["x-compute-type"] == "gpu+optimized"
    assert response.headers["x-compute-characters"] == str(len(PROMPT))
    assert response.headers["x-prompt-tokens"] == str(len(hf_tokenizer(PROMPT).input_ids))
    assert float(response.headers["x-compute-time"]) > 0
    assert response.headers["content-type"] == "application/json"


def test_seeded_sampling_is_reproducible_and_reports_the_seed(server_url):
    first = generate(server_url, max_new_tokens=8, do_sample=True, seed=1234, details=True).json()
    second = generate(server_url, max_new_tokens=8, do_sample=True, seed=1234, details=True).json()
    assert first == second and first["details"]["seed"] == 1234
    unseeded = generate(server_url, max_new_tokens=2, temperature=0.8, details=True).json()
    assert isinstance(unseeded["details"]["seed"], int)


def test_best_of_returns_the_sequence_with_the_highest_mean_logprob(server_url):
    details = generate(server_url, max_new_tokens=6, best_of=2, do_sample=True, details=True).json()["details"]
    (other,) = details["best_of_sequences"]
    mean = lambda tokens: sum(t["logprob"] for t in tokens) / len(tokens)   # noqa: E731
    assert mean(details["tokens"]) >= mean(other["tokens"])
    assert isinstance(details["seed"], int) and isinstance(other["seed"], int)
    assert set(other) >= {"generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"}


def test_return_full_text(server_url):
    plain = generate(server_url, max_new_tokens=4).json()["generated_text"]
    full = generate(server_url, max_new_tokens=4, return_full_text=True).json()["generated_text"]
    assert full == PROMPT + plain


def test_compat_route_returns_a_list_with_the_prompt_by_default(server_url):
    plain = generate(server_url, max_new_tokens=4).json()["generated_text"]
    response = generate(server_url, route="/", max_new_tokens=4)
    assert response.json() == [{"generated_text": PROMPT + plain}]
    assert "x-generated-tokens" in response.headers
    explicit = generate(server_url, route="/", max_new_tokens=4, return_full_text=False).json()
    assert explicit == [{"generated_text": plain}]


def test_truncate_keeps_the_last_prompt_tokens(server_url, hf_tokenizer):
    prompt = "the quick brown fox jumps over the lazy dog"
    response = generate(server_url, prompt, max_new_tokens=2, truncate=4, details=True, decoder_input_details=True)
    prefill = [p["id"] for p in response.json()["details"]["prefill"]]
    assert prefill == hf_tokenizer(prompt).input_ids[-4:]
    assert response.headers["x-prompt-tokens"] == "4"


def test_stop_sequence_spanning_two_tokens_stops_and_aborts(server_url, engine_backend):
    full = generate(server_url, max_new_tokens=16, details=True).json()
    stop, count = spanning_stop([t["text"] for t in full["details"]["tokens"]])
    stopped = generate(server_url, max_new_tokens=16, details=True, stop=[stop]).json()
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert stopped["details"]["generated_tokens"] == count
    assert stop in stopped["generated_text"]                 # the stop sequence stays in the output
    assert full["generated_text"].startswith(stopped["generated_text"])
    wait_idle(engine_backend)                                # the request was aborted: its KV slots are free


def test_client_disconnect_aborts_a_non_stream_request(hf_tokenizer, engine_backend):
    from tgi_compat import create_app

    backend = CountingBackend(engine_backend)
    app = create_app(make_settings(max_input_tokens=64, max_total_tokens=500), hf_tokenizer, backend)
    with serve(app) as url:
        with send_raw_post(url, "/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 480}}):
            assert backend.started.wait(10)            # generating: now the client goes away
        request_id = backend.wait_closed()
        assert backend.closed_early[request_id] and backend.consumed[request_id] < 480
        wait_idle(engine_backend)
