"""JSON body -> typed request for the OpenAI-style routes (TGI's `ChatRequest`, `CompletionRequest`).

Types and shapes only, like ``schema``: unknown keys are ignored, an explicit null means
"default", a wrong type is a 422 ``Input validation error`` naming the field. Where the
OpenAI API accepts more shapes than TGI (``stop`` as a string, ``response_format``
``{"type": "json_object"}`` without a schema, OpenAI's ``json_schema`` wrapper) we accept
both. Value ranges are checked by ``validation`` once the request became a
``GenerateRequest``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import InputValidationError
from .schema import U32_MAX, U64_MAX, _boolean, _integer, _number, _string, _type_error

# OpenAI's JSON mode: any JSON object (a `properties` key, as TGI's grammar validation requires)
ANY_JSON_OBJECT = {"type": "object", "properties": {}, "additionalProperties": True}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None                     # text parts joined (images as markdown); None: tool calls
    tool_calls: tuple[dict, ...] | None = None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: Any                         # the JSON schema of the arguments (TGI: `arguments`)

    def openai_json(self) -> dict:
        """As OpenAI clients send it (and chat templates that use `tools` expect it)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def tgi_json(self) -> dict:
        """As TGI serializes a `Tool` into the prompt: `arguments` as a JSON string."""
        return {"type": "function", "function": {"description": self.description, "name": self.name,
                                                 "arguments": compact_json(self.parameters)}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str                               # auto | none | required | function
    function_name: str | None = None


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    tools: tuple[Tool, ...] | None = None
    tool_choice: ToolChoice = ToolChoice("auto")
    tool_prompt: str | None = None
    grammar: dict | None = None             # `response_format` as a TGI `grammar`


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str, ...]
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    suffix: str | None = None


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _object(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise _type_error(name, "an object", value)
    return value


def _stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _type_error(name, "a string or an array of strings", value)
    return tuple(value)


def _optional(body: dict, name: str, parse) -> Any:
    value = body.get(name)
    return None if value is None else parse(name, value)


def _content(name: str, value: Any) -> str:
    """A string, or content parts: text parts joined, images as `![](url)` (TGI `TextMessage`)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _type_error(name, "a string or an array of content parts", value)
    texts = []
    for i, part in enumerate(value):
        part = _object(f"{name}[{i}]", part)
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif part.get("type") == "image_url" and isinstance(part.get("image_url"), dict) \
                and isinstance(part["image_url"].get("url"), str):
            texts.append(f"![]({part['image_url']['url']})")
        else:
            raise InputValidationError(
                f"`{name}[{i}]` must be {{\"type\": \"text\", \"text\": ...}} or "
                f"{{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}")
    return "".join(texts)


def _message(name: str, value: Any) -> ChatMessage:
    value = _object(name, value)
    if "role" not in value:
        raise InputValidationError(f"missing field `{name}.role`")
    role = _string(f"{name}.role", value["role"])
    if value.get("content") is not None:
        return ChatMessage(role, _content(f"{name}.content", value["content"]))
    tool_calls = value.get("tool_calls")
    if isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls):
        return ChatMessage(role, None, tuple(tool_calls))
    raise InputValidationError(f"`{name}` must have a `content` (a string or an array of content parts) "
                               f"or `tool_calls` (an array of objects)")


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list):
        raise _type_error("messages", "an array of messages", value)
    if not value:
        raise InputValidationError("`messages` must contain at least one message")
    return tuple(_message(f"messages[{i}]", m) for i, m in enumerate(value))


def _tool(name: str, value: Any) -> Tool:
    function = _object(f"{name}.function", _object(name, value).get("function"))
    if not isinstance(function.get("name"), str):
        raise InputValidationError(f"`{name}.function.name` must be a string")
    parameters = function.get("parameters", function.get("arguments", {}))
    description = function.get("description")
    if description is not None:
        description = _string(f"{name}.function.description", description)
    return Tool(function["name"], description, parameters)


def _tools(name: str, value: Any) -> tuple[Tool, ...]:
    if not isinstance(value, list):
        raise _type_error(name, "an array of tools", value)
    return tuple(_tool(f"{name}[{i}]", t) for i, t in enumerate(value))


def _tool_choice(name: str, value: Any) -> ToolChoice:
    """TGI: "auto" | "none" | "required" | "<function name>" | {"type":"function","function":{"name"}}."""
    if isinstance(value, str):
        return ToolChoice(value) if value in ("auto", "none", "required") else ToolChoice("function", value)
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        return ToolChoice("function", value["function"]["name"])
    raise InputValidationError(
        f"`{name}` must be \"auto\", \"none\", \"required\", a function name or "
        f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")


def _response_format(name: str, value: Any) -> dict | None:
    """`response_format` -> TGI grammar; every JSON flavour becomes {"type": "json", "value": schema}."""
    value = _object(name, value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind in ("json", "json_object"):
        schema = value.get("value")
        return {"type": "json", "value": ANY_JSON_OBJECT if schema is None else schema}
    if kind == "json_schema":
        config = value.get("value", value.get("json_schema"))
        if isinstance(config, dict) and "schema" in config:
            return {"type": "json", "value": config["schema"]}
    if kind == "regex" and isinstance(value.get("value"), str):
        return {"type": "regex", "value": value["value"]}
    raise InputValidationError(
        f"`{name}` must be {{\"type\": \"json_object\"}}, {{\"type\": \"json\", \"value\": <JSON schema>}}, "
        f"{{\"type\": \"json_schema\", \"json_schema\" (or \"value\"): {{\"name\": ..., \"schema\": ...}}}}, "
        f"{{\"type\": \"regex\", \"value\": ...}} or {{\"type\": \"text\"}}")


def _body(body: Any, required: str) -> dict:
    if not isinstance(body, dict):
        raise _type_error("request body", f"a JSON object with a `{required}` field", body)
    if body.get(required) is None:
        raise InputValidationError(f"missing field `{required}`")
    return body


_U32, _U64 = _integer(0, U32_MAX), _integer(0, U64_MAX)


def _count(body: dict) -> int:
    """`n`, the number of choices (its range is the route's to check)."""
    n = _optional(body, "n", _U32)
    return 1 if n is None else n


def parse_chat_request(body: Any) -> ChatRequest:
    body = _body(body, "messages")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    stream_options = _optional(body, "stream_options", _object) or {}
    return ChatRequest(
        messages=_messages(body["messages"]),
        model=_optional(body, "model", _string),
        max_tokens=None if max_tokens is None else _U32("max_tokens", max_tokens),
        temperature=_optional(body, "temperature", _number),
        top_p=_optional(body, "top_p", _number),
        frequency_penalty=_optional(body, "frequency_penalty", _number),
        presence_penalty=_optional(body, "presence_penalty", _number),
        seed=_optional(body, "seed", _U64),
        stop=_optional(body, "stop", _stop) or (),
        logprobs=bool(_optional(body, "logprobs", _boolean)),
        top_logprobs=_optional(body, "top_logprobs", _U32),
        n=_count(body),
        stream=bool(_optional(body, "stream", _boolean)),
        include_usage=bool(_optional(stream_options, "include_usage", _boolean)),
        tools=_optional(body, "tools", _tools),
        tool_choice=_optional(body, "tool_choice", _tool_choice) or ToolChoice("auto"),
        tool_prompt=_optional(body, "tool_prompt", _string),
        grammar=_optional(body, "response_format", _response_format),
    )


def _prompts(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _type_error("prompt", "a string or an array of strings", value)
    if not value:
        raise InputValidationError("Empty array detected. Do not use an empty array for the prompt.")
    return tuple(value)


def parse_completion_request(body: Any) -> CompletionRequest:
    body = _body(body, "prompt")
    return CompletionRequest(
        prompts=_prompts(body["prompt"]),
        model=_optional(body, "model", _string),
        max_tokens=_optional(body, "max_tokens", _U32),
        temperature=_optional(body, "temperature", _number),
        top_p=_optional(body, "top_p", _number),
        repetition_penalty=_optional(body, "repetition_penalty", _number),
        frequency_penalty=_optional(body, "frequency_penalty", _number),
        seed=_optional(body, "seed", _U64),
        stop=_optional(body, "stop", _stop) or (),
        n=_count(body),
        stream=bool(_optional(body, "stream", _boolean)),
        suffix=_optional(body, "suffix", _string),
    )
