"""Start the server: ``python launcher.py --model-id <hub id or directory> [--num-shard N] ...``

The supervisor: parses TGI's launcher flags (``tgi_compat.launch_config``), resolves the
weights (``weights.hub``), checks the checkpoint, spawns the shard workers, the router
and the HTTP front end (``tgi_compat.launch_plan``), and stops them all together: on SIGINT or
SIGTERM, or when any of them dies (exit code 1, the cause in one line).
"""
from __future__ import annotations

import logging
import signal
import sys
import time

SHUTDOWN_GRACE_S = 5.0      # children get this long to exit after SIGTERM
DEATH_GRACE_S = 3.0         # after a shard dies, /health answers 503 this long before the exit

log = logging.getLogger("launcher")


def main(argv: list[str] | None = None) -> int:
    from tgi_compat.launch_config import parse_args

    config = parse_args(argv)
    _setup_logging(config)
    try:
        plan = _plan(config)
    except ValueError as e:     # every startup error type derives from ValueError
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _Supervisor(plan).run()


def _setup_logging(config) -> None:
    level = getattr(config, "log_level", None) or "INFO"
    if getattr(config, "json_output", False):
        fmt = '{"timestamp":"%(asctime)s","level":"%(levelname)s","target":"%(name)s","message":"%(message)s"}'
    else:
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr)


def _plan(config):
    from tgi_compat.launch_plan import plan_server

    return plan_server(config)


class _Supervisor:
    def __init__(self, plan):
        self.plan = plan
        self.processes = []
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        self.processes = self.plan.start()
        for p in self.processes:
            log.info("started %s (pid %d)", p.name, p.pid)
        code = self._watch()
        self._stop_all()
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
        if process.name == "frontend" and process.exitcode == 0:
            return 0
        log.error("%s exited with code %s: stopping the server", process.name, process.exitcode)
        if process.name != "frontend":
            deadline = time.monotonic() + DEATH_GRACE_S   # let /health report 503 meanwhile
            while time.monotonic() < deadline and not self.stopping:
                time.sleep(0.1)
        return 1

    def _stop_all(self) -> None:
        for p in reversed(self.processes):      # the front end first, the shards last
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("%s did not stop in %.0f s: killing it", p.name, SHUTDOWN_GRACE_S)
                p.kill()
                p.join(1.0)


if __name__ == "__main__":
    sys.exit(main())
