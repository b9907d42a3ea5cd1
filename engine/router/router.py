"""One router step: schedule -> submit to the shards -> collect -> stop criteria -> token events.

Steps are pipelined one deep: ``step()`` submits step N+1 before it collects step N, so
the device starts N+1 as soon as N ends while the router turns N's tokens into events
(decode rows of N+1 feed tokens the worker sampled in N; see ``engine.router.scheduler``).
Except while requests are arriving (one came within ``arrival_window_s``: the server's
``tgi_compat.launch_config.ARRIVAL_WINDOW_S``; 0, the in-process engine's default, keeps it off) and the step in flight
carries prompt chunks: then ``step()`` collects it before planning the next, so what arrives
during a long prompt step joins the very next one instead of the one after it (a burst's TTFT
loses a whole step less; the device waits only for the router's planning).

The same ``Router`` serves the in-process ``Engine`` (shards = a local worker) and the
router process of the server (shards = worker processes behind pipes).
"""
from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from engine.protocol.messages import (
    FED_BACK,
    GenerationRequest,
    Step,
    StepResult,
    StepStats,
    TokenEvent,
)
from engine.router.scheduler import Request, Scheduler

log = logging.getLogger(__name__)


class Shards(Protocol):
    def submit(self, step: Step) -> None:
        """Queue a step; the shards start it when the device is free."""

    def collect(self, timeout: float | None = None) -> StepResult:
        """The result of the oldest submitted step not yet collected (blocks until it is done, or
        raises after ``timeout`` seconds where the shards have a watchdog)."""


class LocalShards:
    """A single in-process worker."""

    def __init__(self, worker):
        self.worker = worker
        self._launched: deque = deque()

    def submit(self, step: Step) -> None:
        self._launched.append(self.worker.launch(step))

    def collect(self, timeout: float | None = None) -> StepResult:
        return self._launched.popleft().result()


@dataclass
class _Flight:
    """A submitted step and its timestamps (``time.perf_counter``)."""
    step: Step
    started: float            # scheduling began
    submitted: float          # handed to the shards
    number: int = 0           # steps submitted before it, plus one

    @property
    def method(self) -> str:
        return "prefill" if any(row.input_ids[0] != FED_BACK for row in self.step.rows) else "decode"

    @property
    def joined(self) -> bool:
        """New requests (rows that carry their sampling parameters) beside rows already running."""
        new = sum(row.params is not None for row in self.step.rows)
        return 0 < new < len(self.step.rows)


class Router:
    def __init__(self, scheduler: Scheduler, shards: Shards, eos_token_ids: tuple[int, ...],
                 arrival_window_s: float = 0.0):
        self.scheduler = scheduler
        self.arrival_window_s = arrival_window_s      # 0: always pipelined
        self.shards = shards
        self.eos_token_ids = frozenset(eos_token_ids)
        self._in_flight: deque[_Flight] = deque()
        self._last_result = 0.0                 # when the previous step's result came back
        self._last_arrival = float("-inf")      # when the latest request was queued
        self._stats: list[StepStats] = []
        self._steps = 0                         # steps submitted (numbers the debug log's step lines)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; ValueError if it can never fit (too long for the limits)."""
        params = request.params
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        stops = self.eos_token_ids if request.stop_token_ids is None else frozenset(request.stop_token_ids)
        self.scheduler.add(Request(
            request_id=request.request_id, prompt_ids=list(request.prompt_ids),
            max_new_tokens=request.max_new_tokens, params=params, seed=seed, stop_token_ids=stops,
        ))
        self._last_arrival = time.perf_counter()
        log.debug("request %s queued: %d prompt tokens", request.request_id, len(request.prompt_ids))

    def abort(self, request_id: int) -> bool:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._in_flight)

    def step(self, timeout: float | None = None) -> list[TokenEvent]:
        """Submit the next step, then collect the oldest in flight once two are (or nothing new came).

        When nothing could be planned beside the step in flight (every running request waits for its
        result: a verify row decides its next position), the next step is submitted right after that
        result is processed, before the caller turns to its events: the device idles only for the
        router's own work. While requests arrive, a prompt step in flight is collected first (module
        docstring)."""
        if self._arrivals_wait_for_the_step_in_flight():
            return self.collect(timeout)
        submitted = self._submit_next()
        if not self._in_flight or (submitted and len(self._in_flight) < 2):
            return []
        events = self.collect(timeout)
        if not submitted and not self._in_flight and self.scheduler.has_work():
            self._submit_next()
        return events

    def _arrivals_wait_for_the_step_in_flight(self) -> bool:
        """One step in flight carrying prompt chunks while requests are arriving: plan the next once it is
        done, with what arrived meanwhile. Unless the waiting requests fill the next step already: then a
        newcomer could not join it, and planning it while the device runs hides the planning (about 0.5 ms
        a new request behind a 3,000-token cached prefix on an H100 host: 54-75 ms a step of 100)."""
        return (len(self._in_flight) == 1 and self._in_flight[0].method == "prefill"
                and time.perf_counter() - self._last_arrival < self.arrival_window_s
                and not self.scheduler.waiting_fills_a_step())

    def _submit_next(self) -> bool:
        """Plan the next step and hand it to the shards; False when it had nothing to carry."""
        started = time.perf_counter()
        step = self.scheduler.schedule()
        if not (step.rows or step.released):
            return False
        planned = time.perf_counter()
        self.shards.submit(step)
        self._steps += 1
        self._in_flight.append(_Flight(step, started, time.perf_counter(), self._steps))
        if log.isEnabledFor(logging.DEBUG):
            self._log_submitted(self._in_flight[-1], planned)
        return True

    def _log_submitted(self, flight: _Flight, planned: float) -> None:
        prompt = [row for row in flight.step.rows if row.input_ids[0] != FED_BACK]
        log.debug("step %d: %d rows (%d prompt tokens in %d prompt rows, %d new requests), %d waiting; "
                  "planned in %.1f ms, handed to the shards in %.1f ms", flight.number, len(flight.step.rows),
                  sum(len(row.input_ids) for row in prompt), len(prompt),
                  sum(row.params is not None for row in flight.step.rows), len(self.scheduler.waiting),
                  1000 * (planned - flight.started), 1000 * (flight.submitted - planned))

    def collect(self, timeout: float | None = None) -> list[TokenEvent]:
        """The token events of the oldest step in flight. With ``timeout``, the shards may raise
        ``ShardStalled`` (engine.router.process) when no result came: the step stays in flight."""
        result = self.shards.collect(timeout)
        arrived = time.perf_counter()
        done = self._in_flight.popleft()
        processed = self.scheduler.process(done.step, result)
        events = [self._event(request, res, reason) for request, res, reason in processed]
        if done.step.rows:
            self._record(done, arrived)
        log.debug("step %d collected %.1f ms after it was handed over; %d events in %.1f ms", done.number,
                  1000 * (arrived - done.submitted), len(events), 1000 * (time.perf_counter() - arrived))
        self._last_result = arrived
        return events

    def take_stats(self) -> list[StepStats]:
        """The numbers of the steps collected (or failed) since the last call."""
        stats, self._stats = self._stats, []
        return stats

    def _record(self, done: _Flight, arrived: float) -> None:
        finished = time.perf_counter()
        filter_s = self.scheduler.last_filter_s
        self._stats.append(StepStats(
            method=done.method, size=len(done.step.rows), joined=done.joined,
            concat_s=done.submitted - done.started,
            forward_s=arrived - max(done.submitted, self._last_result),
            decode_s=finished - arrived - filter_s, filter_s=filter_s, inference_s=finished - done.started))

    def fail_all(self, message: str) -> list[TokenEvent]:
        """End every queued and running request with an error (a shard died: nothing more comes back)."""
        now = time.perf_counter()
        for flight in self._in_flight:
            if flight.step.rows:
                self._stats.append(StepStats(
                    method=flight.method, size=len(flight.step.rows), joined=flight.joined,
                    concat_s=flight.submitted - flight.started, forward_s=0.0, decode_s=0.0, filter_s=0.0,
                    inference_s=now - flight.started, ok=False))
        self._in_flight.clear()
        return self.abort_all(message)

    def abort_all(self, message: str) -> list[TokenEvent]:
        """End every queued and running request with an error; steps in flight stay to be collected."""
        requests = list(self.scheduler.waiting) + list(self.scheduler.running)
        for request in requests:
            self.scheduler.abort(request.request_id)
        return [TokenEvent(request_id=r.request_id, error=message) for r in requests]

    @staticmethod
    def _event(request: Request, res, reason: str | None) -> TokenEvent:
        if res.error is not None:
            return TokenEvent(request_id=request.request_id, error=res.error)
        first = len(request.generated) == 1
        return TokenEvent(
            request_id=request.request_id, token_id=res.token_id, logprob=res.logprob,
            top_ids=res.top_ids, top_logprobs=res.top_logprobs, finish_reason=reason,
            seed=request.seed if request.params.do_sample else None,
            prompt_logprobs=request.prompt_logprobs if (first and request.params.prompt_logprobs) else None,
        )
