"""Several front-end processes on one port (``--frontend-processes``), serving as one.

One Python event loop takes a burst of requests one at a time: on an H100 host the front end
alone needed 353-390 ms to give 256 requests of 3,000 tokens their first token (stop 37), and
the first request of such a burst waited about 240 ms for its own validation behind the
others' (stop 54). N processes each bind the port with ``SO_REUSEPORT``: the kernel spreads
new connections over them, and each has its own event loop, tokenizer threads and pipe to the
router. What they share, so that clients see one server:

- request ids: process ``k`` of ``N`` numbers its requests ``k + 1``, ``k + 1 + N``, ...
  (``engine.protocol.messages.frontend_of``),
  so they are unique across the server and the router sends each request's events to the pipe
  of its owner;
- ``--max-concurrent-requests``: one counter in shared memory (``permits``);
- ``/metrics``: prometheus_client's multiprocess mode (each process writes its counters and
  histograms to files in one directory; a scrape, whichever process answers it, sums them).
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass

MAX_FRONTEND_PROCESSES = 64
CORES_PER_FRONTEND = 4          # auto: one front end per 4 usable cores (the router, the shards and the
AUTO_MAX_FRONTENDS = 4          # tokenizers' threads need the rest), at most 4; at least 1
LISTEN_BACKLOG = 2048           # uvicorn's default


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def auto_frontend_processes(cores: int | None = None) -> int:
    """``--frontend-processes``'s default on a machine with ``cores`` usable cores (default: this one's)."""
    cores = usable_cores() if cores is None else cores
    return max(1, min(AUTO_MAX_FRONTENDS, cores // CORES_PER_FRONTEND))


FRONTEND_NAME = "frontend"


def is_frontend_name(name: str) -> bool:
    """Whether a process of the server is a front end (``FrontendMember.process_name``)."""
    return name == FRONTEND_NAME or name.startswith(FRONTEND_NAME + "-")


@dataclass(frozen=True)
class FrontendMember:
    """What front end ``index`` of ``count`` shares with the others (made by ``FrontendGroup``)."""
    index: int = 0
    count: int = 1
    permits: object = None            # a shared multiprocess Value('q') of held permits (count > 1)
    metrics_dir: str | None = None    # prometheus_client's multiprocess directory (count > 1)

    @property
    def shared(self) -> bool:
        return self.count > 1

    @property
    def process_name(self) -> str:
        return FRONTEND_NAME if self.count == 1 else f"{FRONTEND_NAME}-{self.index}"

    def first_request_id(self) -> int:
        return self.index + 1


class FrontendGroup:
    """The launcher's side: creates what the front ends share; ``close`` removes the metrics files."""

    def __init__(self, count: int, context):
        if not 1 <= count <= MAX_FRONTEND_PROCESSES:
            raise ValueError(f"--frontend-processes must be between 1 and {MAX_FRONTEND_PROCESSES}, got {count}")
        self.count = count
        self.permits = context.Value("q", 0) if count > 1 else None
        self.metrics_dir = tempfile.mkdtemp(prefix="lightserve-metrics-") if count > 1 else None

    def member(self, index: int) -> FrontendMember:
        return FrontendMember(index, self.count, self.permits, self.metrics_dir)

    def close(self) -> None:
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening TCP socket on (host, port), as uvicorn binds one; ``reuse_port``: shared with the other front
    ends (``SO_REUSEPORT``: Linux spreads the connections over every process that bound it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def use_shared_metrics(member: FrontendMember) -> None:
    """Make this process's prometheus_client metrics file-backed in the group's directory (before any metric
    is created): what every front end counts is summed at each scrape."""
    if not member.shared:
        return
    from prometheus_client import values

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = member.metrics_dir
    values.ValueClass = values.MultiProcessValue()
