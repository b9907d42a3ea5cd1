"""The shard process: join the tensor-parallel group, load the model, run Steps from the router.

Pipe (msgpack via ``engine.protocol.codec``): router -> shard ``Step`` / ``Shutdown``;
shard -> router ``Ready``, ``ShardError``, and (rank 0 only) one ``StepResult`` per Step.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from engine.processes import child_setup, tune_collector_for_serving
from engine.protocol.codec import decode, encode
from engine.protocol.messages import Ready, ShardError, Shutdown

log = logging.getLogger("engine.worker")

RENDEZVOUS_S = 60
# How often a shard looks whether its launched step finished while no message arrives. In
# steady decoding the router's next Step arrives first (it is sent before the previous
# result is read), so this bounds only the latency of a step nothing follows yet.
DEVICE_POLL_S = 0.0002


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    worker_config: object          # engine.worker.model_worker.WorkerConfig
    model_config: object           # the family's frozen config (engine.models), as the plan decided it


def shard_main(spec: ShardSpec, conn, log_level="INFO") -> None:
    """``log_level``: an ``engine.processes.LogSetup`` (or a level name)."""
    child_setup(log_level)
    try:
        from engine.models.parallel import TensorParallel
        from engine.worker.model_worker import ModelWorker

        worker_config = _join_group(spec)
        log.info("shard %d: loading the model on %s, then warm-up and KV cache sizing", spec.rank,
                 worker_config.device)
        worker = ModelWorker(worker_config, spec.model_config, tp=TensorParallel(spec.rank, spec.world_size))
        conn.send_bytes(encode(Ready(spec.rank, worker.num_slots)))
        log.info("shard %d ready: %d KV slots (KV cache dtype %s)", spec.rank, worker.num_slots,
                 str(worker.kv_dtype).removeprefix("torch."))
        tune_collector_for_serving()
        serve_steps(worker, conn, reply=spec.rank == 0)
    except (EOFError, KeyboardInterrupt):
        return
    except BaseException as e:
        log.error("shard %d failed: %s: %s", spec.rank, type(e).__name__, e)
        try:
            conn.send_bytes(encode(ShardError(spec.rank, f"{type(e).__name__}: {e}")))
        except OSError:
            pass
        os._exit(1)


def serve_steps(worker, conn, reply: bool) -> None:
    """Run Steps until Shutdown; one StepResult per Step, in order (rank 0 only).

    A step's result goes out as soon as the device finished it: while the next Step is
    being launched behind it (the worker looks between the pieces of that launch, see
    ``ModelWorker.launch``), else once that launch is queued, or at once if no Step came
    first. The device never waits for the router, and a launch that takes longer than the
    step before it ran does not hold that step's tokens back: before, they went out with the
    next step's (one H200, debug log: 23 of a stream's 2,075 steps beside a 100k-token prompt).
    """
    replies = _Replies(conn, reply)
    while True:
        if replies.pending is not None and not _next_step_first(conn, replies.pending):
            replies.send()
            continue
        data = conn.recv_bytes()
        received = time.perf_counter()
        message = decode(data)
        if isinstance(message, Shutdown):
            return
        decoded = time.perf_counter()
        newer = worker.launch(message, meanwhile=replies.send_if_ready)
        log.debug("shard step of %d rows (%d bytes): decoded in %.1f ms, launched in %.1f ms", len(message.rows),
                  len(data), 1000 * (decoded - received), 1000 * (time.perf_counter() - decoded))
        replies.send()
        replies.pending = newer


class _Replies:
    """The launched step whose result is not sent yet (``pending``), and its sending."""

    def __init__(self, conn, reply: bool):
        self.conn, self.reply = conn, reply
        self.pending = None

    def send_if_ready(self) -> None:
        if self.pending is not None and self.pending.ready():
            self.send()

    def send(self) -> None:
        if self.pending is not None:
            _reply(self.conn, self.pending, self.reply)
            self.pending = None


def _next_step_first(conn, launched) -> bool:
    """Wait until a message arrives (True) or the launched step is done on the device (False).

    Sleeps in the pipe's poll between looks at the device: a message wakes it at once, a
    finished step is noticed within ``DEVICE_POLL_S`` (no core spins while the device works).
    """
    while not launched.ready():
        if conn.poll(DEVICE_POLL_S):
            return True
    return conn.poll(0)


def _reply(conn, launched, reply: bool) -> None:
    waited = time.perf_counter()
    result = launched.result()
    if reply:
        conn.send_bytes(encode(result))
    log.debug("shard step result of %d rows: ready and sent after %.1f ms", len(result.rows),
              1000 * (time.perf_counter() - waited))


def _join_group(spec: ShardSpec):
    """Pick this rank's device and join torch.distributed (NCCL on GPUs, gloo on the CPU)."""
    from dataclasses import replace
    from datetime import timedelta

    import torch

    config = spec.worker_config
    if config.device.type == "cuda":
        torch.cuda.set_device(spec.rank)
        config = replace(config, device=torch.device("cuda", spec.rank))
    else:
        _limit_cpu_threads(spec.world_size)
    if spec.world_size > 1:
        backend = "nccl" if config.device.type == "cuda" else "gloo"
        address = f"tcp://{spec.master_addr}:{spec.master_port}"
        try:
            torch.distributed.init_process_group(backend, init_method=address, rank=spec.rank,
                                                 world_size=spec.world_size, timeout=timedelta(seconds=RENDEZVOUS_S))
        except Exception as e:
            raise RuntimeError(f"shard {spec.rank} could not join the group at {address} "
                               f"(--master-addr/--master-port) within {RENDEZVOUS_S} s: {e}") from None
    return config


def _limit_cpu_threads(world_size: int) -> None:
    """CPU shards share the cores and leave one to the router and the front end: OpenMP
    threads that outnumber the free cores spin-wait on each other (measured on 2 cores:
    24 demo tokens in 2.7-3.6 s with 2 threads, 0.2 s with 1). OMP_NUM_THREADS wins."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, (cores - 1) // world_size))


