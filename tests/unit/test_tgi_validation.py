"""TGI's validation: exact messages, their order, defaults, nulls, types, body checks."""
from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from transformers import AutoTokenizer

from tests.tiny_models import save_tiny_tokenizer
from tgi_compat.errors import (BadRequestError, InputValidationError, PayloadTooLargeError, UnauthorizedError,
                               UnsupportedMediaTypeError)
from tgi_compat.http_input import check_api_key, read_json
from tgi_compat.schema import parse_generate_request
from tgi_compat.settings import ServerSettings
from tgi_compat.tokenization import TokenizerAdapter
from tgi_compat.validation import Validator, validate_best_of

MAX_INPUT, MAX_TOTAL = 16, 32
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 2     # 20 tokens: > MAX_INPUT, < MAX_TOTAL


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    adapter = TokenizerAdapter(AutoTokenizer.from_pretrained(path), workers=2)
    yield adapter
    adapter.close()


def settings(**overrides) -> ServerSettings:
    return ServerSettings(**{"model_id": "tiny", "max_input_tokens": MAX_INPUT, "max_total_tokens": MAX_TOTAL,
                             **overrides})


def validate(tokenizer, body: dict, started: bool = False, **overrides):
    """``started``: tokenizing begins when the body is parsed (as for a stream), not at check 14."""
    validator = Validator(settings(**overrides), tokenizer)
    request = parse_generate_request(body)
    best_of = validate_best_of(request.parameters.best_of, validator.settings.max_best_of)
    assert best_of >= 1
    early = validator.start_tokenizing(request) if started else None
    return asyncio.run(validator.validate(request, return_full_text_default=False, started=early))


def body(inputs: str = "hello world", **parameters) -> dict:
    return {"inputs": inputs, "parameters": parameters}


S = dict(do_sample=True)   # sampling on, so best_of checks get past check 1
BAD_REQUESTS = [
    # (id, request body, exact TGI message after "Input validation error: ")
    ("best_of-greedy", body(best_of=2), "you must use sampling when `best_of` is > 1"),
    ("best_of-too-many", body(best_of=3, **S), "`best_of` must be > 0 and <= 2. Given: 3"),
    ("best_of-zero", body(best_of=0, **S), "`best_of` must be > 0 and <= 2. Given: 0"),
    ("temperature-zero", body(temperature=0.0), "`temperature` must be strictly positive"),
    ("temperature-negative", body(temperature=-1), "`temperature` must be strictly positive"),
    ("repetition-zero", body(repetition_penalty=0), "`repetition_penalty` must be strictly positive"),
    ("repetition-negative", body(repetition_penalty=-0.5), "`repetition_penalty` must be strictly positive"),
    ("frequency-high", body(frequency_penalty=2.5), "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ("frequency-low", body(frequency_penalty=-2.01), "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ("top_p-zero", body(top_p=0.0), "`top_p` must be > 0.0 and < 1.0"),
    ("top_p-one", body(top_p=1.0), "`top_p` must be > 0.0 and < 1.0"),
    ("top_p-above", body(top_p=1.5), "`top_p` must be > 0.0 and < 1.0"),
    ("typical_p-zero", body(typical_p=0), "`typical_p` must be > 0.0 and < 1.0"),
    ("typical_p-one", body(typical_p=1.0), "`typical_p` must be > 0.0 and < 1.0"),
    ("top_k-zero", body(top_k=0), "`top_k` must be strictly positive"),
    ("top_k-negative", body(top_k=-3), "`top_k` must be strictly positive"),
    ("max_new_tokens-zero", body(max_new_tokens=0), "`max_new_tokens` must be strictly positive"),
    ("stop-too-many", body(stop=["a", "b", "c", "d", "e"]), "`stop` supports up to 4 stop sequences. Given: 5"),
    ("seed-with-best_of", body(best_of=2, seed=7, **S), "`seed` must not be set when `best_of` > 1"),
    ("top_n_tokens-high", body(top_n_tokens=6), "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ("inputs-empty", body(""), "`inputs` cannot be empty"),
    ("truncate-zero", body(truncate=0), "`truncate` must be strictly positive and less than 16. Given: 0"),
    ("truncate-high", body(truncate=17), "`truncate` must be strictly positive and less than 16. Given: 17"),
    ("total-tokens", body("hello world", max_new_tokens=31),
     "`inputs` tokens + `max_new_tokens` must be <= 32. Given: 4 `inputs` tokens and 31 `max_new_tokens`"),
    ("input-length", body(LONG_PROMPT, max_new_tokens=2), None),       # message computed in the test
    ("input-length-default-max-new", body(LONG_PROMPT), None),
    ("grammar", body(grammar={"type": "json", "value": {"type": "object"}}),
     "grammar is not valid: Grammar must have a 'properties' field"),
    ("adapter", body(adapter_id="my-lora"),
     "`adapter_id` 'my-lora' is not available: this server only serves 'tiny'"),
    # check order: the first failing check wins
    ("order-temperature-before-top_p", body(temperature=0, top_p=2.0), "`temperature` must be strictly positive"),
    ("order-repetition-before-frequency", body(repetition_penalty=0, frequency_penalty=9),
     "`repetition_penalty` must be strictly positive"),
    ("order-top_p-before-top_k", body(top_p=0, top_k=0), "`top_p` must be > 0.0 and < 1.0"),
    ("order-typical_p-before-top_k", body(typical_p=2, top_k=0), "`typical_p` must be > 0.0 and < 1.0"),
    ("order-stop-before-empty", body("", stop=["x"] * 5), "`stop` supports up to 4 stop sequences. Given: 5"),
    ("order-top_n-before-empty", body("", top_n_tokens=9), "`top_n_tokens` must be >= 0 and <= 5. Given: 9"),
    ("order-empty-before-truncate", body("", truncate=0), "`inputs` cannot be empty"),
    ("order-truncate-before-length", body(LONG_PROMPT, truncate=99),
     "`truncate` must be strictly positive and less than 16. Given: 99"),
    ("order-length-before-grammar", body("hello world", max_new_tokens=40, grammar={"type": "json", "value": {}}),
     "`inputs` tokens + `max_new_tokens` must be <= 32. Given: 4 `inputs` tokens and 40 `max_new_tokens`"),
]


@pytest.mark.parametrize("started", [False, True], ids=["tokenized-at-check-14", "tokenizing-started-early"])
@pytest.mark.parametrize("request_body,message", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_parameters_give_tgi_messages(tokenizer, request_body, message, started):
    if message is None:
        n = len(tokenizer.encode_sync(request_body["inputs"]).ids)
        message = f"`inputs` must have less than {MAX_INPUT} tokens. Given: {n}"
    with pytest.raises(InputValidationError) as caught:
        validate(tokenizer, request_body, started=started)
    error = caught.value
    assert error.detail == message
    assert error.body() == {"error": f"Input validation error: {message}", "error_type": "validation"}
    assert error.status == 422


@pytest.mark.parametrize("parameters", [{}, {"truncate": 3}, {"max_new_tokens": 5, "stop": ["x"]}])
def test_tokenizing_started_early_validates_the_same(tokenizer, parameters):
    text = "é snow ☃ hello world"
    assert validate(tokenizer, body(text, **parameters), started=True) == validate(tokenizer, body(text, **parameters))


def test_tokenizing_starts_early_only_for_a_text_check_14_would_tokenize(tokenizer):
    validator = Validator(settings(), tokenizer)
    assert validator.start_tokenizing(parse_generate_request(body(""))) is None
    too_long = "x" * (validator.max_chars + 1)
    assert validator.start_tokenizing(parse_generate_request(body(too_long))) is None
    early = validator.start_tokenizing(parse_generate_request(body("hello world")))
    assert early.result(timeout=10).ids == tokenizer.encode_sync("hello world").ids


def test_best_of_disabled_when_max_best_of_is_one():
    with pytest.raises(InputValidationError, match="`best_of` != 1 is not allowed for this endpoint"):
        validate_best_of(2, max_best_of=1)
    assert validate_best_of(None, max_best_of=1) == 1


def test_prompt_at_exactly_max_input_tokens_is_allowed(tokenizer):
    n = len(tokenizer.encode_sync(LONG_PROMPT).ids)
    valid = validate(tokenizer, body(LONG_PROMPT, max_new_tokens=1), max_input_tokens=n, max_total_tokens=n + 1)
    assert valid.input_length == n and valid.max_new_tokens == 1


def test_missing_parameters_mean_sampling_and_empty_parameters_mean_greedy(tokenizer):
    assert validate(tokenizer, {"inputs": "hello"}).params.do_sample is True
    assert validate(tokenizer, {"inputs": "hello", "parameters": {}}).params.do_sample is False


def test_null_parameters_are_refused_as_tgi_does(tokenizer):
    with pytest.raises(InputValidationError, match="`parameters` must be an object, got null"):
        validate(tokenizer, {"inputs": "hello", "parameters": None})


@pytest.mark.parametrize("field,value,message", [
    ("temperature", 1e-320, "`temperature` must be strictly positive"),         # 0.0 in float32
    ("temperature", 1e309, "`parameters.temperature` must be a finite number within float32's range"),
    ("temperature", 1e39, "`parameters.temperature` must be a finite number within float32's range"),
    ("repetition_penalty", 1e-46, "`repetition_penalty` must be strictly positive"),
    ("top_p", 1e309, "`parameters.top_p` must be a finite number"),
    ("frequency_penalty", -1e309, "`parameters.frequency_penalty` must be a finite number"),
])
def test_numbers_float32_cannot_hold_are_refused(tokenizer, field, value, message):
    with pytest.raises(InputValidationError, match=message.replace("(", r"\(")):
        validate(tokenizer, json.loads(json.dumps(body(**{field: value}))))


@pytest.mark.parametrize("warper,value", [("temperature", 0.7), ("top_k", 5), ("top_p", 0.9), ("typical_p", 0.5)])
def test_any_warper_turns_sampling_on(tokenizer, warper, value):
    params = validate(tokenizer, body(**{warper: value})).params
    assert params.do_sample is True and getattr(params, warper) == value


def test_temperature_one_alone_stays_greedy(tokenizer):
    assert validate(tokenizer, body(temperature=1.0)).params.do_sample is False


def test_python_client_body_with_explicit_nulls_is_accepted(tokenizer):
    client_body = json.loads(
        '{"inputs":"Hello","parameters":{"do_sample":false,"max_new_tokens":20,"repetition_penalty":null,'
        '"frequency_penalty":null,"return_full_text":false,"stop":[],"seed":null,"temperature":null,"top_k":null,'
        '"top_p":null,"truncate":null,"typical_p":null,"best_of":null,"watermark":false,"details":true,'
        '"decoder_input_details":false,"top_n_tokens":null,"grammar":null},"stream":false}')
    valid = validate(tokenizer, client_body)
    assert valid.max_new_tokens == 20 and valid.details and not valid.params.do_sample
    assert valid.params.temperature == 1.0 and valid.params.top_n_tokens == 0


def test_nulls_for_non_nullable_tgi_fields_take_their_defaults(tokenizer):
    valid = validate(tokenizer, body(stop=None, do_sample=None, details=None, watermark=None,
                                     decoder_input_details=None))
    assert valid.stop_sequences == () and not valid.details and not valid.params.do_sample


def test_unknown_keys_are_ignored(tokenizer):
    valid = validate(tokenizer, {"inputs": "hello", "extra": 1, "parameters": {"foo": "bar", "max_new_tokens": 3}})
    assert valid.max_new_tokens == 3


def test_null_max_new_tokens_takes_the_remaining_budget(tokenizer):
    valid = validate(tokenizer, body("hello world"))
    assert valid.max_new_tokens == MAX_TOTAL - valid.input_length


def test_truncate_keeps_the_last_tokens(tokenizer):
    full = tokenizer.encode_sync(LONG_PROMPT).ids
    valid = validate(tokenizer, body(LONG_PROMPT, truncate=5, max_new_tokens=3))
    assert valid.input_ids == full[-5:]


def test_prompt_logprobs_follow_decoder_input_details_and_the_setting(tokenizer):
    assert validate(tokenizer, body(decoder_input_details=True)).params.prompt_logprobs is True
    assert validate(tokenizer, body()).params.prompt_logprobs is False
    off = validate(tokenizer, body(decoder_input_details=True), enable_prefill_logprobs=False)
    assert off.params.prompt_logprobs is False


def test_sampling_parameters_reach_the_engine(tokenizer):
    p = validate(tokenizer, body(temperature=0.5, top_k=7, top_p=0.8, typical_p=0.9, repetition_penalty=1.3,
                                 frequency_penalty=-0.5, seed=42, top_n_tokens=3)).params
    assert (p.temperature, p.top_k, p.top_p, p.typical_p) == (0.5, 7, 0.8, 0.9)
    assert (p.repetition_penalty, p.frequency_penalty, p.seed, p.top_n_tokens) == (1.3, -0.5, 42, 3)


def test_grammar_disabled_says_not_supported(tokenizer):
    with pytest.raises(InputValidationError) as caught:
        validate(tokenizer, body(grammar={"type": "json", "value": {"properties": {}}}), disable_grammar_support=True)
    assert caught.value.detail == "grammar is not supported"


TYPE_ERRORS = [
    ("body-not-object", ["hello"], "`request body` must be a JSON object with an `inputs` field, got an array"),
    ("inputs-missing", {"parameters": {}}, "missing field `inputs`"),
    ("inputs-number", {"inputs": 5}, "`inputs` must be a string, got an integer"),
    ("parameters-array", {"inputs": "a", "parameters": [1]}, "`parameters` must be an object, got an array"),
    ("temperature-string", body(temperature="hot"), "`parameters.temperature` must be a number, got a string"),
    ("do_sample-string", body(do_sample="yes"), "`parameters.do_sample` must be a boolean, got a string"),
    ("details-int", body(details=1), "`parameters.details` must be a boolean, got an integer"),
    ("max_new_tokens-float", body(max_new_tokens=1.5), "`parameters.max_new_tokens` must be an integer, got a number"),
    ("max_new_tokens-negative", body(max_new_tokens=-1),
     "`parameters.max_new_tokens` must be an integer in [0, 4294967295], got -1"),
    ("seed-negative", body(seed=-1), "`parameters.seed` must be an integer in [0, 18446744073709551615], got -1"),
    ("seed-too-big", body(seed=2**64), "`parameters.seed` must be an integer in [0, 18446744073709551615], "
                                       "got 18446744073709551616"),
    ("top_k-bool", body(top_k=True), "`parameters.top_k` must be an integer, got a boolean"),
    ("stop-string", body(stop="abc"), "`parameters.stop` must be an array of strings, got a string"),
    ("stop-numbers", body(stop=[1]), "`parameters.stop` must be an array of strings, got an array"),
    ("grammar-unknown-type", body(grammar={"type": "xml", "value": "x"}),
     "`parameters.grammar` must be an object {\"type\": one of ['json', 'json_object', 'regex', 'json_schema'], "
     "\"value\": ...}"),
]


@pytest.mark.parametrize("request_body,message", [c[1:] for c in TYPE_ERRORS], ids=[c[0] for c in TYPE_ERRORS])
def test_wrong_types_are_422_validation_errors(request_body, message):
    with pytest.raises(InputValidationError) as caught:
        parse_generate_request(request_body)
    assert caught.value.detail == message and caught.value.status == 422


def test_compat_stream_flag():
    assert parse_generate_request({"inputs": "a", "stream": True}, with_stream_flag=True).stream is True
    assert parse_generate_request({"inputs": "a", "stream": None}, with_stream_flag=True).stream is False
    with pytest.raises(InputValidationError, match="`stream` must be a boolean"):
        parse_generate_request({"inputs": "a", "stream": "yes"}, with_stream_flag=True)


# ---- body checks and the API key (axum's order: 401, 415, 413, 400) ----------------------------

def make_request(body: bytes, headers: dict[str, str], chunk: int | None = None) -> Request:
    chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/generate", "headers": raw_headers}, receive)


def read(body: bytes, headers: dict[str, str], limit: int = 100, chunk: int | None = None):
    return asyncio.run(read_json(make_request(body, headers, chunk), limit))


JSON = {"content-type": "application/json"}


def test_json_body_is_read():
    assert read(b'{"inputs":"a"}', JSON) == {"inputs": "a"}
    assert read(b'{"inputs":"a"}', {"content-type": "application/json; charset=utf-8"}) == {"inputs": "a"}


@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form"}])
def test_missing_json_content_type_is_415(headers):
    with pytest.raises(UnsupportedMediaTypeError) as caught:
        read(b'{"inputs":"a"}', headers)
    assert caught.value.status == 415
    assert caught.value.message == "Expected request with `Content-Type: application/json`"


def test_oversized_body_is_413_by_header_or_by_size():
    big = b'{"inputs":"' + b"a" * 200 + b'"}'
    with pytest.raises(PayloadTooLargeError):
        read(big, {**JSON, "content-length": str(len(big))})
    with pytest.raises(PayloadTooLargeError) as caught:
        read(big, JSON, chunk=16)         # chunked: no content-length
    assert caught.value.status == 413


@pytest.mark.parametrize("raw", [b'{"inputs":', b"not json", b'{"inputs": NaN}', b"\xff\xfe"])
def test_malformed_json_is_400(raw):
    with pytest.raises(BadRequestError) as caught:
        read(raw, JSON)
    assert caught.value.status == 400
    assert caught.value.message.startswith("Failed to parse the request body as JSON: ")


@pytest.mark.parametrize("header,ok", [
    ("Bearer secret", True), ("bearer SECRET", True), ("BEARER Secret", True),
    ("Bearer wrong", False), ("secret", False), (None, False), ("Bearer secret ", False),
])
def test_api_key_compares_the_whole_header_case_insensitively(header, ok):
    request = make_request(b"", {} if header is None else {"authorization": header})
    if ok:
        check_api_key(request, "secret")
    else:
        with pytest.raises(UnauthorizedError):
            check_api_key(request, "secret")


def test_no_api_key_configured_lets_everything_through():
    check_api_key(make_request(b"", {}), None)


@pytest.mark.parametrize("depth,ok", [(128, True), (129, False), (970, False), (100_000, False)])
def test_json_nested_deeper_than_serde_allows_is_400(depth, ok):
    body = b"[" * depth + b"]" * depth
    if ok:
        assert read(body, JSON, limit=10**6) is not None
        return
    with pytest.raises(BadRequestError, match="nesting deeper than 128"):
        read(body, JSON, limit=10**6)


@pytest.mark.parametrize("body", [b'{"inputs":"\\ud800"}', b'{"tool_choice":{"\\udfff":1}}',
                                  b'{"messages":[{"content":"a\\ud83d"}]}'])
def test_a_lone_surrogate_is_400(body):
    with pytest.raises(BadRequestError, match="lone surrogate"):
        read(body, JSON, limit=10**6)
    assert read(b'{"inputs":"\\ud83d\\ude00"}', JSON) == {"inputs": "\U0001F600"}     # a pair is one character


def test_texts_no_prompt_could_be_are_tokenized_whole_one_at_a_time(tokenizer):
    """/tokenize and /chat_tokenize encode every token of a text (TGI has no limit there); encoding one of
    --payload-limit's size takes hundreds of MB, so such texts take turns, while short ones go at once."""
    validator = Validator(settings(), tokenizer)
    long_text = "hello world " * (validator.max_chars // 12 + 1)
    order = []

    async def tokenize(name: str, text: str, hold: float):
        async with validator.whole_tokens(text) as encoding:
            order.append((name, "in"))
            await asyncio.sleep(hold)
            order.append((name, "out"))
        return len(encoding.ids), len(encoding.offsets)

    async def run():
        first = asyncio.ensure_future(tokenize("long 1", long_text, hold=0.3))
        await asyncio.sleep(0.1)
        return await asyncio.gather(first, tokenize("long 2", long_text, hold=0), tokenize("short", "hello", hold=0))

    counts = asyncio.run(run())
    assert counts[0] == counts[1] == (len(tokenizer.encode_sync(long_text).ids),) * 2 and counts[0][0] > MAX_INPUT
    assert order.index(("long 2", "in")) > order.index(("long 1", "out"))       # the second long text waited
    assert order.index(("short", "out")) < order.index(("long 1", "out"))       # the short one did not
