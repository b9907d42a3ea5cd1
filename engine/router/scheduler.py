"""The router's step planner: admission, chunked prefill, decode rows, stop criteria.

Admission is LightLLM's Efficient Router rule. For the admitted requests sorted by
remaining new tokens ``L`` (descending), each holding (or about to hold) ``R`` tokens,
the peak future KV usage is ``max_k (k * L_k + sum_{j<=k} R_j)``: when the request
with the k-th longest remaining output finishes, the k longest are still running and
each has grown by ``L_k``. A waiting request is admitted only if the peak with it
stays within the slot capacity, so a step can never run out of KV slots.

Steps are pipelined: the router plans step N+1 while step N runs, so a request may have
a token in flight (``pending``) whose value only the worker knows. Its next decode row
feeds ``FED_BACK`` (the worker substitutes the token it sampled last for the row), and
no row is planned past ``max_new_tokens``. A request that finishes or is aborted frees
its slots at once: a row of it still in flight writes only slots that a later step (run
after it on the device) may hand to another request, and its result is ignored.
"""
from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field

from engine.protocol.messages import (
    FED_BACK,
    RowResult,
    SamplingParams,
    Step,
    StepResult,
    StepRow,
)
from engine.router.allocator import SlotAllocator

log = logging.getLogger(__name__)

ADMISSION_RULES = ("peak", "reserve")
MAX_SKIPPED = 16     # waiting requests tried per step after one did not fit


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 4096       # prompt tokens per step (chunks beyond it)
    waiting_served_ratio: float = 0.0    # TGI: admit only when waiting >= ratio * running
    max_waiting_steps: int = 20          # TGI's --max-waiting-tokens: then admit anyway
    max_seq_len: int = 4096              # prompt + new tokens of one request
    admission: str = "peak"              # "peak": LightLLM's rule; "reserve": TGI-style sum of maxima

    def __post_init__(self):
        if self.admission not in ADMISSION_RULES:
            raise ValueError(f"admission {self.admission!r} is not one of {', '.join(ADMISSION_RULES)}")


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int] = frozenset()
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0
    waited_steps: int = 0
    prompt_logprobs: list[float | None] | None = None
    pending: int = 0                   # tokens sampled by steps in flight, not yet seen

    @property
    def remaining(self) -> int:
        """New tokens not yet planned."""
        return self.max_new_tokens - len(self.generated) - self.pending

    @property
    def held_tokens(self) -> int:
        """Tokens this request holds once its whole prompt is in (planned ones included)."""
        return len(self.prompt_ids) + len(self.generated) + self.pending

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt_ids)


class Scheduler:
    def __init__(self, allocator: SlotAllocator, config: SchedulerConfig):
        self.allocator = allocator
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._released: list[int] = []

    # ---- requests in and out -------------------------------------------------------

    def add(self, request: Request) -> None:
        total = len(request.prompt_ids) + request.max_new_tokens
        if not request.prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if total > self.config.max_seq_len or total > self.allocator.num_slots:
            raise ValueError(f"prompt ({len(request.prompt_ids)}) + max_new_tokens ({request.max_new_tokens}) = "
                             f"{total} exceeds the limit of {min(self.config.max_seq_len, self.allocator.num_slots)}")
        self.waiting.append(request)

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is; its slots are freed. False if unknown."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return True
        for request in self.running:
            if request.request_id == request_id:
                self._finish(request)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ------------------------------------------------------------------

    def schedule(self) -> Step:
        """The next Step: prompt chunks within the prefill budget, then one decode row each."""
        self._admit()
        budget = self.config.max_prefill_tokens
        rows = []
        for request in self.running:
            if request.in_prefill:
                if budget > 0:
                    row = self._prefill_row(request, budget)
                    budget -= len(row.input_ids)
                    rows.append(row)
            elif request.remaining > 0:
                rows.append(self._decode_row(request))
        released, self._released = self._released, []
        return Step(rows=rows, released=released)

    def _admit(self) -> None:
        if not self.waiting:
            return
        ratio_ok = len(self.waiting) >= self.config.waiting_served_ratio * len(self.running)
        head = self.waiting[0]
        if self.running and not ratio_ok and head.waited_steps < self.config.max_waiting_steps:
            for request in self.waiting:
                request.waited_steps += 1
            return
        usage = peak_usage if self.config.admission == "peak" else reserved_usage
        admitted = sorted(((r.remaining, r.held_tokens) for r in self.running), key=_longest_first)
        misses = 0
        for request in list(self.waiting):
            candidate = (request.remaining, request.held_tokens)
            trial = admitted.copy()
            bisect.insort(trial, candidate, key=_longest_first)
            if self.allocator.free_rows > 0 and usage(trial, presorted=True) <= self.allocator.num_slots:
                self.waiting.remove(request)
                self.allocator.open_request(request.request_id)
                self.running.append(request)
                admitted = trial
                continue
            misses += 1
            if (request is head and head.waited_steps >= self.config.max_waiting_steps) or misses >= MAX_SKIPPED:
                break   # the head has waited long enough (nobody overtakes it), or enough was tried
        for request in self.waiting:
            request.waited_steps += 1

    def _prefill_row(self, request: Request, budget: int) -> StepRow:
        start = request.prefilled
        end = min(len(request.prompt_ids), start + budget)
        chunk = request.prompt_ids[start:end]
        last_chunk = end == len(request.prompt_ids)
        targets = None
        if request.params.prompt_logprobs:
            targets = request.prompt_ids[start + 1 : end + (0 if last_chunk else 1)]
        row = StepRow(
            request_id=request.request_id, row=self.allocator.row(request.request_id), start_pos=start,
            input_ids=chunk, slots=self.allocator.allocate(request.request_id, len(chunk)), sample=last_chunk,
            params=request.params if start == 0 else None, seed=request.seed, logprob_targets=targets,
        )
        request.prefilled = end
        request.pending += last_chunk
        return row

    def _decode_row(self, request: Request) -> StepRow:
        """Feeds the request's newest token (sampled by the worker, maybe still in flight)."""
        row = StepRow(
            request_id=request.request_id, row=self.allocator.row(request.request_id),
            start_pos=request.held_tokens - 1, input_ids=[FED_BACK],
            slots=self.allocator.allocate(request.request_id, 1), sample=True,
        )
        request.pending += 1
        return row

    # ---- results -------------------------------------------------------------------

    def process(self, step: Step, result: StepResult) -> list[tuple[Request, RowResult, str | None]]:
        """Append sampled tokens, apply stop criteria, free finished requests.

        Returns (request, row result, finish reason or None) for each generated token.
        """
        by_id = {r.request_id: r for r in self.running}
        events = []
        for row, res in zip(step.rows, result.rows):
            request = by_id.get(row.request_id)
            if request is None:
                continue            # finished or aborted while this step was in flight
            if res.prompt_logprobs is not None:
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = [None]
                request.prompt_logprobs.extend(res.prompt_logprobs)
            if res.token_id is None:
                continue
            request.pending -= 1
            request.generated.append(res.token_id)
            reason = self._stop_reason(request, res.token_id)
            if reason:
                self._finish(request)
            events.append((request, res, reason))
        return events

    @staticmethod
    def _stop_reason(request: Request, token_id: int) -> str | None:
        if len(request.generated) >= request.max_new_tokens:
            return "length"
        if token_id in request.stop_token_ids:
            return "eos_token"
        return None

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.release(request.request_id)
        self._released.append(request.request_id)


def _longest_first(request: tuple[int, int]) -> int:
    return -request[0]


def reserved_usage(requests: list[tuple[int, int]], presorted: bool = False) -> int:
    """TGI-style reservation: every request holds room for its maximum length from the start."""
    return sum(remaining + tokens for remaining, tokens in requests)


def peak_usage(requests: list[tuple[int, int]], presorted: bool = False) -> int:
    """max_k (k * L_k + sum_{j<=k} R_j) over (L, R) pairs sorted by L descending."""
    peak, held = 0, 0
    ordered = requests if presorted else sorted(requests, key=_longest_first)
    for k, (remaining, tokens) in enumerate(ordered, start=1):
        held += tokens
        peak = max(peak, held + k * remaining)
    return peak
