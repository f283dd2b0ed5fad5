"""POST /v1/responses: OpenAI's Responses API, for Codex and the openai SDK's `responses`.

A request is translated into the chat pipeline's terms (services.gateway.chat.prepare_chat): `instructions` becomes the
system message, `input` (a string or items: messages, `function_call`, `function_call_output`, and their custom-tool
twins) the conversation, function tools and `tool_choice` OpenAI's chat ones, `text.format` a `response_format`.
A custom tool (Codex's `apply_patch`) stays a custom tool (free-form input, its Lark or regex format enforced by
grammar once the model starts the call; services.gateway.tools) and comes back as a `custom_tool_call`. Fields Codex
always sends and this server has no use for (`store`, `include`, `reasoning`, `service_tier`, `prompt_cache_key`, ...)
are accepted and ignored; `previous_response_id` is a 400 (nothing is stored).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.chat import prepare_chat
from services.gateway.errors import OpenAIError, as_openai_error, from_validation
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.serving import new_id, with_first
from services.gateway.streaming import DisconnectAwareStreamingResponse
from services.gateway.tools import CallFilter, ToolCall, parse_calls

router = APIRouter()


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    stream: bool = False
    previous_response_id: str | None = None

    def to_chat(self) -> ChatCompletionRequest:
        try:
            return self._to_chat()
        except (KeyError, TypeError, AttributeError) as exc:  # an item or tool of the wrong shape
            raise OpenAIError(400, f"malformed input or tools: {type(exc).__name__}: {exc}", "input") from exc

    def _to_chat(self) -> ChatCompletionRequest:
        if self.previous_response_id:
            raise OpenAIError(
                400, "previous_response_id is not supported (responses are not stored)", "previous_response_id"
            )
        messages: list[dict] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            _add_item(messages, item, i)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages or [{"role": "user", "content": ""}],
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
        }
        tools = []
        for tool in self.tools or []:
            kind = tool.get("type")
            if kind == "function":
                parameters = tool.get("parameters") or {"type": "object"}
                tools.append(
                    {
                        "type": "function",
                        "function": {
                            "name": tool["name"],
                            "description": tool.get("description", ""),
                            "parameters": parameters,
                        },
                    }
                )
            elif kind == "custom":
                custom = {"name": tool["name"], "description": tool.get("description", "")}
                if tool.get("format"):
                    custom["format"] = tool["format"]
                tools.append({"type": "custom", "custom": custom})
            # Hosted tools (web_search, local_shell, ...) are the client's or OpenAI's: not offered to this model.
        if tools:
            body["tools"] = tools
            body["parallel_tool_calls"] = self.parallel_tool_calls
            choice = self.tool_choice
            if isinstance(choice, dict) and choice.get("name"):
                kind = "custom" if choice.get("type") == "custom" else "function"
                body["tool_choice"] = {"type": kind, kind: {"name": choice["name"]}}
            elif choice in ("auto", "none", "required"):
                body["tool_choice"] = choice
        fmt = (self.text or {}).get("format") or {}
        if fmt.get("type") == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")},
            }
        elif fmt.get("type") == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc) from exc


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        if part.get("type") in ("input_text", "output_text", "text"):
            parts.append(part.get("text", ""))
        else:
            raise OpenAIError(400, f"{where}: content of type {part.get('type')!r} is not supported", where)
    return "".join(parts)


def _add_item(messages: list[dict], item: dict, index: int) -> None:
    kind = item.get("type", "message")
    where = f"input[{index}]"
    if kind == "message":
        role = item.get("role", "user")
        messages.append(
            {"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"), where)}
        )
    elif kind in ("function_call", "custom_tool_call"):
        call: dict[str, Any] = {"id": item.get("call_id", "")}
        if kind == "function_call":
            call |= {"type": "function", "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
        else:
            call |= {"type": "custom", "custom": {"name": item["name"], "input": item.get("input", "")}}
        if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
            messages[-1]["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output", "")
        text = output if isinstance(output, str) else _text_of(output, where)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": text})
    elif kind == "reasoning":
        return  # an earlier turn's reasoning summary: nothing to render
    else:
        raise OpenAIError(400, f"{where}: items of type {kind!r} are not supported", where)


def _call_item(call: ToolCall) -> dict:
    call_id = call.id
    if call.custom:
        text = call.arguments
        return {
            "type": "custom_tool_call",
            "id": new_id("ctc"),
            "call_id": call_id,
            "name": call.name,
            "input": text,
            "status": "completed",
        }
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call_id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


def _message_item(item_id: str, text: str) -> dict:
    return {
        "type": "message",
        "id": item_id,
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _response(
    body: ResponsesRequest,
    response_id: str,
    created: int,
    model: str,
    status: str,
    output: list[dict],
    usage: dict | None,
) -> dict:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "instructions": body.instructions,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "text": body.text or {"format": {"type": "text"}},
        "usage": usage,
    }


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    chat = body.to_chat()
    prepared = await prepare_chat(chat, request)
    serving, generation = prepared.serving, prepared.generation
    response_id, created = new_id("resp"), int(time.time())
    model = body.model or serving.model_name

    def usage() -> dict:
        n_in, n_out = generation.stats.prompt_n, generation.stats.predicted_n
        return {
            "input_tokens": n_in,
            "output_tokens": n_out,
            "total_tokens": n_in + n_out,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }

    if not body.stream:
        out = await serving.complete(generation, prepared.stop)
        text, calls = out.text, []
        if prepared.tools and prepared.fmt is not None:
            text, calls = parse_calls(prepared.fmt, out.text, prepared.tools)
        output = ([_message_item(new_id("msg"), text)] if text or not calls else []) + [_call_item(c) for c in calls]
        status = "incomplete" if out.finish_reason == "length" and not calls else "completed"
        return JSONResponse(_response(body, response_id, created, model, status, output, usage()))

    deltas = serving.deltas(generation, prepared.stop)
    first = await anext(deltas)  # the prefill: failures here still get a real HTTP status
    held = CallFilter(prepared.fmt, prepared.tools) if prepared.tools and prepared.fmt is not None else None
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        payload = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    async def events() -> AsyncIterator[str]:
        shell = _response(body, response_id, created, model, "in_progress", [], None)
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        output: list[dict] = []
        message_id, text, opened, finish, calls = new_id("msg"), "", False, "stop", []
        try:
            async for delta in with_first(first, deltas):
                shown = held.feed(delta.text) if held is not None else delta.text
                if delta.finish_reason is not None:
                    finish = delta.finish_reason
                    if held is not None:
                        rest, calls = held.finish()
                        shown += rest
                if shown:
                    if not opened:
                        item = {
                            "type": "message",
                            "id": message_id,
                            "status": "in_progress",
                            "role": "assistant",
                            "content": [],
                        }
                        yield event("response.output_item.added", output_index=0, item=item)
                        part = {"type": "output_text", "text": "", "annotations": []}
                        yield event(
                            "response.content_part.added",
                            item_id=message_id,
                            output_index=0,
                            content_index=0,
                            part=part,
                        )
                        opened = True
                    text += shown
                    yield event(
                        "response.output_text.delta", item_id=message_id, output_index=0, content_index=0, delta=shown
                    )
            if opened:
                yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=text)
                part = {"type": "output_text", "text": text, "annotations": []}
                yield event(
                    "response.content_part.done", item_id=message_id, output_index=0, content_index=0, part=part
                )
                done = _message_item(message_id, text)
                yield event("response.output_item.done", output_index=0, item=done)
                output.append(done)
            for call in calls:
                item = _call_item(call)
                index = len(output)
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item={
                        **item,
                        "status": "in_progress",
                        **({"arguments": ""} if item["type"] == "function_call" else {"input": ""}),
                    },
                )
                if item["type"] == "function_call":
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=item["arguments"],
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=item["arguments"],
                    )
                else:
                    yield event(
                        "response.custom_tool_call_input.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=item["input"],
                    )
                    yield event(
                        "response.custom_tool_call_input.done",
                        item_id=item["id"],
                        output_index=index,
                        input=item["input"],
                    )
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)
            status = "incomplete" if finish == "length" and not calls else "completed"
            final = _response(body, response_id, created, model, status, output, usage())
            # Also when cut at max_output_tokens (status "incomplete", with incomplete_details): the openai SDK's
            # responses.stream() assembles a response only from a response.completed event.
            yield event("response.completed", response=final)
        except Exception as exc:  # the status line is already sent: report in-band
            error = as_openai_error(exc)
            yield event("error", code=error.code, message=error.message, param=error.param)
        finally:
            await deltas.aclose()

    return DisconnectAwareStreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
