"""Tests for services/gateway/protocol.py: OpenAI request validation and the values handed to the generator.

Unsupported parameters are rejected by a model validator raising OpenAIError. Pydantic only wraps ValueError and
AssertionError into a ValidationError, so OpenAIError propagates from the constructor as itself; these tests pin
that, together with the status and the parameter named.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from services.gateway.errors import OpenAIError
from services.gateway.protocol import (
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    CompletionRequest,
)
from tandem.sampling import SamplingParams

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


# --- rejected parameters ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"n": 0}, "n"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"min_p": 0.05}, "min_p"),
        ({"repeat_penalty": 1.1}, "repeat_penalty"),
        ({"mirostat": 2}, "mirostat"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_chat_unsupported_parameter_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        chat(**fields)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("fields", "param"), [({"n": 3}, "n"), ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix")])
def test_completion_unsupported_parameter_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        completion(**fields)
    assert info.value.status == 400
    assert info.value.param == param


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 1},
        {"tools": []},
        {"tool_choice": "none"},
        {"tool_choice": "auto"},
        {"logit_bias": {}},
        {"echo": False},
        {"frequency_penalty": 0},
        {"presence_penalty": 0.0},
        {"min_p": 0},
        {"typical_p": 1.0},
        {"repeat_penalty": 1},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"unknown_extension": 123},
    ],
)
def test_harmless_values_are_accepted(fields: dict[str, Any]) -> None:
    request = chat(**fields)
    assert request.n == 1


@pytest.mark.parametrize("fields", [{"best_of": 1}, {"response_format": {"type": "text"}}])
def test_explicit_openai_defaults_are_accepted(fields: dict[str, Any]) -> None:
    request = completion(**fields)
    assert request.n == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 3},
        {"temperature": -0.1},
        {"top_p": 0},
        {"top_k": -1},
        {"max_tokens": 0},
        {"max_completion_tokens": 0},
        {"top_logprobs": 21},
        {"speculative.n_max": 65},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "hi"}]},
    ],
)
def test_out_of_range_values_are_validation_errors(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        chat(**fields)


def test_content_part_other_than_text_is_a_400_naming_it() -> None:
    request = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(OpenAIError) as info:
        request.messages[0].text(0)
    assert info.value.status == 400
    assert info.value.param == "messages[0].content"


def test_message_text_joins_text_parts() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = chat(messages=[{"role": "user", "content": parts}])
    assert request.messages[0].text(0) == "ab"
    assert chat(messages=[{"role": "assistant", "content": None}]).messages[0].text(0) == ""


# --- values passed on -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"max_tokens": 7}, 7),
        ({"max_completion_tokens": 9}, 9),
        ({"max_tokens": 7, "max_completion_tokens": 9}, 9),
    ],
)
def test_chat_max_completion_tokens_preferred_over_max_tokens(fields: dict[str, Any], expected: int | None) -> None:
    assert chat(**fields).requested_max_tokens() == expected


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (None, []),
        ("END", ["END"]),
        ("", []),
        (["a", "", "b"], ["a", "b"]),
        ([], []),
    ],
)
def test_stop_list(stop: str | list[str] | None, expected: list[str]) -> None:
    assert chat(stop=stop).stop_list() == expected


def test_stop_list_limit() -> None:
    stops = [f"s{i}" for i in range(MAX_STOP_SEQUENCES)]
    assert MAX_STOP_SEQUENCES == 16
    assert chat(stop=stops).stop_list() == stops
    request = chat(stop=[*stops, "one too many"])
    with pytest.raises(OpenAIError) as info:
        request.stop_list()
    assert info.value.status == 400
    assert info.value.param == "stop"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, -1),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
        ({"logprobs": False}, -1),
    ],
)
def test_chat_top_logprobs(fields: dict[str, Any], expected: int) -> None:
    assert chat(**fields).requested_top_logprobs() == expected


@pytest.mark.parametrize("logprobs", [None, False])
def test_top_logprobs_without_logprobs_is_a_400(logprobs: bool | None) -> None:
    fields: dict[str, Any] = {"top_logprobs": 3}
    if logprobs is not None:
        fields["logprobs"] = logprobs
    request = chat(**fields)
    with pytest.raises(OpenAIError) as info:
        request.requested_top_logprobs()
    assert info.value.status == 400
    assert info.value.param == "top_logprobs"


def test_llama_server_flat_speculative_keys() -> None:
    request = chat(**{"speculative.n_max": 8, "speculative.n_min": 2})
    assert request.speculative_n_max == 8
    assert request.speculative_n_min == 2
    assert "speculative.n_max" not in (request.model_extra or {})
    # populate_by_name: the Python names work too.
    assert chat(speculative_n_max=3).speculative_n_max == 3
    assert chat().speculative_n_max is None


def test_sampling_params() -> None:
    params = chat(temperature=0.5, top_p=0.9, top_k=40, seed=7).sampling_params()
    assert params == SamplingParams(temperature=0.5, top_k=40, top_p=0.9, seed=7)
    assert chat(temperature=0).sampling_params().greedy


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, False),
        ({"stream": True}, False),
        ({"stream": True, "stream_options": {"include_usage": False}}, False),
        ({"stream": True, "stream_options": {"include_usage": True}}, True),
        ({"stream": False, "stream_options": {"include_usage": True}}, False),
    ],
)
def test_include_usage(fields: dict[str, Any], expected: bool) -> None:
    assert chat(**fields).include_usage() is expected


# --- /v1/completions --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "expected"), [({}, 16), ({"max_tokens": 5}, 5), ({"max_tokens": 100}, 100)])
def test_completion_max_tokens_default(fields: dict[str, Any], expected: int | None) -> None:
    assert completion(**fields).requested_max_tokens() == expected


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", "hello"),
        (["hello"], "hello"),
        ([1, 2, 3], [1, 2, 3]),
        ([0], [0]),
    ],
)
def test_completion_prompt_value(prompt: str | list[str] | list[int], expected: str | list[int]) -> None:
    assert completion(prompt=prompt).prompt_value() == expected


@pytest.mark.parametrize("prompt", [[], ["a", "b"]])
def test_completion_prompt_rejected(prompt: list[str]) -> None:
    request = completion(prompt=prompt)
    with pytest.raises(OpenAIError) as info:
        request.prompt_value()
    assert info.value.status == 400
    assert info.value.param == "prompt"


def test_completion_prompt_must_be_present_and_well_typed() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({})
    with pytest.raises(ValidationError):
        completion(prompt=[[1, 2]])  # batches of token lists are not served


@pytest.mark.parametrize(("logprobs", "expected"), [(None, -1), (0, 0), (5, 5)])
def test_completion_top_logprobs(logprobs: int | None, expected: int) -> None:
    assert completion(logprobs=logprobs).requested_top_logprobs() == expected
