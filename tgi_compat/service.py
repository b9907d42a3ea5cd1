"""One generation request from validated body to result: permits, validation, backend,
metrics and the request's log lines. The HTTP handlers (``routes``) only translate.

Order as TGI: best_of limits, then the concurrency permits (429), then validation (422),
then generation (424/500). Streams report everything after body parsing in-band.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import AsyncIterator

from engine.client import Backend

from .concurrency import ConcurrencyLimiter
from .errors import (GenerationError, IncompleteGenerationError, IncompleteGenerationStreamError,
                     InputValidationError, TGIError)
from .generation import generate_best_of, generate_result, generate_steps
from .metrics import ServerMetrics
from .tracing import RequestTracer
from .outputs import GeneratedStep, GenerationResult, Timing
from .request_ids import next_request_id
from .schema import GenerateRequest
from .settings import ServerSettings
from .sse import error_event, step_event
from .tokenization import TemplatedTokenizer, TokenizerAdapter
from .validation import ValidRequest, Validator, validate_best_of

log = logging.getLogger("tgi_compat")


@dataclass
class GenerateOutcome:
    request: ValidRequest
    best: GenerationResult
    others: list[GenerationResult]

    def text(self, result: GenerationResult) -> str:
        """generated_text as returned: the prompt prepended when `return_full_text`."""
        prefix = self.request.inputs if self.request.return_full_text else ""
        return prefix + result.generated_text


class GenerateService:
    def __init__(self, settings: ServerSettings, tokenizer: TokenizerAdapter, backend: Backend,
                 metrics: ServerMetrics, tracer: RequestTracer | None = None, shared_permits=None):
        self.settings, self.tokenizer, self.backend, self.metrics = settings, tokenizer, backend, metrics
        self.tracer = tracer            # --otlp-endpoint: each request's spans
        # shared_permits: the front ends' common count (--frontend-processes), else this process's own
        self.limiter = ConcurrencyLimiter(settings.max_concurrent_requests, shared_permits)
        whole_turn = asyncio.Semaphore(1)      # one text too long for a prompt tokenized whole at a time
        self.validator = Validator(settings, tokenizer, whole_turn)
        # prompts rendered by a chat template already hold their special tokens
        self.templated_validator = Validator(settings, TemplatedTokenizer(tokenizer), whole_turn)

    async def generate(self, request: GenerateRequest, full_text_default: bool,
                       templated: bool = False) -> GenerateOutcome:
        """Non-stream generation; raises ``TGIError`` (or is cancelled on disconnect).
        ``templated``: ``inputs`` is a rendered chat template (no special tokens added)."""
        request_id, timing = next_request_id(), Timing()
        self._record_received(request_id, request, stream=False)
        try:
            best_of = validate_best_of(request.parameters.best_of, self.settings.max_best_of)
            with self.limiter.permits(best_of):
                valid = await self._validate(request_id, request, full_text_default, timing, templated)
                if best_of == 1:
                    best = await generate_result(self.backend, self.tokenizer, valid, request_id, timing)
                    others = []
                else:
                    ids = [request_id] + [next_request_id() for _ in range(best_of - 1)]
                    best, others = await generate_best_of(self.backend, self.tokenizer, valid, ids, timing)
        except TGIError as error:
            self._record_failure(request_id, error, timing, "generate")
            raise
        except asyncio.CancelledError:
            self._record_dropped(request_id, timing=timing, route="generate")
            raise
        except Exception as error:
            raise self._unexpected(request_id, error, timing, "generate") from error
        self._record_success(best, valid, "generate")
        return GenerateOutcome(valid, best, others)

    def stream(self, request: GenerateRequest, full_text_default: bool) -> AsyncIterator[bytes]:
        """SSE bytes of a streamed generation; every error is an in-band event. The prompt's
        tokenizing starts now, before the response does."""
        return self._stream_events(request, full_text_default, self.validator.start_tokenizing(request))

    async def _stream_events(self, request: GenerateRequest, full_text_default: bool,
                             started: Future | None) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(self.stream_steps(request, full_text_default, started=started)) as steps:
                async for valid, step in steps:
                    text = None
                    if step.result is not None:
                        text = (valid.inputs if valid.return_full_text else "") + step.result.generated_text
                    yield step_event(step, text, valid.details)
        except TGIError as error:
            yield error_event(error)

    async def stream_steps(self, request: GenerateRequest, full_text_default: bool, templated: bool = False,
                           started: Future | None = None) -> AsyncIterator[tuple[ValidRequest, GeneratedStep]]:
        """The steps of a streamed generation, for any wire format. Every failure is
        recorded here and raised as a ``TGIError`` (a stream reports it in-band).
        ``started``: the validator's ``start_tokenizing(request)`` (cancelled if unused)."""
        request_id, timing = next_request_id(), Timing()
        self._record_received(request_id, request, stream=True)
        generated = 0
        try:
            _check_streamable(request)
            with self.limiter.permits(1):
                valid = await self._validate(request_id, request, full_text_default, timing, templated, started)
                steps = generate_steps(self.backend, self.tokenizer, valid, request_id, timing)
                async for step in steps:
                    generated = step.index
                    if step.result is not None:
                        self._record_success(step.result, valid, "generate_stream")
                    yield valid, step
        except TGIError as error:
            if isinstance(error, IncompleteGenerationError):
                error = IncompleteGenerationStreamError()
            self._record_failure(request_id, error, timing, "generate_stream")
            raise error from None
        except (GeneratorExit, asyncio.CancelledError):
            self._record_dropped(request_id, generated, timing, "generate_stream")
            raise
        except Exception as error:
            raise self._unexpected(request_id, error, timing, "generate_stream") from error
        finally:
            if started is not None:
                started.cancel()        # refused before check 14 (or 429): not tokenized if still waiting

    async def _validate(self, request_id: int, request: GenerateRequest, full_text_default: bool,
                        timing: Timing, templated: bool = False, started: Future | None = None) -> ValidRequest:
        validator = self.templated_validator if templated else self.validator
        valid = await validator.validate(request, full_text_default, started)
        self.metrics.input_length.observe(valid.input_length)
        self.metrics.max_new_tokens.observe(valid.max_new_tokens)
        log.info("request %d validated: %d input tokens, max_new_tokens=%d, sampling=%s in %.1f ms",
                 request_id, valid.input_length, valid.max_new_tokens, valid.params.do_sample,
                 timing.total_s * 1000)
        return valid

    def _record_received(self, request_id: int, request: GenerateRequest, stream: bool) -> None:
        self.metrics.request_count.inc()
        log.info("request %d received: %s, %d characters", request_id,
                 "stream" if stream else "generate", len(request.inputs))

    def _trace(self, route: str, timing: Timing | None, attributes: dict, error: str | None = None) -> None:
        if self.tracer is not None and timing is not None:
            self.tracer.record(route, timing, attributes, error)

    def _record_failure(self, request_id: int, error: TGIError, timing: Timing | None = None,
                        route: str = "") -> None:
        if error.metric_label:
            self.metrics.request_failure.labels(err=error.metric_label).inc()
        self._trace(route, timing, {"request_id": request_id, "error_type": error.error_type}, error.error_type)
        # The message may quote the request (a grammar, a stop sequence): only at DEBUG.
        log.info("request %d failed (%d %s, %d-character message)", request_id, error.status, error.error_type,
                 len(error.message))
        log.debug("request %d failure: %s", request_id, error.message)

    def _unexpected(self, request_id: int, error: Exception, timing: Timing | None = None,
                    route: str = "") -> GenerationError:
        """A failure nobody classified (a backend bug): logged with its traceback, reported as 424."""
        log.exception("request %d failed unexpectedly", request_id)
        failure = GenerationError(f"{type(error).__name__}: {error}")
        self._record_failure(request_id, failure, timing, route)
        return failure

    def _record_dropped(self, request_id: int, generated: int | None = None, timing: Timing | None = None,
                        route: str = "") -> None:
        self.metrics.request_failure.labels(err="dropped").inc()
        self._trace(route, timing, {"request_id": request_id}, "dropped")
        after = "" if generated is None else f" after {generated} tokens"
        log.info("request %d cancelled: the client disconnected%s", request_id, after)

    def _record_success(self, result: GenerationResult, request: ValidRequest, route: str) -> None:
        m, t = self.metrics, result.timing
        self._trace(route, t, {"request_id": result.request_id, "input_length": request.input_length,
                               "max_new_tokens": request.max_new_tokens, "generated_tokens": result.generated_tokens,
                               "finish_reason": result.finish_reason, "seed": str(result.seed)})
        m.request_success.inc()
        m.request_duration.observe(t.total_s)
        m.validation_duration.observe(t.validation_s)
        m.queue_duration.observe(t.queue_s)
        m.inference_duration.observe(t.inference_s)
        m.time_per_token.observe(result.time_per_token_s)
        m.generated_tokens.observe(result.generated_tokens)
        log.info("request %d finished: %s after %d tokens, seed=%s, %.1f ms total, %.1f ms to first token",
                 result.request_id, result.finish_reason, result.generated_tokens, result.seed,
                 t.total_s * 1000, (t.validation_s + t.queue_s) * 1000)


def _check_streamable(request: GenerateRequest) -> None:
    p = request.parameters
    if p.best_of not in (None, 1):
        raise InputValidationError("`best_of` != 1 is not supported when streaming tokens")
    if p.decoder_input_details:
        raise InputValidationError("`decoder_input_details` == true is not supported when streaming tokens")
