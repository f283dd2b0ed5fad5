"""Adaptive draft length: the cost fit, the acceptance estimate and the choice of k (pure functions, exact checks)."""

from __future__ import annotations

import pytest

from services.gateway.adaptive import (
    PROBE_EVERY,
    AcceptanceTracker,
    CostModel,
    DraftLengthPolicy,
    worth_drafting_ahead,
)


def costs_with(fixed_ms: float, per_token_ms: float, sequences: int = 1, overhead_ms: float = 0.0) -> CostModel:
    costs = CostModel()
    for tokens in (1, 3, 5, 9, 2, 7) * 5:
        costs.observe_verify(tokens * sequences, sequences, int((fixed_ms + per_token_ms * tokens * sequences) * 1e6))
    costs.observe_overhead(overhead_ms * 1e6)
    return costs


def test_cost_fit_recovers_the_line() -> None:
    fixed, per_token = costs_with(20.0, 6.0).line()
    assert fixed == pytest.approx(20e6, rel=1e-6)
    assert per_token == pytest.approx(6e6, rel=1e-6)


def test_cost_fit_waits_for_two_step_sizes() -> None:
    costs = CostModel()
    for _ in range(10):
        costs.observe_verify(5, 1, 30_000_000)
    assert costs.line() is None and costs.round_ns(3) is None


def test_expected_tokens_follow_the_per_position_rates() -> None:
    tracker = AcceptanceTracker(4)
    for _ in range(400):
        tracker.observe(4, 4)
    # The decay keeps about 33 rounds of memory, so the prior still weighs 2 of 35: each rate is about 0.97.
    assert 4.6 < tracker.expected_tokens(4) < 5.0
    rejected = AcceptanceTracker(4)
    for _ in range(400):
        rejected.observe(4, 0)
    assert rejected.rate(0) < 0.05
    assert rejected.expected_tokens(4) == pytest.approx(1.0, abs=0.06)
    # A short draft is not a rejection of the positions it did not reach: those take the estimate of the position
    # before them (drafts are correlated), here the first position's.
    assert rejected.rate(1) == pytest.approx(rejected.rate(0))
    short = AcceptanceTracker(8)
    for _ in range(400):
        short.observe(2, 2)
    assert short.rate(7) == pytest.approx(short.rate(1)) and short.rate(7) > 0.95


def test_policy_lengthens_drafts_that_are_always_accepted() -> None:
    """A request that drafted 2 tokens a round and had every one accepted tries longer drafts when they pay."""
    policy = DraftLengthPolicy(costs_with(10.0, 5.5), n_min=0, n_max=8)
    for _ in range(30):
        policy.tracker.observe(2, 2)
    assert policy.choose(cap=100) == 8


def test_policy_drafts_long_when_acceptance_is_high_and_tokens_are_cheap() -> None:
    policy = DraftLengthPolicy(costs_with(20.0, 1.0), n_min=0, n_max=8)
    for _ in range(50):
        policy.tracker.observe(8, 8)
    assert policy.choose(cap=100) == 8
    assert policy.choose(cap=3) == 3  # never more than the tokens left


def test_policy_stops_drafting_when_it_does_not_pay_and_probes_later() -> None:
    policy = DraftLengthPolicy(costs_with(20.0, 10.0), n_min=0, n_max=8)
    for _ in range(50):
        policy.tracker.observe(4, 0)
    choices = [policy.choose(cap=100) for _ in range(PROBE_EVERY)]
    assert choices[:-1] == [0] * (PROBE_EVERY - 1)
    assert choices[-1] == 1  # one short probe so the request can resume drafting if the text changes


def test_policy_drafts_less_when_a_step_is_shared_by_many_sessions() -> None:
    alone = DraftLengthPolicy(costs_with(20.0, 2.0, sequences=1), n_min=0, n_max=8)
    loaded = DraftLengthPolicy(costs_with(20.0, 2.0, sequences=8), n_min=0, n_max=8)
    for policy in (alone, loaded):
        for i in range(100):
            policy.tracker.observe(8, (0, 0, 1, 1, 2, 3, 4, 5, 8, 8)[i % 10])  # mixed outcomes, as text gives
    assert loaded.choose(cap=100) < alone.choose(cap=100)


def test_policy_explores_two_lengths_until_the_cost_is_known() -> None:
    policy = DraftLengthPolicy(CostModel(), n_min=0, n_max=8)
    assert {policy.choose(cap=100) for _ in range(4)} == {8, 4}


def test_drafting_ahead_only_when_the_whole_round_is_likely_accepted() -> None:
    sure, unsure = AcceptanceTracker(8), AcceptanceTracker(8)
    for i in range(200):
        sure.observe(4, 4)
        unsure.observe(4, (0, 1, 4, 2)[i % 4])
    assert worth_drafting_ahead(sure, 4)
    assert not worth_drafting_ahead(unsure, 4)
    assert not worth_drafting_ahead(AcceptanceTracker(8), 4)  # no evidence yet: the prior (0.5 a position) says no
