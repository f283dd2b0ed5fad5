"""The draft-length replay used to choose the n-gram policy: exact round accounting on a made-up copy task."""

from __future__ import annotations

import pytest

from bench.replay_ngram import Costs, by_match, fixed, replay

COSTS = Costs(fixed_ms=10.0, per_token_ms=2.0, overhead_ms=1.0, plain_ms=0.5)


def test_plain_rounds_cost_one_step_each() -> None:
    # Nothing ever repeats: no draft, one token per round.
    output = list(range(1000, 1040))
    assert replay(list(range(100)), output, fixed(8), COSTS) == pytest.approx(40 * COSTS.round_ms(0))


def test_a_copied_passage_is_drafted_and_accepted() -> None:
    passage = list(range(200, 260))
    prompt = [1, 2, 3, *passage, 4, 5]
    output = passage[:40]
    plain = len(output) * COSTS.round_ms(0)
    copied = replay(prompt, output, fixed(8), COSTS)
    # The first token has no match (the suffix 4, 5 never occurred before), after it every round drafts the copy.
    assert copied < plain / 2
    assert (
        replay(prompt, output, by_match(32, COSTS.overhead_ms, COSTS.plain_ms), COSTS) < copied
    )  # longer drafts, fewer rounds


def test_a_measured_curve_replaces_the_line() -> None:
    costs = Costs(fixed_ms=10.0, per_token_ms=2.0, overhead_ms=1.0, plain_ms=0.5)
    costs.curve = [10.0, 17.0, 20.0]
    assert [costs.verify_ms(k) for k in range(5)] == [10.0, 17.0, 20.0, 23.0, 26.0]  # then the last slope
