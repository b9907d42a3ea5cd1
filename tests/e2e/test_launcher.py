"""End to end: the real launcher (supervisor, shard, router, front end processes) on a
free loopback port with a tiny checkpoint, driven by the clients TGI users run.
Limits, auth, a dying shard and SIGTERM: test_launcher_lifecycle.py."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time

import pytest
import requests
import text_generation
from huggingface_hub import InferenceClient

from tests.e2e.server import running

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def server(launcher_model_dir):
    """Stopped when this module ends: on one GPU a second server (test_launcher_lifecycle) needs its memory."""
    with running(launcher_model_dir, "--max-concurrent-requests", "256", "--max-total-tokens", "256",
                 "--max-input-tokens", "192", "--max-batch-prefill-tokens", "512") as srv:
        yield srv


def metric(server, name: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=5).text
    match = re.search(rf"^{name} ([0-9.eE+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_until_idle(server, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "tgi_kv_cache_usage") == 0 and metric(server, "tgi_batch_current_size") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("KV slots still in use after the requests ended")


# ---- the clients -------------------------------------------------------------------------

def test_text_generation_client_parses_every_response(server):
    client = text_generation.Client(server.url, timeout=60)
    r = client.generate("hello world", max_new_tokens=12, decoder_input_details=True, top_n_tokens=3)
    assert r.details.generated_tokens == 12 == len(r.details.tokens)
    assert r.details.finish_reason == "length"
    assert r.details.prefill[0].logprob is None and all(t.logprob is not None for t in r.details.prefill[1:])
    assert len(r.details.top_tokens) == 12 and all(len(t) == 3 for t in r.details.top_tokens)
    assert r.generated_text == "".join(t.text for t in r.details.tokens if not t.special)
    streamed = list(client.generate_stream("hello world", max_new_tokens=12))
    assert [s.token.id for s in streamed] == [t.id for t in r.details.tokens]
    assert streamed[-1].generated_text == r.generated_text and streamed[-1].details.finish_reason == "length"


def test_best_of_returns_the_other_sequences(server):
    client = text_generation.Client(server.url, timeout=60)
    r = client.generate("hello", max_new_tokens=6, best_of=2, do_sample=True)
    assert len(r.details.best_of_sequences) == 1 and r.details.seed is not None


def test_async_client(server):
    async def run():
        client = text_generation.AsyncClient(server.url, timeout=60)
        full = await client.generate("the quick brown", max_new_tokens=8)
        tokens = [s.token.id async for s in client.generate_stream("the quick brown", max_new_tokens=8)]
        return full, tokens

    full, tokens = asyncio.run(run())
    assert [t.id for t in full.details.tokens] == tokens


def test_client_error_classes_for_validation(server):
    client = text_generation.Client(server.url, timeout=60)
    with pytest.raises(text_generation.errors.ValidationError, match="must be <= 256"):
        client.generate("hello", max_new_tokens=1000)
    with pytest.raises(text_generation.errors.ValidationError):
        list(client.generate_stream("hello", max_new_tokens=1000))


def test_huggingface_hub_inference_client_streams(server):
    client = InferenceClient(base_url=server.url)
    chunks = list(client.text_generation("hello there", max_new_tokens=7, stream=True, details=True))
    assert len(chunks) == 7 and chunks[-1].details.finish_reason == "length"
    text = client.text_generation("hello there", max_new_tokens=7)
    assert text == chunks[-1].generated_text


def test_curl_sees_server_sent_events(server):
    body = json.dumps({"inputs": "hello", "parameters": {"max_new_tokens": 5}})
    out = subprocess.run(["curl", "-sN", "-X", "POST", server.url + "/generate_stream", "-H",
                          "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=60)
    events = [json.loads(line[len("data:"):]) for line in out.stdout.splitlines() if line.startswith("data:")]
    assert [e["index"] for e in events] == [1, 2, 3, 4, 5]
    assert events[-1]["details"] is None and isinstance(events[-1]["generated_text"], str)


# ---- load, disconnects, bad input --------------------------------------------------------

def test_200_concurrent_streams_equal_one_at_a_time(server):
    prompts = [("hello world " * (1 + i % 7))[: 10 + 3 * i] for i in range(200)]
    lengths = [4 + i % 29 for i in range(200)]

    async def stream_all():
        client = text_generation.AsyncClient(server.url, timeout=300)

        async def one(prompt, n):
            return [s.token.id async for s in client.generate_stream(prompt, max_new_tokens=n)]

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    together = asyncio.run(stream_all())
    client = text_generation.Client(server.url, timeout=60)
    for i in range(200):   # each again, one at a time (the model may end a sequence with EOS early)
        alone = client.generate(prompts[i], max_new_tokens=lengths[i])
        assert together[i] == [t.id for t in alone.details.tokens], i
        assert len(together[i]) == lengths[i] or alone.details.finish_reason == "eos_token"
    wait_until_idle(server)


def test_clients_that_disconnect_mid_stream_free_their_slots(server):
    body = {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 240}}
    responses = []
    for _ in range(5):
        r = requests.post(server.url + "/generate_stream", json=body, stream=True, timeout=30)
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith(b"data:"))
        responses.append(r)
    deadline = time.monotonic() + 5
    while metric(server, "tgi_kv_cache_usage") == 0:   # the router reports every 0.25 s
        assert time.monotonic() < deadline, "the open streams hold no KV slots"
        time.sleep(0.05)
    for r in responses:
        r.close()
    wait_until_idle(server)


BAD_BODIES = [
    ({"inputs": "hi", "parameters": {"temperature": 0}}, "`temperature` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"temperature": -1}}, "`temperature` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"repetition_penalty": 0}}, "`repetition_penalty` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"frequency_penalty": 3}}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"inputs": "hi", "parameters": {"frequency_penalty": -2.5}}, "`frequency_penalty` must be >= -2.0"),
    ({"inputs": "hi", "parameters": {"top_p": 1.0}}, "`top_p` must be > 0.0 and < 1.0"),
    ({"inputs": "hi", "parameters": {"top_p": 0}}, "`top_p` must be > 0.0 and < 1.0"),
    ({"inputs": "hi", "parameters": {"typical_p": 1.5}}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"inputs": "hi", "parameters": {"top_k": 0}}, "`top_k` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "`max_new_tokens` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}, "`stop` supports up to 4 stop sequences"),
    ({"inputs": "hi", "parameters": {"best_of": 2, "do_sample": True, "seed": 1}}, "`seed` must not be set"),
    ({"inputs": "hi", "parameters": {"best_of": 2}}, "you must use sampling when `best_of` is > 1"),
    ({"inputs": "hi", "parameters": {"best_of": 3, "do_sample": True}}, "`best_of` must be > 0 and <= 2"),
    ({"inputs": "hi", "parameters": {"top_n_tokens": 6}}, "`top_n_tokens` must be >= 0 and <= 5"),
    ({"inputs": ""}, "`inputs` cannot be empty"),
    ({"inputs": "hi", "parameters": {"truncate": 0}}, "`truncate` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"truncate": 500}}, "`truncate` must be strictly positive and less than 192"),
    ({"inputs": "hello " * 300, "parameters": {"max_new_tokens": 1}}, "`inputs` tokens + `max_new_tokens` must be"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 300}}, "`max_new_tokens` must be <= 256"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": "ten"}}, ""),
    ({"inputs": 5}, ""),
    ({"parameters": {}}, ""),
    ({"inputs": "hi", "parameters": {"stop": "x"}}, ""),
    ({"inputs": "hi", "parameters": {"seed": -1}}, ""),
    ({"inputs": "hi", "parameters": {"do_sample": "yes"}}, ""),
    ({"inputs": "hi", "parameters": {"details": 3}}, ""),
]


@pytest.mark.parametrize("body,message", BAD_BODIES)
def test_bad_bodies_get_422_and_the_server_keeps_serving(server, body, message):
    r = requests.post(server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 422, r.text
    payload = r.json()
    assert payload["error_type"] == "validation" and message in payload["error"]
    stream = requests.post(server.url + "/generate_stream", json=body, timeout=30)
    if message:   # validation errors arrive in-band on streams, with HTTP 200
        assert stream.status_code == 200 and '"error_type":"validation"' in stream.text
        # TGI rejects any best_of != 1 on streams before the other checks
        expected = "`best_of` != 1 is not supported when streaming tokens" if "best_of" in body.get("parameters", {}) else message
        assert expected in stream.text


def test_malformed_requests_get_their_status(server):
    url = server.url + "/generate"
    assert requests.post(url, data="{not json", headers={"Content-Type": "application/json"}).status_code == 400
    assert requests.post(url, data='{"inputs":"hi"}', headers={"Content-Type": "text/plain"}).status_code == 415
    big = {"inputs": "x" * 2_100_000}
    assert requests.post(url, json=big, timeout=30).status_code == 413
    assert requests.post(url, json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    wait_until_idle(server)
