"""The front end's `grammar` and `watermark` checks: TGI's shapes, messages and order."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from engine.sampling.grammar import json_grammar_text
from tests.tiny_models import save_tiny_tokenizer
from tests.unit.test_tgi_validation import body, validate
from tgi_compat.errors import InputValidationError
from tgi_compat.tokenization import TokenizerAdapter

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer", "minimum": 0}},
          "required": ["name"]}
NOT_VALID = "grammar is not valid: "


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    adapter = TokenizerAdapter(AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))),
                               workers=1)
    yield adapter
    adapter.close()


@pytest.mark.parametrize("grammar", [
    {"type": "json", "value": SCHEMA},
    {"type": "json_object", "value": SCHEMA},                          # TGI's alias of json
    {"type": "json", "value": json.dumps(SCHEMA)},                     # a schema given as a string
    {"type": "json_schema", "value": {"name": "thing", "schema": SCHEMA}},
], ids=["json", "json_object", "json-string", "json_schema"])
def test_json_grammars_become_the_schema_text(tokenizer, grammar):
    params = validate(tokenizer, body(grammar=grammar)).params
    assert (params.grammar_type, json.loads(params.grammar)) == ("json", SCHEMA)
    assert params.grammar == json_grammar_text(SCHEMA)                  # property order kept


def test_regex_grammar_is_passed_as_is(tokenizer):
    params = validate(tokenizer, body(grammar={"type": "regex", "value": r"\d{3}-[a-z]+"})).params
    assert (params.grammar_type, params.grammar) == ("regex", r"\d{3}-[a-z]+")


def test_watermark_is_passed_to_the_engine(tokenizer):
    assert validate(tokenizer, body(watermark=True)).params.watermark is True
    assert validate(tokenizer, body()).params.watermark is False


BAD_GRAMMARS = [
    ("no-properties", {"type": "json", "value": {"type": "object"}},
     NOT_VALID + "Grammar must have a 'properties' field"),
    ("json_object-no-properties", {"type": "json_object", "value": {"type": "object"}},
     NOT_VALID + "Grammar must have a 'properties' field"),
    ("not-an-object", {"type": "json", "value": 5}, "grammar is not supported"),
    ("string-not-json", {"type": "json", "value": "{not json"},
     NOT_VALID + "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ("unknown-type", {"type": "json", "value": {"properties": {"a": {"type": "strin"}}}},
     NOT_VALID + "Invalid type: strin"),
    ("bad-ref", {"type": "json", "value": {"properties": {"a": {"$ref": "#/$defs/missing"}}}},
     NOT_VALID + "Pointer '/$defs/missing' does not exist"),
    ("bad-regex", {"type": "regex", "value": "a(b"},
     NOT_VALID + 'invalid regex "a(b" (in regex): regex parse error:\n    a(b\n     ^\nerror: unclosed group'),
    ("regex-lookaround", {"type": "regex", "value": "(?<=a)b"}, None),
]


@pytest.mark.parametrize("grammar,message", [c[1:] for c in BAD_GRAMMARS], ids=[c[0] for c in BAD_GRAMMARS])
def test_invalid_grammars_are_422_with_tgis_message(tokenizer, grammar, message):
    with pytest.raises(InputValidationError) as caught:
        validate(tokenizer, body(grammar=grammar))
    if message is None:
        assert caught.value.detail.startswith(NOT_VALID + "invalid regex") and "look-around" in caught.value.detail
    else:
        assert caught.value.detail == message


def test_disabled_grammar_support_refuses_even_a_valid_grammar(tokenizer):
    with pytest.raises(InputValidationError) as caught:
        validate(tokenizer, body(grammar={"type": "regex", "value": "a+"}), disable_grammar_support=True)
    assert caught.value.detail == "grammar is not supported"


@pytest.mark.parametrize("grammar,message", [
    ({"type": "regex", "value": 5}, "`parameters.grammar.value` must be a string (the regex), got an integer"),
    ({"type": "json_schema", "value": {"name": "x"}},
     "`parameters.grammar.value` must be an object {\"name\": ..., \"schema\": {...}} for the type json_schema"),
], ids=["regex-not-string", "json_schema-without-schema"])
def test_grammar_shapes_are_checked_when_parsing(tokenizer, grammar, message):
    with pytest.raises(InputValidationError) as caught:
        validate(tokenizer, body(grammar=grammar))
    assert caught.value.detail == message
