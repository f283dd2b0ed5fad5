"""Tool calling: the tools in the prompt, a grammar that forces a call, and the calls parsed back out of the text.

Each model family writes calls its own way; the format is chosen from the chat template:
- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `llama3` (Llama 3.1+): a JSON object `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`;
- `generic`, for a template with no tool support (SmolLM2's is one): the Hermes form, with the tools and the form
  described in a system message the gateway adds, as llama.cpp does. A forced call is enforced by grammar, so every
  model can call tools.

A forced choice (`tool_choice` "required" or a named function) becomes a Lark grammar (llguidance's dialect, with the
tools' JSON schemas inlined through `%json`) that the target masks with: the output is always a well-formed call
whose arguments satisfy the tool's schema.
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

    def as_openai(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def with_id(self) -> ToolCall:
        return self if self.id else ToolCall(self.name, self.arguments, f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
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


GENERIC_DESCRIPTION_CHARS = 200  # of each tool's description: agents send pages of it, small contexts cannot hold them


def generic_system_message(tools: list[Tool]) -> str:
    """The tools in a few lines each: name, the start of the description, and the arguments with their types. Agents
    send 10-20k tokens of schemas and descriptions; a forced call's grammar still enforces the full schema."""
    return GENERIC_SYSTEM.format(tools="\n".join(_describe(t) for t in tools))


def _describe(tool: Tool) -> str:
    description = " ".join(tool.description.split())
    if len(description) > GENERIC_DESCRIPTION_CHARS:
        description = description[:GENERIC_DESCRIPTION_CHARS].rsplit(" ", 1)[0] + "..."
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


def forced_call_grammar(fmt: ToolFormatName, tools: list[Tool], parallel: bool) -> Constraint:
    """A Lark grammar whose every sentence is one call (or, with `parallel`, one or more) to one of `tools`, with
    arguments that satisfy that tool's schema, in the model's own format."""
    key = "parameters" if fmt == "llama3" else "arguments"
    schemas = [_call_schema(t, key) for t in tools]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call = f"%json {json.dumps(one)}"
    if fmt == "mistral":
        body = '"[TOOL_CALLS][" call ("," call)* "]"' if parallel else '"[TOOL_CALLS][" call "]"'
    elif fmt == "llama3":
        body = 'call ("\\n" call)*' if parallel else "call"
    else:
        block = '"<tool_call>\\n" call "\\n</tool_call>"'
        body = f'{block} ("\\n" {block})*' if parallel else block
    return Constraint("lark", f"start: {body}\ncall: {call}\n")


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_calls(fmt: ToolFormatName, text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """(content before the calls, the calls) of a model's answer; text that is not a well-formed call to a known tool
    stays content."""
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
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


def call_marker(fmt: ToolFormatName) -> str:
    """The text a call starts with: streamed content is held back from here on (llama3: a JSON object at the start)."""
    return {"hermes": "<tool_call>", "generic": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "{"}[fmt]


class CallFilter:
    """Streamed text with the tool calls held back: text is shown until the model starts a call (or may be starting
    one: a held-back tail that is a prefix of the marker); from there on it is collected and parsed at the end."""

    def __init__(self, fmt: ToolFormatName, tools: list[Tool]) -> None:
        self.fmt, self.tools = fmt, tools
        self.marker = call_marker(fmt)
        self.text = ""  # everything so far
        self.shown = 0  # characters of it already shown
        self.calling = False

    def feed(self, piece: str) -> str:
        """The part of the text so far that can be shown now."""
        self.text += piece
        if self.calling:
            return ""
        if self.fmt == "llama3":  # a call is a JSON object at the very start
            head = self.text.lstrip()
            if head.startswith(("{", "<|python_tag|>")):
                self.calling = True
                return ""
            if not head or "<|python_tag|>".startswith(head):
                return ""
            return self._show(len(self.text))
        start = self.text.find(self.marker, self.shown)
        if start >= 0:
            self.calling = True
            return self._show(start)
        keep = next(
            (
                n
                for n in range(min(len(self.marker) - 1, len(self.text)), 0, -1)
                if self.marker.startswith(self.text[-n:])
            ),
            0,
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
