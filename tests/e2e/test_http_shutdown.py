"""A stream that is running when the server is told to exit (SIGTERM) goes on for up to
--graceful-termination-timeout: sse-starlette cancels every stream at once otherwise (its
shutdown watcher; here set by hand, as its AppStatus allows)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sse_starlette.sse import AppStatus


def stream_events(url: str, body: dict) -> list[dict]:
    """The events received; a stream cut short ends the list there."""
    events = []
    response = requests.post(url, json=body, stream=True, timeout=60)
    try:
        events.extend(json.loads(line[5:]) for line in response.iter_lines() if line.startswith(b"data:"))
    except requests.exceptions.ChunkedEncodingError:
        pass                                      # "Response ended prematurely": the server cut it
    return events


@pytest.mark.parametrize("grace_s,finishes", [(30.0, True), (0.0, False)])
def test_a_running_stream_finishes_within_the_grace_period(gated_app, grace_s, finishes):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 6, "details": True}}
    with gated_app(stream_shutdown_grace_s=grace_s) as (url, gated), ThreadPoolExecutor(1) as pool:
        events = pool.submit(stream_events, url + "/generate_stream", body)
        gated.wait_for_waiting(1)                 # streaming (headers sent), held before its first token
        AppStatus.should_exit = True
        try:
            time.sleep(1.2)                       # sse-starlette's watcher polls every 0.5 s
            gated.gate.set()
            got = events.result(30)
        finally:
            AppStatus.should_exit = False
    completed = bool(got) and (got[-1].get("details") or {}).get("generated_tokens") == 6
    assert completed == finishes, got
