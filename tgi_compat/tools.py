"""Tool calling as TGI does it (`router/src/infer/tool_grammar.rs`, `router/src/chat.rs`).

The tools the request allows become one JSON schema, ``{"function": <one of the tools>}``
where each tool is an object whose ``_name`` is the constant tool name followed by its
arguments; generation is constrained to it (a TGI ``grammar``) and the generated JSON
is parsed back into OpenAI ``tool_calls``. ``tool_choice`` "auto" adds TGI's ``no_tool``
tool: when the model picks it, the request is answered again without tools.
"""
from __future__ import annotations

import json
import re
import uuid

from .errors import ToolError
from .openai_schema import ChatMessage, Tool, ToolChoice, compact_json

NO_TOOL = Tool("no_tool", "Open ended response with no specific tool selected", {"type": "object"})


def tools_to_use(tools: tuple[Tool, ...], choice: ToolChoice) -> tuple[Tool, ...] | None:
    """The tools the model may call (TGI `ToolGrammar::apply`); None: generate plain text."""
    if choice.mode == "function":
        named = [t for t in tools if t.name == choice.function_name]
        if not named:
            raise ToolError(f"Tool with name {choice.function_name} not found")
        return (named[0],)
    if choice.mode == "required":
        return tools or None
    if choice.mode == "auto":
        return tools + (NO_TOOL,)
    return None


def _function_schema(tool: Tool) -> dict:
    properties = {"_name": {"type": "string", "const": tool.name}}
    required = ["_name"]
    schema = {"type": "object", "description": tool.description or ""}
    if isinstance(tool.parameters, dict):
        if isinstance(tool.parameters.get("properties"), dict):
            properties.update(tool.parameters["properties"])
        if isinstance(tool.parameters.get("required"), list):
            required += tool.parameters["required"]
        # sic: TGI only allows extra properties for the *string* "true"
        schema["additionalProperties"] = tool.parameters.get("additionalProperties") == "true"
    schema["properties"], schema["required"] = properties, required
    return schema


def tool_grammar(tools: tuple[Tool, ...]) -> dict:
    """The JSON schema of a tool call: ``{"function": {"_name": <tool>, ...arguments}}``.

    TGI puts the tools under ``$functions`` and refers to them with ``$ref``; we inline
    them (the same language) and also require ``function``, which TGI leaves optional
    although an answer without it can never be parsed.
    """
    return {"type": "object",
            "properties": {"function": {"anyOf": [_function_schema(t) for t in tools]}},
            "required": ["function"]}


def parse_tool_output(text: str) -> list[dict] | None:
    """Generated JSON -> TGI's `tool_calls` (id "0"); None when the model chose ``no_tool``."""
    try:
        function = json.loads(text)["function"]
        name = function["_name"]
    except (ValueError, KeyError, TypeError) as e:
        raise ToolError(f"Failed to parse generated text: {type(e).__name__}: {e} {text!r}") from e
    if name == NO_TOOL.name:
        return None
    arguments = {k: v for k, v in function.items() if k != "_name"}
    return [{"id": "0", "type": "function",
             "function": {"description": None, "name": name, "arguments": compact_json(arguments)}}]


def next_tool_call_id(messages: tuple[ChatMessage, ...]) -> str:
    """TGI: one more than the largest integer id of earlier tool calls, else a UUID."""
    ids = [call.get("id") for m in messages for call in (m.tool_calls or ())]
    try:
        return str(max((int(i) + 1 for i in ids), default=0))
    except (TypeError, ValueError):
        return str(uuid.uuid4())


_NAME_FIELD = re.compile(r'\s*\{\s*"function"\s*:\s*\{\s*"_name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_SEPARATOR = re.compile(r"\s*,?")
_HELD_BACK = " \t\r\n}"     # could be the closing brace of the outer object


class ToolCallStream:
    """The generated text of a tool call, token by token -> OpenAI tool-call deltas.

    As TGI: nothing until the tool name is complete, then one delta with the name and
    ``"{"``, then the arguments text as generated. Unlike TGI the fragments always join
    into the arguments' JSON: trailing braces and spaces are held back until more text
    shows they are not the outer object's end, and the last step always yields a delta
    (it carries the finish reason).
    """

    def __init__(self):
        self.text = ""
        self.name: str | None = None
        self.no_tool = False
        self._sent = 0              # characters of the arguments already sent

    def push(self, text: str, last: bool) -> list[tuple[str | None, str]]:
        """Add a token's text; return the (name or None, arguments fragment) deltas to send."""
        self.text += text
        deltas = []
        if self.name is None and not self.no_tool:
            deltas += self._find_name()
        if self.no_tool:
            return []
        if self.name is None:
            return self._whole_call() if last else []
        arguments = self._arguments(last)
        if len(arguments) > self._sent or (last and not deltas):
            deltas.append((None, arguments[self._sent:]))
            self._sent = len(arguments)
        return _joined(deltas)

    def _find_name(self) -> list[tuple[str | None, str]]:
        match = _NAME_FIELD.match(self.text)
        if match is None:
            return []
        name = json.loads(f'"{match.group(1)}"')
        if name == NO_TOOL.name:
            self.no_tool = True
            return []
        self.name, self._body_start = name, match.end()
        self._sent = 1
        return [(name, "{")]

    def _arguments(self, last: bool) -> str:
        body = self.text[self._body_start:]
        arguments = "{" + body[_SEPARATOR.match(body).end():]
        if not last:
            return arguments.rstrip(_HELD_BACK) or "{"
        if _is_json(self.text):
            arguments = arguments.rstrip()
            return arguments[:-1].rstrip() if arguments.endswith("}") else arguments
        return arguments

    def _whole_call(self) -> list[tuple[str | None, str]]:
        """The name never showed up in front: parse the whole text at the end."""
        calls = parse_tool_output(self.text)
        if calls is None:
            self.no_tool = True
            return []
        function = calls[0]["function"]
        return [(function["name"], function["arguments"])]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _joined(deltas: list[tuple[str | None, str]]) -> list[tuple[str | None, str]]:
    """The name delta and a fragment from the same token become one delta."""
    if len(deltas) == 2 and deltas[0][0] is not None:
        return [(deltas[0][0], deltas[0][1] + deltas[1][1])]
    return deltas
