"""Structured-output cases shared by the grammar tests: 20 JSON schemas, 10 regexes, a checker.

The schemas cover nested objects, arrays, enums, numbers with bounds, optional properties,
anyOf, $ref, patterns and string lengths. Each case has a prompt in the demo model's
language (Python) so that it has something to continue.
"""
from __future__ import annotations

import json
import re

import jsonschema

from engine.sampling.grammar import json_grammar_text

_INT = {"type": "integer"}
_SHORT = {"type": "string", "maxLength": 16}

SCHEMAS = [
    # (name, prompt, schema)
    ("person", "person = ", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"]}),
    ("address", "record = ", {"type": "object", "properties": {
        "name": _SHORT, "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 30}, "city": _SHORT,
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"]}},
        "required": ["name", "address"]}),
    ("color-enum", "style = ", {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "shade": {"type": "string", "enum": ["light", "dark"]}},
        "required": ["color", "shade"]}),
    ("weather-bounds", "reading = ", {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["temperature", "humidity"]}),
    ("optional-fields", "user = ", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999}, "nickname": _SHORT,
        "email": {"type": "string", "maxLength": 32}}, "required": ["id"]}),
    ("anyof-scalar", "result = ", {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": -1000, "maximum": 1000},
                            {"type": "string", "maxLength": 12}, {"type": "null"}]}}, "required": ["value"]}),
    ("weekdays", "schedule = ", {"type": "object", "properties": {
        "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                 "minItems": 1, "maxItems": 7}}, "required": ["days"]}),
    ("points", "shape = ", {"type": "object", "properties": {
        "points": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -100, "maximum": 100},
            "y": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["x", "y"]}}},
        "required": ["points"]}),
    ("flags", "options = ", {"type": "object", "properties": {
        "enabled": {"type": "boolean"}, "debug": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
        "required": ["enabled", "debug", "level"]}),
    ("deep-config", "settings = ", {"type": "object", "properties": {
        "server": {"type": "object", "properties": {
            "host": {"type": "string", "maxLength": 20},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535}}, "required": ["host", "port"]},
        "retries": {"type": "integer", "minimum": 0, "maximum": 10}}, "required": ["server", "retries"]}),
    ("unit-vector", "vector = ", {"type": "object", "properties": {
        "components": {"type": "array", "minItems": 2, "maxItems": 3,
                       "items": {"type": "number", "minimum": 0, "maximum": 1}}}, "required": ["components"]}),
    ("anyof-objects", "figure = ", {"type": "object", "properties": {
        "shape": {"anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"},
                                              "radius": {"type": "number", "minimum": 0, "maximum": 100}},
             "required": ["kind", "radius"]},
            {"type": "object", "properties": {"kind": {"const": "rect"}, "w": _INT, "h": _INT},
             "required": ["kind", "w", "h"]}]}}, "required": ["shape"]}),
    ("version", "release = ", {"type": "object", "properties": {
        "version": {"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,3}$"},
        "stable": {"type": "boolean"}}, "required": ["version", "stable"]}),
    ("tool-call", "call = ", {"type": "object", "properties": {
        "name": {"enum": ["get_weather", "search", "open_file"]},
        "arguments": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40}},
                      "required": ["query"]}}, "required": ["name", "arguments"]}),
    ("refs", "pair = ", {"$defs": {"item": {"type": "object", "properties": {
        "label": _SHORT, "count": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["label", "count"]}},
        "type": "object", "properties": {"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}},
        "required": ["first", "second"]}),
    ("code-length", "token = ", {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 3, "maxLength": 6}, "count": {"type": "integer", "maximum": 10**6}},
        "required": ["code", "count"]}),
    ("exclusive-ratio", "stats = ", {"type": "object", "properties": {
        "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "total": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10000}}, "required": ["ratio", "total"]}),
    ("mostly-optional", "meta = ", {"type": "object", "properties": {
        "title": _SHORT, "author": _SHORT, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "pages": {"type": "integer", "minimum": 1, "maximum": 5000}, "isbn": {"type": "string", "maxLength": 13},
        "draft": {"type": "boolean"}}, "required": ["title", "year"]}),
    ("nullable-list", "entry = ", {"type": "object", "properties": {
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 10}},
        "parent": {"type": ["string", "null"], "maxLength": 12}}, "required": ["tags", "parent"]}),
    ("matrix", "grid = ", {"type": "object", "additionalProperties": False, "properties": {
        "matrix": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["matrix"]}),
]

REGEXES = [
    # (name, prompt, pattern): bounded repetitions, so a greedy model cannot loop forever
    ("phone", "phone = '", r"\(\d{3}\) \d{3}-\d{4}"),
    ("call", "result = ", r"[a-z_][a-z0-9_]{0,15}\(\)"),
    ("date", "date = '", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("ipv4", "host = '", r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"),
    ("email", "email = '", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)"),
    ("hex-color", "color = '", r"#[0-9a-fA-F]{6}"),
    ("import", "", r"import (os|sys|re|json)"),
    ("def", "class Parser:\n    ", r"def [a-z_]{1,20}\((self)?\):"),
    ("yes-no", "answer = '", r"(yes|no)"),
    ("int-list", "sizes = ", r"\[\d{1,3}(, \d{1,3}){0,4}\]"),
]


def cases() -> list[tuple[str, str, str, str, object]]:
    """(name, prompt, engine kind, engine text, what to check against) for all 30 cases."""
    out = [(name, prompt, "json", json_grammar_text(schema), schema) for name, prompt, schema in SCHEMAS]
    out += [(name, prompt, "regex", pattern, pattern) for name, prompt, pattern in REGEXES]
    return out


def check_output(kind: str, expected, text: str) -> None:
    """AssertionError unless ``text`` is valid: a JSON instance of the schema, or a full regex match."""
    if kind == "json":
        jsonschema.validate(json.loads(text), expected)
    else:
        assert re.fullmatch(expected, text), f"{text!r} does not match {expected!r}"
