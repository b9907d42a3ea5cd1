"""Chat messages -> prompt text: the model's chat template, rendered as TGI renders it
(`router/src/infer/chat_template.rs`) but with transformers' Jinja machinery
(``tokenizer.apply_chat_template``, so a template behaves as it does in transformers).

What TGI does around the template, and so do we:
- each message reaches the template as ``{role, content}``: text parts joined, images
  as ``![](url)``, an assistant's ``tool_calls`` as their JSON; ``name`` and
  ``tool_call_id`` are dropped;
- ``add_generation_prompt`` is always true, but when the last message is the
  assistant's the prompt ends right after its content (the model continues it);
- with tools, a template that does not read ``tools`` gets them appended to the last
  message (``"\\n---\\n" + tools JSON + "\\n" + tool_prompt``); one that does gets them
  as ``tools`` and only ``"\\n---\\n" + tool_prompt`` is appended.
The template comes from the tokenizer (``tokenizer_config.json`` / ``chat_template.jinja``)
or from ``chat_template.json`` beside it; none: "Template error: template not found".
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2

from .errors import TemplateError
from .openai_schema import ChatMessage, Tool, compact_json

DEFAULT_TOOL_PROMPT = (
    "\nGiven the functions available, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt. Respond in the format {name: function name, parameters: "
    "dictionary of argument name and its value}.Do not use variables.\n")


def find_chat_template(tokenizer) -> str | dict | None:
    """The tokenizer's template, else ``chat_template`` of ``chat_template.json`` in its folder."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    path = Path(getattr(tokenizer, "name_or_path", "") or ".") / "chat_template.json"
    if path.is_file():
        template = json.loads(path.read_text()).get("chat_template")
        if isinstance(template, str) and template:
            return template
    return None


def message_json(message: ChatMessage) -> dict:
    """What the template sees of one message (TGI `TextMessage`)."""
    if message.content is not None:
        return {"role": message.role, "content": message.content}
    return {"role": message.role, "content": compact_json([_tool_call_json(c) for c in message.tool_calls])}


def _tool_call_json(call: dict) -> dict:
    """An assistant's tool call as TGI re-serializes it: `arguments` as a JSON string."""
    function = call.get("function") or {}
    arguments = function.get("arguments", function.get("parameters"))
    return {"id": call.get("id"), "type": call.get("type"),
            "function": {"description": function.get("description"), "name": function.get("name"),
                         "arguments": compact_json(arguments)}}


def reads_tools(template: str) -> bool:
    """Whether the template uses the ``tools`` variable (TGI: minijinja's undeclared variables)."""
    try:
        from jinja2 import meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        source = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
        return "tools" in meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError:
        return re.search(r"\btools\b", template) is not None


class ChatTemplate:
    def __init__(self, tokenizer):
        """``tokenizer``: the Hugging Face tokenizer (its Jinja environment and special tokens)."""
        self.tokenizer = tokenizer
        self.template = find_chat_template(tokenizer)

    def render(self, messages: tuple[ChatMessage, ...], tools: tuple[Tool, ...] | None = None,
               tool_prompt: str | None = None) -> str:
        """The prompt text; raises ``TemplateError`` (422) if there is no template or it fails."""
        if self.template is None:
            raise TemplateError("template not found")
        chat = [message_json(m) for m in messages]
        tools_json = None if tools is None else [t.openai_json() for t in tools]
        try:
            template = self.tokenizer.get_chat_template(
                self.template if isinstance(self.template, str) else None, tools_json)
            if tools is not None and messages[-1].content is not None:
                chat[-1]["content"] += self._tool_text(template, tools, tool_prompt or DEFAULT_TOOL_PROMPT)
            rendered = self.tokenizer.apply_chat_template(
                chat, tools=tools_json, chat_template=template, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as e:
            raise TemplateError(str(e)) from e
        except ValueError as e:     # transformers: e.g. several templates and no "default"
            raise TemplateError(str(e)) from e
        return _continue_final_message(rendered, chat[-1])

    @staticmethod
    def _tool_text(template: str, tools: tuple[Tool, ...], tool_prompt: str) -> str:
        if reads_tools(template):
            return f"\n---\n{tool_prompt}"
        return f"\n---\n{compact_json([t.tgi_json() for t in tools])}\n{tool_prompt}"


def _continue_final_message(rendered: str, last: dict) -> str:
    """A final assistant message is continued: cut the prompt right after its content."""
    if last["role"] != "assistant":
        return rendered
    index = rendered.rfind(last["content"])
    if index < 0:
        return rendered
    return rendered[:index + len(last["content"])].rstrip()
