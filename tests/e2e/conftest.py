"""Fixtures of the HTTP-level tests: the real engine (tiny Llama, CPU, torch kernels)
behind ``InProcessBackend``, the tiny byte-level BPE tokenizer of ``tests.tiny_models``
saved next to the checkpoint, and the TGI front end served by uvicorn on a free
loopback port. Test wrappers around the real backend (counting, gating, health) live
here too; there is no fake backend.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.tiny_models import save_tiny_model, save_tiny_server_model, save_tiny_tokenizer

@pytest.fixture(scope="session")
def launcher_model_dir(tmp_path_factory):
    """What the launcher tests serve: the tiny checkpoint, or E2E_MODEL_DIR (the GPU run's random 7B,
    bench/gpu_run.sh e2e)."""
    if os.environ.get("E2E_MODEL_DIR"):
        return os.environ["E2E_MODEL_DIR"]
    return save_tiny_server_model("llama", tmp_path_factory.mktemp("e2e") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-tgi")
    save_tiny_model("llama", path)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def engine_backend(tiny_model_dir):
    """The real engine stepped on a background thread (shared by every test app)."""
    from engine.client import InProcessBackend
    from engine.generation import Engine, EngineConfig

    engine = Engine(EngineConfig(model_dir=str(tiny_model_dir), device="cpu", kernel_backend="torch",
                                 num_slots=4096, max_requests=64))
    return InProcessBackend(engine)


def wait_idle(backend, timeout: float = 10.0) -> dict:
    """Wait until the engine holds no request and no KV slot; return its last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = backend.stats()
        if stats["kv_used"] == 0 and stats["batch_size"] == 0 and stats["queue_size"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is still busy after {timeout} s: {stats}")
        time.sleep(0.01)


def spanning_stop(texts: list[str]) -> tuple[str, int]:
    """A 2-character stop made of the end of token k and the start of token k + 1,
    that does not occur earlier in the text; returns (stop, k + 1 = tokens up to the match)."""
    for k in range(len(texts) - 1):
        if texts[k] and texts[k + 1]:
            stop = texts[k][-1] + texts[k + 1][0]
            end = len("".join(texts[:k + 1])) + 1
            if "".join(texts).find(stop) == end - len(stop):
                return stop, k + 2
    raise AssertionError(f"no two neighbouring tokens with text in {texts}")


@contextlib.contextmanager
def serve(app):
    """Run ``app`` with uvicorn on 127.0.0.1 (a free port) in a thread; yield its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def make_settings(**overrides):
    from tgi_compat import ServerSettings

    values = dict(model_id="tiny-llama", max_input_tokens=64, max_total_tokens=128, max_concurrent_requests=16,
                  validation_workers=2)
    values.update(overrides)
    return ServerSettings(**values)


@pytest.fixture(scope="session")
def server_url(hf_tokenizer, engine_backend):
    """The default front end (no API key, TGI's default limits, small token budgets)."""
    from tgi_compat import create_app

    with serve(create_app(make_settings(), hf_tokenizer, engine_backend)) as url:
        yield url


@pytest.fixture
def serve_app(hf_tokenizer, engine_backend):
    """Start a front end with other settings: ``with serve_app(api_key="k") as url: ...``."""
    from tgi_compat import create_app

    def start(**overrides):
        return serve(create_app(make_settings(**overrides), hf_tokenizer, engine_backend))
    return start


class CountingBackend:
    """Wraps the real backend; records each request's consumed events and how it ended."""

    def __init__(self, backend):
        self.backend, self.consumed, self.closed_early = backend, {}, {}
        self.started = threading.Event()

    def healthy(self):
        return self.backend.healthy()

    def stats(self):
        return self.backend.stats()

    def observe_steps(self, observer):
        self.backend.observe_steps(observer)

    async def generate(self, request):
        finished = False
        try:
            async with contextlib.aclosing(self.backend.generate(request)) as events:
                async for event in events:
                    self.consumed[request.request_id] = self.consumed.get(request.request_id, 0) + 1
                    self.started.set()
                    finished = bool(event.finish_reason or event.error)
                    yield event
        finally:
            self.closed_early[request.request_id] = not finished

    def wait_closed(self, timeout: float = 10.0) -> int:
        """Wait until one request's iterator was closed; return its id."""
        deadline = time.monotonic() + timeout
        while not self.closed_early:
            if time.monotonic() > deadline:
                raise AssertionError("the backend iterator was never closed")
            time.sleep(0.01)
        (request_id,) = self.closed_early
        return request_id


@contextlib.contextmanager
def send_raw_post(url: str, path: str, body: dict):
    """POST over a bare socket (closing it is a client disconnect); yield the socket."""
    address = urlparse(url)
    data = json.dumps(body).encode()
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        yield sock


class GatedBackend:
    """The real backend behind a gate: ``generate`` waits until ``gate`` is set, so a
    test can hold requests (and their concurrency permits) as long as it needs."""

    def __init__(self, backend):
        self.backend, self.gate, self.waiting = backend, threading.Event(), 0

    def healthy(self):
        return self.backend.healthy()

    def stats(self):
        return self.backend.stats()

    def observe_steps(self, observer):
        self.backend.observe_steps(observer)

    async def generate(self, request):
        self.waiting += 1
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.005)
        finally:
            self.waiting -= 1
        async with contextlib.aclosing(self.backend.generate(request)) as events:
            async for event in events:
                yield event

    def wait_for_waiting(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.waiting < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.waiting} requests reached the backend, expected {count}")
            time.sleep(0.005)


@pytest.fixture
def gated_app(hf_tokenizer, engine_backend):
    """``with gated_app(max_concurrent_requests=1) as (url, gated): ...``; the gate opens on exit."""
    from tgi_compat import create_app

    @contextlib.contextmanager
    def start(**overrides):
        gated = GatedBackend(engine_backend)
        try:
            with serve(create_app(make_settings(**overrides), hf_tokenizer, gated)) as url:
                yield url, gated
        finally:
            gated.gate.set()
    return start
