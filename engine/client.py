"""What the HTTP front end talks to: a ``Backend`` that turns a request into token events.

``RouterClient`` is the server's backend: it sends requests to the router process over a
msgpack pipe and routes the router's event batches back to the waiting coroutines.
``InProcessBackend`` runs a ``Router`` over an in-process ``Engine`` on a thread (for
embedding the engine in another program; the tests of the HTTP layer use it).

Closing the async iterator of ``generate`` before its last event (a client that went
away, a stop sequence) aborts the request in the router, which frees its KV slots.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import socket
import struct
import threading
from typing import AsyncIterator, Callable, Protocol

from engine.protocol.codec import decode, encode
from engine.protocol.messages import Abort, Events, GenerationRequest, RouterStatus, StepStats, TokenEvent

_STATUS_NOT_NUMBERS = ("healthy", "error")

log = logging.getLogger(__name__)

StepObserver = Callable[[list[StepStats]], None]
ROUTER_GONE = "the router process is gone"
MAX_FRAME = 0x7FFFFFFF      # the largest message a 4-byte frame header holds
WRITE_CHUNK = 1 << 20       # bytes the writer thread hands the socket at a time


class Backend(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]: ...
    def healthy(self) -> bool: ...
    def stats(self) -> dict: ...
    def observe_steps(self, observer: StepObserver) -> None:
        """Call ``observer`` (on another thread) with the numbers of the engine's steps as they end."""


class _EventRouting:
    """Per-request asyncio queues fed from another thread; shared by both backends."""

    def __init__(self):
        self._queues: dict[int, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._step_observer: StepObserver | None = None

    def observe_steps(self, observer: StepObserver) -> None:
        self._step_observer = observer

    def _report_steps(self, steps: list[StepStats]) -> None:
        if steps and self._step_observer is not None:
            try:
                self._step_observer(steps)
            except Exception:
                log.exception("the step observer failed")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self._loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._queues[request.request_id] = events
        finished = False
        try:
            self._submit(request)
            while not finished:
                event = await events.get()
                finished = bool(event.finish_reason or event.error)
                yield event
        finally:
            with self._lock:
                self._queues.pop(request.request_id, None)
            if not finished:
                self._abort(request.request_id)

    def _deliver(self, events: list[TokenEvent]) -> None:
        """Called on the reader thread: one wake-up of the event loop hands out a whole step's events."""
        loop = self._loop
        if loop is None or not events:
            return
        try:
            loop.call_soon_threadsafe(self._hand_out, events)
        except RuntimeError:
            pass   # the event loop is closed: nobody waits any more

    def _hand_out(self, events: list[TokenEvent]) -> None:
        """On the event loop (the only thread that adds or removes queues): each event to its request."""
        queues = self._queues
        for event in events:
            target = queues.get(event.request_id)
            if target is not None:
                target.put_nowait(event)

    def _fail_pending(self, message: str) -> None:
        with self._lock:
            ids = list(self._queues)
        self._deliver([TokenEvent(request_id=i, error=message) for i in ids])

    def _submit(self, request: GenerationRequest) -> None:
        raise NotImplementedError

    def _abort(self, request_id: int) -> None:
        raise NotImplementedError


class RouterClient(_EventRouting):
    """The front end's end of the router pipe."""

    def __init__(self, conn):
        super().__init__()
        self._conn = conn
        self._status = RouterStatus(healthy=False)
        self._ready = threading.Event()
        self._sender = _Sender(conn)
        self._reader = threading.Thread(target=self._read_loop, name="router-reader", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout: float | None = None) -> RouterStatus:
        """Block until the router reported its first status (all shards Ready)."""
        if not self._ready.wait(timeout):
            raise TimeoutError("the router did not report ready")
        return self._status

    def healthy(self) -> bool:
        return self._status.healthy

    def stats(self) -> dict:
        """Every number of the router's last status (queue, batch, KV, prefix cache, speculation counters)."""
        s = self._status
        return {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in _STATUS_NOT_NUMBERS}

    def _submit(self, request: GenerationRequest) -> None:
        if not self._status.healthy and self._status.error == ROUTER_GONE:
            self._hand_out([TokenEvent(request_id=request.request_id, error=f"Request failed during generation: "
                                                                             f"{ROUTER_GONE}")])
            return
        self._sender.send(encode(request))

    def _abort(self, request_id: int) -> None:
        self._sender.send(encode(Abort(request_id)))

    def _read_loop(self) -> None:
        while True:
            try:
                message = decode(self._conn.recv_bytes())
            except (EOFError, OSError) as e:
                if not isinstance(e, EOFError):
                    log.error("reading the router's pipe failed (%s: %s): every request fails", type(e).__name__, e)
                self._status = RouterStatus(healthy=False, error=ROUTER_GONE)     # before the pending are failed
                self._ready.set()
                self._fail_pending(f"Request failed during generation: {ROUTER_GONE}")
                return
            if isinstance(message, Events):
                log.debug("events of %d requests from the router", len(message.events))
                self._deliver(message.events)
                self._report_steps(message.steps)
            elif isinstance(message, RouterStatus):
                self._status = message
                self._ready.set()


class _Sender:
    """Messages to the router, in order, and the caller never waits for the router.

    The router reads its pipe while it waits for a step's result, not while it plans one, so a burst of
    long prompts can fill the pipe: the event loop must never block on it (every stream would stall). The
    calling thread (the event loop's) writes what the socket takes at once, with ``MSG_DONTWAIT`` (the
    descriptor stays blocking for the reader thread; an event loop's ``add_writer`` may not: uvloop's
    makes it non-blocking). Only what the socket cannot take now waits for the writer thread. Before,
    every message went through that thread, which first had to win the GIL from the busy event loop:
    a burst's requests reached the router 76-153 ms after validation on an H100 host (stop 36).
    Frames are ``multiprocessing.Connection``'s (a 4-byte big-endian length, then the bytes), read with
    ``recv_bytes``; the pipe is a socket pair.
    """

    def __init__(self, conn):
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._pending = bytearray()          # frames (or their ends) the socket has not taken yet, in order
        self._lock = threading.Lock()
        self._waiting = threading.Condition(self._lock)
        self._gone = False
        threading.Thread(target=self._write_loop, name="router-writer", daemon=True).start()

    def send(self, data: bytes) -> None:
        if len(data) > MAX_FRAME:
            raise ValueError(f"a {len(data)}-byte message to the router exceeds the {MAX_FRAME}-byte frame limit")
        frame = struct.pack("!i", len(data)) + data
        with self._lock:
            if self._gone:
                return         # the router is gone: the reader thread fails every pending request
            if not self._pending:
                sent = self._send_now(frame)
                if sent == len(frame):
                    return
                frame = frame[sent:]
            self._pending += frame
            self._waiting.notify()

    def _send_now(self, frame: bytes) -> int:
        try:
            return self._sock.send(frame, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self._gone = True
            return len(frame)

    def _write_loop(self) -> None:
        """Send what waits, blocking while the router is busy; the caller appends meanwhile."""
        while True:
            with self._lock:
                while not self._pending:
                    self._waiting.wait()
                chunk = bytes(self._pending[:WRITE_CHUNK])
            try:
                sent = self._sock.send(chunk)
            except OSError:
                with self._lock:
                    self._gone = True
                    self._pending.clear()
                return
            with self._lock:
                del self._pending[:sent]


class InProcessBackend(_EventRouting):
    """An ``Engine`` stepped on a background thread (single process, no pipes)."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._loop_forever, name="engine-loop", daemon=True)
        self._thread.start()

    def healthy(self) -> bool:
        return self._error is None

    def stats(self) -> dict:
        used, capacity = self.engine.kv_usage()
        scheduler = self.engine.router.scheduler
        return {"queue_size": len(scheduler.waiting), "batch_size": len(scheduler.running),
                "kv_used": used, "kv_capacity": capacity, **scheduler.prefix_cache_status(),
                **scheduler.speculation_status()}

    def _submit(self, request: GenerationRequest) -> None:
        self._inbox.put(request)

    def _abort(self, request_id: int) -> None:
        self._inbox.put(Abort(request_id))

    def _loop_forever(self) -> None:
        while True:
            block = not self.engine.has_work()
            try:
                message = self._inbox.get(block=block, timeout=0.1 if block else None)
            except queue.Empty:
                message = None
            if message is not None:
                self._handle(message)
                continue   # drain the inbox before the next step
            if self.engine.has_work():
                self._step()

    def _handle(self, message) -> None:
        if isinstance(message, Abort):
            self.engine.abort(message.request_id)
            return
        if self._error is not None:     # a failed step ended the engine, as a shard's failure ends the server's
            self._deliver([TokenEvent(request_id=message.request_id, error=self._error)])
            return
        try:
            self.engine.add_request(message)
        except ValueError as e:
            self._deliver([TokenEvent(request_id=message.request_id, error=str(e))])

    def _step(self) -> None:
        try:
            self._deliver(self.engine.step())
        except Exception as e:  # a failed step fails its requests, as the server does
            log.exception("engine step failed")
            self._error = f"Request failed during generation: {type(e).__name__}: {e}"
            self._deliver(self.engine.fail_all(self._error))
        self._report_steps(self.engine.router.take_stats())
