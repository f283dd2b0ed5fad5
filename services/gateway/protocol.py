"""OpenAI request models (the subset tandem serves) and their translation into a GenerationRequest.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do, except where ignoring them would change
the answer silently (n > 1, tools, logit_bias...): those are a 400 naming the parameter.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.gateway.errors import OpenAIError
from services.gateway.tools import Tool, ToolCall
from tandem.grammar import Constraint
from tandem.sampling import SamplingParams

MAX_STOP_SEQUENCES = 16
# Explicit OpenAI defaults change nothing and are accepted.
HARMLESS_VALUES: dict[str, tuple] = {"best_of": (1,)}
# OpenAI's penalties and llama-server's sampler extensions, accepted at the value that leaves the distribution as it
# is; any other would change what is sampled, so it is a 400 rather than ignored (Open WebUI and llama.cpp clients
# send some of them).
NEUTRAL_ONLY: dict[str, float] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "mirostat": 0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
}
# Accepted by OpenAI but not served here: ignoring them would change the answer silently.
UNSUPPORTED = (
    "functions",
    "function_call",
    "logit_bias",
    "suffix",
    "best_of",
    "echo",
    "audio",
    "modalities",
    "prediction",
)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the output must match (always enforced, `strict` or not)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`; llama-server's `schema` beside `json_object` is accepted too."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            schema = self.schema_ if self.schema_ is not None else {"type": "object"}
            return Constraint("json_schema", json.dumps(schema))
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise OpenAIError(400, "response_format json_schema needs json_schema.schema", "response_format")
        return Constraint("json_schema", json.dumps(self.json_schema.schema_))


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class CustomCall(BaseModel):
    name: str
    input: str = ""


class _TypeNamesItsField(BaseModel):
    """OpenAI's tagged shape, `{"type": "function", "function": {...}}`: the field `type` names must be there."""

    @model_validator(mode="after")
    def _has_body(self):
        if getattr(self, self.type) is None:  # type: ignore[attr-defined]
            raise ValueError(f"a {self._what} of type {self.type!r} needs its {self.type!r} field")  # type: ignore[attr-defined]
        return self


class MessageToolCall(_TypeNamesItsField):
    model_config = ConfigDict(extra="allow")
    _what: ClassVar[str] = "tool call"
    id: str = ""
    type: Literal["function", "custom"] = "function"
    function: FunctionCall | None = None
    custom: CustomCall | None = None

    def as_call(self) -> ToolCall:
        if self.custom is not None and self.type == "custom":
            return ToolCall(self.custom.name, self.custom.input, self.id, custom=True)
        assert self.function is not None
        return ToolCall(self.function.name, self.function.arguments, self.id)


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomFormat(BaseModel):
    """A custom tool's input format: free text, or a grammar (chat completions' shape, `{"type": "grammar",
    "grammar": {"syntax", "definition"}}`; the Responses API's flat `syntax`/`definition` is accepted too)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "grammar"] = "text"
    grammar: dict[str, str] | None = None
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    def lark(self) -> str | None:
        """The format as a Lark grammar (a regex becomes one terminal), None for free text."""
        if self.type == "text":
            return None
        spec = self.grammar or {"syntax": self.syntax or "lark", "definition": self.definition or ""}
        syntax, definition = spec.get("syntax", "lark"), spec.get("definition")
        if not definition:
            raise OpenAIError(400, "a grammar format needs its definition", "tools")
        if syntax == "regex":
            return "start: /" + definition.replace("/", "\\/") + "/\n"
        if syntax != "lark":
            raise OpenAIError(400, f"grammar syntax {syntax!r} is not supported (lark or regex)", "tools")
        return definition


class CustomDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str = ""
    format: CustomFormat | None = None


class ToolDef(_TypeNamesItsField):
    _what: ClassVar[str] = "tool"
    type: Literal["function", "custom"]
    function: FunctionDef | None = None
    custom: CustomDef | None = None

    def as_tool(self) -> Tool:
        if self.type == "custom" and self.custom is not None:
            fmt = self.custom.format
            return Tool(self.custom.name, self.custom.description, {}, True, fmt.lark() if fmt else None)
        assert self.function is not None
        return Tool(self.function.name, self.function.description, self.function.parameters or {})


class NamedCustom(BaseModel):
    name: str


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function", "custom"]
    function: NamedFunction | None = None
    custom: NamedCustom | None = None

    @property
    def name(self) -> str:
        named = self.function if self.type == "function" else self.custom
        if named is None:
            raise OpenAIError(400, f"tool_choice of type {self.type!r} needs its {self.type!r} field", "tool_choice")
        return named.name


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(
                    400,
                    f"content part of type {part.type!r} is not supported (text only)",
                    f"messages[{index}].content",
                )
            texts.append(part.text)
        return "".join(texts)


class SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000, description="extension: keep the k most likely tokens (0 = off)")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    # llama-server's flat names, so one running stack can be compared with and without speculation.
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", ge=0, le=64)
    speculative_n_min: int | None = Field(None, alias="speculative.n_min", ge=0, le=64)
    speculative_ngram_min: int | None = Field(
        None,
        alias="speculative.ngram_min",
        ge=1,
        le=32,
        description="extension: the gateway's own n-gram lookup drafts only behind a suffix match of at least this"
        " many tokens (default: the server's --local-ngram-min)",
    )
    speculative_adaptive: bool | None = Field(
        None,
        alias="speculative.adaptive",
        description="extension: choose each round's draft length in n_min..n_max (default: the server's setting,"
        " which never applies to a seeded sampled request: timing-driven lengths would change its text)",
    )
    speculative_overlap: bool | None = Field(
        None,
        alias="speculative.overlap",
        description="extension: a model draft drafts the next round while the target verifies this one (default: the"
        " server's --overlap-draft)",
    )
    speculative_cross_vocab: Literal["auto", "string", "intersection"] | None = Field(
        None,
        alias="speculative.cross_vocab",
        description="extension: how a draft of another vocabulary drafts: string (its text, verified as fixed drafts),"
        " intersection (sampled from the tokens both vocabularies share) or auto (string when greedy, intersection"
        " when sampled; default: the server's --cross-vocab)",
    )
    speculative_type: str | None = Field(
        None,
        alias="speculative.type",
        max_length=64,
        description="extension: the drafting types this request uses, of those the deployment offers, e.g. `ngram`"
        " (prompt lookup), `model`, or `ngram,model` (lookup first, the model where it finds nothing; the default of a"
        " draft service started with --drafter ngram,model)",
    )
    response_format: ResponseFormat | None = None
    timings_detail: bool = Field(
        False, description="extension: add tandem's split of round time and its round counters to `timings`"
    )

    @model_validator(mode="after")
    def _reject_unsupported(self) -> SamplingFields:
        if self.n != 1:
            raise OpenAIError(400, "only n=1 is supported", "n")
        extra = self.model_extra or {}
        for name in UNSUPPORTED:
            value = extra.get(name)
            if value not in HARMLESS_VALUES.get(name, ()) and value not in (None, [], {}, False, "none", "auto"):
                raise OpenAIError(400, f"parameter {name!r} is not supported by this server", name)
        for name, neutral in NEUTRAL_ONLY.items():
            value = extra.get(name)
            if value is not None and value != neutral:
                raise OpenAIError(
                    400,
                    f"parameter {name!r} is not supported (only its neutral value {neutral}); this server samples"
                    " with temperature, top_k and top_p",
                    name,
                )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise OpenAIError(400, "seed must be a non-negative 63-bit integer", "seed")
        return self

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise OpenAIError(400, f"at most {MAX_STOP_SEQUENCES} stop sequences", "stop")
        return [s for s in stops if s]

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        if not self.tools and self.tool_choice not in (None, "none", "auto"):
            raise OpenAIError(400, "tool_choice needs tools", "tool_choice")
        return self

    def tool_list(self) -> list[Tool]:
        """The tools the model may call ([] with none, or with tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            if self.tool_choice not in (None, "none", "auto"):
                raise OpenAIError(400, "tool_choice needs tools", "tool_choice")
            return []
        tools = [t.as_tool() for t in self.tools]
        if len({t.name for t in tools}) != len(tools):
            raise OpenAIError(400, "tool names must be unique", "tools")
        return tools

    def forced_tools(self, tools: list[Tool]) -> list[Tool] | None:
        """The tools one of which the answer must call (tool_choice "required" or named), else None."""
        if self.tool_choice == "required":
            return tools
        if isinstance(self.tool_choice, NamedToolChoice):
            named = [t for t in tools if t.name == self.tool_choice.name]
            if not named:
                message = f"tool_choice names {self.tool_choice.name!r}, which is not in tools"
                raise OpenAIError(400, message, "tool_choice")
            return named
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_top_logprobs(self) -> int:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else -1


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if "max_tokens" in self.model_fields_set else 16

    def requested_top_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    def prompt_value(self) -> str | list[int]:
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise OpenAIError(400, "only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        return prompt
