"""The HTTP handlers: parse, call the service, format. No generation logic lives here."""
from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import Response

from engine.client import Backend

from .errors import UnhealthyError, error_response
from .http_input import ClientDisconnected, cancel_on_disconnect, check_api_key, read_json
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServerMetrics
from .responses import JSONBytesResponse, generate_json
from .schema import GenerateRequest, parse_generate_request
from .service import GenerateOutcome, GenerateService
from .settings import ServerSettings
from .sse import sse_response
from .tokenization import Encoding

CLIENT_CLOSED_REQUEST = 499     # nginx's status for a client that went away; nobody reads it


def _ms(seconds: float) -> str:
    return str(int(seconds * 1000))


def generate_headers(settings: ServerSettings, outcome: GenerateOutcome) -> dict[str, str]:
    """TGI's x-* headers of a non-stream response (times of the best sequence)."""
    best, t = outcome.best, outcome.best.timing
    return {
        "x-compute-type": settings.compute_type,
        "x-compute-time": repr(t.total_s),
        "x-compute-characters": str(len(outcome.request.inputs)),
        "x-total-time": _ms(t.total_s),
        "x-validation-time": _ms(t.validation_s),
        "x-queue-time": _ms(t.queue_s),
        "x-inference-time": _ms(t.inference_s),
        "x-time-per-token": _ms(best.time_per_token_s),
        "x-prompt-tokens": str(best.input_length),
        "x-generated-tokens": str(best.generated_tokens),
    }


class Handlers:
    def __init__(self, settings: ServerSettings, service: GenerateService, backend: Backend,
                 metrics: ServerMetrics):
        self.settings, self.service, self.backend, self.metrics = settings, service, backend, metrics

    async def _parse(self, request: Request, with_stream_flag: bool = False) -> GenerateRequest:
        check_api_key(request, self.settings.api_key)
        body = await read_json(request, self.settings.payload_limit)
        return parse_generate_request(body, with_stream_flag=with_stream_flag)

    async def generate(self, request: Request) -> Response:
        return await self._generate(request, await self._parse(request), full_text_default=False, as_list=False)

    async def generate_stream(self, request: Request) -> Response:
        return self._stream(await self._parse(request), full_text_default=False)

    async def compat_generate(self, request: Request) -> Response:
        """`POST /`: `stream` picks the route; the non-stream body is a one-element list."""
        parsed = await self._parse(request, with_stream_flag=True)
        full_text = self.settings.compat_return_full_text
        if parsed.stream:
            return self._stream(parsed, full_text_default=full_text)
        return await self._generate(request, parsed, full_text_default=full_text, as_list=True)

    async def _generate(self, request: Request, parsed: GenerateRequest, full_text_default: bool,
                        as_list: bool) -> Response:
        try:
            outcome = await cancel_on_disconnect(request, self.service.generate(parsed, full_text_default))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        details = outcome.request.details or outcome.request.decoder_input_details
        others = [(other, outcome.text(other)) for other in outcome.others]
        body = generate_json(outcome.best, outcome.text(outcome.best), details, others)
        return JSONBytesResponse([body] if as_list else body, headers=generate_headers(self.settings, outcome))

    def _stream(self, parsed: GenerateRequest, full_text_default: bool) -> Response:
        headers = {"x-compute-type": self.settings.compute_type,
                   "x-compute-characters": str(len(parsed.inputs)), "X-Accel-Buffering": "no"}
        events = self.service.stream(parsed, full_text_default)
        return sse_response(events, headers, self.settings.keep_alive_s,
                            self.settings.stream_shutdown_grace_s)

    async def tokenize(self, request: Request) -> Response:
        """A bare list of {id, text, start, stop}; offsets in bytes of the UTF-8 input. As TGI: every
        token, whatever --max-input-tokens, and `parameters` unused (`truncate` too)."""
        parsed = await self._parse(request)
        async with self.service.validator.whole_tokens(parsed.inputs) as encoding:
            body = await simple_tokens_json(parsed.inputs, encoding)
        return Response(body, media_type="application/json")

    async def health(self, request: Request) -> Response:
        if self.backend.healthy():
            return Response(status_code=200)
        return error_response(UnhealthyError())

    async def info(self, request: Request) -> Response:
        return JSONBytesResponse(info_json(self.settings, self.backend.stats()))

    async def metrics_text(self, request: Request) -> Response:
        """Rendered on a thread: about 2,000 samples take milliseconds, which the event loop
        (every stream's tokens) should not wait for."""
        self.metrics.update_from_stats(self.backend.stats(), self.settings.max_batch_total_tokens)
        return Response(await asyncio.to_thread(self.metrics.render), media_type=METRICS_CONTENT_TYPE)


TOKENS_PER_CHUNK = 4096    # a long answer is written in pieces of this many tokens (milliseconds each)


def _simple_tokens(raw: bytes, ids: list[int], offsets: list[tuple[int, int]]) -> bytes:
    """TGI's `SimpleToken`s, comma-separated JSON objects (as ``json_bytes`` writes them)."""
    quote = json.encoder.encode_basestring       # json.dumps(..., ensure_ascii=False) of a str
    return ",".join(f'{{"id":{i},"text":{quote(raw[a:b].decode("utf-8", errors="replace"))},"start":{a},"stop":{b}}}'
                    for i, (a, b) in zip(ids, offsets)).encode("utf-8")


async def simple_tokens_json(inputs: str, encoding: Encoding, before: bytes = b"", after: bytes = b"") -> bytes:
    """``before`` + TGI's `SimpleToken` list ({id, text, start, stop}, offsets in bytes of the UTF-8 input)
    + ``after``. A long one (a --payload-limit text can be 10^6 tokens, tens of MB of JSON) is written in
    pieces between the event loop's other work, its offsets taken on a thread."""
    raw, ids = inputs.encode("utf-8"), encoding.ids
    if len(ids) <= TOKENS_PER_CHUNK:
        return before + b"[" + _simple_tokens(raw, ids, encoding.offsets) + b"]" + after
    offsets = await asyncio.to_thread(lambda: encoding.offsets)
    pieces = [before + b"["]
    for start in range(0, len(ids), TOKENS_PER_CHUNK):
        end = start + TOKENS_PER_CHUNK
        pieces.append((b"," if start else b"") + _simple_tokens(raw, ids[start:end], offsets[start:end]))
        await asyncio.sleep(0)        # the other requests' turn between pieces
    pieces.append(b"]" + after)
    return b"".join(pieces)


def info_json(s: ServerSettings, stats: dict) -> dict:
    """TGI's `Info`, plus the v1/v2 fields older tools still read."""
    max_batch_total_tokens = s.max_batch_total_tokens or stats.get("max_batch_total_tokens") \
        or stats.get("kv_capacity")
    return {
        "model_id": s.model_id, "model_sha": s.model_sha, "model_pipeline_tag": s.model_pipeline_tag,
        "max_concurrent_requests": s.max_concurrent_requests, "max_best_of": s.max_best_of,
        "max_stop_sequences": s.max_stop_sequences, "max_input_tokens": s.max_input_tokens,
        "max_total_tokens": s.max_total_tokens, "validation_workers": s.validation_workers,
        "max_client_batch_size": s.max_client_batch_size, "router": s.router_name, "version": s.version,
        "sha": s.sha, "docker_label": s.docker_label,
        # legacy (TGI v1.x-v2.0)
        "max_input_length": s.max_input_tokens, "model_dtype": s.model_dtype,
        "model_device_type": s.model_device_type, "waiting_served_ratio": s.waiting_served_ratio,
        "max_batch_total_tokens": max_batch_total_tokens, "max_waiting_tokens": s.max_waiting_tokens,
        "max_batch_size": s.max_batch_size,
        # ours: the KV cache's storage dtype (--kv-cache-dtype, else the model's) and its slots
        "kv_cache_dtype": s.kv_cache_dtype or s.model_dtype, "kv_cache_slots": stats.get("kv_capacity"),
    }
