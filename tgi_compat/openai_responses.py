"""The JSON bodies and SSE events of TGI's OpenAI-style routes, in TGI's key order.

``object`` comes first (TGI tags its enums with it), ``id`` is always "", ``created`` is
unix seconds, ``system_fingerprint`` is ``<version>-<docker_label or "native">``.
Streams end with ``data: [DONE]`` and report errors in-band as
``{"error": {"message", "http_status_code": 422}}`` (TGI `into_openai_event`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .errors import TGIError
from .outputs import GenerationResult, Token
from .settings import ServerSettings
from .sse import sse_data

# With the space, unlike TGI's `data:[DONE]` (same event for SSE parsers): huggingface_hub's
# InferenceClient stops only at the exact line `data: [DONE]` and fails on TGI's.
DONE_EVENT = b"data: [DONE]\n\n"


def openai_finish_reason(finish_reason: str) -> str:
    """TGI `FinishReason::format(true)`: the end-of-sequence token reads "stop"."""
    return "stop" if finish_reason == "eos_token" else finish_reason


def openai_error_event(error: TGIError) -> bytes:
    return sse_data({"error": {"message": error.message, "http_status_code": 422}})


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _logprob(value: float) -> float | None:
    return value if math.isfinite(value) else None


def logprob_json(token: Token, top_tokens: list[Token]) -> dict:
    return {"token": token.text, "logprob": _logprob(token.logprob),
            "top_logprobs": [{"token": t.text, "logprob": _logprob(t.logprob)} for t in top_tokens]}


def logprobs_json(result: GenerationResult) -> dict:
    return {"content": [logprob_json(t, top) for t, top in zip(result.tokens, result.top_tokens)]}


@dataclass(frozen=True)
class OpenAIFormat:
    """What every body of one response shares."""
    model: str
    system_fingerprint: str

    @classmethod
    def for_settings(cls, settings: ServerSettings, model: str | None = None) -> "OpenAIFormat":
        return cls(model or settings.model_id, f"{settings.version}-{settings.docker_label or 'native'}")

    def _head(self, kind: str) -> dict:
        return {"object": kind, "id": "", "created": int(time.time()), "model": self.model,
                "system_fingerprint": self.system_fingerprint}

    # ---- /v1/chat/completions ------------------------------------------------------------

    def chat_completion(self, choices: list[dict], usage: dict) -> dict:
        return {**self._head("chat.completion"), "choices": choices, "usage": usage}

    @staticmethod
    def chat_choice(index: int, result: GenerationResult, tool_calls: list[dict] | None,
                    logprobs: bool) -> dict:
        message = ({"role": "assistant", "tool_calls": tool_calls} if tool_calls is not None
                   else {"role": "assistant", "content": result.generated_text})
        return {"index": index, "message": message, "logprobs": logprobs_json(result) if logprobs else None,
                "finish_reason": openai_finish_reason(result.finish_reason)}

    def chat_chunk(self, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": None if finish_reason is None else openai_finish_reason(finish_reason)}
        return {**self._head("chat.completion.chunk"), "choices": [choice], "usage": None}

    def chat_usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage}

    # ---- /v1/completions -----------------------------------------------------------------

    def completion(self, choices: list[dict], usage: dict) -> dict:
        return {**self._head("text_completion"), "choices": choices, "usage": usage}

    @staticmethod
    def completion_choice(index: int, text: str, finish_reason: str) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def completion_chunk(self, index: int, text: str) -> dict:
        """An intermediate chunk: TGI's `Chunk` (choices before model; finish_reason "")."""
        head = self._head("text_completion")
        return {"object": head["object"], "id": "", "created": head["created"],
                "choices": [self.completion_choice(index, text, "")], "model": self.model,
                "system_fingerprint": self.system_fingerprint}

    def completion_final_chunk(self, index: int, text: str, result: GenerationResult) -> dict:
        """The last chunk of one sequence; finish_reason unformatted ("eos_token"), as TGI."""
        choice = self.completion_choice(index, text, result.finish_reason)
        return {**self._head("text_completion"), "choices": [choice],
                "usage": usage_json(result.input_length, result.generated_tokens)}


def models_json(settings: ServerSettings) -> dict:
    return {"object": "list",
            "data": [{"id": settings.model_id, "object": "model", "created": 0, "owned_by": settings.model_id}]}


_SUMMED_HEADERS = ("x-compute-characters", "x-total-time", "x-validation-time", "x-queue-time",
                   "x-inference-time", "x-time-per-token", "x-prompt-tokens", "x-generated-tokens")


def summed_headers(headers: list[dict[str, str]]) -> dict[str, str]:
    """TGI's `/v1/completions`: the x-* headers of every generation, added up."""
    total = dict(headers[0])
    for name in _SUMMED_HEADERS:
        total[name] = str(sum(int(h[name]) for h in headers))
    total["x-compute-time"] = repr(sum(float(h["x-compute-time"]) for h in headers))
    return total
