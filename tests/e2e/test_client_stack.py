"""TGI's client installed the README's way beside the server (``pip install --no-deps
text-generation``, as .ci/run does after the first Quickstart command's stack) leaves the
server's requirements met, and the launched server then answers that client's grammar and
tool requests with valid output (a worker that cannot build grammars answers an error,
never an empty text: tests/unit/test_grammar.py)."""
from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys

import pytest
import text_generation
from packaging.requirements import Requirement
from text_generation.types import Grammar, GrammarType, Message, Tool

from tests.e2e.demo_server import DEMO
from tests.e2e.openai.test_openai_tools import ASK, WEATHER, check_weather_arguments
from tests.e2e.server import running

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def server_requirements() -> set[str]:
    """The distributions the server needs: lightserve's requirements (extras left out) and theirs, by name."""
    names, todo = set(), ["lightserve"]
    while todo:
        name = todo.pop()
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            key = requirement.name.lower().replace("_", "-")
            if requirement.marker is None and key not in names:
                names.add(key)
                try:
                    importlib.metadata.distribution(key)
                except importlib.metadata.PackageNotFoundError:
                    continue
                todo.append(key)
    return names


def test_installing_the_client_left_every_server_requirement_met():
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    needed = server_requirements() | {"lightserve"}
    assert {"transformers", "huggingface-hub", "llguidance"} <= needed
    broken = [line for line in check.stdout.splitlines()
              if line.split(" ")[0].lower().replace("_", "-") in needed]
    assert not broken, check.stdout


@pytest.fixture(scope="module")
def demo_launcher():
    with running(DEMO, "--max-total-tokens", "512", "--max-input-tokens", "384") as srv:
        yield srv


def test_grammar_and_tool_requests_from_the_text_generation_client(demo_launcher):
    client = text_generation.Client(demo_launcher.url, timeout=120)
    pattern = r"(yes|no)\.( [a-z]{1,8}){0,3}"
    reply = client.generate("def is_ready(self):\n    return", max_new_tokens=24,
                            grammar=Grammar(type=GrammarType.Regex, value=pattern))
    assert re.fullmatch(pattern, reply.generated_text), reply.generated_text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    streamed = "".join(r.token.text for r in client.generate_stream(
        "config = ", max_new_tokens=24, grammar=Grammar(type=GrammarType.Json, value=schema)) if not r.token.special)
    assert isinstance(json.loads(streamed)["ok"], bool), streamed
    chat = client.chat([Message(**m) for m in ASK], tools=[Tool(**WEATHER)], tool_choice="get_weather",
                       max_tokens=80, temperature=0)
    call = chat.choices[0].message.tool_calls[0]
    assert call["function"]["name"] == "get_weather"
    check_weather_arguments(call["function"]["arguments"])
