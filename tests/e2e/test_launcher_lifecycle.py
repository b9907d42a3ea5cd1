"""End to end, the launcher's other servers: limits and auth, a dying shard, SIGTERM.

Each test module holds at most one server at a time, so on one GPU (bench/gpu_run.sh
e2e, a 7B that sizes its KV cache from the free memory) the servers do not overlap.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time

import pytest
import requests
import text_generation

from tests.e2e.server import LaunchedServer, running

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def small_server(launcher_model_dir):
    """A test kills its shard, so its exit code is not checked here."""
    with running(launcher_model_dir, "--max-concurrent-requests", "2", "--api-key", "s3cret",
                 "--max-total-tokens", "256", "--max-input-tokens", "192", expect_clean_exit=False) as srv:
        yield srv


def test_every_serving_process_sets_the_garbage_collector_for_serving(small_server):
    """The front end, the router and the shard each freeze what start-up left alive and collect young
    objects rarely: a full collection in the router's planning of a burst, or in a shard's launch,
    holds the step up (``engine.processes.tune_collector_for_serving``)."""
    tuned = re.findall(r"(\S+): garbage collector set for serving \((\d+) objects frozen", small_server.output())
    names = sorted(re.sub(r"^frontend-\d+$", "frontend", name) for name, _ in tuned)   # --frontend-processes
    assert set(names) == {"frontend", "router", "shard-0"} and names.count("router") == 1
    assert all(int(frozen) > 10_000 for _, frozen in tuned)


def test_the_front_end_lets_its_helper_threads_take_the_gil_sooner(small_server):
    """Tokenizer, pipe reader and writer threads wait at most 0.5 ms for a busy event loop's GIL, not 5 ms
    (``tgi_compat.frontend_process.GIL_SWITCH_INTERVAL_S``)."""
    assert "a waiting thread may take the GIL after 0.5 ms" in small_server.output()


def test_api_key_and_overload(small_server):
    url = small_server.url
    assert requests.post(url + "/generate", json={"inputs": "hi"}).status_code == 401
    assert requests.post(url + "/generate", json={"inputs": "hi"}, headers={"Authorization": "Bearer no"}).status_code == 401
    assert requests.get(url + "/health").status_code == 200   # not protected
    headers = {"Authorization": "Bearer S3CRET"}              # TGI compares case-insensitively
    client = text_generation.Client(url, headers=headers, timeout=60)
    assert client.generate("hi", max_new_tokens=2).details.generated_tokens == 2

    async def burst():
        aclient = text_generation.AsyncClient(url, headers=headers, timeout=60)
        return await asyncio.gather(*(aclient.generate("hello", max_new_tokens=60) for _ in range(6)),
                                    return_exceptions=True)

    results = asyncio.run(burst())
    overloaded = [r for r in results if isinstance(r, text_generation.errors.OverloadedError)]
    assert overloaded and len(overloaded) <= 4
    assert all(not isinstance(r, Exception) or r in overloaded for r in results)


def test_a_killed_shard_fails_requests_marks_unhealthy_and_stops_the_launcher(small_server):
    headers = {"Authorization": "Bearer s3cret"}
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 250}}
    stream = requests.post(small_server.url + "/generate_stream", json=body, headers=headers, stream=True, timeout=60)
    lines = stream.iter_lines()
    assert next(line for line in lines if line.startswith(b"data:"))
    shard_pid = int(re.search(r"started shard-0 \(pid (\d+)\)", small_server.output()).group(1))
    subprocess.run(["kill", "-9", str(shard_pid)], check=True)
    killed = time.monotonic()
    rest = b"\n".join(lines)
    assert b'"error_type":"generation"' in rest
    assert requests.get(small_server.url + "/health", timeout=5).status_code == 503
    assert time.monotonic() - killed < 2.0          # the stream's error and /health's 503 within 2 s
    small_server.process.wait(30)
    assert small_server.process.returncode != 0
    assert small_server.wait_no_children() == []


def test_kill_9_of_the_launcher_takes_every_process_with_it_and_a_relaunch_stops_on_sigterm(launcher_model_dir):
    """kill -9 of the launcher takes every process with it and frees the port; a launcher started again on that
    port serves, and SIGTERM stops it and every process of it within seconds, exit code 0."""
    args = ("--max-total-tokens", "128", "--max-input-tokens", "64")
    srv = LaunchedServer(launcher_model_dir, *args).wait_healthy()
    assert len(srv.children()) >= 5     # supervisor, resource tracker, shard, router, front end
    assert any("resource_tracker" in command for command in srv.commands())    # multiprocess starts one
    srv.process.kill()
    srv.process.wait(5)
    assert srv.wait_no_children(timeout=5.0) == []
    srv.stop()
    again = LaunchedServer(launcher_model_dir, *args, port=srv.port)
    try:
        again.wait_healthy()
        assert requests.get(again.url + "/health", timeout=5).status_code == 200
        assert len(again.children()) >= 4     # supervisor, shard, router, front end
        start = time.monotonic()
        again.process.send_signal(signal.SIGTERM)
        assert again.process.wait(15) == 0, again.output()
        assert time.monotonic() - start < 10
        assert again.wait_no_children() == []
    finally:
        again.stop()


def test_a_taken_port_fails_before_the_model_loads(launcher_model_dir):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = time.monotonic()
        srv = LaunchedServer(launcher_model_dir, port=port)
        code = srv.process.wait(30)
        elapsed = time.monotonic() - start
        output = srv.output()
        srv.stop()
    assert code == 2 and elapsed < 5, (elapsed, output)
    assert f"--port {port} on 127.0.0.1 is taken" in output and "choose another --port" in output


def test_a_nan_weight_stops_the_launch_with_the_tensor_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import save_tiny_server_model

    model_dir = save_tiny_server_model("llama", tmp_path / "llama")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 4] = float("nan")
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    srv = LaunchedServer(model_dir)
    try:
        code = srv.process.wait(60)       # a launcher that serves the model anyway is stopped, not left behind
        output = srv.output()
    finally:
        srv.stop()
    assert code != 0 and "Traceback" not in output, output
    assert "tensor 'model.layers.1.mlp.down_proj.weight' holds NaN or infinite values (1 where this shard read it " \
           "as float32): the checkpoint is broken" in output, output


def _stream_events(url: str, body: dict) -> list[dict]:
    response = requests.post(url, json=body, stream=True, timeout=60)
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith(b"data:")]


def _logged(server, text: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while text not in server.output():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _refuses_connections(url: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            requests.get(url + "/health", timeout=1)
        except requests.ConnectionError:
            return True
        time.sleep(0.05)
    return False


def test_json_output_env_and_a_graceful_termination_that_lets_a_stream_finish(launcher_model_dir):
    """One server for three flags: -e logs the environment; on SIGTERM the front end stops accepting
    while a running stream (admitted while its shard is held with SIGSTOP, so it cannot have
    finished before) completes within --graceful-termination-timeout; with --json-output every line
    of every process is one JSON object."""
    from concurrent.futures import ThreadPoolExecutor

    srv = LaunchedServer(launcher_model_dir, "--json-output", "-e", "--graceful-termination-timeout", "30",
                         "--max-total-tokens", "256", "--max-input-tokens", "64").wait_healthy()
    try:
        shard = int(re.search(r"started shard-0 \(pid (\d+)\)", srv.output()).group(1))
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 100, "details": True}}
        os.kill(shard, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            try:
                events = pool.submit(_stream_events, srv.url + "/generate_stream", body)
                assert _logged(srv, "request 1 admitted", within=10.0)
                srv.process.send_signal(signal.SIGTERM)
                assert _refuses_connections(srv.url, within=10.0), srv.output()[-3000:]
            finally:
                os.kill(shard, signal.SIGCONT)
            events = events.result(60)
        assert "error" not in events[-1] and events[-1]["details"]["generated_tokens"] == 100, events[-1]
        assert srv.process.wait(30) == 0
        assert srv.wait_no_children() == []
    finally:
        srv.stop()
    records = [json.loads(line) for line in srv.output().splitlines()]     # every line is JSON
    messages = " ".join(r["fields"]["message"] for r in records)
    assert {r["process"] for r in records} >= {"launcher", "shard-0", "router", "frontend"}
    assert "runtime environment:" in messages and "torch:" in messages and "transformers:" in messages
    assert re.search(r"serving \S+ on http://127\.0\.0\.1:\d+: \w+ on 1 (cpu|cuda) shard\(s\), \d+ KV slots", messages)
    assert "waiting up to 30 s for running requests to finish" in messages
