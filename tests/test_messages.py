"""/v1/messages (Anthropic's Messages API) through the official anthropic SDK, on real services with speculation on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.conftest import Service, start_gateway

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def keyed_gateway(target: Service, ngram_draft: Service, service_tmp: Path) -> Iterator[Service]:
    gateway = start_gateway(target.address, ngram_draft.address, service_tmp, "--api-keys", "sk-test")
    yield gateway
    gateway.stop()


@pytest.fixture()
def client(keyed_gateway: Service) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=keyed_gateway.address, api_key="sk-test", max_retries=0)  # sends x-api-key


def test_a_message_with_a_system_prompt(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(
        model="tandem",
        max_tokens=40,
        system="You answer in one short sentence.",
        messages=[{"role": "user", "content": "Name a colour."}],
        extra_body={"temperature": 0},
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg")
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.input_tokens > 5 and 0 < reply.usage.output_tokens <= 40


def test_max_tokens_far_past_the_context_is_capped(keyed_gateway: Service) -> None:
    """Claude Code asks for 32k+ output tokens whatever the model: capped, never a 400. (The SDK itself refuses a
    non-streamed request that large, so this one goes by hand.)"""
    body = {"model": "tandem", "max_tokens": 64000, "temperature": 0, "messages": [{"role": "user", "content": "Hi."}]}
    reply = httpx.post(f"{keyed_gateway.address}/v1/messages", headers={"x-api-key": "sk-test"}, json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"] and reply.json()["stop_reason"] in ("end_turn", "max_tokens")


def test_stop_sequences_and_max_tokens_reasons(client: anthropic.Anthropic) -> None:
    counted = client.messages.create(
        model="tandem",
        max_tokens=60,
        messages=[{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
        extra_body={"temperature": 0},
        stop_sequences=["7"],
    )
    assert counted.stop_reason == "stop_sequence" and counted.stop_sequence == "7"
    assert "7" not in counted.content[0].text
    short = client.messages.create(
        model="tandem",
        max_tokens=3,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        extra_body={"temperature": 0},
    )
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_a_forced_tool_use_and_its_result(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(
        model="tandem",
        max_tokens=80,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    assert reply.stop_reason == "tool_use"
    use = next(block for block in reply.content if block.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id.startswith("toolu_")
    follow = client.messages.create(
        model="tandem",
        max_tokens=30,
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "-3 C, snow"}]},
        ],
        tools=[WEATHER],
        extra_body={"temperature": 0},
    )
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_the_stream_assembles_in_the_sdk(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="tandem",
        max_tokens=40,
        messages=[{"role": "user", "content": "Name two fruits."}],
        extra_body={"temperature": 0},
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0


def test_a_streamed_tool_use(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="tandem",
        max_tokens=80,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    use = next(block for block in final.content if block.type == "tool_use")
    assert use.name == "get_weather" and "city" in use.input
    assert final.stop_reason == "tool_use"


def test_count_tokens(client: anthropic.Anthropic) -> None:
    short = client.messages.count_tokens(model="tandem", messages=[{"role": "user", "content": "hi"}])
    longer = client.messages.count_tokens(model="tandem", messages=ASK, tools=[WEATHER])
    assert 0 < short.input_tokens < longer.input_tokens


def test_errors_have_anthropics_shape(keyed_gateway: Service, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tandem", max_tokens=10, messages=[])
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed_gateway.address, api_key="wrong", max_retries=0).messages.create(
            model="tandem", max_tokens=10, messages=ASK
        )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    raw = httpx.post(
        f"{keyed_gateway.address}/v1/messages",
        headers={"x-api-key": "sk-test"},
        json={"model": "tandem", "max_tokens": 10, "messages": [{"role": "user", "content": [image]}]},
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert "image" in json.dumps(raw.json())
