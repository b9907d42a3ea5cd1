"""Hostile requests beside a running stream, through the launched demo server: 1.9 MB bodies to
/tokenize, /chat_tokenize (both answered whole, as TGI: tens of MB of JSON) and /generate, and the
first grammar request of the server, leave the stream's largest inter-token gap under 0.5 s and the
front end's memory within 1.2 GB."""
from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.server import REPO, running

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
HUGE = "def f(x):\n    return x\n" * 80_000          # about 1.9 MB


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024


class TimedStream(threading.Thread):
    """One streamed request; ``gaps`` are the seconds between its tokens."""

    def __init__(self, url: str, max_new_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_new_tokens, self.times = url, max_new_tokens, []

    def run(self):
        body = {"inputs": "import os\n\ndef ", "parameters": {"max_new_tokens": self.max_new_tokens}}
        with requests.post(self.url + "/generate_stream", json=body, stream=True, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith(b"data:"):
                    self.times.append(time.monotonic())

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def hostile_requests(url: str) -> list[requests.Response]:
    bodies = [("/tokenize", {"inputs": HUGE}), ("/generate", {"inputs": HUGE}),
              ("/chat_tokenize", {"model": "tgi", "messages": [{"role": "user", "content": HUGE}]}),
              ("/generate", {"inputs": "Answer:", "parameters": {"max_new_tokens": 4, "grammar": {
                  "type": "json", "value": {"properties": {"name": {"type": "string"}}}}}})]
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: requests.post(url + b[0], json=b[1], timeout=60), bodies))


def test_hostile_bodies_and_the_first_grammar_do_not_stall_a_stream(tmp_path):
    with running(REPO / "weights" / "demo", "--payload-limit", "4000000") as srv:
        frontend = int(re.search(r"started frontend \(pid (\d+)\)", srv.output()).group(1))
        requests.post(srv.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}, timeout=60)
        before = rss_mb(frontend)
        stream = TimedStream(srv.url, max_new_tokens=150)
        stream.start()
        while len(stream.times) < 5:
            time.sleep(0.01)
        answers = hostile_requests(srv.url)
        stream.join(120)
        after = rss_mb(frontend)
    # TGI's tokenize routes have no prompt limit: the 1.9 MB texts are tokenized whole (720,000 tokens)
    assert [a.status_code for a in answers[:3]] == [200, 422, 200], [a.text[:200] for a in answers]
    assert "must have less than" in answers[1].json()["error"]
    assert len(answers[0].json()) == 720_001 and len(answers[2].json()["tokenize_response"]) > 720_000
    assert answers[3].status_code == 200, answers[3].text
    assert len(stream.times) >= 100 and max(stream.gaps) < 0.5, max(stream.gaps)
    # two 720,000-token answers, one after the other (``Validator.whole_tokens``): their tokens, offsets and
    # Rust's encodings (+956 MB on the 2-core CPU machine); before TGI's unbounded tokenize routes, 200 MB
    assert after - before < 1200, (before, after)
