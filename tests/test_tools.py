"""Tool-call formats without a model: choosing the format, parsing calls out of text, holding streamed calls back,
and grammars that compile and accept exactly the calls they should (llguidance, no tokenizer needed to validate)."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from services.gateway.tools import (
    CallFilter,
    Tool,
    choose_format,
    forced_call_grammar,
    generic_system_message,
    parse_calls,
    render_call,
)

WEATHER = Tool(
    "get_weather",
    "Current weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
)
TIME = Tool("get_time", "Current time", {"type": "object", "properties": {}})
TOOLS = [WEATHER, TIME]


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% for tool in tools %}<tool_call>{% endfor %}", "hermes"),
        ("{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{% if tools %}<|python_tag|>{% endif %}<|eot_id|>", "llama3"),
        ("<|im_start|>{{ message.content }}<|im_end|>", "generic"),  # SmolLM2-like: no tool support
    ],
)
def test_the_format_follows_the_template(template: str, fmt: str) -> None:
    assert choose_format(template) == fmt


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
        ("generic", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
        ("mistral", 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
        ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ],
)
def test_calls_parse_in_each_format(fmt: str, text: str) -> None:
    content, calls = parse_calls(fmt, text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_")
    assert content in ("", "Let me look.")


def test_parallel_calls_and_unknown_tools() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    )
    _, calls = parse_calls("hermes", text, TOOLS)
    assert [c.name for c in calls] == ["get_weather", "get_time"]  # an unknown tool is not a call
    assert len({c.id for c in calls}) == 2
    assert parse_calls("hermes", "<tool_call>{not json", TOOLS) == ("<tool_call>{not json", [])
    assert parse_calls("hermes", "no call here", TOOLS) == ("no call here", [])


def test_rendered_calls_parse_back() -> None:
    _, calls = parse_calls("hermes", render_call("hermes", parse_calls("mistral", _mistral(), TOOLS)[1]), TOOLS)
    assert [c.name for c in calls] == ["get_weather"]
    for fmt in ("hermes", "mistral", "llama3"):
        assert [c.name for c in parse_calls(fmt, render_call(fmt, calls), TOOLS)[1]] == ["get_weather"]


def _mistral() -> str:
    return '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'


def test_streamed_text_is_shown_until_a_call_starts() -> None:
    held = CallFilter("hermes", TOOLS)
    shown = [
        held.feed(p) for p in ["Sure", ", checking <tool", "_call>", '{"name": "get_weather", ', '"arguments": {}}']
    ]
    assert "".join(shown) == "Sure, checking "  # '<tool' was held back until it turned out to be the marker
    rest, calls = held.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]

    plain = CallFilter("hermes", TOOLS)
    shown = [plain.feed(p) for p in ["a < b", " and <tool", "s> are fine"]]
    rest, calls = plain.finish()
    assert "".join(shown) + rest == "a < b and <tools> are fine" and calls == []


@pytest.mark.parametrize("fmt", ["hermes", "generic", "mistral", "llama3"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammars_compile(fmt: str, parallel: bool) -> None:
    constraint = forced_call_grammar(fmt, TOOLS, parallel)
    assert constraint.kind == "lark"
    assert not LLMatcher.validate_grammar_with_warnings(constraint.grammar())[0]


def test_the_generic_system_message_describes_every_tool() -> None:
    message = generic_system_message(TOOLS)
    assert "get_weather" in message and "get_time" in message and "<tool_call>" in message
