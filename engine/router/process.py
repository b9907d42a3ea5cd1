"""The router process: the step loop between the front end and the shards.

Pipes (msgpack via ``engine.protocol.codec``): front end -> router ``GenerationRequest`` /
``Abort``; router -> front end ``Events`` and ``RouterStatus``; router -> every shard the
same ``Step`` bytes; rank 0 -> router the ``StepResult``. With several front ends
(``--frontend-processes``), ``FrontendLinks`` reads them all and sends each request's events to
the one that numbered it.
"""
from __future__ import annotations

import logging
import time

from multiprocess.connection import wait

from engine.processes import child_setup, tune_collector_for_serving
from engine.protocol.codec import decode, encode
from engine.protocol.messages import (Abort, Events, GenerationRequest, Ready, RouterStatus, ShardError, Shutdown, Step,
                                      StepResult, TokenEvent, frontend_of)

log = logging.getLogger("engine.router")

STATUS_INTERVAL_S = 0.25          # the router's status (health, queue, batch, KV) at least this often
STATUS_CHANGE_S = 0.01            # and within this long after it changed (what /metrics shows)
INBOX_SLICE_S = 0.002             # with work to plan, the inbox is read this long at most before the next step


class ShardFailure(RuntimeError):
    """A shard died or reported an error; the message names the rank and cause."""


class ShardStalled(RuntimeError):
    """No step result came within the watchdog time; the step is still in flight."""


class PipeShards:
    """The router's view of the shards: the same Step bytes to all, the result from rank 0.

    While it waits for a step's result it also serves ``also_read`` (the front end's pipe): requests
    that arrive during a step are queued by its end, not left in the pipe until the step is done (a
    burst behind a 3,000-token prompt waited the whole prompt step, then for the reading).
    """

    def __init__(self, conns):
        self.conns = conns
        self._also: tuple | None = None       # (connections, handler) served while a result is awaited

    def also_read(self, conns: list, handler) -> None:
        """While ``collect`` waits, call ``handler(result_ready)`` whenever one of ``conns`` (a list the caller
        may shrink) is readable; the handler stops reading once ``result_ready()`` (the step's result goes
        first); one that returns False is not called again."""
        self._also = (conns, handler)

    def wait_ready(self) -> int:
        """The KV capacity every shard can hold (the minimum over ranks)."""
        slots = [self._receive(rank, Ready).num_slots for rank in range(len(self.conns))]
        return min(slots)

    def submit(self, step: Step) -> None:
        data = encode(step)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise ShardFailure(f"shard {rank} is gone ({e})") from e

    def collect(self, timeout: float | None = None) -> StepResult:
        """Rank 0's result of the oldest step in flight; ShardStalled if none came within ``timeout``."""
        if not self._wait_for_result(timeout):
            raise ShardStalled(f"no step result from the shards for {timeout:g} s")
        return self._receive(0, StepResult)

    def _wait_for_result(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        result = self.conns[0]
        while self._also is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([result, *self._also[0]], left)
            if result in ready:
                return True
            if not ready:
                return False
            if not self._also[1](lambda: result.poll(0)):
                self._also = None
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return result.poll(left)

    def check_idle(self) -> None:
        """While no step is in flight a shard says nothing: anything readable is a death or an error."""
        for rank, conn in enumerate(self.conns):
            if conn.poll(0):
                message = self._receive(rank, object)
                raise ShardFailure(f"shard {rank} sent {type(message).__name__} while idle")

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(encode(Shutdown()))
            except OSError:
                pass

    def _receive(self, rank: int, expected: type):
        try:
            message = decode(self.conns[rank].recv_bytes())
        except (EOFError, OSError) as e:
            raise ShardFailure(f"shard {rank} died") from e
        if isinstance(message, ShardError):
            raise ShardFailure(f"shard {message.rank} failed: {message.message}")
        if not isinstance(message, expected):
            raise ShardFailure(f"shard {rank} sent {type(message).__name__}, expected {expected.__name__}")
        return message



class FrontendLinks:
    """The router's ends of the front ends' pipes. Front end ``k`` of ``N`` numbers its requests ``k + 1``,
    ``k + 1 + N``, ... (``tgi_compat.request_ids``): a request's events go to the pipe of its owner. The
    status goes to every front end, the steps' numbers to the first one alive (the front ends' /metrics
    sum what each records, so one records them). A front end that is gone is dropped (``drop``)."""

    def __init__(self, conns):
        self.conns = list(conns)
        self.live = list(self.conns)         # shrinks as front ends go (PipeShards.also_read reads it)

    def owner(self, request_id: int) -> int:
        return frontend_of(request_id, len(self.conns))

    def index(self, conn) -> int:
        return self.conns.index(conn)

    def readable(self, timeout: float | None) -> list:
        return wait(self.live, timeout) if self.live else []

    def drop(self, conn) -> None:
        if conn in self.live:
            self.live.remove(conn)

    def send_events(self, events: list[TokenEvent], steps: list) -> None:
        if len(self.conns) == 1:
            self._send(self.conns[0], Events(events, steps))
            return
        mine: dict[int, list[TokenEvent]] = {}
        for event in events:
            mine.setdefault(self.owner(event.request_id), []).append(event)
        stats_to = self.live[0] if self.live else None
        for index, conn in enumerate(self.conns):
            ours, stats = mine.get(index, []), (steps if conn is stats_to else [])
            if ours or stats:
                self._send(conn, Events(ours, stats))

    def send_to(self, index: int, events: Events) -> None:
        """To front end ``index`` whatever the events' owners (an answer to a request it should not have sent)."""
        self._send(self.conns[index], events)

    def send_status(self, status: RouterStatus) -> None:
        data = encode(status)
        for conn in list(self.live):
            self._send(conn, data)

    def _send(self, conn, message) -> None:
        """To one front end; one that is gone is dropped (its reads will say so too)."""
        if conn not in self.live:
            return
        try:
            conn.send_bytes(message if isinstance(message, bytes) else encode(message))
        except OSError:
            self.drop(conn)


def router_main(plan, frontend_conns, shard_conns, log_level="INFO") -> None:
    """The router process: wait for every shard's Ready, then run the step loop (``plan``: an
    ``engine.assembly.EnginePlan``, the same one the shards were started from; ``frontend_conns``: one
    pipe end per front-end process; ``log_level``: an ``engine.processes.LogSetup`` or a level name)."""
    from engine.assembly import build_router

    child_setup(log_level)
    links = FrontendLinks(frontend_conns)
    shards = PipeShards(shard_conns)
    try:
        capacity = shards.wait_ready()
    except ShardFailure as e:
        log.error("startup failed: %s", e)
        links.send_status(RouterStatus(healthy=False, error=str(e)))
        return
    loop = RouterLoop(build_router(plan, shards, capacity), links, plan.config.step_timeout_s)
    shards.also_read(links.live, lambda result_ready: loop.read_inbox(timeout=0, stop=result_ready))
    log.info("router ready: %d KV slots, %d request rows", capacity, plan.max_requests)
    tune_collector_for_serving()
    try:
        loop.run()
    finally:
        shards.shutdown()


class RouterLoop:
    def __init__(self, router, links: FrontendLinks, step_timeout_s: float | None = None):
        self.router = router
        self.shards = router.shards
        self.allocator = router.scheduler.allocator
        self.links = links
        self.step_timeout_s = step_timeout_s     # the watchdog: no step result for this long -> stalled
        self.stalled = False
        self.healthy = True
        self.error: str | None = None
        self._last_status = 0.0
        self._last_sent: RouterStatus | None = None

    def run(self) -> None:
        self._send_status(force=True)
        checked = True                  # the slots were checked since the last step
        while True:
            if not self.read_inbox(timeout=0 if self.router.has_work() else STATUS_INTERVAL_S, stop=self._slice_over()):
                return
            if self.stalled:
                self._wait_for_stalled_step()
            elif self.healthy and self.router.has_work():
                self._step()
                checked = False
            elif self.healthy:
                self._watch_idle_shards()
                if not checked:
                    self.router.scheduler.check_idle()      # once each time the router goes idle
                    checked = True
            self._send_status()

    def _slice_over(self):
        """When the loop stops reading its inbox to step: once it has work and has read for ``INBOX_SLICE_S``
        since the first message. A burst arrives over tens of milliseconds (256 prompts behind one 3,000-token
        prefix from four front ends: 64 ms on an H200 host); read whole, its first step waited for its last
        request. What is not read yet is read while the step runs (``PipeShards.also_read``), or before the next
        step."""
        first = None

        def over() -> bool:     # asked after each message read: the slice starts with the first one
            nonlocal first
            now = time.perf_counter()
            first = first or now
            return self.router.has_work() and now - first >= INBOX_SLICE_S
        return over

    def read_inbox(self, timeout: float, stop=None) -> bool:
        """Handle every waiting message (or until ``stop()``), a message from each readable front end in
        turn; False when every front end is gone."""
        ready = self.links.readable(timeout)
        while ready:
            for conn in ready:
                try:
                    message = decode(conn.recv_bytes())
                except (EOFError, OSError):
                    self._front_end_gone(conn)
                    continue
                self._handle(message, self.links.index(conn))
                if stop is not None and stop():
                    return bool(self.links.live)
            ready = self.links.readable(0)
        return bool(self.links.live)

    def _front_end_gone(self, conn) -> None:
        """Its requests are aborted (their slots freed): nobody is left to read their events."""
        self.links.drop(conn)
        index = self.links.index(conn)
        scheduler = self.router.scheduler
        ids = [r.request_id for r in [*scheduler.waiting, *scheduler.running] if self.links.owner(r.request_id) == index]
        for request_id in ids:
            self.router.abort(request_id)
        if self.links.live:        # at shutdown each front end drains, then goes: nothing to abort
            log.log(logging.WARNING if ids else logging.INFO, "front end %d of %d is gone: %d of its requests "
                    "aborted", index + 1, len(self.links.conns), len(ids))

    def _handle(self, message, sender: int) -> None:
        if isinstance(message, Abort):
            if self.router.abort(message.request_id):
                log.info("request %s aborted", message.request_id)
        elif isinstance(message, GenerationRequest):
            if self.links.owner(message.request_id) != sender:     # its events would go to another front end
                log.error("front end %d sent request %d, numbered for front end %d: refused", sender + 1,
                          message.request_id, self.links.owner(message.request_id) + 1)
                self.links.send_to(sender, Events([TokenEvent(request_id=message.request_id,
                                                              error="Request failed: misnumbered request id")]))
                return
            if not self.healthy:
                self._send_events([TokenEvent(request_id=message.request_id, error=self.error)])
                return
            try:
                self.router.submit(message)
            except ValueError as e:
                self._send_events([TokenEvent(request_id=message.request_id, error=f"Input validation error: {e}")])

    def _step(self) -> None:
        try:
            events = self.router.step(timeout=self.step_timeout_s)
        except ShardFailure as e:
            events = self._on_failure(e)
        except ShardStalled as e:
            events = self._on_stall(e)
        self._send_events(events)

    def _on_failure(self, error: ShardFailure) -> list[TokenEvent]:
        """A dead or failed shard: unhealthy for good, every request ends with the error."""
        log.error("%s", error)
        self.healthy, self.stalled = False, False
        self.error = f"Request failed during generation: {error}"
        self._send_status(force=True)          # /health answers 503 from now on
        return self.router.fail_all(self.error)

    def _on_stall(self, stall: ShardStalled) -> list[TokenEvent]:
        """Stuck shards: /health answers 503 and every request ends with the error; the steps in
        flight stay, so that results that come late are read (and dropped) and the router recovers."""
        log.error("%s (--step-timeout): unhealthy until the shards answer", stall)
        self.healthy, self.stalled = False, True
        self.error = f"Request failed during generation: {stall}"
        self._send_status(force=True)
        return self.router.abort_all(self.error)

    def _wait_for_stalled_step(self) -> None:
        try:
            self.router.collect(timeout=STATUS_INTERVAL_S)
        except ShardStalled:
            return
        except ShardFailure as e:
            self._send_events(self._on_failure(e))
            return
        if not self.router.has_work():
            log.info("the shards answer again: healthy")
            self.healthy, self.stalled, self.error = True, False, None
            self._send_status(force=True)

    def _watch_idle_shards(self) -> None:
        try:
            self.shards.check_idle()
        except ShardFailure as e:
            self._send_events(self._on_failure(e))

    def _send_events(self, events: list[TokenEvent]) -> None:
        """The events, with the numbers of the steps collected since the last message (if any)."""
        steps = self.router.take_stats()
        if events or steps:
            self.links.send_events(events, steps)

    def _send_status(self, force: bool = False) -> None:
        scheduler = self.router.scheduler
        status = RouterStatus(
            healthy=self.healthy, queue_size=len(scheduler.waiting), batch_size=len(scheduler.running),
            kv_used=self.allocator.used_slots, kv_capacity=self.allocator.num_slots, error=self.error,
            **scheduler.prefix_cache_status(), **scheduler.speculation_status())
        since = time.monotonic() - self._last_status
        changed = status != self._last_sent
        if force or since >= STATUS_INTERVAL_S or (changed and since >= STATUS_CHANGE_S):
            self._last_status, self._last_sent = time.monotonic(), status
            self.links.send_status(status)

