"""Structured output (`response_format`), lossless under speculation, on real services and the real model.

The target masks every position it samples or verifies with the request's grammar (tandem.grammar), so a draft token
the grammar forbids is rejected. Temperature 0 with speculation must then give exactly the constrained target-only
text: checked on a target that verifies one token a pass (`--verify-mode sequential`), where batch numerics cannot
flip a near-tie, with the n-gram draft service and with a model draft.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from openai import BadRequestError, OpenAI

from tandem.config import EngineSettings
from tandem.engine import Engine
from tandem.models import default_model_path
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.conftest import Service, start_gateway, start_model_service

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
CARD = (
    "Ada Lovelace, 36, wrote in English and French. Grace Hopper, 85, wrote COBOL and English. "
    "Turn the first person into JSON with name, age and languages."
)


@pytest.fixture(scope="module")
def exact_services(service_tmp: Path) -> Iterator[tuple[Service, Service, Service]]:
    from tests.conftest import THREADS

    flags = ["--n-threads", THREADS, "--max-sessions", "4", "--n-ctx", "8192", "--no-prefix-cache"]
    target = start_model_service("services.target", ["--verify-mode", "sequential", *flags], service_tmp)
    draft = start_model_service("services.draft", ["--drafter", "model", *flags], service_tmp)
    ngram = start_model_service("services.draft", ["--drafter", "ngram"], service_tmp)
    yield target, draft, ngram
    for service in (target, draft, ngram):
        service.stop()


@pytest.fixture(scope="module")
def gateways(exact_services: tuple[Service, Service, Service], service_tmp: Path) -> Iterator[tuple[Service, Service]]:
    target, draft, ngram = exact_services
    with_ngram = start_gateway(target.address, ngram.address, service_tmp)
    with_model = start_gateway(target.address, draft.address, service_tmp)
    yield with_ngram, with_model
    with_ngram.stop()
    with_model.stop()


def _chat(gateway: Service, response_format: dict | None, n_max: int, **extra) -> dict:
    body = {
        "messages": [{"role": "user", "content": CARD}],
        "max_tokens": 96,
        "temperature": 0,
        "speculative.n_max": n_max,
        "speculative.adaptive": False,
        "timings_detail": True,
        **extra,
    }
    if response_format is not None:
        body["response_format"] = response_format
    reply = httpx.post(f"{gateway.address}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _person_ok(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"name", "age", "languages"}
    assert isinstance(value["name"], str) and isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert isinstance(value["languages"], list) and all(isinstance(x, str) for x in value["languages"])
    assert len(value["languages"]) <= 4
    return value


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_constrained_output_with_speculation_equals_constrained_target_only(
    gateways: tuple[Service, Service], drafter: str
) -> None:
    gateway = gateways[0] if drafter == "ngram" else gateways[1]
    plain = _chat(gateway, SCHEMA_FORMAT, n_max=0)
    spec = _chat(gateway, SCHEMA_FORMAT, n_max=8)
    plain_text = plain["choices"][0]["message"]["content"]
    assert spec["choices"][0]["message"]["content"] == plain_text
    assert spec["choices"][0]["finish_reason"] == "stop"
    _person_ok(plain_text)
    timings = spec["timings"]
    assert timings["speculation"] == "on" and timings["rounds"] > 0 and timings["draft_n"] > 0


def test_json_object_and_sampled_output_parse(gateways: tuple[Service, Service]) -> None:
    gateway, _ = gateways
    any_object = _chat(gateway, {"type": "json_object"}, n_max=8)["choices"][0]
    assert any_object["message"]["content"].lstrip().startswith("{")  # a tiny model may nest until max_tokens
    if any_object["finish_reason"] == "stop":
        assert isinstance(json.loads(any_object["message"]["content"]), dict)
    with_schema = _chat(gateway, {"type": "json_object", "schema": PERSON}, n_max=8)["choices"][0]  # llama-server's
    assert with_schema["finish_reason"] == "stop"
    _person_ok(with_schema["message"]["content"])
    for seed in (1, 2, 3):
        reply = _chat(gateway, SCHEMA_FORMAT, n_max=8, temperature=0.9, seed=seed)
        if reply["choices"][0]["finish_reason"] == "stop":
            _person_ok(reply["choices"][0]["message"]["content"])
        else:  # cut by max_tokens: still a prefix the grammar allows, so never a wrong field
            assert reply["choices"][0]["message"]["content"].startswith("{")


def test_the_openai_sdk_streams_structured_output(gateways: tuple[Service, Service]) -> None:
    gateway, _ = gateways
    client = OpenAI(base_url=f"{gateway.address}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="tandem",
        messages=[{"role": "user", "content": CARD}],
        max_tokens=96,
        temperature=0,
        response_format=SCHEMA_FORMAT,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    _person_ok(text)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x"}},  # no schema
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}},
        {"type": "xml"},
    ],
    ids=["no schema", "bad type", "dangling ref", "unknown format"],
)
def test_a_schema_that_cannot_compile_is_a_400_naming_response_format(
    gateways: tuple[Service, Service], response_format: dict
) -> None:
    gateway, _ = gateways
    client = OpenAI(base_url=f"{gateway.address}/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(
            model="tandem", messages=[{"role": "user", "content": "hi"}], response_format=response_format
        )
    assert caught.value.status_code == 400
    assert caught.value.body["param"].startswith("response_format")  # e.g. response_format.type


def test_the_target_masks_verified_drafts_and_rolls_the_grammar_back(
    exact_services: tuple[Service, Service, Service],
) -> None:
    """At the gRPC level: under a regex, a draft the grammar forbids is rejected even where it is the unconstrained
    argmax, an allowed draft that is the constrained argmax is accepted, and after a Rollback the same Verify gives
    the same answer (the matcher rolled back with the sequence)."""
    target, _, _ = exact_services
    with grpc.insecure_channel(target.address) as channel:
        stub = pb_grpc.TargetStub(channel)
        prompt = list(stub.Tokenize(pb.TokenizeRequest(text="Count: one two three", add_special=True)).token_ids)
        digits = pb.Constraint(regex="[0-9]{6}")
        sid = "grammar-session"
        item = pb.OpenItem(
            session_id=sid, prompt_token_ids=prompt, sampling=pb.SamplingParams(temperature=0), constraint=digits
        )
        first = stub.Open(pb.OpenRequest(items=[item])).results[0]
        assert first.first_token.piece.decode().isdigit()
        free = pb.OpenItem(session_id="free", prompt_token_ids=prompt, sampling=pb.SamplingParams(temperature=0))
        free_first = stub.Open(pb.OpenRequest(items=[free])).results[0].first_token
        assert not free_first.piece.decode().strip().isdigit()  # unconstrained, the model would write a word

        position = first.position
        word = free_first.id  # forbidden by the grammar
        rejected = stub.Verify(
            pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=position, draft_token_ids=[word])])
        ).results[0]
        assert rejected.num_accepted == 0 and rejected.tokens[0].piece.decode().isdigit()

        stub.Rollback(pb.RollbackRequest(items=[pb.RollbackItem(session_id=sid, position=position)]))
        own = rejected.tokens[0].id
        again = stub.Verify(
            pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=position, draft_token_ids=[own])])
        ).results[0]
        assert again.num_accepted == 1 and again.tokens[0].id == own  # the same constrained argmax, now a draft
        text = "".join(t.piece.decode() for t in [first.first_token, *again.tokens])
        assert text.isdigit()
        stub.Close(pb.CloseRequest(session_ids=[sid, "free"]))


def test_a_model_draft_masks_its_proposals_and_follows_the_committed_tokens(
    exact_services: tuple[Service, Service, Service],
) -> None:
    """The draft masks like the target: under a regex every proposed token is a digit where the unconstrained draft
    proposes a word; sampled, the distributions it sends put all their mass on digits; after the target commits
    tokens (and after a rewind), the draft's matcher follows the committed sequence."""
    target, draft, _ = exact_services
    with grpc.insecure_channel(target.address) as tchan, grpc.insecure_channel(draft.address) as dchan:
        tstub, dstub = pb_grpc.TargetStub(tchan), pb_grpc.DraftStub(dchan)
        assert dstub.Info(pb.InfoRequest()).capabilities.constraints
        prompt = list(tstub.Tokenize(pb.TokenizeRequest(text="Count: one two three", add_special=True)).token_ids)
        engine = Engine(EngineSettings(model=str(default_model_path()), n_ctx=64, max_sessions=1, n_threads=1))
        pieces = {t: engine.pieces[t].decode("utf-8", "replace") for t in range(engine.n_vocab)}
        engine.close()

        def propose(sid: str, position: int, append: list[int], n: int = 5) -> pb.Proposal:
            item = pb.ProposeItem(session_id=sid, position=position, append_token_ids=append, max_tokens=n)
            return dstub.Propose(pb.ProposeRequest(items=[item])).proposals[0]

        for sid, temperature, constraint in [
            ("digits", 0.0, pb.Constraint(regex="[0-9]{12}")),
            ("digits-sampled", 1.0, pb.Constraint(regex="[0-9]{12}")),
            ("words", 0.0, None),
        ]:
            item = pb.OpenItem(
                session_id=sid, prompt_token_ids=prompt, sampling=pb.SamplingParams(temperature=temperature, seed=3)
            )
            if constraint is not None:
                item.constraint.CopyFrom(constraint)
            dstub.Open(pb.OpenRequest(items=[item]))
        free = propose("words", len(prompt), [])
        assert not "".join(pieces[t] for t in free.token_ids).strip().isdigit()  # unmasked: words

        first = propose("digits", len(prompt), [])
        assert first.token_ids and "".join(pieces[t] for t in first.token_ids).isdigit()
        sampled = propose("digits-sampled", len(prompt), [])
        for dist in sampled.distributions:
            assert all(pieces[t].isdigit() or p == 0 for t, p in zip(dist.token_ids, dist.probs, strict=True))
        # The target commits the first two proposed tokens and a digit of its own; the draft catches up and goes on.
        digit = next(t for t in first.token_ids if pieces[t].isdigit())
        committed = [*first.token_ids[:2], digit]
        after = propose("digits", len(prompt), committed)
        text = "".join(pieces[t] for t in [*committed, *after.token_ids])
        assert text.isdigit() and len(text) <= 12
        dstub.Close(pb.CloseRequest(session_ids=["digits", "digits-sampled", "words"]))


def test_a_constraint_the_target_cannot_compile_is_invalid_argument(
    exact_services: tuple[Service, Service, Service],
) -> None:
    target, _, _ = exact_services
    with grpc.insecure_channel(target.address) as channel:
        stub = pb_grpc.TargetStub(channel)
        item = pb.OpenItem(
            session_id="bad-grammar",
            prompt_token_ids=[1, 2, 3],
            sampling=pb.SamplingParams(temperature=0),
            constraint=pb.Constraint(json_schema="{not json"),
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.Open(pb.OpenRequest(items=[item]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "json schema" in caught.value.details()


# ---------------------------------------------------------------- tool calls (SmolLM2: the generic form)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": {}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo right now, in celsius?"}]


def _call(gateway: Service, n_max: int, **extra) -> dict:
    body = {
        "messages": ASK,
        "max_tokens": 80,
        "temperature": 0,
        "tools": [WEATHER, TIME],
        "speculative.n_max": n_max,
        "speculative.adaptive": False,
        **extra,
    }
    reply = httpx.post(f"{gateway.address}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_a_forced_tool_call_is_well_formed_and_the_same_with_speculation(
    gateways: tuple[Service, Service], drafter: str
) -> None:
    gateway = gateways[0] if drafter == "ngram" else gateways[1]
    spec = _call(gateway, 8, tool_choice="required")
    plain = _call(gateway, 0, tool_choice="required")
    choice = spec["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert calls == [{**c, "id": calls[i]["id"]} for i, c in enumerate(plain["choices"][0]["message"]["tool_calls"])]
    assert len(calls) >= 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    for call in calls:
        assert call["function"]["name"] in ("get_weather", "get_time")
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")


def _without_ids(message: dict) -> list[dict]:
    return [{k: v for k, v in call.items() if k != "id"} for call in message.get("tool_calls") or []]


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_with_tool_choice_auto_a_started_call_is_well_formed_and_the_same_with_speculation(
    gateways: tuple[Service, Service], drafter: str
) -> None:
    """auto: the grammar engages at the model's `<tool_call`, so whatever the model chose (text or a call) a call
    parses, and the masked output with speculation is target-only's."""
    gateway = gateways[0] if drafter == "ngram" else gateways[1]
    prompts = [ASK, [{"role": "user", "content": "Say hello, then call get_time."}]]
    for messages in prompts:
        spec = _call(gateway, 8, tool_choice="auto", messages=messages, max_tokens=120)
        plain = _call(gateway, 0, tool_choice="auto", messages=messages, max_tokens=120)
        choice, reference = spec["choices"][0], plain["choices"][0]
        assert choice["message"]["content"] == reference["message"]["content"]
        assert _without_ids(choice["message"]) == _without_ids(reference["message"])
        text = choice["message"]["content"] or ""
        # Either no call was started, or it parsed: a started call is never left as broken text.
        assert "<tool_call" not in text or choice["finish_reason"] == "length"


def test_a_named_tool_call_streams_in_openais_delta_shape(gateways: tuple[Service, Service]) -> None:
    gateway, _ = gateways
    client = OpenAI(base_url=f"{gateway.address}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="tandem",
        messages=ASK,
        max_tokens=80,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    arguments = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert set(arguments) == {"city", "unit"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()  # the call is not shown as text


def test_a_tool_result_in_the_history_is_answered(gateways: tuple[Service, Service]) -> None:
    gateway, _ = gateways
    client = OpenAI(base_url=f"{gateway.address}/v1", api_key="unused")
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": -3, "sky": "snow"}'},
    ]
    reply = client.chat.completions.create(
        model="tandem", messages=history, max_tokens=40, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_an_impossible_tool_choice_is_a_400_naming_it(
    gateways: tuple[Service, Service], extra: dict, param: str
) -> None:
    gateway, _ = gateways
    body = {"messages": ASK, "tools": [WEATHER], **extra}
    reply = httpx.post(f"{gateway.address}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
