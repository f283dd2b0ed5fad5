"""The OpenAI API of the gateway, through the official `openai` SDK and raw HTTP, over the real stack."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.conftest import Service

MODEL = "SmolLM2-135M-Instruct.Q4_1"
EDIT_PROMPT = (
    "Return this function unchanged except that `total` is renamed to `result`:\n\n"
    "def summarize(values):\n"
    "    total = 0\n"
    "    for v in values:\n"
    "        total += v\n"
    "    count = len(values)\n"
    "    mean = total / count\n"
    "    return total, count, mean\n"
)


@pytest.fixture()
def client(gateway: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.address}/v1", api_key="unused", max_retries=0, timeout=120)


# Tests that compare the text of two greedy requests pin the draft length. Adaptive k chooses from costs timed on
# this machine, so two identical requests can verify in different batch shapes, and llama.cpp's batched matmuls then
# round differently: a near-tie can flip (docs/architecture.md, "Lossless").
FIXED_K = {"speculative.adaptive": False}


def greedy_edit(max_tokens: int) -> dict:
    """Arguments of a temperature-0 chat request for EDIT_PROMPT at a fixed draft length (see FIXED_K)."""
    messages = [{"role": "user", "content": EDIT_PROMPT}]
    return dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=FIXED_K)


def test_models_and_health(gateway: Service, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(f"{gateway.address}/health").json()
    assert health["status"] == "ok" and health["draft"]["drafter"] == "ngram"


def test_chat_completion_with_speculation(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": EDIT_PROMPT}],
        max_tokens=80,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert "summarize" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 80 and reply.usage.prompt_tokens > 50
    timings = reply.model_extra["timings"]
    assert timings["predicted_n"] == reply.usage.completion_tokens
    assert timings["draft_n"] > 0 and timings["draft_n_accepted"] > 0  # the n-gram drafter copies the input
    assert timings["speculation"] == "on"


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    args = greedy_edit(60)
    whole = client.chat.completions.create(**args).choices[0].message.content
    stream = client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens > 0


def test_sse_wire_format_ends_with_done(gateway: Service) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{gateway.address}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    json.loads(lines[-2][len("data: ") :])


def test_speculation_can_be_switched_off_per_request(client: openai.OpenAI) -> None:
    """`speculative.n_max: 0` (llama-server's key) runs target-only on the same stack. The speculative request beside
    it drafts at a fixed length: at adaptive k, whether 48 tokens are worth drafting follows costs timed on this
    machine (on a busy host the policy drafted nothing in them, and the test failed)."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": EDIT_PROMPT}], max_tokens=48, temperature=0)
    spec = client.chat.completions.create(**args, extra_body=FIXED_K)
    plain = client.chat.completions.create(**args, extra_body={"speculative.n_max": 0})
    assert plain.model_extra["timings"]["draft_n"] == 0
    assert plain.model_extra["timings"]["speculation"] == "off"
    assert spec.model_extra["timings"]["draft_n_accepted"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_is_exact(client: openai.OpenAI, stream: bool) -> None:
    args = greedy_edit(120)
    full = client.chat.completions.create(**args).choices[0].message.content
    assert "count" in full
    stop = "count"
    expected = full[: full.index(stop)]
    if stream:
        chunks = list(client.chat.completions.create(**args, stop=[stop, "zzzz"], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"]
    else:
        reply = client.chat.completions.create(**args, stop=stop)
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
    assert text == expected


@pytest.mark.parametrize("stream", [False, True])
def test_target_only_pipeline_stops_exactly_and_frees_the_session(
    client: openai.OpenAI, target: Service, stream: bool
) -> None:
    """Target-only decoding keeps two Verify calls in flight: stops and max_tokens must still cut exactly, the
    spare call's token must never show, and the session must be closed on the target afterwards."""
    import grpc

    from tandem.v1 import tandem_pb2 as pb
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    plain = {"speculative.n_max": 0}
    args = dict(model=MODEL, messages=[{"role": "user", "content": EDIT_PROMPT}], temperature=0, extra_body=plain)
    full = client.chat.completions.create(**args, max_tokens=120)
    short = client.chat.completions.create(**args, max_tokens=9)
    assert short.usage.completion_tokens == 9 and short.choices[0].finish_reason == "length"
    assert full.choices[0].message.content.startswith(short.choices[0].message.content)
    text = full.choices[0].message.content
    expected = text[: text.index("count")]
    if stream:
        chunks = list(client.chat.completions.create(**args, max_tokens=120, stop=["count"], stream=True))
        cut = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        cut = client.chat.completions.create(**args, max_tokens=120, stop="count").choices[0].message.content
    assert cut == expected
    deadline = time.monotonic() + 5  # a streamed reply can end just before the gateway's Close reaches the target
    with grpc.insecure_channel(target.address) as channel:
        while (active := pb_grpc.TargetStub(channel).Info(pb.InfoRequest()).load.active_sessions) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
    assert active == 0


def test_max_completion_tokens_and_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story about a cat."}],
        max_completion_tokens=7,
    )
    assert reply.usage.completion_tokens == 7
    assert reply.choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_with_speculation(client: openai.OpenAI) -> None:
    args = dict(
        model=MODEL, messages=[{"role": "user", "content": EDIT_PROMPT}], max_tokens=40, temperature=0.8, seed=1234
    )
    a = client.chat.completions.create(**args).choices[0].message.content
    b = client.chat.completions.create(**args).choices[0].message.content
    c = client.chat.completions.create(**{**args, "seed": 99}).choices[0].message.content
    assert a == b
    assert a != c


def test_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count: one, two, three,"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = reply.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely token


def test_text_completions(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt="def fib(n):", max_tokens=20, temperature=0, extra_body=FIXED_K)
    reply = client.completions.create(**args)
    assert reply.object == "text_completion"
    assert len(reply.choices[0].text) > 0
    assert reply.usage.completion_tokens <= 20
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert streamed == reply.choices[0].text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools[0]"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "model"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        ({"messages": "hello"}, 400, "messages"),
        # The lookup minimum is the gateway's own lookup's; this gateway calls an n-gram draft service.
        ({"messages": [{"role": "user", "content": "hi"}], "speculative.ngram_min": 12}, 400, "speculative.ngram_min"),
        ({"messages": [{"role": "user", "content": "hi"}], "speculative.ngram_min": 0}, 400, "speculative.ngram_min"),
        ({"messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(gateway: Service, body: dict, status: int, param: str) -> None:
    response = httpx.post(f"{gateway.address}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"] and error["type"]


def test_malformed_json_is_400(gateway: Service) -> None:
    response = httpx.post(
        f"{gateway.address}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{gateway.address}/health").status_code == 200


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    assert info.value.body["param"] == "n"


def test_prompts_and_completions_are_not_logged(gateway: Service, target: Service, ngram_draft: Service) -> None:
    marker = "zebra-quartz-7731"
    reply = httpx.post(
        f"{gateway.address}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": f"Repeat exactly: {marker}"}], "max_tokens": 16},
        timeout=60,
    ).json()
    completion = reply["choices"][0]["message"]["content"].strip()
    for service in (gateway, target, ngram_draft):
        log = service.log()
        assert marker not in log
        assert not completion or completion not in log
