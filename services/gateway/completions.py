"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway.errors import OpenAIError
from services.gateway.protocol import CompletionRequest
from services.gateway.serving import Delta, Serving, new_id, now, stream_events, usage
from services.gateway.streaming import DisconnectAwareStreamingResponse
from tandem.v1 import tandem_pb2 as pb

router = APIRouter()


def _logprobs(tokens: list[pb.Token], wanted: bool, offset: int) -> dict | None:
    if not wanted:
        return None
    shown = [t for t in tokens if t.HasField("logprob") and not t.is_eog]
    texts = [t.piece.decode("utf-8", "replace") for t in shown]
    offsets, pos = [], offset
    for text in texts:
        offsets.append(pos)
        pos += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in shown],
        "top_logprobs": [{a.piece.decode("utf-8", "replace"): a.logprob for a in t.top_logprobs} for t in shown],
        "text_offset": offsets,
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    serving: Serving = request.app.state.serving
    serving.check_model(body.model)
    prompt = body.prompt_value()
    if isinstance(prompt, str):
        prompt_ids = await serving.tokenize(prompt, add_special=True, parse_special=False)
    else:
        prompt_ids = list(prompt)
        vocab = serving.up.target_info.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise OpenAIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    top = body.requested_top_logprobs()
    gen_req = serving.generation_request(body, prompt_ids, body.requested_max_tokens(), top)
    generation = serving.start(gen_req)
    stop = body.stop_list()
    base = {"id": new_id("cmpl"), "created": now(), "model": serving.model_name}

    if not body.stream:
        out = await serving.complete(generation, stop)
        return JSONResponse(
            {
                **base,
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": out.text,
                        "logprobs": _logprobs(out.tokens, top >= 0, 0),
                        "finish_reason": out.finish_reason,
                    }
                ],
                "usage": usage(out.stats),
                "timings": out.stats.timings(body.timings_detail),
            }
        )

    deltas = serving.deltas(generation, stop)
    first = await anext(deltas)
    offset = 0

    def chunk(delta: Delta) -> dict | None:
        nonlocal offset
        if not delta.text and delta.finish_reason is None and not (top >= 0 and delta.tokens):
            return None
        payload = {
            **base,
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": delta.text,
                    "logprobs": _logprobs(delta.tokens, top >= 0, offset),
                    "finish_reason": delta.finish_reason,
                }
            ],
        }
        offset += len(delta.text)
        if delta.finish_reason is not None:
            payload["timings"] = generation.stats.timings(body.timings_detail)
        return payload

    def tail() -> list[dict]:
        if not body.include_usage():
            return []
        return [{**base, "object": "text_completion", "choices": [], "usage": usage(generation.stats)}]

    return DisconnectAwareStreamingResponse(stream_events(first, deltas, chunk, tail), media_type="text/event-stream")
