"""`POST /v1/completions` and `GET /v1/models` (TGI server.rs `completions`, `openai_get_model_info`).

Each prompt (times `n`) is an ordinary ``GenerateService`` request; choice ``p * n + k`` is
prompt ``p``'s ``k``-th sample. Streams interleave the sequences' chunks as tokens come.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from .chat import check_choice_count
from .errors import OpenAIRouteError, TGIError
from .fan_out import choice_request, gather_all, merge_streams
from .http_input import ClientDisconnected, cancel_on_disconnect, check_api_key, read_json
from .openai_responses import (DONE_EVENT, OpenAIFormat, models_json, openai_error_event, openai_finish_reason,
                               summed_headers, usage_json)
from .openai_schema import CompletionRequest, parse_completion_request
from .responses import JSONBytesResponse
from .routes import CLIENT_CLOSED_REQUEST, generate_headers
from .schema import GenerateParameters, GenerateRequest
from .service import GenerateService
from .settings import ServerSettings
from .sse import sse_data, sse_response


def completion_requests(req: CompletionRequest) -> list[GenerateRequest]:
    """One request per choice, in choice order (TGI's parameter mapping; temperature 0 = greedy)."""
    greedy = req.temperature == 0
    parameters = GenerateParameters(
        temperature=None if greedy else req.temperature, do_sample=not greedy,
        repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty, top_p=req.top_p,
        max_new_tokens=req.max_tokens, stop=req.stop, details=True, seed=req.seed,
        adapter_id=None)   # `model` names no adapter: none is loaded (TGI ignores it then)
    return [choice_request(GenerateRequest(inputs=prompt, parameters=parameters), k)
            for prompt in req.prompts for k in range(req.n)]


def check_completion_request(req: CompletionRequest, settings: ServerSettings) -> None:
    """TGI's two hard-coded errors (suffix first), then our `n` range."""
    if req.suffix is not None:
        raise OpenAIRouteError("Suffix is not supported and can be achieved by preprocessing the prompt.",
                               "suffix not supported")
    if len(req.prompts) > settings.max_client_batch_size:
        raise OpenAIRouteError(f"Number of prompts exceeds the maximum allowed batch size of "
                               f"{settings.max_client_batch_size}", "batch size exceeded")
    check_choice_count(req.n, settings)


class CompletionRoutes:
    def __init__(self, settings: ServerSettings, service: GenerateService):
        self.settings, self.service = settings, service

    async def models(self, request: Request) -> Response:
        return JSONBytesResponse(models_json(self.settings))

    async def completions(self, request: Request) -> Response:
        check_api_key(request, self.settings.api_key)
        req = parse_completion_request(await read_json(request, self.settings.payload_limit))
        check_completion_request(req, self.settings)
        requests = completion_requests(req)
        form = OpenAIFormat.for_settings(self.settings)
        if req.stream:
            headers = {"x-compute-type": self.settings.compute_type,
                       "x-compute-characters": str(sum(len(r.inputs) for r in requests)), "X-Accel-Buffering": "no"}
            started = [self.service.validator.start_tokenizing(r) for r in requests]   # before the response starts
            return sse_response(self._stream(requests, form, started), headers, self.settings.keep_alive_s,
                                self.settings.stream_shutdown_grace_s)
        try:
            outcomes = await cancel_on_disconnect(
                request, gather_all([self.service.generate(r, False) for r in requests]))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = [form.completion_choice(i, o.best.generated_text, openai_finish_reason(o.best.finish_reason))
                   for i, o in enumerate(outcomes)]
        prompt_tokens = sum(o.best.input_length for o in outcomes[::req.n])   # each prompt once
        usage = usage_json(prompt_tokens, sum(o.best.generated_tokens for o in outcomes))
        headers = summed_headers([generate_headers(self.settings, o) for o in outcomes])
        return JSONBytesResponse(form.completion(choices, usage), headers=headers)

    async def _stream(self, requests: list[GenerateRequest], form: OpenAIFormat,
                      started: list[Future | None]) -> AsyncIterator[bytes]:
        """``started``: each request's prompt tokenizing (``Validator.start_tokenizing``)."""
        streams = [self.service.stream_steps(r, False, started=f) for r, f in zip(requests, started)]
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for index, item in merged:
                if isinstance(item, TGIError):
                    yield openai_error_event(item)
                    continue
                _, step = item
                text = "" if step.token.special else step.token.text
                if step.result is None:
                    yield sse_data(form.completion_chunk(index, text))
                else:
                    yield sse_data(form.completion_final_chunk(index, text, step.result))
        yield DONE_EVENT
