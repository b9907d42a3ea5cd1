"""OpenAI request bodies -> typed requests: the shapes we accept and the errors we give."""
import pytest

from tgi_compat.errors import InputValidationError
from tgi_compat.openai_schema import ANY_JSON_OBJECT, parse_chat_request, parse_completion_request

USER = [{"role": "user", "content": "Hi"}]


def test_openai_fields_and_aliases():
    chat = parse_chat_request({"messages": USER, "max_completion_tokens": 7, "stop": "\n", "n": 3, "seed": 5,
                               "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
                               "top_logprobs": 2, "temperature": None, "logit_bias": {"1": 2}})
    assert (chat.max_tokens, chat.stop, chat.n, chat.seed, chat.stream, chat.include_usage) == (7, ("\n",), 3, 5, True, True)
    assert (chat.logprobs, chat.top_logprobs, chat.temperature) == (True, 2, None)
    assert parse_chat_request({"messages": USER, "max_tokens": 4, "stop": ["a", "b"]}).stop == ("a", "b")


@pytest.mark.parametrize("response_format, grammar", [
    ({"type": "json_object"}, {"type": "json", "value": ANY_JSON_OBJECT}),
    ({"type": "json", "value": {"properties": {"a": {"type": "integer"}}}},
     {"type": "json", "value": {"properties": {"a": {"type": "integer"}}}}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {}}}},
     {"type": "json", "value": {"properties": {}}}),
    ({"type": "json_schema", "value": {"name": "x", "schema": {"properties": {}}}},
     {"type": "json", "value": {"properties": {}}}),
    ({"type": "regex", "value": "[0-9]+"}, {"type": "regex", "value": "[0-9]+"}),
    ({"type": "text"}, None),
])
def test_response_format_becomes_a_tgi_grammar(response_format, grammar):
    assert parse_chat_request({"messages": USER, "response_format": response_format}).grammar == grammar


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "`messages` must contain at least one message"),
    ({}, "missing field `messages`"),
    ({"messages": [{"content": "x"}]}, "missing field `messages[0].role`"),
    ({"messages": [{"role": 3, "content": "x"}]}, "`messages[0].role` must be a string, got an integer"),
    ({"messages": [{"role": "user"}]}, "`messages[0]` must have a `content`"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "`messages[0].content[0]` must be"),
    ({"messages": USER, "stop": 3}, "`stop` must be a string or an array of strings"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "`response_format` must be"),
    ({"messages": USER, "tool_choice": 5}, "`tool_choice` must be"),
    ({"messages": USER, "n": -1}, "`n` must be an integer in"),
])
def test_malformed_chat_bodies_are_validation_errors(body, message):
    with pytest.raises(InputValidationError) as caught:
        parse_chat_request(body)
    assert caught.value.message.startswith("Input validation error: " + message), caught.value.message
    assert (caught.value.status, caught.value.error_type) == (422, "validation")


def test_completion_prompts():
    assert parse_completion_request({"prompt": "a"}).prompts == ("a",)
    assert parse_completion_request({"prompt": ["a", "b"], "n": 2}).prompts == ("a", "b")
    with pytest.raises(InputValidationError, match="Empty array detected. Do not use an empty array for the prompt."):
        parse_completion_request({"prompt": []})
    with pytest.raises(InputValidationError, match="`prompt` must be a string or an array of strings"):
        parse_completion_request({"prompt": [1, 2]})
