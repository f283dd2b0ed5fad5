"""Tests for the model-free n-gram drafter (services/draft/drafters.py): NgramIndex and NgramDrafter.

Every case is a tiny sequence whose proposal can be worked out by hand: the longest suffix of the sequence that
occurred earlier is found, and the tokens that followed its latest earlier occurrence are proposed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from services.draft.drafters import Draft, NgramDrafter
from tandem.ngram import NGRAM_MAX, NGRAM_MIN, NgramIndex, RepeatWatch, RepeatWatches
from tandem.sampling import SamplingParams
from tandem.sessions import Session


def index_of(tokens: Sequence[int], n_min: int = 1, n_max: int = 4) -> NgramIndex:
    index = NgramIndex(n_min, n_max)
    index.extend(tokens)
    return index


def lookup(tokens: Sequence[int], max_tokens: int, n_min: int = 1, n_max: int = 4) -> list[int]:
    return index_of(tokens, n_min, n_max).lookup(tokens, max_tokens)


def make_session(tokens: Sequence[int]) -> Session:
    return Session(
        session_id="s",
        seq_id=0,
        prompt=tuple(tokens),
        sampling=SamplingParams(temperature=0),
        rng=np.random.default_rng(0),
        tokens=list(tokens),
    )


# --- NgramIndex -------------------------------------------------------------------------------------------------


def test_docstring_example() -> None:
    # (5, 6) occurred at positions 0-1 and was followed by position 2.
    assert lookup([5, 6, 7, 5, 6], 3) == [7, 5, 6]


def test_longest_suffix_wins_over_more_recent_shorter_one() -> None:
    # (1, 2, 3) occurred at 0-2 (followed by 50); the shorter (2, 3) occurred later at 5-6 (followed by 60).
    tokens = [1, 2, 3, 50, 9, 2, 3, 60, 1, 2, 3]
    assert lookup(tokens, 3) == [50, 9, 2]
    # With n capped at 2, only the shorter suffix is looked up, and its latest occurrence wins.
    assert lookup(tokens, 3, n_max=2) == [60, 1, 2]


def test_default_longest_suffix_tells_apart_repeats_of_a_looping_text() -> None:
    """A text that loops over paragraphs of three identical 13-token sentences: 16 tokens of context cannot tell the
    first sentence boundary of a paragraph from the second (their latest occurrence ends the paragraph), 32 can."""
    sentence = list(range(1, 14))
    paragraph = sentence * 3 + [99]
    text = paragraph * 3 + sentence + sentence[:5]
    truth = (paragraph * 5)[len(text) : len(text) + 30]
    index = NgramIndex(NGRAM_MIN, NGRAM_MAX)
    index.extend(text)
    assert index.lookup(text, 30) == truth
    short = NgramIndex(2, 16)
    short.extend(text)
    assert short.lookup(text, 30) != truth


def test_latest_earlier_occurrence_wins() -> None:
    assert lookup([5, 6, 7, 5, 6, 8, 5, 6], 3) == [8, 5, 6]


def test_falls_back_to_shorter_suffix() -> None:
    # No earlier (2, 9) or longer; the 1-gram (9,) occurred at position 1, followed by 4.
    assert lookup([3, 9, 4, 2, 9], 2) == [4, 2]


def test_no_match_proposes_nothing() -> None:
    assert lookup([1, 2, 3, 4], 5) == []


def test_n_min_excludes_short_matches() -> None:
    tokens = [3, 9, 4, 2, 9]  # only the 1-gram (9,) repeats
    assert lookup(tokens, 2, n_min=1) == [4, 2]
    assert lookup(tokens, 2, n_min=2) == []


def test_empty_and_single_token_sequences() -> None:
    assert lookup([], 4) == []
    assert lookup([7], 4) == []


def test_continuation_runs_into_the_suffix_itself() -> None:
    # (1, 2) at 0-1 is followed by positions 2-3, which are the suffix (1, 2) itself.
    assert lookup([1, 2, 1, 2], 2) == [1, 2]
    assert lookup([1, 2, 1, 2], 8)[:2] == [1, 2]
    # A constant run: (7, 7, 7) at 0-2 is followed by position 3.
    assert lookup([7, 7, 7, 7], 1) == [7]


@pytest.mark.parametrize(("max_tokens", "expected"), [(0, []), (1, [2]), (3, [2, 3, 4]), (5, [2, 3, 4, 5, 6])])
def test_max_tokens_respected(max_tokens: int, expected: list[int]) -> None:
    assert lookup([1, 2, 3, 4, 5, 6, 1], max_tokens) == expected


def test_negative_max_tokens_proposes_nothing() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]  # (1,) matches at j=1; tokens[1:-4] == [2, 3, 4, 5, 6]
    assert lookup(tokens, -5) == []


def test_incremental_extend_equals_one_shot() -> None:
    rng = np.random.default_rng(1)
    tokens = [int(t) for t in rng.integers(0, 4, size=60)]  # small vocab: many repeated n-grams
    one_shot = index_of(tokens, 1, 3)
    incremental = NgramIndex(1, 3)
    cut = 0
    for step in (0, 1, 1, 2, 0, 5, 7, 13, 31):
        cut += step
        incremental.extend(tokens[:cut])
        assert incremental.indexed == cut
        # At every prefix, the incrementally built index answers like a fresh one.
        assert incremental.lookup(tokens[:cut], 4) == index_of(tokens[:cut], 1, 3).lookup(tokens[:cut], 4)
    assert cut == len(tokens)
    assert incremental.follow == one_shot.follow
    assert incremental.indexed == one_shot.indexed == len(tokens)


def test_extend_twice_with_same_tokens_is_a_no_op() -> None:
    index = index_of([1, 2, 1, 3, 1])
    before = {n: dict(table) for n, table in index.follow.items()}
    index.extend([1, 2, 1, 3, 1])
    assert index.follow == before


def test_index_never_contains_the_final_suffix() -> None:
    # The n-grams ending at the last token have no follower yet: looking them up must not return the end.
    index = index_of([4, 5, 6])
    assert (5, 6) not in index.follow[2]
    assert index.follow[2] == {(4, 5): 2}
    assert index.follow[1] == {(4,): 1, (5,): 2}


# --- NgramDrafter ---------------------------------------------------------------------------------------------------


def test_drafter_open_and_propose() -> None:
    drafter = NgramDrafter(scaled=False)
    session = make_session([5, 6, 7, 5, 6])
    drafter.open([session])
    assert isinstance(session.extra, NgramIndex)
    assert drafter.propose(session, 2) == Draft([7, 5], None, match_len=2)  # behind the repeated (5, 6)


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_drafter_non_positive_max_tokens(max_tokens: int) -> None:
    drafter = NgramDrafter()
    session = make_session([5, 6, 7, 5, 6])
    drafter.open([session])
    assert drafter.propose(session, max_tokens) == Draft([], None)


def test_drafter_appended_indexes_new_tokens() -> None:
    drafter = NgramDrafter(scaled=False)
    session = make_session([1, 2, 3])
    drafter.open([session])
    assert drafter.propose(session, 4).tokens == []
    start = len(session.tokens)
    session.tokens.extend([4, 1, 2])
    drafter.appended(session, start)
    # (1, 2) at 0-1 is followed by 3, then the appended tokens.
    assert drafter.propose(session, 4).tokens == [3, 4, 1, 2]
    assert session.extra.indexed == len(session.tokens)


def test_drafter_truncated_forgets_removed_tokens() -> None:
    drafter = NgramDrafter(scaled=False)
    session = make_session([1, 2, 3, 1, 2, 99, 1, 2])
    drafter.open([session])
    # Latest earlier (1, 2) is at 3-4, followed by the soon-removed 99.
    assert drafter.propose(session, 3).tokens == [99, 1, 2]

    del session.tokens[5:]  # roll back to [1, 2, 3, 1, 2]
    drafter.truncated(session)
    proposal = drafter.propose(session, 3).tokens
    assert 99 not in proposal
    assert proposal == [3, 1, 2]  # the earlier occurrence at 0-1, followed by 3
    assert session.extra.indexed == 5

    # New tokens after the rollback: the index is that of the new sequence, as if built from scratch.
    start = len(session.tokens)
    session.tokens.extend([8, 1, 2])
    drafter.appended(session, start)
    assert session.extra.follow == index_of(session.tokens).follow
    assert drafter.propose(session, 3).tokens == [8, 1, 2]


def test_drafter_sessions_have_independent_indexes() -> None:
    drafter = NgramDrafter(n_min=1, n_max=2, scaled=False)
    a = make_session([1, 2, 1])
    b = make_session([1, 3, 1])
    drafter.open([a, b])
    assert a.extra is not b.extra
    assert drafter.propose(a, 1).tokens == [2]
    assert drafter.propose(b, 1).tokens == [3]


# --- match lengths and the confidence rule ------------------------------------------------------------------------


def test_match_counts_the_exact_length_beyond_the_indexed_n() -> None:
    # The suffix 10..19 (10 tokens) occurred at 0-9, followed by 77. Only n in {1..4, 6, 8} is indexed with
    # n_max=8, but the match is counted token by token: 10.
    tokens = [*range(10, 20), 77, 5, *range(10, 20)]
    index = index_of(tokens, 1, 8)
    assert 10 not in index.follow and 8 in index.follow
    assert index.match(tokens) == (10, 10)
    # A different token before the suffix stops the count: 3 tokens match.
    assert index_of([1, 2, 3, 9, 4, 2, 3], 1, 8).match([1, 2, 3, 9, 4, 2, 3]) == (3, 2)


def test_match_without_occurrence() -> None:
    assert index_of([1, 2, 3]).match([1, 2, 3]) == (-1, 0)


@pytest.mark.parametrize(("suffix_len", "expected_len"), [(1, 0), (2, 1), (3, 2), (5, 4), (12, 6)])
def test_scaled_drafter_drafts_one_less_than_the_match(suffix_len: int, expected_len: int) -> None:
    # A run of 40 distinct tokens, then a filler, then its first `suffix_len` tokens again: the match is
    # suffix_len long and is followed by the rest of the run.
    run = list(range(100, 140))
    tokens = [*run, 7, *run[:suffix_len]]
    drafter = NgramDrafter(n_min=1, n_max=16)
    session = make_session(tokens)
    drafter.open([session])
    proposal = drafter.propose(session, 6).tokens
    assert proposal == run[suffix_len : suffix_len + expected_len]
    unscaled = NgramDrafter(n_min=1, n_max=16, scaled=False)
    unscaled.open([session])
    assert unscaled.propose(session, 6).tokens == run[suffix_len : suffix_len + 6]


def test_prompt_lookup_drafts_from_the_prompt_and_what_was_committed() -> None:
    """The gateway's local drafter: drafts continue a copy of the prompt, and learn the tokens committed since."""
    from tandem.ngram import PromptLookup

    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert lookup.propose([], 4) == []  # the sequence's suffix (9) occurred nowhere before
    # 1 2 3 4 committed: a 4-token match earns at most 3 draft tokens (the confidence rule).
    assert lookup.propose([1, 2, 3, 4], 8) == [5, 6, 7]
    assert lookup.propose([5, 6, 7, 8], 8) == [9, 1, 2, 3, 4, 5, 6]
    assert lookup.propose([], 2) == [9, 1]


@pytest.mark.parametrize("n_min", [3, 5, 7, 12])
def test_prompt_lookup_drafts_only_behind_matches_of_its_minimum(n_min: int) -> None:
    """`--local-ngram-min` / `speculative.ngram_min`: a suffix that matches over n_min - 1 tokens drafts nothing,
    one that matches over exactly n_min tokens drafts (also for minimums that are not indexed lengths of their own)."""
    from tandem.ngram import PromptLookup

    prompt = list(range(100, 130))
    short = PromptLookup(prompt, n_min)
    assert short.propose(prompt[: n_min - 1], 8) == []
    exact = PromptLookup(prompt, n_min)
    assert exact.propose(prompt[:n_min], 8) == prompt[n_min : n_min + min(8, n_min - 1)]
    assert exact.last_match == n_min


def test_gateway_refuses_a_lookup_minimum_over_its_maximum() -> None:
    from pydantic import ValidationError

    from tandem.config import GatewaySettings

    assert GatewaySettings(local_ngram_min=12).local_ngram_min == 12
    with pytest.raises(ValidationError, match="must not exceed"):
        GatewaySettings(local_ngram_min=12, local_ngram_max=8)


@pytest.mark.parametrize("seed", range(4))
def test_repeat_watch_answers_as_the_definition_while_the_sequence_grows(seed: int) -> None:
    """RepeatWatch (the test behind Continuation.stop_at_repeat, on both sides of the call): after every growth step
    of one to five tokens, whether the sequence ends with n tokens seen together earlier, for n from 1 to 6 (a small
    alphabet, so repeats of every length occur), through watches kept per n and rebuilt past the limit."""
    rng = random.Random(seed)
    sequence: list[int] = []
    watches = RepeatWatches()
    single = {n: RepeatWatch(n) for n in range(1, 7)}
    answers = {True: 0, False: 0}
    while len(sequence) < 400:
        sequence.extend(rng.randrange(4) for _ in range(rng.randint(1, 5)))
        for n in rng.sample(range(1, 7), 3):  # more lengths than RepeatWatches keeps: some are rebuilt
            suffix = sequence[len(sequence) - n :]
            expected = len(sequence) > n and any(sequence[i : i + n] == suffix for i in range(len(sequence) - n))
            assert watches.ends_with_repeat(sequence, n) is expected
            assert single[n].ends_with_repeat(sequence) is expected
            answers[expected] += 1
    assert answers[True] and answers[False]


@pytest.mark.parametrize(
    ("n_min", "n_max", "scaled", "declared"),
    [(1, 4, True, 2), (1, 4, False, 1), (2, 16, True, 2), (2, 16, False, 2), (3, 16, True, 3), (3, 16, False, 3)],
)
def test_ngram_drafter_proposes_exactly_behind_the_repeat_it_declares(
    n_min: int, n_max: int, scaled: bool, declared: int
) -> None:
    """`proposes_after_repeat` (Info) is what the gateway stops its target-only stretches at, then asks again: the
    drafter must propose nothing unless the sequence ends with that many tokens that occurred together earlier (or
    the gateway would skip drafts), and here, where every length it declares is indexed, always propose behind one."""
    drafter = NgramDrafter(n_min, n_max, scaled)
    assert drafter.proposes_after_repeat == declared
    rng = random.Random(n_min * 10 + scaled)
    tokens = [rng.randrange(5) for _ in range(300)]  # a small alphabet: repeats of every length occur
    session = make_session(tokens[:1])
    drafter.open([session])
    watch = RepeatWatch(declared)
    outcomes = set()
    past_cap = False  # a proposal longer than match_len - 1: what only an unscaled drafter sends
    for end in range(2, len(tokens) + 1):
        session.tokens.append(tokens[end - 1])
        drafter.appended(session, end - 1)
        draft = drafter.propose(session, 8)
        proposed = bool(draft.tokens)
        assert proposed == watch.ends_with_repeat(session.tokens), end
        # Its confidence: the suffix of match_len tokens occurred before, followed by the first proposed token, and
        # with the confidence rule it drafts at most match_len - 1 tokens.
        m = draft.match_len
        assert (m >= declared) if proposed else (m == 0)
        if proposed:
            seq = session.tokens
            assert any(seq[i : i + m] == seq[end - m : end] and seq[i + m] == draft.tokens[0] for i in range(end - m))
            assert not scaled or len(draft.tokens) <= m - 1
            past_cap |= len(draft.tokens) > m - 1
        outcomes.add(proposed)
    assert outcomes == {True, False}
    assert past_cap == (not scaled)
