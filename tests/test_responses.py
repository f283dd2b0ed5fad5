"""/v1/responses (OpenAI's Responses API, what Codex speaks) through the official openai SDK, on real services."""

from __future__ import annotations

import json
import re

import pytest
from openai import BadRequestError, OpenAI

from tests.conftest import Service

SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a shell command",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["command"],
        "additionalProperties": False,
    },
}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to files"}
# Codex's shape: a custom tool whose input is a Lark grammar (a small one: the tiny model rambles inside a patch
# language until max_output_tokens; tests/test_tools.py holds that one against the vocabulary).
MODE = {
    "type": "custom",
    "name": "set_mode",
    "description": "Set the speed mode",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "mode=" ("fast" | "slow") " level=" /[1-3]/'},
}
# What Codex sends beside the request proper; accepted and ignored.
CODEX_FIELDS = {
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"effort": "low", "summary": "auto"},
    "service_tier": "auto",
    "prompt_cache_key": "session-1",
}


@pytest.fixture()
def client(gateway: Service) -> OpenAI:
    return OpenAI(base_url=f"{gateway.address}/v1", api_key="unused", max_retries=0)


def test_a_string_input_with_instructions(client: OpenAI) -> None:
    reply = client.responses.create(
        model="tandem",
        instructions="Answer in one short sentence.",
        input="Name a colour.",
        max_output_tokens=30,
        temperature=0,
        extra_body=CODEX_FIELDS,
    )
    assert reply.status in ("completed", "incomplete") and reply.id.startswith("resp")
    assert reply.output[0].type == "message" and reply.output_text
    assert reply.usage.input_tokens > 5 and 0 < reply.usage.output_tokens <= 30


def test_a_forced_function_call_then_its_output(client: OpenAI) -> None:
    reply = client.responses.create(
        model="tandem",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "List the files here."}]}],
        tools=[SHELL],
        tool_choice="required",
        max_output_tokens=80,
        temperature=0,
        extra_body=CODEX_FIELDS,
    )
    call = next(item for item in reply.output if item.type == "function_call")
    assert call.name == "shell" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["command"], list)
    follow = client.responses.create(
        model="tandem",
        input=[
            {"role": "user", "content": "List the files here."},
            {"type": "function_call", "call_id": call.call_id, "name": "shell", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "README.md\nsetup.py"},
        ],
        tools=[SHELL],
        tool_choice="none",
        max_output_tokens=30,
        temperature=0,
    )
    assert follow.output_text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_custom_tool_call_comes_back_as_one_in_its_grammar(client: OpenAI, temperature: float) -> None:
    reply = client.responses.create(
        model="tandem",
        input="Make it go faster.",
        tools=[PATCH, MODE],
        tool_choice={"type": "custom", "name": "set_mode"},
        max_output_tokens=60,
        temperature=temperature,
    )
    calls = [item for item in reply.output if item.type == "custom_tool_call"]
    assert calls, reply.output
    assert calls[0].name == "set_mode" and re.fullmatch(r"mode=(fast|slow) level=[1-3]", calls[0].input)


def test_the_stream_assembles_in_the_sdk(client: OpenAI) -> None:
    with client.responses.stream(
        model="tandem", input="Name two fruits.", max_output_tokens=30, temperature=0, extra_body=CODEX_FIELDS
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.output_text


def test_a_streamed_function_call(client: OpenAI) -> None:
    with client.responses.stream(
        model="tandem",
        input="List the files here.",
        tools=[SHELL],
        tool_choice="required",
        max_output_tokens=80,
        temperature=0,
    ) as stream:
        final = stream.get_final_response()
    call = next(item for item in final.output if item.type == "function_call")
    assert call.name == "shell" and "command" in json.loads(call.arguments)


def test_text_format_json_schema(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string"}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    reply = client.responses.create(
        model="tandem",
        input="Name a colour, as JSON.",
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    assert set(json.loads(reply.output_text)) == {"colour"}


def test_stored_state_is_a_400(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model="tandem", input="hi", previous_response_id="resp_123")
    assert caught.value.body["param"] == "previous_response_id"
