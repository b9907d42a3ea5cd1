"""`POST /v1/chat/completions` and `POST /chat_tokenize` (TGI server.rs `chat_completions`,
lib.rs `ChatRequest::try_into_generate`, chat.rs `ChatState`).

A chat request becomes one ``GenerateRequest`` per choice: the rendered template as
``inputs`` (no special tokens added), TGI's parameter mapping (temperature 0 = greedy,
``repetition_penalty = presence_penalty + 2``, ``top_logprobs`` -> ``top_n_tokens``),
``details`` on, and a ``grammar`` from ``response_format`` or from the tools. Generation
itself is ``GenerateService``'s. Errors before generation (body, template, tools, ``n``)
are HTTP errors; once a stream started they are in-band OpenAI error events.
"""
from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from .chat_template import ChatTemplate
from .errors import InputValidationError, TGIError, ToolError
from .fan_out import choice_request, gather_all, merge_streams
from .http_input import ClientDisconnected, cancel_on_disconnect, check_api_key, read_json
from .openai_responses import (DONE_EVENT, OpenAIFormat, logprob_json, openai_error_event, summed_headers,
                               usage_json)
from .openai_schema import ChatRequest, parse_chat_request
from .outputs import GeneratedStep, GenerationResult
from .responses import JSONBytesResponse, json_bytes
from .routes import CLIENT_CLOSED_REQUEST, generate_headers, simple_tokens_json
from .schema import GenerateParameters, GenerateRequest
from .service import GenerateOutcome, GenerateService
from .settings import ServerSettings
from .sse import sse_data, sse_response
from .tools import ToolCallStream, next_tool_call_id, parse_tool_output, tool_grammar, tools_to_use


@dataclass(frozen=True)
class ChatPlan:
    """A chat request made generation-ready (TGI `try_into_generate`)."""
    request: GenerateRequest
    using_tools: bool


def chat_parameters(chat: ChatRequest, grammar: dict | None) -> GenerateParameters:
    greedy = chat.temperature == 0
    return GenerateParameters(
        temperature=None if greedy else chat.temperature, do_sample=not greedy,
        repetition_penalty=None if chat.presence_penalty is None else chat.presence_penalty + 2.0,
        frequency_penalty=chat.frequency_penalty, top_p=chat.top_p, max_new_tokens=chat.max_tokens,
        stop=chat.stop, details=True, seed=chat.seed, top_n_tokens=chat.top_logprobs, grammar=grammar,
        adapter_id=None)   # `model` names no adapter: none is loaded (TGI ignores it then)


def check_choice_count(n: int, settings: ServerSettings) -> None:
    """`n` choices run as `n` generations; like a prompt list, at most `max_client_batch_size`."""
    if not 1 <= n <= settings.max_client_batch_size:
        raise InputValidationError(f"`n` must be >= 1 and <= {settings.max_client_batch_size} "
                                   f"(--max-client-batch-size). Given: {n}")


class ChatRoutes:
    def __init__(self, settings: ServerSettings, service: GenerateService):
        self.settings, self.service = settings, service
        self.template = ChatTemplate(service.tokenizer.tokenizer)

    async def plan(self, chat: ChatRequest, use_tools: bool = True) -> ChatPlan:
        if chat.grammar is not None and chat.tools is not None:
            raise ToolError("Grammar and tools are mutually exclusive")
        tools = tools_to_use(chat.tools, chat.tool_choice) if (chat.tools is not None and use_tools) else None
        grammar = chat.grammar if tools is None else {"type": "json", "value": tool_grammar(tools)}
        inputs = await asyncio.to_thread(self.template.render, chat.messages, tools, chat.tool_prompt)
        request = GenerateRequest(inputs=inputs, parameters=chat_parameters(chat, grammar if use_tools else None))
        return ChatPlan(request, tools is not None)

    async def chat_tokenize(self, request: Request) -> Response:
        """TGI: `{"tokenize_response": [SimpleToken], "templated_text"}`. As TGI, open without the
        --api-key key and every token, whatever --max-input-tokens (--payload-limit bounds the body)."""
        chat = parse_chat_request(await read_json(request, self.settings.payload_limit))
        plan = await self.plan(chat)
        inputs = plan.request.inputs
        async with self.service.templated_validator.whole_tokens(inputs) as encoding:
            body = await simple_tokens_json(inputs, encoding, before=b'{"tokenize_response":',
                                            after=b',"templated_text":' + json_bytes(inputs) + b"}")
        return Response(body, media_type="application/json")

    async def chat_completions(self, request: Request) -> Response:
        check_api_key(request, self.settings.api_key)
        chat = parse_chat_request(await read_json(request, self.settings.payload_limit))
        check_choice_count(chat.n, self.settings)
        plan = await self.plan(chat)
        form = OpenAIFormat.for_settings(self.settings, None if chat.model == "tgi" else chat.model)
        if chat.stream:
            headers = {"x-compute-type": self.settings.compute_type,
                       "x-compute-characters": str(chat.n * len(plan.request.inputs)), "X-Accel-Buffering": "no"}
            # each choice's prompt starts tokenizing now, before the response does (as /generate_stream)
            started = [self.service.templated_validator.start_tokenizing(choice_request(plan.request, i))
                       for i in range(chat.n)]
            return sse_response(self._stream(chat, plan, form, started), headers, self.settings.keep_alive_s,
                                self.settings.stream_shutdown_grace_s)
        choices = [self._complete(chat, plan, i) for i in range(chat.n)]
        try:
            answers = await cancel_on_disconnect(request, gather_all(choices))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        results = [outcome.best for outcome, _ in answers]
        body = form.chat_completion(
            [form.chat_choice(i, outcome.best, calls, chat.logprobs) for i, (outcome, calls) in enumerate(answers)],
            usage_json(results[0].input_length, sum(r.generated_tokens for r in results)))
        headers = summed_headers([generate_headers(self.settings, outcome) for outcome, _ in answers])
        return JSONBytesResponse(body, headers=headers)

    async def _complete(self, chat: ChatRequest, plan: ChatPlan, index: int) -> tuple[GenerateOutcome, list | None]:
        """One choice; a `no_tool` answer is generated again without tools (TGI)."""
        outcome = await self.service.generate(choice_request(plan.request, index), False, templated=True)
        if not plan.using_tools:
            return outcome, None
        calls = parse_tool_output(outcome.best.generated_text)
        if calls is not None:
            return outcome, calls
        plain = await self.plan(chat, use_tools=False)
        return await self.service.generate(choice_request(plain.request, index), False, templated=True), None

    async def _stream(self, chat: ChatRequest, plan: ChatPlan, form: OpenAIFormat,
                      started: list[Future | None]) -> AsyncIterator[bytes]:
        """``started``: each choice's prompt tokenizing (``Validator.start_tokenizing``)."""
        results: list[GenerationResult] = []
        failed = False
        streams = [self._choice_chunks(chat, plan, form, i, started[i]) for i in range(chat.n)]
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for _, item in merged:
                if isinstance(item, TGIError):
                    failed = True
                    yield openai_error_event(item)
                elif isinstance(item, GenerationResult):
                    results.append(item)
                else:
                    yield sse_data(item)
        if chat.include_usage and not failed:
            usage = usage_json(results[0].input_length, sum(r.generated_tokens for r in results))
            yield sse_data(form.chat_usage_chunk(usage))
        yield DONE_EVENT

    async def _choice_chunks(self, chat: ChatRequest, plan: ChatPlan, form: OpenAIFormat, index: int,
                             started: Future | None) -> AsyncIterator[dict | GenerationResult]:
        """The chunks of one choice, then its ``GenerationResult`` (for the usage chunk); ``started``: its
        prompt's tokenizing (a `no_tool` answer's new prompt tokenizes when it is validated)."""
        if plan.using_tools:
            calls, call_id = ToolCallStream(), next_tool_call_id(chat.messages)
            async for step in self._steps(plan, index, started):
                text = "" if step.token.special else step.token.text
                for name, arguments in calls.push(text, last=step.result is not None):
                    delta = {"role": "assistant", "tool_calls": [{
                        "index": 0, "id": call_id, "type": "function",
                        "function": {"name": name, "arguments": arguments}}]}
                    yield self._chunk(form, chat, index, delta, step)
                if step.result is not None and not calls.no_tool:
                    yield step.result
            if not calls.no_tool:
                return
            plan, started = await self.plan(chat, use_tools=False), None
        async for step in self._steps(plan, index, started):
            delta = {"role": "assistant", "content": "" if step.token.special else step.token.text}
            yield self._chunk(form, chat, index, delta, step)
            if step.result is not None:
                yield step.result

    async def _steps(self, plan: ChatPlan, index: int, started: Future | None) -> AsyncIterator[GeneratedStep]:
        request = choice_request(plan.request, index)
        async with contextlib.aclosing(self.service.stream_steps(request, False, templated=True,
                                                                 started=started)) as steps:
            async for _, step in steps:
                yield step

    @staticmethod
    def _chunk(form: OpenAIFormat, chat: ChatRequest, index: int, delta: dict, step: GeneratedStep) -> dict:
        logprobs = {"content": [logprob_json(step.token, step.top_tokens)]} if chat.logprobs else None
        finish = None if step.result is None else step.result.finish_reason
        return form.chat_chunk(index, delta, logprobs, finish)
