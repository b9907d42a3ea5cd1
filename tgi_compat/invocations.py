"""`POST /invocations`, SageMaker's route (TGI `sagemaker_compatibility`): the body's shape
picks the route, in TGI's order (an untagged enum: the first variant that parses wins).

| body has   | answered as                                    |
| ---------- | ---------------------------------------------- |
| `inputs`   | `POST /` (`stream` picks SSE; else a one-element list, as SageMaker's clients read it) |
| `messages` | `POST /v1/chat/completions`                    |
| `prompt`   | `POST /v1/completions`                         |
"""
from __future__ import annotations

import json
from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from .errors import InputValidationError
from .http_input import check_api_key, read_json
from .settings import ServerSettings

Handler = Callable[[Request], Awaitable[Response]]


def _replay(request: Request, body: bytes) -> Request:
    """A copy of ``request`` whose body is ``body`` (the original's was read); later messages
    (a client disconnect) still come from the connection."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()
    return Request(request.scope, receive)


class Invocations:
    def __init__(self, settings: ServerSettings, generate: Handler, chat: Handler, completions: Handler):
        self.settings = settings
        self.by_key = (("inputs", generate), ("messages", chat), ("prompt", completions))

    async def invocations(self, request: Request) -> Response:
        check_api_key(request, self.settings.api_key)
        body = await read_json(request, self.settings.payload_limit)
        for key, handler in self.by_key:
            if isinstance(body, dict) and key in body:
                return await handler(_replay(request, json.dumps(body).encode()))
        raise InputValidationError("`/invocations` takes a body with `inputs` (TGI's /generate), "
                                   "`messages` (/v1/chat/completions) or `prompt` (/v1/completions)")
