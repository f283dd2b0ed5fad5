"""Tool calling: the tools in the prompt, a grammar that forces a call, and the calls parsed back out of the text.

Each model family writes calls its own way; the format is chosen from the chat template:
- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `llama3` (Llama 3.1+): a JSON object `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`;
- `generic`, for a template with no tool support (SmolLM2's is one): the Hermes form, with the tools and the form
  described in a system message the gateway adds, as llama.cpp does. A forced call is enforced by grammar, so every
  model can call tools.

Custom tools (Codex's `apply_patch`: free-form input, optionally in a Lark grammar or regex) are written the same way
in every format, as a raw block: `<tool_call name="NAME">\nINPUT\n</tool_call>` (JSON would have to escape the input,
and no grammar engine can enforce a grammar under JSON escaping).

The calls become a Lark grammar (llguidance's dialect: the tools' JSON schemas inlined through `%json`, a custom tool's
grammar referenced as a sub-grammar) that the target masks with (`call_grammar`):
- forced (`tool_choice` "required" or a named function): the output is one well-formed call (or, with parallel calls,
  several) whose arguments satisfy the tool's schema;
- `auto`: text is free until the model starts a call (the format's trigger, e.g. `<tool_call`); from there the call is
  held to the same grammar, so a call that starts is always well-formed. Text never contains a trigger that is not
  followed by a call, which is the only change to the model's distribution.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from tandem.grammar import Constraint

ToolFormatName = Literal["hermes", "mistral", "llama3", "generic"]
GENERIC_SYSTEM = (
    "You can call these tools (name, arguments, what it does):\n{tools}\n\n"
    "To call a tool, answer with one block per call and nothing else:\n"
    '<tool_call>\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "A tool's result comes back in a message of its own. If no tool is needed, answer normally."
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    custom: bool = False  # free-form input instead of JSON arguments
    grammar: str | None = None  # a custom tool's input format: a Lark grammar (llguidance's dialect)

    def as_openai(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it; a custom tool's raw input
    id: str = ""
    custom: bool = False

    def with_id(self) -> ToolCall:
        return self if self.id else ToolCall(self.name, self.arguments, f"call_{uuid.uuid4().hex[:24]}", self.custom)

    def as_openai(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {"id": self.id, "type": "custom" if self.custom else "function"}
        if self.custom:
            out["custom"] = {"name": self.name, "input": self.arguments}
        else:
            out["function"] = {"name": self.name, "arguments": self.arguments}
        if index is not None:
            out["index"] = index
        return out


def choose_format(template_source: str) -> ToolFormatName:
    """The calling convention the model was trained on, told by its chat template."""
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|python_tag|>" in template_source or ("tools" in template_source and "<|eot_id|>" in template_source):
        return "llama3"
    return "generic"


def template_knows_tools(template_source: str) -> bool:
    return choose_format(template_source) != "generic"


CUSTOM_SYSTEM = (
    "These tools take free-form text instead of JSON arguments:\n{tools}\n\n"
    "To call one, answer with a block of its own:\n"
    '<tool_call name="<tool name>">\n<the input>\n</tool_call>'
)
GENERIC_DESCRIPTION_CHARS = 200  # of each tool's description: agents send pages of it, small contexts cannot hold them


def tools_system_message(fmt: ToolFormatName, tools: list[Tool]) -> str | None:
    """What the gateway adds to the system message: the tools the template does not describe (all of them for the
    generic form, the custom ones for every form), a few lines each. Agents send 10-20k tokens of schemas and
    descriptions; the call grammar still enforces the full schema."""
    functions = [t for t in tools if not t.custom] if fmt == "generic" else []
    custom = [t for t in tools if t.custom]
    parts = []
    if functions:
        parts.append(GENERIC_SYSTEM.format(tools="\n".join(_describe(t) for t in functions)))
    if custom:
        parts.append(CUSTOM_SYSTEM.format(tools="\n".join(f"- {t.name}: {_shorten(t.description)}" for t in custom)))
    return "\n\n".join(parts) or None


def _shorten(description: str) -> str:
    description = " ".join(description.split())
    if len(description) > GENERIC_DESCRIPTION_CHARS:
        description = description[:GENERIC_DESCRIPTION_CHARS].rsplit(" ", 1)[0] + "..."
    return description


def _describe(tool: Tool) -> str:
    description = _shorten(tool.description)
    properties = tool.parameters.get("properties", {}) if isinstance(tool.parameters, dict) else {}
    required = set(tool.parameters.get("required", [])) if isinstance(tool.parameters, dict) else set()
    arguments = ", ".join(
        f"{name}: {_type_of(schema)}{'' if name in required else ' (optional)'}" for name, schema in properties.items()
    )
    return f"- {tool.name}({arguments}): {description}"


def _type_of(schema: object) -> str:
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"][:8])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type_of(schema.get('items', {}))}"
    return kind if isinstance(kind, str) else " | ".join(map(str, kind))


def render_call(fmt: ToolFormatName, calls: list[ToolCall]) -> str:
    """An assistant message's tool calls as the model would have written them (for templates that do not)."""
    custom = "\n".join(_raw_block(c.name, c.arguments) for c in calls if c.custom)
    calls = [c for c in calls if not c.custom]
    if not calls:
        return custom
    return _render_functions(fmt, calls) + ("\n" + custom if custom else "")


def _raw_block(name: str, text: str) -> str:
    return f'<tool_call name="{name}">\n{text}\n</tool_call>'


def _render_functions(fmt: ToolFormatName, calls: list[ToolCall]) -> str:
    if fmt == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": c.name, "arguments": _args(c.arguments)} for c in calls])
    if fmt == "llama3":
        return "\n".join(json.dumps({"name": c.name, "parameters": _args(c.arguments)}) for c in calls)
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": c.name, "arguments": _args(c.arguments)}) + "\n</tool_call>"
        for c in calls
    )


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


def _call_schema(tool: Tool, arguments_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters or {"type": "object"}},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


RAW_TRIGGER = "<tool_call"  # how every call in the hermes/generic form, and every custom tool call, starts
# A custom tool's input without a grammar: any text up to the block's end (lazy: the input ends at the first end tag).
RAW_INPUT = 'RAW_BODY: /(?s:.*)/ & ~/(?s:.*)\\n<\\/tool_call>(?s:.*)/\nraw_input[lazy]: RAW_BODY "\\n</tool_call>"'


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lark string literal


def call_grammar(fmt: ToolFormatName, tools: list[Tool], parallel: bool, forced: bool) -> Constraint:
    """A Lark grammar for the calls to `tools` in the model's own format, each with arguments that satisfy its tool's
    schema (a custom tool's input its grammar).

    `forced`: every sentence is one call (with `parallel`, one or more). Otherwise (`tool_choice` "auto") text is free
    until it reaches a trigger (`<tool_call`, `[TOOL_CALLS]`), and what follows a trigger must complete a well-formed
    call (then text again; with `parallel`, more calls). The text before a trigger is a lazy lexeme (llguidance ends
    it at the first trigger), which is what makes the grammar engage exactly there.
    """
    functions = [t for t in tools if not t.custom]
    custom = [t for t in tools if t.custom]
    key = "parameters" if fmt == "llama3" else "arguments"
    rules: list[str] = []
    named: list[tuple[str, str]] = []
    after: dict[str, list[str]] = {}  # trigger -> what may follow it
    direct: list[str] = []  # calls with no trigger (llama3: a JSON object)
    if functions:
        schemas = [_call_schema(t, key) for t in functions]
        one = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
        # Lenient: a keyword llguidance does not implement (Claude Code's `propertyNames`, ...) is not enforced
        # rather than failing the request; agents send tool schemas their users do not control.
        one["x-guidance"] = {"lenient": True}
        rules.append(f"fcall: %json {json.dumps(one)}")
        if fmt == "mistral":
            after["[TOOL_CALLS]"] = ['"[" fcall ("," fcall)* "]"' if parallel else '"[" fcall "]"']
        elif fmt == "llama3":
            direct.append("fcall")
        else:
            after[RAW_TRIGGER] = ['">\\n" fcall "\\n</tool_call>"']
    for i, tool in enumerate(custom):
        body = "raw_input"
        if tool.grammar is not None:
            named.append((f"input{i}", tool.grammar))
            body = f'@input{i} "\\n</tool_call>"'
        opening = _lark_string(f" name={json.dumps(tool.name)}>\n")
        after.setdefault(RAW_TRIGGER, []).append(f"{opening} {body}")
    if any(t.grammar is None for t in custom):
        rules.append(RAW_INPUT)
    triggers = list(after)
    for i, trigger in enumerate(triggers):
        rules.append(f"rest{i}: " + " | ".join(after[trigger]))
    if forced:
        calls = [f"{_lark_string(t)} rest{i}" for i, t in enumerate(triggers)] + direct
        rules.append("call: " + " | ".join(calls))
        start = 'call ("\\n" call)*' if parallel else "call"
    else:
        free = "/(?s:.*)/"
        if triggers:
            pattern = "|".join(re.escape(t).replace("/", "\\/") for t in triggers)
            free += f" & ~/(?s:.*)({pattern})(?s:.*)/"
        rules.append(f"TEXT: {free}")
        for i, trigger in enumerate(triggers):
            rules.append(f"head{i}[lazy]: TEXT {_lark_string(trigger)}")
        heads = " | ".join(f"head{i} rest{i}" for i in range(len(triggers)))
        start = "TEXT"
        if heads:
            start = f"({heads})* TEXT" if parallel else f"({heads})? TEXT"
        if direct:  # llama3: a JSON call at the very start
            rules.append('lcalls: fcall ("\\n" fcall)*' if parallel else "lcalls: fcall")
            start = f"lcalls | {start}"
    return Constraint("lark", "\n".join([f"start: {start}", *rules]) + "\n", tuple(named))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_RAW = re.compile(r'<tool_call name="([^"\n]+)">\n(.*?)\n</tool_call>', re.DOTALL)


def parse_calls(fmt: ToolFormatName, text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """(content before the calls, the calls) of a model's answer; text that is not a well-formed call to a known tool
    stays content. Custom tools' raw blocks are found in every format."""
    custom = {t.name for t in tools if t.custom}
    raw: list[ToolCall] = []

    def take(match: re.Match) -> str:
        if match.group(1) not in custom:
            return match.group(0)
        raw.append(ToolCall(match.group(1), match.group(2), custom=True).with_id())
        return ""

    rest = _RAW.sub(take, text) if custom else text
    content, calls = _parse_functions(fmt, rest, [t for t in tools if not t.custom])
    if not raw:
        return content, calls
    if not calls:
        content = content.rstrip()
    return content, calls + raw


def _parse_functions(fmt: ToolFormatName, text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    if not names:
        return text, []
    if fmt == "mistral":
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        items = _loads(text[start + len("[TOOL_CALLS]") :])
        if isinstance(items, dict):
            items = [items]
        for item in items if isinstance(items, list) else []:
            call = _to_call(item, "arguments", names)
            if call is not None:
                calls.append(call)
        return (text[:start].rstrip(), calls) if calls else (text, [])
    if fmt == "llama3":
        body = text.replace("<|python_tag|>", "").strip()
        for line in body.split("\n") if body.startswith("{") else []:
            call = _to_call(_loads(line), "parameters", names) if line.strip() else None
            if call is None and line.strip():
                return text, []
            if call is not None:
                calls.append(call)
        return ("", calls) if calls else (text, [])
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    for match in _HERMES.finditer(text, start):
        call = _to_call(_loads(match.group(1)), "arguments", names)
        if call is not None:
            calls.append(call)
    return (text[:start].rstrip(), calls) if calls else (text, [])


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _to_call(item: Any, key: str, names: set[str]) -> ToolCall | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get(key, item.get("arguments", {}))
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)).with_id()


def call_markers(fmt: ToolFormatName, tools: list[Tool]) -> list[str]:
    """The texts a call starts with: streamed content is held back from there on (llama3: a JSON object at the
    start, handled apart)."""
    markers = {"hermes": [RAW_TRIGGER], "generic": [RAW_TRIGGER], "mistral": ["[TOOL_CALLS]"], "llama3": []}[fmt]
    if any(t.custom for t in tools) and RAW_TRIGGER not in markers:
        markers = [*markers, RAW_TRIGGER]
    return markers


class CallFilter:
    """Streamed text with the tool calls held back: text is shown until the model starts a call (or may be starting
    one: a held-back tail that is a prefix of a marker); from there on it is collected and parsed at the end."""

    def __init__(self, fmt: ToolFormatName, tools: list[Tool]) -> None:
        self.fmt, self.tools = fmt, tools
        self.markers = call_markers(fmt, tools)
        self.text = ""  # everything so far
        self.shown = 0  # characters of it already shown
        self.calling = False

    def feed(self, piece: str) -> str:
        """The part of the text so far that can be shown now."""
        self.text += piece
        if self.calling:
            return ""
        if self.fmt == "llama3" and any(not t.custom for t in self.tools):  # a call: a JSON object at the start
            head = self.text.lstrip()
            if head.startswith(("{", "<|python_tag|>")):
                self.calling = True
                return ""
            if not head or "<|python_tag|>".startswith(head):
                return ""
        starts = [i for i in (self.text.find(m, self.shown) for m in self.markers) if i >= 0]
        if starts:
            self.calling = True
            return self._show(min(starts))
        keep = max(
            (
                next((n for n in range(min(len(m) - 1, len(self.text)), 0, -1) if m.startswith(self.text[-n:])), 0)
                for m in self.markers
            ),
            default=0,
        )
        return self._show(len(self.text) - keep)

    def _show(self, end: int) -> str:
        out = self.text[self.shown : end]
        self.shown = max(self.shown, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(text still to show, the calls): a call region that does not parse is shown as text after all."""
        content, calls = parse_calls(self.fmt, self.text, self.tools)
        if calls:
            return content[self.shown :] if len(content) > self.shown else "", calls
        return self._show(len(self.text)), []
