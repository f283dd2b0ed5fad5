"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway.protocol import ChatCompletionRequest
from services.gateway.serving import Delta, Serving, new_id, now, stream_events, usage
from services.gateway.streaming import DisconnectAwareStreamingResponse
from tandem.v1 import tandem_pb2 as pb

router = APIRouter()


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


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    serving: Serving = request.app.state.serving
    serving.check_model(body.model)
    messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
    prompt = request.app.state.chat_template.render(messages)
    bos = serving.up.target_info.bos_text
    add_bos = not (bos and prompt.startswith(bos))
    prompt_ids = await serving.tokenize(prompt, add_special=add_bos, parse_special=True)
    top = body.requested_top_logprobs()
    gen_req = serving.generation_request(body, prompt_ids, body.requested_max_tokens(), top)
    stop = body.stop_list()
    generation = serving.start(gen_req)
    completion_id, created = new_id("chatcmpl"), now()
    base = {"id": completion_id, "created": created, "model": serving.model_name}

    if not body.stream:
        out = await serving.complete(generation, stop)
        return JSONResponse(
            {
                **base,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": out.text},
                        "logprobs": _logprobs(out.tokens, top >= 0),
                        "finish_reason": out.finish_reason,
                    }
                ],
                "usage": usage(out.stats),
                "timings": out.stats.timings(body.timings_detail),
            }
        )

    deltas = serving.deltas(generation, stop)
    first = await anext(deltas)  # the prefill: failures here still get a real HTTP status
    role_sent = False

    def chunk(delta: Delta) -> dict | None:
        nonlocal role_sent
        content: dict = {}
        if not role_sent:
            content["role"] = "assistant"
            role_sent = True
        if delta.text or "role" in content:
            content["content"] = delta.text
        if not content and delta.finish_reason is None and not (top >= 0 and delta.tokens):
            return None
        payload = {
            **base,
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": content,
                    "logprobs": _logprobs(delta.tokens, top >= 0),
                    "finish_reason": delta.finish_reason,
                }
            ],
        }
        if delta.finish_reason is not None:
            payload["timings"] = generation.stats.timings(body.timings_detail)
        return payload

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
