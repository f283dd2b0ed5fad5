"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, for Claude Code and the anthropic SDK.

A request is translated into the chat pipeline's terms (services.gateway.chat.prepare_chat): `system` becomes the
first message, `tool_use` blocks become assistant tool calls and `tool_result` blocks tool messages, `tools`
(`input_schema`) and `tool_choice` (`auto`, `any`, `tool`, `none`) map to OpenAI's. The answer comes back as content
blocks (`text`, `tool_use`), with `stop_reason` `end_turn`, `max_tokens`, `stop_sequence` or `tool_use`, streamed as
the anthropic SDK reads it. Errors on these routes have Anthropic's shape (services.gateway.errors).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.chat import prepare_chat
from services.gateway.errors import OpenAIError, anthropic_error_body, as_openai_error, from_validation
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.serving import new_id, with_first
from services.gateway.streaming import DisconnectAwareStreamingResponse
from services.gateway.tools import CallFilter, ToolCall, parse_calls

router = APIRouter()


class Block(BaseModel):
    """A content block: text, tool_use, tool_result (images and documents are refused with a 400)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]  # Claude Code sends system reminders as messages too
    content: str | list[Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # required by /v1/messages, not by count_tokens
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # accepted and ignored: these models do not think aloud

    def to_chat(self) -> ChatCompletionRequest:
        try:
            return self._to_chat()
        except (KeyError, TypeError, AttributeError) as exc:  # a block of the wrong shape
            raise OpenAIError(400, f"malformed messages: {type(exc).__name__}: {exc}", "messages") from exc

    def _to_chat(self) -> ChatCompletionRequest:
        messages: list[dict] = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            messages.extend(_chat_messages(message, i))
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stop": self.stop_sequences or None,
            "stream": self.stream,
        }
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.top_k is not None:
            body["top_k"] = self.top_k
        tools = [t for t in self.tools or [] if t.type in (None, "custom")]
        if tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in tools
            ]
            choice = self.tool_choice
            if choice is not None:
                body["tool_choice"] = {
                    "auto": "auto",
                    "none": "none",
                    "any": "required",
                    "tool": {"type": "function", "function": {"name": choice.name or ""}},
                }[choice.type]
                body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc) from exc


def _text(content: str | list[Block], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if block.type != "text":
            raise OpenAIError(400, f"{where}: content blocks of type {block.type!r} are not supported here", where)
        parts.append(block.text or "")
    return "".join(parts)


def _chat_messages(message: Message, index: int) -> list[dict]:
    """One Anthropic message as chat messages: tool results become tool messages, tool_use blocks tool calls."""
    where = f"messages[{index}].content"
    if message.role == "system":
        return [{"role": "system", "content": _text(message.content, where)}]
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    for block in message.content:
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use" and message.role == "assistant":
            arguments = json.dumps(block.input if block.input is not None else {})
            calls.append(
                {"id": block.id or "", "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        elif block.type == "tool_result" and message.role == "user":
            result = block.content if block.content is not None else ""
            text = _text(result, where) if not isinstance(result, str) else result
            out.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": text})
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # an earlier turn's thinking: nothing to render
        else:
            raise OpenAIError(400, f"{where}: content blocks of type {block.type!r} are not supported", where)
    if texts or calls or not out:
        entry: dict = {"role": message.role, "content": "".join(texts)}
        if calls:
            entry["tool_calls"] = calls
        out.append(entry)
    return out


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(finish: str, text: str, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason (and which stop sequence ended the text, if one did)."""
    if finish == "stop_sequence":
        return "stop_sequence", next((s for s in stops if s), None)
    return _STOP_REASONS.get(finish, "end_turn"), None


def _tool_use(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_"), "name": call.name, "input": arguments}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    if body.max_tokens is None:
        raise OpenAIError(400, "max_tokens: Field required", "max_tokens")
    chat = body.to_chat()
    prepared = await prepare_chat(chat, request)
    serving, generation = prepared.serving, prepared.generation
    message_id = new_id("msg")
    model = body.model or serving.model_name

    if not body.stream:
        out = await serving.complete(generation, prepared.stop)
        text, calls = out.text, []
        if prepared.tools and prepared.fmt is not None:
            text, calls = parse_calls(prepared.fmt, out.text, prepared.tools)
        content = ([{"type": "text", "text": text}] if text else []) + [_tool_use(c) for c in calls]
        finish = "tool_calls" if calls else _finish(out.finish_reason, out.tokens, out.text, prepared.stop)
        reason, sequence = _stop_reason(finish, out.text, prepared.stop)
        return JSONResponse(
            {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": content,
                "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": {"input_tokens": out.stats.prompt_n, "output_tokens": out.stats.predicted_n},
            }
        )

    deltas = serving.deltas(generation, prepared.stop)
    first = await anext(deltas)  # the prefill: failures here still get a real HTTP status
    held = CallFilter(prepared.fmt, prepared.tools) if prepared.tools and prepared.fmt is not None else None

    async def events() -> AsyncIterator[str]:
        start = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": generation.stats.prompt_n, "output_tokens": 0},
        }
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event("ping", {"type": "ping"})
        index, text_open = 0, False
        finish, calls, tokens, raw = "stop", [], [], ""
        try:
            async for delta in with_first(first, deltas):
                raw += delta.text
                tokens.extend(delta.tokens)
                text = held.feed(delta.text) if held is not None else delta.text
                if delta.finish_reason is not None:
                    finish = delta.finish_reason
                    if held is not None:
                        rest, calls = held.finish()
                        text += rest
                if text:
                    if not text_open:
                        block = {"type": "text", "text": ""}
                        yield _event(
                            "content_block_start",
                            {"type": "content_block_start", "index": index, "content_block": block},
                        )
                        text_open = True
                    delta_event = {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "text_delta", "text": text},
                    }
                    yield _event("content_block_delta", delta_event)
            if text_open:
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
            for call in calls:
                use = _tool_use(call)
                block = {"type": "tool_use", "id": use["id"], "name": use["name"], "input": {}}
                yield _event(
                    "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
                )
                partial = {"type": "input_json_delta", "partial_json": json.dumps(use["input"])}
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": partial})
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
            finish = "tool_calls" if calls else _finish(finish, tokens, raw, prepared.stop)
            reason, sequence = _stop_reason(finish, raw, prepared.stop)
            usage = {"output_tokens": generation.stats.predicted_n}
            yield _event(
                "message_delta",
                {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage},
            )
            yield _event("message_stop", {"type": "message_stop"})
        except Exception as exc:  # the status line is already sent: report in-band
            yield _event("error", anthropic_error_body(as_openai_error(exc)))
        finally:
            await deltas.aclose()

    return DisconnectAwareStreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _finish(finish: str, tokens: list, text: str, stops: list[str]) -> str:
    """A `stop` that came from a stop sequence rather than the end of the text is Anthropic's stop_sequence."""
    if finish == "stop" and stops and not (tokens and tokens[-1].is_eog):
        return "stop_sequence"
    return finish


def _event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesRequest, request: Request):
    """The prompt's length in the target's tokens, as /v1/messages would render it (tools included)."""
    chat = body.to_chat()
    prepared = await prepare_chat(chat, request, start=False)
    return JSONResponse({"input_tokens": len(prepared.prompt_ids)})
