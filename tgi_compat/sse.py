"""Server-sent events exactly as TGI (axum) frames them on `/generate_stream` and `POST /`.

Each event is ``data:<compact json>\\n\\n`` (no space after the colon, no `event:`/`id:`),
there is no ``[DONE]`` sentinel, errors are in-band ``data:{"error","error_type"}``
events, and the keep-alive is the comment ``:\\n\\n`` (axum's default, every 15 s).
"""
from __future__ import annotations

from typing import AsyncIterator

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse

from .errors import TGIError
from .outputs import GeneratedStep
from .responses import json_bytes, stream_details_json, stream_event_json


def sse_data(payload: dict) -> bytes:
    return b"data:" + json_bytes(payload) + b"\n\n"


def step_event(step: GeneratedStep, final_text: str | None, details: bool) -> bytes:
    """One token event; ``final_text`` and StreamDetails only on the last step."""
    result = step.result
    stream_details = stream_details_json(result) if (result is not None and details) else None
    return sse_data(stream_event_json(step.index, step.token, step.top_tokens,
                                      final_text if result is not None else None, stream_details))


def error_event(error: TGIError) -> bytes:
    return sse_data(error.body())


class _KeepAlive(ServerSentEvent):
    def encode(self) -> bytes:
        return b":\n\n"


class _EventStream(EventSourceResponse):
    """sse-starlette's response without a cancel scope around every send when no send timeout is
    set (ours: axum has none): entering and leaving one cost about a third of a token event's
    time on the event loop with 256 streams."""

    async def _send_with_timeout(self, send, message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def sse_response(events: AsyncIterator[bytes], headers: dict[str, str], keep_alive_s: float,
                 shutdown_grace_s: float = 0.0) -> EventSourceResponse:
    """Stream pre-encoded events. sse-starlette watches for the client's disconnect and
    then cancels ``events``, which closes the backend iterator (the request is aborted).
    When the server is told to exit it lets the stream go on for ``shutdown_grace_s``
    (--graceful-termination-timeout) before it cancels it."""
    return _EventStream(
        events, headers={"Cache-Control": "no-cache", **headers}, ping=keep_alive_s, sep="\n",
        ping_message_factory=_KeepAlive, shutdown_grace_period=shutdown_grace_s)
