"""TGI's JSON bodies: compact, NaN logprobs as null, optional keys omitted as TGI omits them."""
from __future__ import annotations

import json
import math
from typing import Any

from starlette.responses import Response

from .outputs import GenerationResult, PrefillToken, Token


def json_bytes(payload: Any) -> bytes:
    """Compact UTF-8 JSON; any non-finite float becomes null (TGI serializes NaN as null)."""
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        text = json.dumps(_finite(payload), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _logprob(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class JSONBytesResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def token_json(token: Token) -> dict:
    return {"id": token.id, "text": token.text, "logprob": _logprob(token.logprob), "special": token.special}


def prefill_json(token: PrefillToken) -> dict:
    return {"id": token.id, "text": token.text, "logprob": _logprob(token.logprob)}


def _sequence_json(result: GenerationResult) -> dict:
    """The fields Details and BestOfSequence share, in TGI's order."""
    body = {
        "finish_reason": result.finish_reason,
        "generated_tokens": result.generated_tokens,
        "seed": result.seed,
        "prefill": [prefill_json(t) for t in result.prefill],
        "tokens": [token_json(t) for t in result.tokens],
    }
    if any(result.top_tokens):
        body["top_tokens"] = [[token_json(t) for t in step] for step in result.top_tokens]
    return body


def generate_json(best: GenerationResult, text: str, details: bool,
                  others: list[tuple[GenerationResult, str]] = ()) -> dict:
    """`/generate` body. ``text`` is the final generated_text (prompt prepended if asked)."""
    body: dict = {"generated_text": text}
    if details:
        body["details"] = _sequence_json(best)
        if others:
            body["details"]["best_of_sequences"] = [
                {"generated_text": other_text, **_sequence_json(other)} for other, other_text in others
            ]
    return body


def stream_event_json(index: int, token: Token, top_tokens: list[Token],
                      text: str | None, details: dict | None) -> dict:
    """One `/generate_stream` event; `generated_text` and `details` null until the last."""
    event: dict = {"index": index, "token": token_json(token)}
    if top_tokens:
        event["top_tokens"] = [token_json(t) for t in top_tokens]
    event["generated_text"] = text
    event["details"] = details
    return event


def stream_details_json(result: GenerationResult) -> dict:
    return {"finish_reason": result.finish_reason, "generated_tokens": result.generated_tokens,
            "seed": result.seed, "input_length": result.input_length}
