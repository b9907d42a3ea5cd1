"""Running validated requests on the backend: token events -> tokens, text, finish reason.

``generate_steps`` drives one sub-request: it submits it, detokenizes each event,
applies stop sequences and stops consuming the backend's iterator as soon as the
sequence is finished, which (like a client disconnect) aborts it in the router.
``generate_best_of`` runs n sampled sub-requests and ranks them (TGI `generate_best_of`).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from engine.client import Backend
from engine.protocol.messages import GenerationRequest

from .detokenizer import IncrementalDetokenizer
from .errors import GenerationError, IncompleteGenerationError
from .outputs import GeneratedStep, GenerationResult, PrefillToken, Timing, Token
from .stop import StopSequenceMatcher
from .tokenization import TokenizerAdapter
from .validation import ValidRequest


class _SequenceState:
    """The tokens, text and finish reason of one sub-request, built event by event."""

    def __init__(self, tokenizer: TokenizerAdapter, request: ValidRequest):
        self.tokenizer, self.request = tokenizer, request
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.input_ids)
        self.stops = StopSequenceMatcher(request.stop_sequences)
        self.tokens: list[Token] = []
        self.top_tokens: list[list[Token]] = []
        self.prefill: list[PrefillToken] = []
        self.seed: int | None = None

    def add(self, event) -> tuple[Token, list[Token], str | None]:
        if not self.tokens and self.request.decoder_input_details and event.prompt_logprobs is not None:
            self.prefill = self._prefill(event.prompt_logprobs)
        tk = self.tokenizer
        token = Token(event.token_id, self.detokenizer.push(event.token_id), event.logprob,
                      tk.is_special(event.token_id))
        top = [Token(i, tk.token_text(i), lp, tk.is_special(i)) for i, lp in zip(event.top_ids, event.top_logprobs)]
        self.tokens.append(token)
        self.top_tokens.append(top)
        self.seed = event.seed
        finish = event.finish_reason
        if finish is None and self.stops.push(token.text) is not None:
            finish = "stop_sequence"
        return token, top, finish

    def _prefill(self, logprobs: list[float | None]) -> list[PrefillToken]:
        ids = self.request.input_ids
        return [PrefillToken(i, self.tokenizer.token_text(i), lp) for i, lp in zip(ids, logprobs)]

    def result(self, request_id: int, finish_reason: str, timing: Timing) -> GenerationResult:
        return GenerationResult(
            request_id=request_id, generated_text=self.detokenizer.generated_text(),
            finish_reason=finish_reason, tokens=self.tokens, top_tokens=self.top_tokens,
            prefill=self.prefill, seed=self.seed, input_length=self.request.input_length, timing=timing)


def submit_request(request: ValidRequest, request_id: int) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, prompt_ids=list(request.input_ids),
                         max_new_tokens=request.max_new_tokens, params=request.params)


async def generate_steps(backend: Backend, tokenizer: TokenizerAdapter, request: ValidRequest,
                         request_id: int, timing: Timing) -> AsyncIterator[GeneratedStep]:
    """Yield each generated token; the last step carries the ``GenerationResult``.

    Raises ``GenerationError`` for an engine error event and ``IncompleteGenerationError``
    if the backend's stream ends without a finish reason.
    """
    state = _SequenceState(tokenizer, request)
    timing.mark("validated")
    events = backend.generate(submit_request(request, request_id))
    try:
        async for event in events:
            if event.error:
                raise GenerationError(event.error)
            if timing.first_token is None:
                timing.mark("first_token")
            token, top, finish = state.add(event)
            if finish is None:
                yield GeneratedStep(len(state.tokens), token, top)
                continue
            timing.mark("finished")
            yield GeneratedStep(len(state.tokens), token, top, state.result(request_id, finish, timing))
            return
    finally:
        await _close(events)   # before the last event: the router aborts the request
    raise IncompleteGenerationError()


async def _close(iterator) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


async def generate_result(backend: Backend, tokenizer: TokenizerAdapter, request: ValidRequest,
                          request_id: int, timing: Timing) -> GenerationResult:
    steps = generate_steps(backend, tokenizer, request, request_id, timing)
    try:
        async for step in steps:
            if step.result is not None:
                return step.result
    finally:
        await steps.aclose()
    raise IncompleteGenerationError()


async def generate_best_of(backend: Backend, tokenizer: TokenizerAdapter, request: ValidRequest,
                           request_ids: list[int], timing: Timing) -> tuple[GenerationResult, list[GenerationResult]]:
    """Run one sub-request per id concurrently; best = highest mean token logprob.

    Every sub-request has its own ``Timing`` (from ``timing.received``); a failure of
    one cancels the others (their iterators close, so the router aborts them).
    """
    tasks = [asyncio.ensure_future(generate_result(backend, tokenizer, request, rid, Timing(received=timing.received)))
             for rid in request_ids]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    best = max(range(len(results)), key=lambda i: (results[i].mean_logprob, -i))
    return results[best], [r for i, r in enumerate(results) if i != best]
