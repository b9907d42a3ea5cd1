"""Chat messages -> prompt: equal to transformers' apply_chat_template, plus TGI's rules
around it (list content, tool calls, a final assistant message, tools, no template)."""
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tgi_compat.chat_template import DEFAULT_TOOL_PROMPT, ChatTemplate
from tgi_compat.errors import TemplateError
from tgi_compat.openai_schema import parse_chat_request
from tgi_compat.tools import NO_TOOL, tools_to_use

DEMO = Path(__file__).resolve().parents[2] / "weights" / "demo"

CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that adds two numbers."}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Reverse a string ü€."}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def template(tokenizer):
    return ChatTemplate(tokenizer)


def render(template, messages, **body):
    chat = parse_chat_request({"messages": messages, **body})
    tools = tools_to_use(chat.tools, chat.tool_choice) if chat.tools is not None else None
    return template.render(chat.messages, tools, chat.tool_prompt)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_prompt_equals_transformers_apply_chat_template(template, tokenizer, messages):
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert render(template, messages) == expected
    assert expected.endswith("### Assistant:\n")   # the generation prompt is there


def test_list_content_renders_as_its_joined_text(template, tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a "}, {"type": "text", "text": "parser."}]}]
    flat = [{"role": "user", "content": "Write a parser."}]
    assert render(template, parts) == tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    image = [{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                          {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]
    assert "Describe ![](http://x/cat.png)\n" in render(template, image)


def test_a_final_assistant_message_is_continued(template, tokenizer):
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2,"}]
    prompt = render(template, messages)
    assert prompt.endswith("### Assistant:\n1, 2,")
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert full.startswith(prompt) and len(full) > len(prompt)


def test_assistant_tool_calls_reach_the_template_as_their_json(template):
    call = {"id": "0", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    prompt = render(template, [{"role": "user", "content": "1+?"}, {"role": "assistant", "tool_calls": [call]},
                               {"role": "tool", "content": "3", "tool_call_id": "0"}])
    expected = json.dumps([{"id": "0", "type": "function", "function": {
        "description": None, "name": "add", "arguments": '{"a":1}'}}], separators=(",", ":"))
    assert f"### Assistant:\n{expected}</s>\n\n" in prompt


def test_tools_are_appended_to_the_last_message_when_the_template_ignores_them(template):
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    prompt = render(template, [{"role": "user", "content": "Weather in Paris?"}], tools=[tool])
    listed = json.loads(prompt.split("\n---\n")[1].split("\n")[0])
    assert [t["function"]["name"] for t in listed] == ["get_weather", NO_TOOL.name]     # auto adds no_tool
    assert json.loads(listed[0]["function"]["arguments"]) == tool["function"]["parameters"]
    assert prompt.endswith(DEFAULT_TOOL_PROMPT + "\n\n### Assistant:\n")
    custom = render(template, [{"role": "user", "content": "Weather?"}], tools=[tool], tool_prompt="Use JSON.",
                    tool_choice="get_weather")
    assert "Use JSON.\n\n### Assistant:\n" in custom and NO_TOOL.name not in custom


def test_a_template_that_reads_tools_gets_them_as_a_variable(tokenizer):
    with_tools = AutoTokenizer.from_pretrained(DEMO)
    with_tools.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                                "{% for m in messages %}{{ m.content }}{% endfor %}")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    prompt = render(ChatTemplate(with_tools), [{"role": "user", "content": "x"}], tools=[tool], tool_prompt="P")
    assert prompt == "[f][no_tool]x\n---\nP"


def test_no_template_is_tgis_template_error(tmp_path):
    from tests.tiny_models import save_tiny_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    with pytest.raises(TemplateError) as caught:
        render(ChatTemplate(tokenizer), [{"role": "user", "content": "Hi"}])
    assert caught.value.body() == {"error": "Template error: template not found", "error_type": "template_error"}
    assert caught.value.status == 422


def test_chat_template_json_beside_the_tokenizer_is_used(tmp_path):
    from tests.tiny_models import save_tiny_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))
    (tmp_path / "chat_template.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"}))
    assert render(ChatTemplate(tokenizer), [{"role": "user", "content": "Hi"}]) == "<user>Hi"


def test_a_template_exception_is_a_template_error(tokenizer):
    strict = AutoTokenizer.from_pretrained(DEMO)
    strict.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(TemplateError, match="^Template error: Conversation roles must alternate$"):
        render(ChatTemplate(strict), [{"role": "user", "content": "Hi"}])
