"""What a request must pass before its JSON is looked at, in axum's order:
API key (401, empty body), content type (415), body size (413), JSON syntax (400).
Also ``cancel_on_disconnect`` for the non-stream routes (TGI drops the request when the
client goes away).
"""
from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any, Awaitable, TypeVar

from starlette.requests import Request

from .errors import BadRequestError, PayloadTooLargeError, UnauthorizedError, UnsupportedMediaTypeError

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def check_api_key(request: Request, api_key: str | None) -> None:
    """TGI compares the whole header with ``Bearer <key>``, case-insensitively."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "").lower().encode()
    if not hmac.compare_digest(given, f"bearer {api_key}".lower().encode()):
        raise UnauthorizedError()


def _is_json(content_type: str | None) -> bool:
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, payload_limit: int) -> Any:
    if not _is_json(request.headers.get("content-type")):
        raise UnsupportedMediaTypeError()
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > payload_limit:
        raise PayloadTooLargeError(payload_limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > payload_limit:
            raise PayloadTooLargeError(payload_limit)
    try:
        value = json.loads(bytes(body), parse_constant=_reject_constant)
        _check_json_value(value)
    except RecursionError:
        raise BadRequestError(f"Failed to parse the request body as JSON: nesting deeper than {MAX_JSON_DEPTH}") \
            from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequestError(f"Failed to parse the request body as JSON: {e}") from e
    return value


MAX_JSON_DEPTH = 128     # serde_json's recursion limit: TGI answers 400 beyond it


def _check_json_value(value: Any) -> None:
    """Refuse (ValueError) nesting deeper than ``MAX_JSON_DEPTH`` and strings that are not valid
    Unicode (a lone surrogate escape such as "\\ud800", which serde_json refuses too)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_unicode(item)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nesting deeper than {MAX_JSON_DEPTH}")
        if isinstance(item, dict):
            for key in item:
                _check_unicode(key)
            stack.extend((v, depth + 1) for v in item.values())
        else:
            stack.extend((v, depth + 1) for v in item)


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"lone surrogate in a string at character {e.start}") from None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    return task.result()
