"""Tool calling and `response_format` on `/v1/chat/completions` (TGI's grammar path).

The tools' JSON schema is decoded under the `grammar` constraint (engine/grammar.py).
Schemas use enums and booleans so that any correct constrained decoder finishes quickly
even with the tiny demo model.
"""
import json

import requests

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_weather_arguments(arguments: str) -> dict:
    parsed = json.loads(arguments)
    assert parsed["location"] in ("Paris", "Tokyo") and parsed["unit"] in ("celsius", "fahrenheit"), parsed
    assert set(parsed) == {"location", "unit"}
    return parsed


def test_named_tool_choice_returns_tgis_tool_call(client):
    reply = client.chat.completions.create(model="tgi", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=80,
                                           temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (choice,) = reply.choices
    assert choice.message.content is None and choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("0", "function", "get_weather")
    check_weather_arguments(call.function.arguments)


def test_required_tool_stream_joins_into_the_same_call(client):
    kwargs = dict(model="tgi", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=80,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks]
    assert deltas[0].function.name == whole.function.name and all(d.function.name is None for d in deltas[1:])
    assert all((d.index, d.id, d.type) == (0, "0", "function") for d in deltas)
    arguments = "".join(d.function.arguments for d in deltas)
    assert json.loads(arguments) == json.loads(whole.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_auto_is_a_tool_call_or_plain_text(client):
    reply = client.chat.completions.create(model="tgi", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0)
    message = reply.choices[0].message
    if message.tool_calls:
        assert message.tool_calls[0].function.name == "get_weather"
        check_weather_arguments(message.tool_calls[0].function.arguments)
    else:    # the model chose no_tool: answered again without tools
        assert isinstance(message.content, str) and "_name" not in message.content


def test_tool_choice_none_is_plain_text(client):
    plain = client.chat.completions.create(model="tgi", messages=ASK, max_tokens=8, temperature=0)
    none = client.chat.completions.create(model="tgi", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_response_format_json_schema_and_tgi_json(client, url):
    schema = WEATHER["function"]["parameters"]
    reply = client.chat.completions.create(
        model="tgi", messages=ASK, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})
    check_weather_arguments(reply.choices[0].message.content)
    tgi = requests.post(url + "/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 60, "temperature": 0, "response_format": {"type": "json", "value": schema}})
    assert tgi.status_code == 200, tgi.text
    assert json.loads(tgi.json()["choices"][0]["message"]["content"]) == json.loads(reply.choices[0].message.content)


def test_response_format_json_object_is_a_json_object(client):
    """Any object is allowed, so the tiny model may still be writing one when max_tokens ends it."""
    reply = client.chat.completions.create(model="tgi", messages=ASK, max_tokens=100, temperature=0,
                                           response_format={"type": "json_object"})
    content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert content.lstrip().startswith("{"), content       # without the grammar the model writes prose
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert finish == "length" and reply.usage.completion_tokens == 100


def test_text_generation_client_chat_with_tools(url):
    from text_generation import Client
    from text_generation.types import Message, Tool

    reply = Client(url).chat([Message(**m) for m in ASK], tools=[Tool(**WEATHER)], tool_choice="get_weather",
                             max_tokens=80, temperature=0)
    call = reply.choices[0].message.tool_calls[0]
    assert call["function"]["name"] == "get_weather"
    check_weather_arguments(call["function"]["arguments"])


def test_unknown_named_tool_is_tgis_tool_error(url):
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "nope"}
    response = requests.post(url + "/v1/chat/completions", json=body)
    assert (response.status_code, response.json()) == (
        422, {"error": "Tool error: Tool with name nope not found", "error_type": "tool_error"})
