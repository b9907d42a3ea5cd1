"""Start the real launcher as a subprocess on a free loopback port, for end-to-end tests.

On the GPU machine the same tests run against a real-size checkpoint (bench/gpu_run.sh e2e):
E2E_MODEL_DIR replaces the tiny checkpoint of tests/e2e/test_launcher.py, E2E_SERVER_ARGS
adds launcher flags to every server, E2E_STARTUP_S is how long a server may take to be healthy."""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, timeout: float, alive=lambda: True) -> bool:
    """Whether ``url`` answers /health with 200 within ``timeout`` seconds (False at once when
    ``alive()`` says the server's process is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return True
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    return False


class LaunchedServer:
    def __init__(self, model_dir: str | Path, *args: str, env: dict | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        repo = Path(os.environ.get("LAUNCHER_REPO", REPO)).resolve()    # benchmarks: another tree's launcher
        cmd = [sys.executable, str(repo / "launcher.py"), "--model-id", str(model_dir), "--hostname", "127.0.0.1",
               "--port", str(self.port), *args, *shlex.split(os.environ.get("E2E_SERVER_ARGS", ""))]
        child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # The repo first, then the caller's path (the GPU script puts its wheels there).
        python_path = os.pathsep.join(p for p in [str(repo), os.environ.get("PYTHONPATH", "")] if p)
        child_env.update({"PYTHONPATH": python_path, "HF_HUB_OFFLINE": "1", **(env or {})})
        self.log_path = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / f"server-{self.port}.log"
        self.log = open(self.log_path, "w+")
        self.process = subprocess.Popen(cmd, cwd=repo, env=child_env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def wait_healthy(self, timeout: float | None = None) -> "LaunchedServer":
        timeout = timeout or float(os.environ.get("E2E_STARTUP_S", 120))
        if not wait_for_health(self.url, timeout, alive=lambda: self.process.poll() is None):
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.output()}")
            raise TimeoutError(f"server not healthy after {timeout} s:\n{self.output()}")
        return self

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def children(self) -> list[int]:
        """PIDs of every process in the server's session (the launcher's process group)."""
        out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
        return [int(pid) for pid, sid in (line.split() for line in out.splitlines()) if int(sid) == self.process.pid]

    def commands(self) -> list[str]:
        """The command lines of the processes of the server's session (the resource tracker's too)."""
        out = subprocess.run(["ps", "-o", "args=", "-s", str(self.process.pid)], capture_output=True, text=True)
        return out.stdout.splitlines()

    def wait_no_children(self, timeout: float = 5.0) -> list[int]:
        """Wait for every process of the session to go; returns the ones left (should be [])."""
        deadline = time.monotonic() + timeout
        while self.children() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.children()

    def stop(self, sig=signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        return self.process.returncode


@contextlib.contextmanager
def running(model_dir: str | Path, *args: str, expect_clean_exit: bool = True):
    """A healthy server for the with-block, stopped with SIGTERM after it (also if it never got healthy);
    with ``expect_clean_exit`` its exit code must then be 0."""
    srv = LaunchedServer(model_dir, *args)
    try:
        yield srv.wait_healthy()
    finally:
        code = srv.stop()
    if expect_clean_exit:
        assert code == 0, srv.output()


def assert_server_greedy_equals(url: str, tokenizer, hf, prompts: list[str], new_tokens: int, label) -> None:
    """Each prompt through ``/generate`` (greedy) gives transformers' ``hf.generate`` tokens (up to an EOS)."""
    import torch

    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):]
        body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "details": True}}
        details = requests.post(url + "/generate", json=body, timeout=60).json()["details"]
        got = [t["id"] for t in details["tokens"]]
        assert got == expected.tolist()[: len(got)], (label, prompt)
        assert len(got) == new_tokens or details["finish_reason"] == "eos_token"
