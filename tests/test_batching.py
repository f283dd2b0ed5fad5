"""Continuous batching and prefix reuse with the real services: merged steps keep every text, cached prefixes are
reused, and a model draft proposes for several sessions in one step."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.conftest import Service

PROMPTS = [
    "List five fruits, one per line.",
    "Write a haiku about rain.",
    "Explain what a CPU cache is in two sentences.",
    "Give three tips for learning Python.",
]


def _chat(gateway: Service, messages: list[dict], max_tokens: int = 48, **extra) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    response = httpx.post(f"{gateway.address}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _info(address: str, stub=pb_grpc.TargetStub) -> pb.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return stub(channel).Info(pb.InfoRequest())


def _text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def _concurrent(gateway: Service, **extra) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _chat(gateway, [{"role": "user", "content": p}], **extra), PROMPTS))


def test_concurrent_requests_share_steps_and_keep_their_text(gateway: Service, target: Service) -> None:
    # Target-only, then n-gram speculation at a fixed k (adaptive k may draft less under load, and a different
    # verify length can flip a near-tie: that is the draft-length effect, not batching).
    for spec in ({"speculative.n_max": 0}, {"speculative.n_max": 4, "speculative.adaptive": False}):
        alone = [_chat(gateway, [{"role": "user", "content": p}], **spec) for p in PROMPTS]
        before = _info(target.address)
        together = _concurrent(gateway, **spec)
        after = _info(target.address)
        assert [_text(r) for r in together] == [_text(r) for r in alone], spec
        assert after.load.batched_calls > before.load.batched_calls
        assert after.load.max_step_calls >= 2  # at least one engine step verified several sessions at once


def test_model_draft_batches_proposals(model_gateway: Service, model_draft: Service) -> None:
    before = _info(model_draft.address, pb_grpc.DraftStub)
    replies = _concurrent(model_gateway, max_tokens=128, **{"speculative.n_max": 4, "speculative.adaptive": False})
    after = _info(model_draft.address, pb_grpc.DraftStub)
    # Four Opens queue at the draft, and a request decodes without its draft until it has opened and caught up: a
    # short answer (24-33 tokens here) may end first. Batching proposals needs two sessions drafting together.
    assert sum(1 for r in replies if r["timings"]["draft_n"] > 0) >= 2
    assert after.load.batched_calls > before.load.batched_calls
    assert after.load.max_step_calls >= 2


def test_second_turn_reuses_the_first_turns_cells(gateway: Service, target: Service) -> None:
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and precisely." for i in range(40))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    first = _chat(gateway, turn1, max_tokens=16)
    before = _info(target.address)
    turn2 = [*turn1, {"role": "assistant", "content": _text(first)}, {"role": "user", "content": "And a shape?"}]
    second = _chat(gateway, turn2, max_tokens=16)
    after = _info(target.address)
    reused = after.load.reused_prompt_tokens - before.load.reused_prompt_tokens
    # Everything up to the end of the first answer is already in a free slot's cells.
    assert reused >= first["usage"]["prompt_tokens"], (reused, first["usage"])
    assert reused < second["usage"]["prompt_tokens"]
    assert after.load.cached_tokens > 0
