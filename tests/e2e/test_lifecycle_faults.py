"""Faults the router must see on its own: a shard that stops answering (SIGSTOP) and a shard
that dies while the server is idle. Each test runs its own launched server."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import requests

from tests.e2e.server import running

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ARGS = ("--max-total-tokens", "256", "--max-input-tokens", "192")


def shard_pid(server) -> int:
    return int(re.search(r"started shard-0 \(pid (\d+)\)", server.output()).group(1))


def health_becomes(server, status: int, within: float) -> float:
    """Seconds until /health answers ``status`` (fails after ``within``)."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if requests.get(server.url + "/health", timeout=5).status_code == status:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"/health did not answer {status} within {within} s:\n{server.output()[-3000:]}")


def test_a_stuck_shard_turns_health_503_and_ends_requests_then_recovers(launcher_model_dir):
    with running(launcher_model_dir, *ARGS, "--step-timeout", "1.5") as srv:
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 200}}
        stream = requests.post(srv.url + "/generate_stream", json=body, stream=True, timeout=60)
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith(b"data:"))
        pid = shard_pid(srv)
        os.kill(pid, signal.SIGSTOP)
        try:
            assert health_becomes(srv, 503, within=6.0) < 6.0
            assert b'"error_type":"generation"' in b"\n".join(lines)       # the stream ended with an error
            refused = requests.post(srv.url + "/generate", json={"inputs": "hi"}, timeout=30)
            assert refused.status_code == 424 and refused.json()["error_type"] == "generation"    # TGI's shape
        finally:
            os.kill(pid, signal.SIGCONT)
        health_becomes(srv, 200, within=10.0)
        answer = requests.post(srv.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 3}},
                               timeout=30)
        assert answer.status_code == 200, answer.text


def test_a_shard_killed_while_idle_turns_health_503_within_two_seconds(launcher_model_dir):
    with running(launcher_model_dir, *ARGS, expect_clean_exit=False) as srv:
        os.kill(shard_pid(srv), signal.SIGKILL)
        assert health_becomes(srv, 503, within=2.0) < 2.0
