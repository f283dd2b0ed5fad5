"""Each speculative strategy against scripted upstreams (tests/fakes.py): exact call sequences, and the reference
text whatever the drafts. Fast and deterministic; the same strategies run against real services and models in
test_lossless_e2e.py, test_gateway_openai.py and test_faults.py."""

from __future__ import annotations

import asyncio

import pytest
from fakes import EOG, FakeDraft, FakeTarget, FakeUpstreams

from services.gateway.speculation import Generation, GenerationOptions, GenerationRequest
from services.gateway.speculation.local_lookup import LocalLookup
from services.gateway.speculation.model_draft import ModelDraft
from services.gateway.speculation.ngram_service import NgramService
from services.gateway.speculation.target_only import TargetOnly
from tandem.sampling import SamplingParams

PROMPT = [2, 3, 4, 5, 6, 7, 8]
# Repeats itself (prompt lookup drafts in the second half of each run of 8) and ends with EOG.
TEXT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
TEXT += [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, EOG]
GREEDY = SamplingParams(temperature=0.0)


def _request(n_max: int, max_tokens: int = 64, adaptive: bool = False) -> GenerationRequest:
    return GenerationRequest(PROMPT, GREEDY, max_tokens=max_tokens, n_max=n_max, adaptive=adaptive)


def _generate(
    up: FakeUpstreams, request: GenerationRequest, options: GenerationOptions
) -> tuple[list[int], Generation]:
    async def run() -> list[int]:
        return [token.id async for token in generation.tokens()]

    generation = Generation(up, request, options)  # type: ignore[arg-type]
    return asyncio.run(run()), generation


def _verifies(target: FakeTarget) -> list[tuple]:
    return [call for call in target.calls if call[0] == "verify"]


@pytest.mark.parametrize(
    ("draft", "options", "strategy"),
    [
        (None, GenerationOptions(), TargetOnly),
        (FakeDraft(TEXT), GenerationOptions(), ModelDraft),
        (FakeDraft(TEXT, ngram=True), GenerationOptions(), NgramService),
        (None, GenerationOptions(local_ngram=True), LocalLookup),
    ],
    ids=["no draft", "model draft", "n-gram service", "local lookup"],
)
def test_each_drafter_gets_its_strategy(draft, options, strategy) -> None:
    generation = Generation(FakeUpstreams(FakeTarget(TEXT), draft), _request(4), options)  # type: ignore[arg-type]
    assert type(generation.strategy) is strategy
    assert type(Generation(FakeUpstreams(FakeTarget(TEXT), draft), _request(0), options).strategy) is TargetOnly


def test_target_only_pipelines_calls_of_a_burst_each() -> None:
    """Two calls in flight from the first token on; once a step's cost is known, each asks for a burst's worth."""
    target = FakeTarget(TEXT)
    tokens, generation = _generate(FakeUpstreams(target), _request(0), GenerationOptions())
    assert tokens == TEXT
    assert _verifies(target) == [
        ("verify", 8, (), 0, 0, False),
        ("verify", 9, (), 0, 0, False),
        ("verify", 10, (), 16, 0, False),  # 100 ms of 1 ms steps, at most 16 a call
        ("verify", 26, (), 16, 0, False),  # the text ends (EOG) inside it
    ]
    assert target.calls[-1] == ("close",)
    assert generation.stats.speculation == "off" and generation.stats.verify_steps == len(TEXT) - 1


def test_model_draft_round_is_propose_verify_settle() -> None:
    """Fixed k = 4, a draft that is always right: each round proposes 4 after appending the 5 tokens of the last."""
    target, draft = FakeTarget(TEXT), FakeDraft(TEXT)
    tokens, generation = _generate(FakeUpstreams(target, draft), _request(4), GenerationOptions(overlap=False))
    assert tokens == TEXT
    assert draft.calls[:4] == [
        ("open", 7),
        ("propose", 7, (5,), 4, False),  # the target's first token, then 4 drafts
        ("propose", 8, (6, 7, 8, 9, 10), 4, False),  # 4 accepted drafts and the target's own token
        ("propose", 13, (11, 12, 5, 6, 7), 4, False),
    ]
    assert _verifies(target)[:2] == [
        ("verify", 8, (6, 7, 8, 9), 0, 0, False),
        ("verify", 13, (11, 12, 5, 6), 0, 0, False),
    ]
    stats = generation.stats
    assert stats.rounds == 7 and stats.draft_n == 28 and stats.draft_n_accepted == 28


def test_model_draft_rejections_keep_the_reference_text() -> None:
    """Drafts wrong at three positions: the target's tokens replace them, and the draft learns them next round."""
    target, draft = FakeTarget(TEXT), FakeDraft(TEXT, wrong={9, 15, 21})
    tokens, generation = _generate(FakeUpstreams(target, draft), _request(4), GenerationOptions(overlap=False))
    assert tokens == TEXT
    assert ("verify", 8, (6, 1, 8, 9), 0, 0, False) in _verifies(target)  # position 9 wrong: 1 accepted
    assert ("propose", 8, (6, 7), 4, False) in draft.calls  # the accepted draft and the target's token
    assert generation.stats.draft_n_accepted < generation.stats.draft_n


def test_overlapped_drafting_drafts_the_next_round_during_verification() -> None:
    """With overlap, a round likely to pass asks for k + 1 (its guess of the target's token) and, while the target
    verifies, proposes the next round from there; a wrong guess is rewound at the next Propose."""
    target, draft = FakeTarget(TEXT), FakeDraft(TEXT, wrong={20})
    tokens, generation = _generate(FakeUpstreams(target, draft), _request(4), GenerationOptions(overlap=True))
    assert tokens == TEXT
    assert generation.stats.overlapped_rounds > 0
    assert any(call[0] == "propose" and call[3] == 5 for call in draft.calls)  # k + 1: the guess
    assert any(call[0] == "propose" and call[4] for call in draft.calls)  # a rewind after the wrong guess
    assert [c for c in _verifies(target) if c[2]] and all(len(c[2]) <= 4 for c in _verifies(target))


def test_a_draft_that_dies_leaves_target_only_decoding_and_the_same_text() -> None:
    target, draft = FakeTarget(TEXT), FakeDraft(TEXT, fail_after=2)
    tokens, generation = _generate(FakeUpstreams(target, draft), _request(4), GenerationOptions(overlap=False))
    assert tokens == TEXT
    assert generation.stats.speculation == "degraded"
    assert sum(call[0] == "propose" for call in draft.calls) == 3  # two answered, the third failed, no fourth
    assert _verifies(target)[-1][2] == ()  # the rest target-only


def test_ngram_service_skips_empty_proposals_and_continues_rounds() -> None:
    """The service drafts only behind a repeat of 2 tokens: where the sequence ends with none, no Propose goes out
    and the target decodes on to the next repeat (stop_at_repeat 2); a round likely to fail goes on as target-only
    decoding in the same call (a Continuation with drafts)."""
    target, draft = FakeTarget(TEXT), FakeDraft(TEXT, ngram=True)
    tokens, generation = _generate(FakeUpstreams(target, draft), _request(4), GenerationOptions())
    assert tokens == TEXT
    stats = generation.stats
    assert stats.proposes_skipped > 0 and stats.continued_rounds > 0 and stats.rounds > 0
    verifies = _verifies(target)
    assert verifies[:3] == [
        ("verify", 8, (), 0, 0, False),  # the lookup found nothing after the prompt: a stretch's one-token call
        ("verify", 9, (), 0, 2, False),  # ... and the next, ended by the target at a repeat of 2
        ("verify", 9, (7,), 17, 2, False),  # a round that goes on in the same call
    ]
    assert all(call[4] == 2 for call in verifies if call[3] > 1)  # every multi-token call stops at a repeat


def test_ngram_service_without_continued_rounds_sends_follow_ups() -> None:
    target, draft = FakeTarget(TEXT, continues_rounds=False), FakeDraft(TEXT, ngram=True)
    tokens, generation = _generate(FakeUpstreams(target, draft), _request(4), GenerationOptions())
    assert tokens == TEXT
    assert generation.stats.continued_rounds == 0 and generation.stats.follow_ups > 0
    assert not [call for call in _verifies(target) if call[2] and call[3]]  # no drafts with a Continuation


def test_local_lookup_lets_the_target_draft_with_its_rule() -> None:
    """The gateway's own lookup, with a target that runs the same rule: after the first round's lookup found
    nothing, every call carries the rule (Continuation.lookup) and the target drafts inside it."""
    target = FakeTarget(TEXT)
    tokens, generation = _generate(FakeUpstreams(target), _request(4), GenerationOptions(local_ngram=True))
    assert tokens == TEXT
    assert all(call[5] for call in _verifies(target))
    assert generation.stats.target_rounds == generation.stats.rounds > 0
    assert generation.stats.propose_calls == 0


def test_local_lookup_stretches_stop_at_repeats_where_the_target_cannot_look_up() -> None:
    target = FakeTarget(TEXT, prompt_lookup=False)
    tokens, generation = _generate(FakeUpstreams(target), _request(4), GenerationOptions(local_ngram=True))
    assert tokens == TEXT
    verifies = _verifies(target)
    assert not any(call[5] for call in verifies)
    assert any(call[2] for call in verifies) and any(call[4] for call in verifies)  # drafts, and stretches
    assert generation.stats.target_rounds == 0 and generation.stats.rounds > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13])
@pytest.mark.parametrize(
    ("draft", "options"),
    [
        (None, GenerationOptions()),
        (FakeDraft(TEXT, wrong={10}), GenerationOptions(overlap=True)),
        (FakeDraft(TEXT, ngram=True), GenerationOptions()),
        (None, GenerationOptions(local_ngram=True)),
    ],
    ids=["target-only", "model", "n-gram service", "local lookup"],
)
def test_max_tokens_is_exact_for_every_strategy(draft, options, max_tokens: int) -> None:
    if draft is not None:
        draft = FakeDraft(draft.text, set(draft.wrong), draft.ngram)  # a fresh one per case
    target = FakeTarget(TEXT)
    tokens, generation = _generate(FakeUpstreams(target, draft), _request(4, max_tokens), options)
    assert tokens == TEXT[:max_tokens]
    assert generation.stats.predicted_n == max_tokens
    assert target.calls[-1] == ("close",)


def test_an_ngram_service_that_dies_leaves_target_only_decoding_and_the_same_text() -> None:
    target, draft = FakeTarget(TEXT), FakeDraft(TEXT, ngram=True, fail_after=1)
    tokens, generation = _generate(FakeUpstreams(target, draft), _request(4, adaptive=True), GenerationOptions())
    assert tokens == TEXT
    assert generation.stats.speculation == "degraded"
    assert sum(call[0] == "propose" for call in draft.calls) == 2  # one answered, the second failed, no third
    assert generation.stats.k_rounds >= 1  # the failed round still counts as a round of k = 0 (match policy)


@pytest.mark.parametrize(
    ("asked", "limit", "expected"),
    [(None, 8192, 64), (10**7, 8192, 93), (10**7, 50, 50), (20, 8192, 20)],
    ids=["default", "past the room", "past the limit", "within both"],
)
def test_max_tokens_is_capped_at_the_room_and_the_limit(asked, limit: int, expected: int) -> None:
    """max_tokens past the context's room or --max-tokens-limit is capped (the answer then ends with "length"),
    as llama-server does, instead of a 400: agents always ask for more than a small context holds."""
    from services.gateway.protocol import ChatCompletionRequest
    from services.gateway.serving import Serving
    from tandem.config import GatewaySettings

    up = FakeUpstreams(FakeTarget(TEXT))
    up.target_info.context_size = 100  # room for 100 - 7 prompt tokens
    settings = GatewaySettings(max_tokens_limit=limit, max_tokens_default=64)
    serving = Serving(up, settings)  # type: ignore[arg-type]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert serving.generation_request(body, PROMPT, asked, -1).max_tokens == expected
