"""The server's processes (spawned by ``launcher.py``) and how they are wired.

    supervisor (launcher) --spawn--> shard 0..N-1   (engine.worker.process; torch.distributed when N > 1)
                          --spawn--> router         (engine.router.process: scheduler + allocator + step loop)
                          --spawn--> front end      (tgi_compat.frontend_process: uvicorn), binds its port
                                                    only after the router reported every shard Ready
Every pipe is a ``multiprocess`` pipe (spawn context) carrying ``engine.protocol`` messages.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys


def child_setup(log_level: str) -> None:
    """Children die with the supervisor and leave Ctrl-C to it (it stops them in order)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, however it dies (kill -9 too), so
    no shard, router or front end outlives the launcher and holds its port. If the parent is
    already gone (it died before this ran), exit now. Elsewhere than Linux: nothing."""
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


def spawn_context():
    import multiprocess as mp

    return mp.get_context("spawn")


def spawn_shards(plan, log_level: str = "INFO") -> tuple[list, list]:
    """Start one shard process per rank of ``plan`` (an ``engine.assembly.EnginePlan``);
    returns (processes, the router's pipe ends, in rank order)."""
    from engine.worker.process import ShardSpec, shard_main

    c = plan.config
    specs = [ShardSpec(rank, plan.num_shards, c.master_addr, c.master_port, plan.worker, plan.model_config)
             for rank in range(plan.num_shards)]
    ctx = spawn_context()
    router_ends, shard_ends = zip(*(ctx.Pipe(duplex=True) for _ in specs))
    processes = [ctx.Process(target=shard_main, args=(spec, end, log_level), name=f"shard-{spec.rank}")
                 for spec, end in zip(specs, shard_ends)]
    for p in processes:
        p.start()
    return processes, list(router_ends)


def spawn_router(plan, frontend_end, router_ends, log_level: str = "INFO"):
    """Start the router process of ``plan`` between a front end's pipe end and the shards' pipe ends."""
    from engine.router.process import router_main

    process = spawn_context().Process(target=router_main, name="router",
                                      args=(plan, frontend_end, router_ends, log_level))
    process.start()
    return process
