"""Start the server: ``python launcher.py --model-id <hub id or directory> [--num-shard N] ...``

The supervisor: parses TGI's launcher flags (``tgi_compat.launch_config``), resolves the
weights (``weights.hub``), checks the checkpoint, spawns the shard workers, the router
and the HTTP front end (``tgi_compat.launch_plan``), and stops them all together: on SIGINT or
SIGTERM (the front end first: it stops accepting and running requests get up to
--graceful-termination-timeout seconds to finish), or when any of them dies (exit code 1, the
cause in one line). If the launcher itself dies (kill -9 too), every child dies with it
(``engine.processes.die_with_parent``); multiprocess's resource tracker, which the first spawn
starts, exits when the last holder of its pipe (the launcher and the children) is gone.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time

SHUTDOWN_GRACE_S = 5.0      # children get this long to exit after SIGTERM (the front end: plus the drain time)
DEATH_GRACE_S = 3.0         # after a shard dies, /health answers 503 this long before the exit

log = logging.getLogger("launcher")


def main(argv: list[str] | None = None) -> int:
    from engine.processes import LogSetup
    from tgi_compat.launch_config import check_port_free, parse_args

    config = parse_args(argv)
    logs = LogSetup(config.log_level or "INFO", config.json_output)
    logs.apply()
    if config.hf_hub_offline:       # the children's huggingface_hub reads it at import (the plan passes it on)
        os.environ["HF_HUB_OFFLINE"] = "1"
    if config.json_output:          # a download's bar would be one JSON record per refresh
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from engine.processes import start_fork_server

    start_fork_server()             # its imports run while this process plans the server
    log.info("args: %r", config)    # secrets (--api-key, --hf-token) are left out of the repr
    for notice in config.notices:   # TGI plumbing flags that are accepted but change nothing here
        log.warning("%s", notice)
    if config.env:
        log.info("runtime environment:\n%s", runtime_environment())
    try:
        check_port_free(config.hostname, config.port)   # in a second, not after the model loaded
        plan = _plan(config)
    except ValueError as e:     # every startup error type derives from ValueError
        log.error("%s", e)
        if not config.json_output:
            print(f"error: {e}", file=sys.stderr)
        return 2
    return _Supervisor(plan, config.graceful_termination_timeout).run()


def runtime_environment() -> str:
    """What ``-e/--env`` prints (TGI prints the same kind of table): versions and devices."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    if torch.cuda.is_available():
        devices = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count()))
    else:
        devices = f"cpu only ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    rows = [("Platform", platform.platform()), ("Python", sys.version.split()[0]),
            ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
            *((name, installed(name)) for name in ("triton", "transformers", "huggingface_hub", "safetensors",
                                                   "tokenizers", "uvicorn", "starlette")),
            ("Devices", devices)]
    return "\n".join(f"{name + ':':<17}{value}" for name, value in rows)


def _plan(config):
    from tgi_compat.launch_plan import plan_server

    return plan_server(config)


class _Supervisor:
    def __init__(self, plan, drain_s: float = 0.0):
        self.plan = plan
        self.drain_s = drain_s          # --graceful-termination-timeout: running requests may finish
        self.processes = []
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        group = self.plan.frontend_group()
        log.info("starting %d shard(s), the router and %s", self.plan.engine.num_shards,
                 "the front end" if group.count == 1 else f"{group.count} front ends (--frontend-processes)")
        try:
            self.processes = self.plan.start(group)
            for p in self.processes:
                log.info("started %s (pid %d)", p.name, p.pid)
            code = self._watch()
            self._stop_all()
        finally:
            group.close()
        return code

    def _on_signal(self, signum, frame) -> None:
        log.info("received %s: shutting down", signal.Signals(signum).name)
        self.stopping = True

    def _watch(self) -> int:
        from multiprocess.connection import wait

        while not self.stopping:
            wait([p.sentinel for p in self.processes], timeout=0.2)
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                return self._on_death(dead[0])
        return 0

    def _on_death(self, process) -> int:
        if _is_frontend(process) and process.exitcode == 0:
            return 0
        log.error("%s exited with code %s: stopping the server", process.name, process.exitcode)
        if not _is_frontend(process):
            deadline = time.monotonic() + DEATH_GRACE_S   # let /health report 503 meanwhile
            while time.monotonic() < deadline and not self.stopping:
                time.sleep(0.1)
        return 1

    def _stop_all(self) -> None:
        """The front end first: it stops accepting and lets running requests finish (at most
        ``drain_s``) while the router and the shards still serve them; then the rest, shards last."""
        frontends = [p for p in self.processes if _is_frontend(p)]
        if any(p.is_alive() for p in frontends) and self.drain_s:
            log.info("waiting up to %g s for running requests to finish (--graceful-termination-timeout)",
                     self.drain_s)
        _stop(frontends, self.drain_s + SHUTDOWN_GRACE_S)
        _stop([p for p in reversed(self.processes) if not _is_frontend(p)], SHUTDOWN_GRACE_S)


def _is_frontend(process) -> bool:
    from tgi_compat.frontend_group import is_frontend_name

    return is_frontend_name(process.name)


def _stop(processes: list, grace_s: float) -> None:
    """SIGTERM each, wait for all up to ``grace_s``, then SIGKILL the ones left."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            log.warning("%s did not stop in %.0f s: killing it", p.name, grace_s)
            p.kill()
            p.join(1.0)

if __name__ == "__main__":
    sys.exit(main())
