"""Tool-call formats: choosing the format, parsing calls out of text, holding streamed calls back, and grammars that
compile and accept exactly the texts they should (llguidance over the real SmolLM2 vocabulary)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from llguidance import LLMatcher

from services.gateway.protocol import CustomFormat
from services.gateway.tools import (
    CallFilter,
    Tool,
    ToolCall,
    call_grammar,
    choose_format,
    parse_calls,
    render_call,
    tools_system_message,
)
from tandem.config import EngineSettings
from tandem.engine import Engine
from tandem.grammar import Constraint, GrammarState, tokenizer_for
from tandem.models import default_model_path

WEATHER = Tool(
    "get_weather",
    "Current weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
)
TIME = Tool("get_time", "Current time", {"type": "object", "properties": {}})
TOOLS = [WEATHER, TIME]
# The Lark grammar Codex sends with its apply_patch custom tool (the same shape).
PATCH_LARK = (Path(__file__).parent / "data" / "apply_patch.lark").read_text()
PATCH = Tool("apply_patch", "Edit files with a patch", {}, custom=True, grammar=PATCH_LARK)
NOTE = Tool("note", "Write a free-form note", {}, custom=True)
A_PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello, world\n*** End Patch\n"


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
@pytest.mark.parametrize("forced", [False, True])
def test_call_grammars_compile(fmt: str, parallel: bool, forced: bool) -> None:
    constraint = call_grammar(fmt, [*TOOLS, PATCH, NOTE], parallel, forced)
    assert constraint.kind == "lark" and dict(constraint.named) == {"input0": PATCH_LARK}
    assert not LLMatcher.validate_grammar_with_warnings(constraint.grammar())[0]


def test_a_schema_keyword_llguidance_lacks_is_not_enforced_rather_than_refused() -> None:
    """Claude Code's TaskCreate uses `propertyNames`, which llguidance does not implement: the call grammar still
    compiles (leniently), in both modes, so agents' requests are served."""
    metadata = {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}}
    task = Tool("TaskCreate", "Create a task", {"type": "object", "properties": {"metadata": metadata}})
    for forced in (False, True):
        assert not LLMatcher.validate_grammar_with_warnings(call_grammar("generic", [task], True, forced).grammar())[0]


def test_the_system_message_describes_every_tool_the_template_does_not() -> None:
    message = tools_system_message("generic", [*TOOLS, PATCH])
    assert message is not None
    assert "get_weather" in message and "get_time" in message and "<tool_call>" in message
    assert '<tool_call name="<tool name>">' in message and "apply_patch" in message
    native = tools_system_message("hermes", [*TOOLS, PATCH])  # the template describes the functions itself
    assert native is not None and "get_weather" not in native and "apply_patch" in native
    assert tools_system_message("hermes", TOOLS) is None


def test_custom_calls_are_raw_blocks_in_every_format() -> None:
    text = f'I will patch it.\n<tool_call name="apply_patch">\n{A_PATCH}\n</tool_call>'
    for fmt in ("hermes", "generic", "mistral", "llama3"):
        content, calls = parse_calls(fmt, text, [*TOOLS, PATCH])
        assert content == "I will patch it."
        assert [(c.name, c.arguments, c.custom) for c in calls] == [("apply_patch", A_PATCH, True)]
        again = parse_calls(fmt, render_call(fmt, calls), [*TOOLS, PATCH])[1]
        assert [(c.name, c.arguments) for c in again] == [("apply_patch", A_PATCH)]
    assert parse_calls("hermes", text, TOOLS) == (text, [])  # not a custom tool of this request: text
    call = ToolCall("apply_patch", A_PATCH, "call_1", custom=True)
    assert call.as_openai() == {"id": "call_1", "type": "custom", "custom": {"name": "apply_patch", "input": A_PATCH}}


def test_streamed_custom_calls_are_held_back_in_a_format_with_other_markers() -> None:
    held = CallFilter("mistral", [*TOOLS, PATCH])
    shown = [held.feed(p) for p in ["On it. <tool", '_call name="apply_patch">\n', A_PATCH, "\n</tool_call>"]]
    rest, calls = held.finish()
    assert "".join(shown) + rest == "On it. " and [c.name for c in calls] == ["apply_patch"]


def test_a_regex_format_becomes_one_lark_terminal() -> None:
    lark = CustomFormat(type="grammar", syntax="regex", definition="[0-9]+/[0-9]+").lark()
    assert lark == "start: /[0-9]+\\/[0-9]+/\n"
    assert CustomFormat(type="grammar", grammar={"syntax": "lark", "definition": 'start: "x"'}).lark() == 'start: "x"'
    assert CustomFormat(type="text").lark() is None


# Grammars against the real vocabulary: which texts a grammar lets the model write, token by token.


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = Engine(EngineSettings(model=str(default_model_path()), n_ctx=256, max_sessions=1, n_threads=1))
    engine.lltokenizer = tokenizer_for(engine)  # type: ignore[attr-defined]  # ~1 s: once for the module
    yield engine


def _accepts(engine: Engine, constraint: Constraint, text: str, complete: bool = True) -> bool:
    """Whether the grammar allows every token of `text` (and, with `complete`, may end there)."""
    state = GrammarState(engine.lltokenizer, constraint.grammar(), engine.n_vocab)  # type: ignore[attr-defined]
    for token in engine.tokenize(text, add_special=False):
        if not state.allowed()[token]:
            return False
        state.take(token)
    return state.matcher.is_accepting() or not complete


def test_auto_lets_text_through_and_holds_a_started_call_to_its_grammar(engine: Engine) -> None:
    auto = call_grammar("generic", [WEATHER, PATCH, NOTE], parallel=True, forced=False)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _accepts(engine, auto, 'No tool is needed: it is 4 o\'clock. {"a": 1} <tool> </tool_call>')
    assert _accepts(engine, auto, f"Let me look.\n{call}\nDone.")
    assert _accepts(engine, auto, f'OK.\n<tool_call name="apply_patch">\n{A_PATCH}\n</tool_call>')
    assert _accepts(engine, auto, 'OK.\n<tool_call name="note">\nanything, even </tool>\n</tool_call>')
    assert _accepts(engine, auto, f"{call}\n{call}")  # parallel calls
    # A started call must be well-formed: arguments that break the schema, a patch that breaks its grammar, an
    # unknown tool, or the trigger written as plain text.
    assert not _accepts(engine, auto, '<tool_call>\n{"name": "get_weather", "arguments": {"town": 1}}', False)
    assert not _accepts(engine, auto, '<tool_call name="apply_patch">\nrm -rf /', False)
    assert not _accepts(engine, auto, '<tool_call name="rm">', False)
    assert not _accepts(engine, auto, "the <tool_call> tag is", False)
    single = call_grammar("generic", [WEATHER], parallel=False, forced=False)
    assert _accepts(engine, single, f"{call}\nDone.") and not _accepts(engine, single, f"{call}\n{call}")


def test_forced_allows_only_calls(engine: Engine) -> None:
    forced = call_grammar("generic", [WEATHER, PATCH], parallel=False, forced=True)
    assert _accepts(engine, forced, f'<tool_call name="apply_patch">\n{A_PATCH}\n</tool_call>')
    assert not _accepts(engine, forced, "Sure", False)
    llama = call_grammar("llama3", [WEATHER], parallel=False, forced=False)
    assert _accepts(engine, llama, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert _accepts(engine, llama, "It is sunny.")
