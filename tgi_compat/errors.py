"""The one place that maps failures to HTTP statuses and TGI error bodies.

Every error the front end reports is a ``TGIError``: ``status`` for the non-stream
routes, ``body()`` = ``{"error", "error_type"}`` (also the in-band SSE event).
TGI answers body-shape problems (415, 413, 400, 422 type errors) in text/plain from
axum; we answer them as JSON so that every client can parse them.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

GENERATION_PREFIX = "Request failed during generation: "


class TGIError(Exception):
    status: int = 500
    error_type: str = "unknown"
    metric_label: str | None = None    # `err` label of tgi_request_failure (None: not counted)

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def body(self) -> dict:
        return {"error": self.message, "error_type": self.error_type}


class InputValidationError(TGIError):
    status, error_type, metric_label = 422, "validation", "validation"

    def __init__(self, detail: str):
        super().__init__(f"Input validation error: {detail}")
        self.detail = detail


class OverloadedError(TGIError):
    status, error_type, metric_label = 429, "overloaded", "overloaded"

    def __init__(self):
        super().__init__("Model is overloaded")


class GenerationError(TGIError):
    status, error_type, metric_label = 424, "generation", "generation"

    def __init__(self, detail: str):
        # the engine may already have prefixed its message
        super().__init__(detail if detail.startswith(GENERATION_PREFIX) else GENERATION_PREFIX + detail)


class IncompleteGenerationError(TGIError):
    status, error_type, metric_label = 500, "incomplete_generation", "incomplete"

    def __init__(self):
        super().__init__("Incomplete generation")


class IncompleteGenerationStreamError(TGIError):
    status, error_type, metric_label = 500, "incomplete_generation_stream", "incomplete"

    def __init__(self):
        super().__init__("Incomplete generation stream")


class VertexError(TGIError):
    """`POST /vertex`'s own two errors, whose `error_type` repeats the message (TGI vertex.rs): 422 for
    no instances, 500 when any instance's generation failed (that failure is counted as itself)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.error_type = status, message


class TemplateError(TGIError):
    """The chat template is missing or failed to render (TGI `InferError::TemplateError`)."""
    status, error_type, metric_label = 422, "template_error", "template"

    def __init__(self, detail: str):
        super().__init__(f"Template error: {detail}")


class ToolError(TGIError):
    """Tools that cannot be applied or a tool call that cannot be parsed (TGI `InferError::ToolError`)."""
    status, error_type, metric_label = 422, "tool_error", "validation"

    def __init__(self, detail: str):
        super().__init__(f"Tool error: {detail}")


class OpenAIRouteError(TGIError):
    """The hard-coded errors of TGI's `/v1/completions` (``error_type`` is free text there)."""
    status, metric_label = 422, "validation"

    def __init__(self, message: str, error_type: str):
        super().__init__(message)
        self.error_type = error_type


class BadRequestError(TGIError):
    """Malformed JSON (TGI/axum: 400 text/plain)."""
    status, error_type = 400, "bad_request"


class PayloadTooLargeError(TGIError):
    status, error_type = 413, "payload_too_large"

    def __init__(self, limit: int):
        super().__init__(f"Failed to buffer the request body: length limit exceeded ({limit} bytes)")


class UnsupportedMediaTypeError(TGIError):
    status, error_type = 415, "unsupported_media_type"

    def __init__(self):
        super().__init__("Expected request with `Content-Type: application/json`")


class UnauthorizedError(TGIError):
    """Wrong or missing API key: 401 with an empty body, as TGI."""
    status, error_type = 401, "unauthorized"

    def __init__(self):
        super().__init__("")


class InternalError(TGIError):
    status, error_type = 500, "internal"


class UnhealthyError(TGIError):
    status, error_type = 503, "healthcheck"

    def __init__(self):
        super().__init__("unhealthy")


def error_response(error: TGIError, headers: dict[str, str] | None = None) -> Response:
    from .responses import (
        JSONBytesResponse,  # responses imports nothing from here at import time
    )

    if isinstance(error, UnauthorizedError):
        return Response(status_code=401, headers=headers)
    return JSONBytesResponse(error.body(), status_code=error.status, headers=headers)


async def handle_tgi_error(request: Request, error: Exception) -> Response:
    """Starlette exception handler for ``TGIError``."""
    assert isinstance(error, TGIError)
    return error_response(error)


async def handle_unexpected_error(request: Request, error: Exception) -> Response:
    """Anything else is a bug: still a JSON body, so that every TGI client can parse it."""
    return error_response(InternalError(f"Internal server error: {type(error).__name__}"))
