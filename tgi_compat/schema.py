"""JSON body -> typed request (TGI's `GenerateRequest` / `CompatGenerateRequest`).

Only shapes and types are checked here (TGI: serde); value ranges are ``validation``'s.
Unknown keys are ignored, explicit nulls mean "default" for every optional field, and
a type error is a 422 ``Input validation error`` naming the field.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields
from typing import Any, Callable

from .errors import InputValidationError

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
GRAMMAR_TYPES = ("json", "json_object", "regex", "json_schema")


@dataclass(frozen=True)
class GenerateParameters:
    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None
    return_full_text: bool | None = None
    stop: tuple[str, ...] = ()
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = None
    top_n_tokens: int | None = None
    grammar: dict | None = None
    adapter_id: str | None = None


# TGI's `default_parameters()`: what a request without "parameters" gets.
DEFAULT_PARAMETERS = GenerateParameters(do_sample=True)


@dataclass(frozen=True)
class GenerateRequest:
    inputs: str
    parameters: GenerateParameters
    stream: bool = False          # only on `POST /`


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


FLOAT32_MAX = 3.4028234663852886e38
ABSENT = object()       # "parameters" not in the body (null is a different thing: an error)


def _type_error(name: str, expected: str, value: Any) -> InputValidationError:
    return InputValidationError(f"`{name}` must be {expected}, got {_json_type(value)}")


def _integer(low: int, high: int) -> Callable[[str, Any], int]:
    def parse(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(name, "an integer", value)
        if not low <= value <= high:
            raise InputValidationError(f"`{name}` must be an integer in [{low}, {high}], got {value}")
        return value
    return parse


def _number(name: str, value: Any) -> float:
    """A JSON number as TGI's f32 holds it: one that float32 cannot hold (1e309, 1e39) is refused
    here; one too small for float32 (1e-320) is 0.0, which the range checks then refuse."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(name, "a number", value)
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise InputValidationError(f"`{name}` must be a finite number within float32's range "
                                   f"(|x| <= {FLOAT32_MAX:.4g}), got {value}")
    return 0.0 if struct.unpack("f", struct.pack("f", float(value)))[0] == 0.0 else float(value)


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _type_error(name, "an array of strings", value)
    return tuple(value)


def _grammar(name: str, value: Any) -> dict:
    """TGI's ``GrammarType``: its shape only; ``validation.check_grammar`` compiles it."""
    if not isinstance(value, dict) or value.get("type") not in GRAMMAR_TYPES or "value" not in value:
        raise InputValidationError(
            f"`{name}` must be an object {{\"type\": one of {list(GRAMMAR_TYPES)}, \"value\": ...}}")
    kind, inner = value["type"], value["value"]
    if kind == "regex" and not isinstance(inner, str):
        raise _type_error(f"{name}.value", "a string (the regex)", inner)
    if kind == "json_schema" and not (isinstance(inner, dict) and "schema" in inner):
        raise InputValidationError(f"`{name}.value` must be an object {{\"name\": ..., \"schema\": {{...}}}} "
                                   f"for the type json_schema")
    return value


_FIELD_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "best_of": _integer(0, U64_MAX),
    "temperature": _number,
    "repetition_penalty": _number,
    "frequency_penalty": _number,
    "top_k": _integer(I32_MIN, I32_MAX),
    "top_p": _number,
    "typical_p": _number,
    "do_sample": _boolean,
    "max_new_tokens": _integer(0, U32_MAX),
    "return_full_text": _boolean,
    "stop": _strings,
    "truncate": _integer(0, U64_MAX),
    "watermark": _boolean,
    "details": _boolean,
    "decoder_input_details": _boolean,
    "seed": _integer(0, U64_MAX),
    "top_n_tokens": _integer(0, U32_MAX),
    "grammar": _grammar,
    "adapter_id": _string,
}
assert set(_FIELD_PARSERS) == {f.name for f in fields(GenerateParameters)}


def parse_parameters(raw: Any) -> GenerateParameters:
    """``raw`` is the JSON value of "parameters"; ABSENT -> TGI's defaults; null is refused, as TGI does."""
    if raw is ABSENT:
        return DEFAULT_PARAMETERS
    if not isinstance(raw, dict):
        raise _type_error("parameters", "an object", raw)
    values = {}
    for name, parse in _FIELD_PARSERS.items():
        value = raw.get(name)
        if value is not None:
            values[name] = parse(f"parameters.{name}", value)
    return GenerateParameters(**values)


def parse_generate_request(body: Any, *, with_stream_flag: bool = False) -> GenerateRequest:
    """Body of `/generate`, `/generate_stream`, `/tokenize`, or `/` (``with_stream_flag``)."""
    if not isinstance(body, dict):
        raise _type_error("request body", "a JSON object with an `inputs` field", body)
    if "inputs" not in body:
        raise InputValidationError("missing field `inputs`")
    inputs = _string("inputs", body["inputs"])
    parameters = parse_parameters(body.get("parameters", ABSENT))
    stream = False
    if with_stream_flag and body.get("stream") is not None:
        stream = _boolean("stream", body["stream"])
    return GenerateRequest(inputs=inputs, parameters=parameters, stream=stream)
