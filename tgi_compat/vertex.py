"""`POST /vertex`, Google Vertex AI's route (TGI vertex.rs `vertex_compatibility`):
`{"instances": [...]}` -> `{"predictions": [generated_text, ...]}`, in the instances' order.

An instance is, in TGI's order (an untagged enum: the first variant that parses wins):

| instance has | generated as                                                                  |
| ------------ | ----------------------------------------------------------------------------- |
| `inputs`     | `/generate` with only `max_new_tokens` and `seed` of its `parameters`, and `do_sample`, `details`, `decoder_input_details` true |
| `messages`   | `/v1/chat/completions` (its template, tools and parameters; `n` unused): the generated text |

Every instance is one ordinary ``GenerateService`` request (its permit, validation, log lines and
metrics), all at once. No instances: 422 `Input validation error`; a chat instance whose template or
tools fail: that error, before anything runs; any instance that fails to generate (a validation
error, 429 and 424 included): 500 `Incomplete generation`.
"""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .chat import ChatRoutes
from .errors import InputValidationError, TGIError, VertexError
from .fan_out import gather_all
from .http_input import ClientDisconnected, cancel_on_disconnect, check_api_key, read_json
from .openai_schema import ChatRequest, parse_chat_request
from .responses import JSONBytesResponse
from .routes import CLIENT_CLOSED_REQUEST
from .schema import GenerateParameters, GenerateRequest, parse_parameters
from .service import GenerateService
from .settings import ServerSettings


def _generate_instance(value: Any) -> GenerateRequest:
    """TGI `GenerateVertexInstance`: `inputs` and an optional (null allowed) `parameters`, of which
    only `max_new_tokens` and `seed` are used."""
    if not isinstance(value, dict) or "inputs" not in value:
        raise InputValidationError("missing field `inputs`")
    inputs = value["inputs"]
    if not isinstance(inputs, str):
        raise InputValidationError("`inputs` must be a string")
    given = GenerateParameters() if value.get("parameters") is None else parse_parameters(value["parameters"])
    return GenerateRequest(inputs=inputs, parameters=GenerateParameters(
        do_sample=True, max_new_tokens=given.max_new_tokens, seed=given.seed, details=True,
        decoder_input_details=True))


def parse_vertex_instances(body: Any) -> list[GenerateRequest | ChatRequest]:
    if not isinstance(body, dict) or "instances" not in body:
        raise InputValidationError("missing field `instances`")
    if not isinstance(body["instances"], list):
        raise InputValidationError("`instances` must be an array")
    instances = []
    for index, value in enumerate(body["instances"]):
        try:
            instances.append(_generate_instance(value))
        except InputValidationError as error:
            if not (isinstance(value, dict) and "messages" in value):
                raise InputValidationError(f"`instances[{index}]` is neither a generate instance "
                                           f"(`inputs`: {error.detail}) nor a chat request (`messages`)") from None
            instances.append(parse_chat_request(value))
    return instances


class Vertex:
    def __init__(self, settings: ServerSettings, service: GenerateService, chat: ChatRoutes):
        self.settings, self.service, self.chat = settings, service, chat

    async def vertex(self, request: Request) -> Response:
        check_api_key(request, self.settings.api_key)
        instances = parse_vertex_instances(await read_json(request, self.settings.payload_limit))
        if not instances:
            raise VertexError(422, "Input validation error")
        planned = []        # (request, templated): every chat instance's template and tools first, as TGI
        for instance in instances:
            if isinstance(instance, ChatRequest):
                planned.append(((await self.chat.plan(instance)).request, True))
            else:
                planned.append((instance, False))
        work = [self.service.generate(generate, False, templated=templated) for generate, templated in planned]
        try:
            outcomes = await cancel_on_disconnect(request, gather_all(work))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except TGIError:
            raise VertexError(500, "Incomplete generation") from None
        return JSONBytesResponse({"predictions": [outcome.text(outcome.best) for outcome in outcomes]})
