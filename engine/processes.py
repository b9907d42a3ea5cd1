"""The server's processes (spawned by ``launcher.py``) and how they are wired.

    supervisor (launcher) --fork--> shard 0..N-1   (engine.worker.process; torch.distributed when N > 1)
                          --fork--> router         (engine.router.process: scheduler + allocator + step loop)
                          --fork--> front end 0..F-1 (tgi_compat.frontend_process: uvicorn), each binds the
                                                    port (SO_REUSEPORT when F > 1, --frontend-processes) only
                                                    after the router reported every shard Ready
(each "fork" through the fork server, a clean process the launcher starts first, which imported
torch and transformers once: ``process_context``, ``start_process``). Every pipe is a
``multiprocess`` pipe carrying ``engine.protocol`` messages.
"""
from __future__ import annotations

import ctypes
import gc
import io
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass


# Container allocations between two young collections while serving (Python's default: 700).
SERVING_GC_THRESHOLDS = (20_000, 10, 10)


def tune_collector_for_serving() -> None:
    """Keep the cyclic garbage collector off the critical path of a burst (it holds the GIL), in every
    process that serves requests: the front end, the router and the shards.

    The objects alive when serving starts (torch, transformers, the tokenizer: about 300,000)
    are frozen: a full collection walked them all (about 0.1 s) in the middle of a burst. Young
    collections are rarer: at 700 allocations a burst of 256 long prompts ran ~120 of them in the front
    end, each walking the young 3,000-id prompt lists again (~70 ms in all; ~30 ms at 20,000). The
    router's planning of that burst took 58 ms with Python's defaults and 46 ms with these (development
    machine, ``Scheduler.schedule`` of its four prompt steps)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    logging.getLogger(__name__).info("%s: garbage collector set for serving (%d objects frozen, young collections "
                                     "every %d allocations)", _process_name(), gc.get_freeze_count(),
                                     SERVING_GC_THRESHOLDS[0])


def child_setup(log: "LogSetup | str") -> None:
    """Children die with the supervisor and leave Ctrl-C to it (it stops them in order); they
    log as the launcher does (``log``: a ``LogSetup``, or a level name for plain text)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    (log if isinstance(log, LogSetup) else LogSetup(log)).apply()


# ---- logs: one setup and one formatter for every process ----------------------------------------

@dataclass(frozen=True)
class LogSetup:
    """How every process of the server logs (the launcher's --log-level and --json-output).

    With ``json_lines`` each line a process writes to stdout or stderr is one JSON object in
    TGI's shape (``{"timestamp", "level", "fields": {"message"}, "target"}``): the log records
    through ``JsonFormatter``, and anything else Python code prints (warnings, progress bars,
    a child's traceback) as a record of the ``stdout``/``stderr`` target. Bytes that C/C++
    code writes straight to the file descriptors are not covered (a one-shard CPU server
    writes none: tests/e2e/test_launcher_lifecycle.py parses every line)."""
    level: str = "INFO"
    json_lines: bool = False

    def apply(self) -> None:
        stream = sys.stderr
        if self.json_lines:
            stream = getattr(sys.stderr, "target", sys.stderr)      # applied twice: keep the real one
            sys.stdout = _LinesAsRecords(logging.getLogger("stdout"), logging.INFO)
            sys.stderr = _LinesAsRecords(logging.getLogger("stderr"), logging.WARNING, stream)
            logging.captureWarnings(True)
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter() if self.json_lines else logging.Formatter(PLAIN_FORMAT))
        logging.basicConfig(level=self.level, handlers=[handler], force=True)


PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (``json.dumps`` escapes quotes, newlines and
    control characters), in the shape of TGI's ``--json-output``."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {"message": record.getMessage()}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return json.dumps({
            "timestamp": _iso_utc(record.created), "level": record.levelname, "fields": fields,
            "target": record.name, "process": _process_name(),
        }, ensure_ascii=False)


def _iso_utc(created: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _process_name() -> str:
    import multiprocess as mp

    name = mp.current_process().name
    return "launcher" if name == "MainProcess" else name


class _LinesAsRecords(io.TextIOBase):
    """A text stream whose every line (``\n`` or a progress bar's ``\r``) becomes a log record,
    so that no process writes a line that is not JSON."""

    def __init__(self, logger: logging.Logger, level: int, target=None):
        self.logger, self.level, self.target = logger, level, target
        self._pending = ""
        self._busy = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if getattr(self._busy, "on", False):        # logging's own error report: never recurse
            return len(text)
        self._busy.on = True
        try:
            *lines, self._pending = (self._pending + text).replace("\r", "\n").split("\n")
            for line in lines:
                if line.strip():
                    self.logger.log(self.level, "%s", line.rstrip())
        finally:
            self._busy.on = False
        return len(text)

    def flush(self) -> None:
        if self._pending.strip():
            pending, self._pending = self._pending, ""
            self.write(pending + "\n")

    def isatty(self) -> bool:
        return False


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, however it dies (kill -9 too), so
    no shard, router or front end outlives the launcher and holds its port (their parent is the
    fork server, which dies with the launcher the same way: ``engine.fork_server``). If the parent
    is already gone (it died before this ran), exit now. Elsewhere than Linux: nothing.

    Linux sends the signal when the *thread* that started this process ends: the fork server forks
    from its one thread, and the launcher starts the fork server from its main thread (``main``)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent == 1 or not _alive(parent):
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# What the fork server imports once, before it forks each process: torch and transformers' tokenizer
# machinery are most of every child's start (about 2.6 + 1.4 s each on a 2-core CPU, three children at once).
PRELOAD = ("engine.fork_server", "torch", "transformers")   # the first: the fork server dies with its parent


def process_context():
    """The start method of the server's processes: a fork server (a clean process that imported
    ``PRELOAD`` and never touched CUDA) forks each one, so a child starts with torch imported."""
    import multiprocess as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def start_process(target, args: tuple, name: str):
    """Start ``target(*args)`` in a child of the fork server, in this process's environment as it is now
    (a forked child would otherwise have the fork server's, from when it started)."""
    process = process_context().Process(target=_in_environment, args=(dict(os.environ), target, args), name=name)
    process.start()
    return process


def _in_environment(environment: dict[str, str], target, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    target(*args)


def start_fork_server() -> None:
    """Start the fork server now (its imports run beside the caller's own start-up), not at the first child."""
    from multiprocess import forkserver

    process_context()               # sets the modules it preloads
    forkserver.ensure_running()


def spawn_shards(plan, log_level: "LogSetup | str" = "INFO") -> tuple[list, list]:
    """Start one shard process per rank of ``plan`` (an ``engine.assembly.EnginePlan``);
    returns (processes, the router's pipe ends, in rank order)."""
    from engine.worker.process import ShardSpec, shard_main

    c = plan.config
    specs = [ShardSpec(rank, plan.num_shards, c.master_addr, c.master_port, plan.worker, plan.model_config)
             for rank in range(plan.num_shards)]
    router_ends, shard_ends = zip(*(process_context().Pipe(duplex=True) for _ in specs))
    processes = [start_process(shard_main, (spec, end, log_level), f"shard-{spec.rank}")
                 for spec, end in zip(specs, shard_ends)]
    return processes, list(router_ends)


def spawn_router(plan, frontend_ends, router_ends, log_level: "LogSetup | str" = "INFO"):
    """Start the router process of ``plan`` between the front ends' pipe ends and the shards' pipe ends."""
    from engine.router.process import router_main

    return start_process(router_main, (plan, frontend_ends, router_ends, log_level), "router")
