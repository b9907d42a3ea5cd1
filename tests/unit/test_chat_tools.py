"""TGI's tool calling pieces: the tools a tool_choice allows, the grammar's JSON schema,
parsing the generated JSON, and streaming it as OpenAI tool-call deltas."""
import json

import pytest

from tgi_compat.errors import ToolError
from tgi_compat.openai_schema import ChatMessage, Tool, ToolChoice, parse_chat_request
from tgi_compat.tools import (NO_TOOL, ToolCallStream, next_tool_call_id, parse_tool_output, tool_grammar,
                              tools_to_use)

WEATHER = Tool("get_current_weather", "Weather now", {
    "type": "object", "properties": {"location": {"type": "string"}, "format": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "format"]})
CLOCK = Tool("get_time", None, {"type": "object", "properties": {}})


def test_tool_choice_selects_the_tools():
    assert tools_to_use((WEATHER, CLOCK), ToolChoice("auto")) == (WEATHER, CLOCK, NO_TOOL)
    assert tools_to_use((WEATHER, CLOCK), ToolChoice("required")) == (WEATHER, CLOCK)
    assert tools_to_use((WEATHER, CLOCK), ToolChoice("none")) is None
    assert tools_to_use((WEATHER, CLOCK), ToolChoice("function", "get_time")) == (CLOCK,)
    with pytest.raises(ToolError) as caught:
        tools_to_use((WEATHER,), ToolChoice("function", "nope"))
    assert caught.value.body() == {"error": "Tool error: Tool with name nope not found", "error_type": "tool_error"}


def test_tool_choice_shapes_parse_like_tgi():
    def choice(value):
        body = {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": value}
        return parse_chat_request(body).tool_choice
    assert choice(None) == ToolChoice("auto")
    assert choice("none") == ToolChoice("none")
    assert choice("get_time") == ToolChoice("function", "get_time")
    assert choice({"type": "function", "function": {"name": "f"}}) == ToolChoice("function", "f")


def test_grammar_schema_is_one_function_object_per_tool_with_its_name_first():
    schema = tool_grammar((WEATHER, NO_TOOL))
    assert schema["required"] == ["function"]
    weather, no_tool = schema["properties"]["function"]["anyOf"]
    assert list(weather["properties"]) == ["_name", "location", "format"]
    assert weather["properties"]["_name"] == {"type": "string", "const": "get_current_weather"}
    assert weather["required"] == ["_name", "location", "format"]
    assert weather["additionalProperties"] is False and weather["description"] == "Weather now"
    assert no_tool["properties"] == {"_name": {"type": "string", "const": "no_tool"}}


def test_generated_json_becomes_tgis_tool_calls():
    text = '{"function": {"_name": "get_current_weather", "location": "Paris", "format": "celsius"}}'
    assert parse_tool_output(text) == [{"id": "0", "type": "function", "function": {
        "description": None, "name": "get_current_weather",
        "arguments": '{"location":"Paris","format":"celsius"}'}}]
    assert parse_tool_output('{"function": {"_name": "no_tool"}}') is None
    with pytest.raises(ToolError, match="^Tool error: Failed to parse generated text"):
        parse_tool_output('{"function": {"_na')


# TGI's own streaming test (chat.rs `test_chat_stream_tool_get_weather`), token by token
TGI_TOKENS = ['{"', "function", '":', ' {"', "_", "name", '":', ' "', "get", "_current", "_weather", '",',
              ' "', "location", '":', ' "', "San", " Francisco", ",", " CA", '",', ' "', "format", '":', ' "',
              "c", "elsius", '"}}']


def stream(tokens):
    calls, deltas = ToolCallStream(), []
    for i, token in enumerate(tokens):
        deltas += calls.push(token, last=i == len(tokens) - 1)
    return calls, deltas


def test_streamed_tool_call_is_the_name_then_argument_fragments_that_join_into_json():
    calls, deltas = stream(TGI_TOKENS)
    assert deltas[0] == ("get_current_weather", "{")
    assert all(name is None for name, _ in deltas[1:])
    arguments = "".join(fragment for _, fragment in deltas)
    assert arguments == '{ "location": "San Francisco, CA", "format": "celsius"}'     # TGI's test expects this
    assert json.loads(arguments) == {"location": "San Francisco, CA", "format": "celsius"}


@pytest.mark.parametrize("text", [
    '{"function":{"_name":"f","a":{"b":[1,2]},"c":"}"}}',      # compact, nested braces, brace in a string
    '{ "function" : { "_name" : "f" } }',                       # no arguments
    '{"function": {"_name": "f", "x": 1 } }\n',
])
def test_arguments_join_into_json_however_the_text_is_split(text):
    expected = {k: v for k, v in json.loads(text)["function"].items() if k != "_name"}
    for size in (1, 2, 5):
        _, deltas = stream([text[i:i + size] for i in range(0, len(text), size)])
        assert deltas[0][0] == "f"
        assert json.loads("".join(f for _, f in deltas)) == expected, (size, deltas)


def test_no_tool_is_detected_from_the_name():
    calls, deltas = stream(['{"function": {"_name": "no', '_tool"', "}}"])
    assert calls.no_tool and deltas == []


def test_the_last_step_always_yields_a_delta_for_the_finish_reason():
    calls = ToolCallStream()
    assert calls.push('{"function": {"_name": "f"}}', last=False) == [("f", "{")]
    assert calls.push("", last=True) == [(None, "}")]
    again = ToolCallStream()
    again.push('{"function": {"_name": "f"', last=False)
    assert again.push("}}", last=True) == [(None, "}")]


def test_next_tool_call_id_follows_earlier_integer_ids_else_a_uuid():
    assert next_tool_call_id((ChatMessage("user", "x"),)) == "0"
    called = ChatMessage("assistant", None, ({"id": "3", "type": "function", "function": {}},))
    assert next_tool_call_id((called,)) == "4"
    named = ChatMessage("assistant", None, ({"id": "call_abc", "type": "function", "function": {}},))
    assert len(next_tool_call_id((named,))) == 36
