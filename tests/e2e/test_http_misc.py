"""/info, health routes, /metrics, /tokenize, request ids in the logs, startup objects frozen."""
from __future__ import annotations

import gc
import logging
import re
import time

import requests

from tgi_compat import create_app
from engine.processes import SERVING_GC_THRESHOLDS

from .conftest import make_settings, serve

INFO_FIELDS = {"model_id", "model_sha", "model_pipeline_tag", "max_concurrent_requests", "max_best_of",
               "max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers",
               "max_client_batch_size", "router", "version", "sha", "docker_label"}
LEGACY_FIELDS = {"max_input_length", "model_dtype", "model_device_type", "waiting_served_ratio",
                 "max_batch_total_tokens", "max_waiting_tokens"}


def test_info(server_url):
    info = requests.get(server_url + "/info", timeout=10).json()
    assert INFO_FIELDS | LEGACY_FIELDS <= set(info)
    assert info["model_id"] == "tiny-llama" and info["max_input_tokens"] == info["max_input_length"] == 64
    assert info["max_total_tokens"] == 128 and info["max_best_of"] == 2 and info["max_concurrent_requests"] == 16
    assert info["max_batch_total_tokens"] == 4096       # the engine's KV capacity


def test_health_routes(server_url):
    for path in ("/health", "/", "/ping"):
        response = requests.get(server_url + path, timeout=10)
        assert response.status_code == 200 and response.content == b"", path


class UnhealthyBackend:
    """The real backend, reporting itself unhealthy (as after a failed engine step)."""

    def __init__(self, backend):
        self.backend = backend

    def healthy(self):
        return False

    def stats(self):
        return self.backend.stats()

    def observe_steps(self, observer):
        self.backend.observe_steps(observer)

    def generate(self, request):
        return self.backend.generate(request)


def test_unhealthy_is_503(hf_tokenizer, engine_backend):
    with serve(create_app(make_settings(), hf_tokenizer, UnhealthyBackend(engine_backend))) as url:
        for path in ("/health", "/", "/ping"):
            response = requests.get(url + path, timeout=10)
            assert response.status_code == 503
            assert response.json() == {"error": "unhealthy", "error_type": "healthcheck"}


def test_serving_tunes_the_garbage_collector(hf_tokenizer, engine_backend):
    """What is alive when the app starts serving (torch, transformers, the tokenizer) is out of the
    collector's reach and young collections are rarer: no collection walks it all in the middle of a
    burst. The process's own settings come back at shutdown."""
    outer = gc.get_threshold()        # another test's server may be running
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)     # Python's default
    try:
        with serve(create_app(make_settings(), hf_tokenizer, engine_backend)):
            assert gc.get_freeze_count() > 100_000
            assert gc.get_threshold() == SERVING_GC_THRESHOLDS
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*outer)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def settled_metrics(url: str) -> str:
    """/metrics once the last step's numbers are in (they are recorded just after its events)."""
    deadline = time.monotonic() + 5
    while True:
        text = requests.get(url + "/metrics", timeout=10).text
        steps = sum(metric(text, f'tgi_batch_inference_success{{method="{m}"}}') for m in ("prefill", "decode"))
        if metric(text, "tgi_batch_next_size_count") == steps or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_metrics_count_requests(hf_tokenizer, engine_backend):
    with serve(create_app(make_settings(num_shards=1), hf_tokenizer, engine_backend)) as url:
        for _ in range(2):
            requests.post(url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}, timeout=30)
        requests.post(url + "/generate", json={"inputs": "hello", "parameters": {"top_k": 0}}, timeout=30)
        text = settled_metrics(url)
    assert metric(text, "tgi_request_count") == 3 and metric(text, "tgi_request_success") == 2
    assert metric(text, 'tgi_request_failure{err="validation"}') == 1
    assert metric(text, "tgi_request_duration_count") == 2
    assert metric(text, "tgi_request_generated_tokens_sum") <= 6
    assert metric(text, "tgi_request_input_length_count") == 2
    assert metric(text, "tgi_batch_max_total_tokens") == 4096
    assert 0.0 <= metric(text, "tgi_kv_cache_usage") <= 1.0 and metric(text, "tgi_num_shards") == 1
    # the router's steps: both requests prefilled in a step of their own, then decoded
    assert metric(text, 'tgi_batch_inference_count{method="prefill"}') >= 2
    assert metric(text, 'tgi_batch_inference_success{method="decode"}') >= 2
    steps = sum(metric(text, f'tgi_batch_inference_success{{method="{m}"}}') for m in ("prefill", "decode"))
    assert metric(text, "tgi_batch_next_size_count") == steps and metric(text, 'tgi_batch_next_size_bucket{le="1.0"}') == steps
    assert metric(text, 'tgi_batch_forward_duration_count{method="prefill"}') >= 2
    # the second request found the first one's prompt in the prefix cache
    assert 0 < metric(text, "tgi_prefix_cache_hit_tokens") < metric(text, "tgi_prefix_cache_lookup_tokens")


def test_metrics_count_the_tokenizer_piece_cache(hf_tokenizer, engine_backend):
    """Two prompts long enough to be cut into pieces, behind one long beginning: the first one's pieces are all
    encoded (misses), the second finds the shared ones in the front end's piece cache (hits)."""
    from tgi_compat.text_pieces import PieceCutter

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta"]
    prefix = " ".join(words[i * 5 % 7] for i in range(1600))       # 9,597 characters, a cut after any word
    prompts = [prefix + " alpha beta", prefix + " gamma delta"]
    cutter = PieceCutter.for_tokenizer(hf_tokenizer.backend_tokenizer)
    first, second = (set(cutter.encoded(cutter.cut(prompt))) for prompt in prompts)     # what the cache keeps
    assert len(first & second) >= 2 and len(second - first) == 1
    with serve(create_app(make_settings(), hf_tokenizer, engine_backend)) as url:
        for prompt in prompts:          # one after the other: the second is looked up once the first is cached
            response = requests.post(url + "/generate", json={
                "inputs": prompt, "parameters": {"max_new_tokens": 1, "truncate": 16}}, timeout=30)
            assert response.status_code == 200, response.text
        text = requests.get(url + "/metrics", timeout=10).text
    assert metric(text, "tgi_tokenizer_piece_cache_hits") == len(first & second)
    assert metric(text, "tgi_tokenizer_piece_cache_misses") == len(first) + len(second - first)
    assert metric(text, "tgi_tokenizer_piece_cache_chars") == sum(len(piece) for piece in first | second)


def test_tokenize(server_url, hf_tokenizer):
    text = "hello é world"
    tokens = requests.post(server_url + "/tokenize", json={"inputs": text}, timeout=10).json()
    assert [t["id"] for t in tokens] == hf_tokenizer(text).input_ids
    assert tokens[0] == {"id": 1, "text": "", "start": 0, "stop": 0}
    raw = text.encode()
    for token in tokens:
        assert token["text"] == raw[token["start"]:token["stop"]].decode("utf-8", errors="replace")
    assert tokens[-1]["stop"] == len(raw)                  # byte offsets: "é" is two bytes
    for truncate in (2, 0, 10**6):      # TGI's tokenize neither applies nor range-checks `truncate`
        response = requests.post(server_url + "/tokenize", json={"inputs": text, "parameters": {"truncate": truncate}},
                                 timeout=10)
        assert response.status_code == 200 and response.json() == tokens, (truncate, response.text)


def test_tokenize_has_no_input_token_bound(server_url, hf_tokenizer):
    """TGI's tokenize checks no length: a text far beyond --max-input-tokens (64 here) is tokenized
    whole, also past the 4,096 tokens a response piece holds."""
    text = "".join(f"word{i} é, " for i in range(2500))
    ids = hf_tokenizer(text).input_ids
    assert len(ids) > 2 * 4096
    response = requests.post(server_url + "/tokenize", json={"inputs": text}, timeout=60)
    assert response.status_code == 200, response.text[:300]
    tokens = response.json()
    assert [t["id"] for t in tokens] == ids
    raw = text.encode()
    assert all(t["text"] == raw[t["start"]:t["stop"]].decode("utf-8", errors="replace") for t in tokens)
    assert tokens[-1]["stop"] == len(raw)
    generate = requests.post(server_url + "/generate", json={"inputs": text}, timeout=60)
    assert generate.status_code == 422         # the prompt limits stay on generation


def test_one_log_line_per_event_with_increasing_request_ids(server_url, caplog):
    caplog.set_level(logging.INFO, logger="tgi_compat")
    for _ in range(2):
        requests.post(server_url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, timeout=30)
    received = [int(m.group(1)) for r in caplog.records
                if r.name == "tgi_compat" and (m := re.match(r"request (\d+) received", r.getMessage()))]
    finished = [r for r in caplog.records if r.name == "tgi_compat" and " finished: " in r.getMessage()]
    assert len(received) == 2 and received[0] < received[1] and len(finished) == 2
