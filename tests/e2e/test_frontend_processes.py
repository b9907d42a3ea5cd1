"""End to end, ``--frontend-processes 2``: two front ends on one port serve as one server.

Each request below opens its own connection, so the kernel (SO_REUSEPORT) hands them to both
processes: the ids stay unique, /metrics counts every request whichever process answers the
scrape, --max-concurrent-requests is the server's limit, and SIGTERM drains both.
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import requests

from tests.e2e.server import LaunchedServer, running

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LIMIT = 4
STATUS_SETTLES_S = 0.6      # an idle router sends its status at least every 0.25 s (engine.router.process)


def wait_for_both(srv: LaunchedServer, timeout: float = 60.0) -> LaunchedServer:
    """/health answers once one front end listens; wait until both do (each logs its serving line after it
    bound the port)."""
    deadline = time.monotonic() + timeout
    while len(re.findall(r"\(front end \d of 2\)", srv.output())) < 2:
        assert time.monotonic() < deadline, srv.output()
        time.sleep(0.1)
    return srv


@pytest.fixture(scope="module")
def two_front_ends(launcher_model_dir):
    with running(launcher_model_dir, "--frontend-processes", "2", "--max-concurrent-requests", str(LIMIT),
                 "--max-total-tokens", "512", "--max-input-tokens", "64") as srv:
        yield wait_for_both(srv)


def _generate(url: str, text: str, new_tokens: int = 4) -> requests.Response:
    return requests.post(url + "/generate", json={"inputs": text, "parameters": {"max_new_tokens": new_tokens}},
                         timeout=60)


def _received_ids(output: str) -> list[int]:
    return [int(i) for i in re.findall(r"request (\d+) received", output)]


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_both_front_ends_take_requests_and_number_them_apart(two_front_ends):
    assert re.search(r"started frontend-0 \(pid \d+\).*\n.*started frontend-1 \(pid \d+\)", two_front_ends.output())
    before = len(_received_ids(two_front_ends.output()))
    answers = [_generate(two_front_ends.url, f"def f{i}(x):") for i in range(16)]
    assert all(r.status_code == 200 and r.json()["generated_text"] for r in answers)
    ids = _received_ids(two_front_ends.output())[before:]
    assert len(ids) == 16 and len(set(ids)) == 16
    assert {i % 2 for i in ids} == {0, 1}           # odd ids: front end 1 of 2, even: front end 2 (all on one: 2^-15)


def test_front_ends_yield_the_cpu_to_the_router_and_the_shard(two_front_ends):
    """Their niceness is raised (the router's and the shard's are not) and each sizes its tokenizer pool to its
    share of the cores (``frontend_process.yield_cpu_to_the_engine``)."""
    pids = {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", two_front_ends.output())}
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert [os.getpriority(os.PRIO_PROCESS, pids[name]) for name in ("frontend-0", "frontend-1")] == [min(own + 5, 19)] * 2
    assert os.getpriority(os.PRIO_PROCESS, pids["router"]) == os.getpriority(os.PRIO_PROCESS, pids["shard-0"]) == own
    threads = os.environ.get("RAYON_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // 2))
    lines = re.findall(r"CPU niceness (\d+), up to (\S+) tokenizer threads", two_front_ends.output())
    assert lines == [(str(min(own + 5, 19)), threads)] * 2


def test_metrics_count_every_front_ends_requests_whichever_answers(two_front_ends):
    url = two_front_ends.url
    time.sleep(STATUS_SETTLES_S)            # the router's last status has reached both front ends
    first = requests.get(url + "/metrics", timeout=10).text
    prompts = [f"import os{i}" for i in range(6)]
    lengths = [len(requests.post(url + "/tokenize", json={"inputs": p}, timeout=10).json()) for p in prompts]
    assert all(_generate(url, p).status_code == 200 for p in prompts)
    time.sleep(STATUS_SETTLES_S)
    scrapes = [requests.get(url + "/metrics", timeout=10).text for _ in range(8)]   # new connections: both answer
    for text in scrapes:
        assert _metric(text, "tgi_request_count") == _metric(first, "tgi_request_count") + 6
        assert _metric(text, "tgi_request_success") == _metric(first, "tgi_request_success") + 6
        # the router's total, as its status gives it: not once per front end
        assert (_metric(text, "tgi_prefix_cache_lookup_tokens")
                == _metric(first, "tgi_prefix_cache_lookup_tokens") + sum(lengths))
        assert _metric(text, "tgi_queue_size") == 0


def test_the_concurrency_limit_is_the_servers_not_each_front_ends(two_front_ends):
    url = two_front_ends.url
    body = {"inputs": "def long(x):", "parameters": {"max_new_tokens": 440}}
    streams = [requests.post(url + "/generate_stream", json=body, stream=True, timeout=60) for _ in range(LIMIT)]
    lines = [stream.iter_lines() for stream in streams]     # kept: a dropped iterator closes its stream
    try:
        for stream, stream_lines in zip(streams, lines):    # every one is generating (holds its permit)
            assert stream.status_code == 200
            assert next(line for line in stream_lines if line.startswith(b"data:"))
        refused = [_generate(url, "hello", 2).status_code for _ in range(6)]
    finally:
        for stream in streams:
            stream.close()
    assert refused == [429] * 6, refused       # per front end, one with fewer than LIMIT streams would accept
    deadline = time.monotonic() + 20            # closed streams are aborted: their permits come back
    while _generate(url, "hello", 2).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _generate(url, "hello", 2).status_code == 200


def test_sigterm_lets_both_front_ends_finish_their_streams(launcher_model_dir, tmp_path):
    srv = LaunchedServer(launcher_model_dir, "--frontend-processes", "2", "--max-total-tokens", "512",
                         "--max-input-tokens", "64", env={"TMPDIR": str(tmp_path)})
    try:
        wait_for_both(srv.wait_healthy())
        assert len(list(tmp_path.glob("lightserve-metrics-*"))) == 1     # the front ends' /metrics files
        body = {"inputs": "def drain(x):", "parameters": {"max_new_tokens": 200}}
        lines = []
        while len(lines) < 24 and {i % 2 for i in _received_ids(srv.output())} != {0, 1}:   # until both hold one
            stream = requests.post(srv.url + "/generate_stream", json=body, stream=True, timeout=60)
            lines.append(stream.iter_lines())
            assert next(line for line in lines[-1] if line.startswith(b"data:"))
        assert {i % 2 for i in _received_ids(srv.output())} == {0, 1}   # each connection picks one: 2^-23 to fail
        srv.process.send_signal(signal.SIGTERM)
        for stream_lines in lines:
            rest = b"\n".join(stream_lines)
            assert b'"generated_text":"' in rest and b'"error"' not in rest     # the last event came
        assert srv.process.wait(60) == 0
        assert srv.wait_no_children() == []
        assert not re.search(r" (ERROR|WARNING) |Traceback", srv.output()), srv.output()   # an orderly stop
        assert list(tmp_path.glob("lightserve-metrics-*")) == []        # removed by the launcher
    finally:
        srv.stop()
