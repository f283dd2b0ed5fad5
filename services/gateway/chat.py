"""POST /v1/chat/completions."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway.protocol import ChatCompletionRequest
from services.gateway.serving import Delta, Serving, new_id, now, stream_events, usage
from services.gateway.speculation import Generation
from services.gateway.streaming import DisconnectAwareStreamingResponse
from services.gateway.tools import (
    CallFilter,
    Tool,
    ToolCall,
    ToolFormatName,
    call_grammar,
    choose_format,
    parse_calls,
    render_call,
    tools_system_message,
)
from tandem.errors import InvalidArgument
from tandem.v1 import tandem_pb2 as pb

router = APIRouter()
log = logging.getLogger(__name__)


def _logprob_entry(token: pb.Token) -> dict:
    text = token.piece.decode("utf-8", "replace")
    return {
        "token": text,
        "logprob": token.logprob,
        "bytes": list(token.piece),
        "top_logprobs": [
            {"token": t.piece.decode("utf-8", "replace"), "logprob": t.logprob, "bytes": list(t.piece)}
            for t in token.top_logprobs
        ],
    }


def _logprobs(tokens: list[pb.Token], wanted: bool) -> dict | None:
    if not wanted:
        return None
    return {"content": [_logprob_entry(t) for t in tokens if t.HasField("logprob") and not t.is_eog]}


def _messages(body: ChatCompletionRequest, fmt: ToolFormatName | None, tools: list[Tool]) -> list[dict]:
    """The messages as the chat template takes them: tool calls and results in the model's own form where the
    template does not write them itself, and (generic form) a system message describing the tools."""
    native = fmt is not None and fmt != "generic"
    out: list[dict] = []
    for i, m in enumerate(body.messages):
        text = m.text(i)
        if m.role == "assistant" and m.tool_calls:
            calls = [c.as_call() for c in m.tool_calls]
            functions = [c for c in calls if not c.custom]
            if native and functions:
                custom = render_call("hermes", [c for c in calls if c.custom])
                out.append(
                    {
                        "role": "assistant",
                        "content": text + ("\n" + custom if custom else ""),
                        "tool_calls": [
                            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _args(c)}}
                            for c in functions
                        ],
                    }
                )
            else:
                out.append(
                    {"role": "assistant", "content": (text + "\n" if text else "") + render_call("hermes", calls)}
                )
        elif m.role == "tool":
            if native:
                out.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id or ""})
            else:
                out.append({"role": "tool", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            out.append({"role": m.role, "content": text})
    system = tools_system_message(fmt, tools) if tools and fmt is not None else None
    if system:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _args(call: ToolCall) -> object:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


@dataclass
class PreparedChat:
    """A chat request rendered, tokenized and started: what the endpoints that speak chat (/v1/chat/completions,
    /v1/messages) share."""

    serving: Serving
    prompt_ids: list[int]
    tools: list[Tool]
    fmt: ToolFormatName | None
    stop: list[str]
    top: int
    generation: Generation | None


async def prepare_chat(body: ChatCompletionRequest, request: Request, start: bool = True) -> PreparedChat:
    """Render the messages with the model's template (tools included), tokenize, and start the generation (a forced
    tool call becomes the grammar it must match)."""
    serving: Serving = request.app.state.serving
    serving.check_model(body.model)
    template = request.app.state.chat_template
    tools = body.tool_list()
    fmt: ToolFormatName | None = choose_format(template.source) if tools else None
    messages = _messages(body, fmt, tools)
    native_tools = [t.as_openai() for t in tools if not t.custom] if fmt not in (None, "generic") else None
    prompt = template.render(messages, tools=native_tools)
    bos = serving.up.target_info.bos_text
    add_bos = not (bos and prompt.startswith(bos))
    prompt_ids = await serving.tokenize(prompt, add_special=add_bos, parse_special=True)
    top = body.requested_top_logprobs()
    stop = body.stop_list()
    generation = None
    if start:
        forced = body.forced_tools(tools) if tools else None
        constraint = None
        if forced and fmt:
            constraint = call_grammar(fmt, forced, body.parallel_tool_calls, forced=True)
        elif tools and fmt and body.response_format is None:  # auto: a call that starts must be well-formed
            constraint = call_grammar(fmt, tools, body.parallel_tool_calls, forced=False)
            try:
                constraint.grammar()
            except InvalidArgument as exc:  # never refuse an auto request for its grammar: parse the calls instead
                log.warning("tool_choice auto: no call grammar for these tools (%s); calls are parsed unchecked", exc)
                constraint = None
        max_tokens = body.requested_max_tokens()
        gen_req = serving.generation_request(body, prompt_ids, max_tokens, top, constraint, "tool_choice")
        generation = serving.start(gen_req)
    return PreparedChat(serving, prompt_ids, tools, fmt, stop, top, generation)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    prepared = await prepare_chat(body, request)
    serving, generation, tools, fmt, stop, top = (
        prepared.serving,
        prepared.generation,
        prepared.tools,
        prepared.fmt,
        prepared.stop,
        prepared.top,
    )
    completion_id, created = new_id("chatcmpl"), now()
    base = {"id": completion_id, "created": created, "model": serving.model_name}

    if not body.stream:
        out = await serving.complete(generation, stop)
        message: dict = {"role": "assistant", "content": out.text}
        finish = out.finish_reason
        if tools and fmt is not None:
            content, calls = parse_calls(fmt, out.text, tools)
            if calls:
                message = {
                    "role": "assistant",
                    "content": content or None,
                    "tool_calls": [c.as_openai() for c in calls],
                }
                finish = "tool_calls"
        return JSONResponse(
            {
                **base,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": _logprobs(out.tokens, top >= 0),
                        "finish_reason": finish,
                    }
                ],
                "usage": usage(out.stats),
                "timings": out.stats.timings(body.timings_detail),
            }
        )

    deltas = serving.deltas(generation, stop)
    first = await anext(deltas)  # the prefill: failures here still get a real HTTP status
    role_sent = False
    calls_held = CallFilter(fmt, tools) if tools and fmt is not None else None

    def payload(delta: dict, finish: str | None, tokens: list[pb.Token]) -> dict:
        return {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": _logprobs(tokens, top >= 0), "finish_reason": finish}],
        }

    def chunk(delta: Delta) -> list[dict]:
        nonlocal role_sent
        text = calls_held.feed(delta.text) if calls_held is not None else delta.text
        calls: list[ToolCall] = []
        finish = delta.finish_reason
        if finish is not None and calls_held is not None:
            rest, calls = calls_held.finish()
            text += rest
        content: dict = {}
        if not role_sent:
            content["role"] = "assistant"
            role_sent = True
        if text or "role" in content:
            content["content"] = text
        out = []
        if content or (top >= 0 and delta.tokens) or (finish is not None and not calls):
            out.append(payload(content, None if calls else finish, delta.tokens))
        for index, call in enumerate(calls):  # OpenAI's shape: id, type and name first, then the arguments
            kind, field = ("custom", "input") if call.custom else ("function", "arguments")
            head = {"index": index, "id": call.id, "type": kind, kind: {"name": call.name, field: ""}}
            out.append(payload({"tool_calls": [head]}, None, []))
            out.append(payload({"tool_calls": [{"index": index, kind: {field: call.arguments}}]}, None, []))
        if calls:
            out.append(payload({}, "tool_calls", []))
        if finish is not None:
            out[-1]["timings"] = generation.stats.timings(body.timings_detail)
        return out

    def tail() -> list[dict]:
        if not body.include_usage():
            return []
        return [
            {
                **base,
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": usage(generation.stats),
                "timings": generation.stats.timings(body.timings_detail),
            }
        ]

    return DisconnectAwareStreamingResponse(
        stream_events(first, deltas, chunk, tail),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
