import math

import msgpack
import pytest

import subprocess
import sys

from engine.protocol.codec import decode, encode
from engine.protocol.messages import (Abort, Events, GenerationRequest, Ready, RouterStatus, RowResult, SamplingParams,
                                      Step, StepResult, StepRow, TokenEvent)


def test_every_message_round_trips():
    messages = [
        GenerationRequest(7, [1, 2, 3], 16, SamplingParams(do_sample=True, top_p=0.5, seed=2**64 - 1), [2]),
        Abort(7),
        Step(rows=[StepRow(1, 0, 0, [5, 6], [10, 11], True, SamplingParams(), 99, [6]),
                   StepRow(2, 1, 4, [9], [12], True)], released=[3, 4]),
        StepResult([RowResult(1, 5, -0.5, [5, 6], [-0.5, -1.0], [-2.0]), RowResult(2)]),
        Events([TokenEvent(1, 5, -0.25, finish_reason="length", seed=3, prompt_logprobs=[None, -1.5]),
                TokenEvent(2, logprob=-1.0, error="boom")]),
        Ready(0, 1234),
        RouterStatus(True, 1, 2, 3, 4),
    ]
    for message in messages:
        assert decode(encode(message)) == message


def test_int_lists_travel_as_raw_int32_bytes():
    step = Step(rows=[StepRow(1, 0, 0, list(range(1000)), list(range(1000, 2000)), True)])
    raw = msgpack.unpackb(encode(step), raw=False, strict_map_key=False)
    row = raw["rows"][0]
    assert isinstance(row["input_ids"], msgpack.ExtType) and len(row["input_ids"].data) == 4000
    assert len(encode(step)) < 8500


def test_lists_that_are_not_int32_keep_their_values():
    for values in ([True, False], [2**31, 1], [-(2**31) - 1], [1, 2.5], [1, None]):
        raw = msgpack.unpackb(encode(RouterStatus(True, error=values)), raw=False, strict_map_key=False)
        assert raw["error"] == values and [type(v) for v in raw["error"]] == [type(v) for v in values]
    edges = [-(2**31), 2**31 - 1, 0]
    assert isinstance(msgpack.unpackb(encode(Abort(edges)), raw=False)["request_id"], msgpack.ExtType)
    assert decode(encode(Abort(edges))).request_id == edges


def test_nan_logprob_survives():
    event = decode(encode(TokenEvent(1, 2)))
    assert math.isnan(event.logprob)


def test_unknown_message_type_is_rejected():
    with pytest.raises(ValueError, match="unknown message type"):
        decode(msgpack.packb({"~": "Nope"}))


def test_the_messages_the_router_and_the_client_need_load_without_torch():
    modules = ["engine.protocol.messages", "engine.protocol.codec", "engine.router.scheduler", "engine.router.router",
               "engine.router.process", "engine.client"]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
