"""Wire formats: TGI's SSE framing, compact JSON, NaN logprobs as null, omitted keys."""
from __future__ import annotations

import asyncio
import math

from tgi_compat.errors import InputValidationError, OverloadedError
from tgi_compat.outputs import GeneratedStep, GenerationResult, PrefillToken, Timing, Token
from tgi_compat.responses import generate_json, json_bytes
from tgi_compat.sse import _KeepAlive, error_event, sse_data, sse_response, step_event

NAN = math.nan


def result(**overrides) -> GenerationResult:
    values = dict(request_id=1, generated_text=" for ever", finish_reason="length",
                  tokens=[Token(363, " for", -1.5, False), Token(2, "</s>", NAN, True)], top_tokens=[[], []],
                  prefill=[], seed=None, input_length=5, timing=Timing())
    values.update(overrides)
    return GenerationResult(**values)


def test_sse_event_is_data_colon_compact_json_blank_line():
    assert sse_data({"a": 1, "b": [1, 2]}) == b'data:{"a":1,"b":[1,2]}\n\n'


def test_intermediate_event_has_null_text_and_details_and_no_top_tokens_key():
    step = GeneratedStep(1, Token(363, " for", -1.5351562, False), [])
    assert step_event(step, "ignored", details=True) == (
        b'data:{"index":1,"token":{"id":363,"text":" for","logprob":-1.5351562,"special":false},'
        b'"generated_text":null,"details":null}\n\n')


def test_final_event_carries_text_and_stream_details():
    step = GeneratedStep(2, Token(2, "</s>", NAN, True), [Token(2, "</s>", -0.1, True)],
                         result(finish_reason="eos_token", seed=42))
    assert step_event(step, "Hi for ever", details=True) == (
        b'data:{"index":2,"token":{"id":2,"text":"</s>","logprob":null,"special":true},'
        b'"top_tokens":[{"id":2,"text":"</s>","logprob":-0.1,"special":true}],'
        b'"generated_text":"Hi for ever",'
        b'"details":{"finish_reason":"eos_token","generated_tokens":2,"seed":42,"input_length":5}}\n\n')
    assert b'"details":null' in step_event(step, "x", details=False)


def test_error_event():
    assert error_event(OverloadedError()) == b'data:{"error":"Model is overloaded","error_type":"overloaded"}\n\n'
    assert error_event(InputValidationError("`top_k` must be strictly positive")) == (
        b'data:{"error":"Input validation error: `top_k` must be strictly positive","error_type":"validation"}\n\n')


def test_keep_alive_is_a_bare_comment():
    assert _KeepAlive().encode() == b":\n\n"


def test_json_bytes_turns_non_finite_floats_into_null_and_keeps_unicode():
    assert json_bytes({"x": NAN, "y": [math.inf, -math.inf, 1.5], "t": "é🙂"}) == \
        '{"x":null,"y":[null,null,1.5],"t":"é🙂"}'.encode()


def test_generate_json_omits_details_unless_asked():
    assert generate_json(result(), " for ever", details=False) == {"generated_text": " for ever"}


def test_generate_json_details_keys():
    prefill = [PrefillToken(1, "<s>", None), PrefillToken(9, "Hi", -2.0)]
    body = generate_json(result(prefill=prefill, seed=3), "t", details=True)
    details = body["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]
    assert details["prefill"] == [{"id": 1, "text": "<s>", "logprob": None}, {"id": 9, "text": "Hi", "logprob": -2.0}]
    assert details["tokens"][1] == {"id": 2, "text": "</s>", "logprob": None, "special": True}
    assert details["seed"] == 3


def test_generate_json_top_tokens_and_best_of_sequences():
    top = [[Token(363, " for", -1.5, False)], [Token(2, "</s>", -0.2, True)]]
    other = result(generated_text=" other", seed=9)
    body = generate_json(result(top_tokens=top), "best", details=True, others=[(other, "Hi other")])
    details = body["details"]
    assert details["top_tokens"][0] == [{"id": 363, "text": " for", "logprob": -1.5, "special": False}]
    (sequence,) = details["best_of_sequences"]
    assert sequence["generated_text"] == "Hi other" and sequence["seed"] == 9
    assert list(sequence) == ["generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"]


def run_asgi(response) -> tuple[dict, bytes]:
    """Send ``response`` through a minimal ASGI server; return (start message, body)."""
    sent: list[dict] = []

    async def main():
        never = asyncio.Event()

        async def receive():
            await never.wait()

        async def send(message):
            sent.append(message)
        await response({"type": "http", "method": "POST", "headers": []}, receive, send)
    asyncio.run(main())
    return sent[0], b"".join(m.get("body", b"") for m in sent[1:])


def test_sse_response_sends_the_bytes_unchanged_with_tgi_headers():
    async def events():
        yield sse_data({"index": 1})
        yield error_event(OverloadedError())

    start, body = run_asgi(sse_response(events(), {"x-compute-type": "gpu+optimized"}, keep_alive_s=15))
    assert body == b'data:{"index":1}\n\ndata:{"error":"Model is overloaded","error_type":"overloaded"}\n\n'
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    assert start["status"] == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    assert headers["x-compute-type"] == "gpu+optimized"
