"""Prompt lookup (n-gram drafting), shared by the draft service's n-gram drafter and the gateway's local one.

A sequence's suffix that occurred earlier predicts that what followed it then follows it again: cheap (microseconds
per round, no model) and right when the output repeats the input, as code edits, quotes and reformatting do.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.config import NGRAM_MAX, NGRAM_MIN  # the defaults, where the flags that take them are

INDEXED_LONG_LENGTHS = (6, 8, 12, 16, 24, 32)
MATCH_CAP = 32


class NgramIndex:
    """For each indexed n: the latest position that followed each n-gram of the sequence.

    Example with n=2 and tokens [5, 6, 7, 5, 6]: the suffix (5, 6) occurred before at positions 0-1 and was followed
    by 7 (position 2), so the proposal continues 7, 5, 6, ... from there.

    Every n up to 4 is indexed, longer ones sparsely (6, 8, 12, ...), so memory stays a few entries per token; the
    exact length of a match is then measured by comparing tokens backwards (`match`).
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        # n_min is always indexed: a match of exactly n_min tokens must be found, whatever n_min is.
        lengths = [n for n in range(n_min, n_max + 1) if n <= 4 or n in INDEXED_LONG_LENGTHS or n in (n_min, n_max)]
        self.follow: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in lengths}
        self._longest_first = sorted(self.follow, reverse=True)
        self.indexed = 0  # tokens[:indexed] are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        # The n-gram ending just before position j is followed by tokens[j].
        for j in range(max(self.indexed, 1), len(tokens)):
            for n, table in self.follow.items():
                if j >= n:
                    table[tuple(tokens[j - n : j])] = j
        self.indexed = len(tokens)

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(position that follows the best earlier occurrence of the sequence's suffix, matched length), or (-1, 0).

        The best occurrence is the latest one of the longest indexed suffix; its matched length is then counted
        exactly, up to MATCH_CAP tokens.
        """
        end = len(tokens)
        for n in self._longest_first:
            if n > end:
                continue
            key = tuple(tokens[end - n :])
            j = self.follow[n].get(key)
            if j is not None:
                m = n
                while m < MATCH_CAP and j - m - 1 >= 0 and tokens[j - m - 1] == tokens[end - m - 1]:
                    m += 1
                return j, m
        return -1, 0

    def lookup(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        j, _ = self.match(tokens)
        return list(tokens[j : j + max_tokens]) if j >= 0 else []


def ngram_draft(index: NgramIndex, tokens: Sequence[int], max_tokens: int, scaled: bool = True) -> list[int]:
    """Up to max_tokens draft tokens continuing `tokens` (already indexed); see `ngram_draft_matched`."""
    return ngram_draft_matched(index, tokens, max_tokens, scaled)[0]


def ngram_draft_matched(
    index: NgramIndex, tokens: Sequence[int], max_tokens: int, scaled: bool = True
) -> tuple[list[int], int]:
    """(up to max_tokens draft tokens continuing `tokens`, length of the suffix match they come from; 0 for none).

    `tokens` must be indexed already. With `scaled`, a confidence rule limits the draft:

    A suffix matched over m tokens earns at most m - 1 draft tokens: a one- or two-token match is often a
    coincidence, and every rejected draft token costs verify time (on a CPU about a third of a one-token step each);
    a long match usually continues a verbatim copy. Measured offline on the benchmark's target-only texts
    (SmolLM2-135M, this CPU's verify costs), drafting m - 1 tokens gave a mean 1.50x over the 4 greedy workloads
    against 1.44x for a flat k=8 after a 3-token match and 1.20x for k=4 after any match.
    """
    j, m = index.match(tokens)
    return list(tokens[j : j + draft_size(j, m, len(tokens), max_tokens, scaled)]), m


def draft_size(position: int, match_len: int, available: int, max_tokens: int, scaled: bool = True) -> int:
    """Tokens a match drafts: from `position` (-1: no match) up to `available`, at most max_tokens and, `scaled`,
    at most match_len - 1 (the confidence rule of `ngram_draft_matched`)."""
    if position < 0:
        return 0
    n = min(max_tokens, match_len - 1) if scaled else max_tokens
    return max(0, min(n, available - position))


# Adaptive draft length for prompt lookup: acceptance is tracked by how long the match is at each drafted position
# (bucket lower bounds, in tokens). The gateway's MatchLengthPolicy learns the rates; LookupRule carries them to the
# target, which drafts with the same rule inside its target-only calls.
MATCH_BUCKETS = (2, 3, 4, 6, 9, 16, 32)


def match_bucket(n: int) -> int:
    return max(bisect.bisect_right(MATCH_BUCKETS, n) - 1, 0)


def best_draft_length(
    match_len: int,
    available: int,
    min_draft: int,
    bucket_rates: Sequence[float],
    round_costs: Sequence[float],
    plain_cost: float,
) -> int:
    """How many of `available` proposed tokens behind a `match_len`-token match to verify: the k >= min_draft that
    maximises expected tokens per unit of cost, or 0 (a plain step is better).

    Draft position i continues a match of match_len + i tokens and is accepted with that bucket's rate, given the
    positions before it were; a round with k drafts emits 1 + sum_{n<=k} prod_{i<n} rate tokens and costs
    round_costs[k] (0 <= k <= available), against plain_cost for one token without a draft.
    """
    lo = max(min_draft, 1)
    k, best = 0, 1.0 / plain_cost
    expected, survive = 1.0, 1.0
    for n in range(1, available + 1):
        survive *= bucket_rates[match_bucket(match_len + n - 1)]
        expected += survive
        if n >= lo and expected / round_costs[n] > best:
            k, best = n, expected / round_costs[n]
    return k


# For `shortest_kept_match`: row m, column n (0..MATCH_CAP - 1) the bucket of draft position n of a round behind an
# m-token match (n = 0: index len(MATCH_BUCKETS), which it reads as a rate of 1), and whether such a round can draft n
# tokens at all (at most m - 1).
_LENGTHS = np.arange(MATCH_CAP + 1)[:, None]
_POSITIONS = np.arange(MATCH_CAP)[None, :]
_BUCKET_AT = np.where(
    _POSITIONS == 0,
    len(MATCH_BUCKETS),
    np.array([match_bucket(n) for n in range(2 * MATCH_CAP)])[_LENGTHS + _POSITIONS - 1],
)
_DRAFTABLE = _POSITIONS <= _LENGTHS - 1


def shortest_kept_match(
    first: int,
    cap: int,
    min_draft: int,
    bucket_rates: Sequence[float],
    round_costs: Sequence[float],
    plain_cost: float,
) -> int:
    """The shortest match length m in first..MATCH_CAP behind which `best_draft_length(m, min(cap, m - 1), ...)`
    drafts at least min_draft tokens (0: none does): where a stretch of target-only decoding must stop.

    `best_draft_length`'s arithmetic, in the same order (so the same floats), for every m at once: row m, column n
    holds the expected tokens of a round with n drafts behind an m-token match, and a draft is kept behind m as soon
    as some n >= min_draft beats a plain token. Asking `best_draft_length` once per m, each time with the rounds
    priced again, cost ~0.5-1.8 ms of the gateway's Python per target-only call: 31% of its CPU at 8 streams of chat
    on the 2-core CPU, where it competes with the target's forward passes (2026-12-06).
    """
    lo = max(min_draft, 1)
    cap = min(cap, MATCH_CAP - 1)
    first = max(first, 1)
    if first > MATCH_CAP or cap < lo:
        return 0
    rates = np.append(np.asarray(bucket_rates, dtype=np.float64), 1.0)[_BUCKET_AT[first:, : cap + 1]]
    expected = np.add.accumulate(np.multiply.accumulate(rates, axis=1), axis=1)  # column n: a round of n drafts
    beats = expected[:, lo:] / np.asarray(round_costs[lo : cap + 1], dtype=np.float64) > 1.0 / plain_cost
    kept = (beats & _DRAFTABLE[first:, lo : cap + 1]).any(axis=1)
    return first + int(kept.argmax()) if kept.any() else 0


@dataclass(frozen=True)
class LookupRule:
    """How a caller's prompt lookup drafts, for a target that drafts with it inside target-only calls
    (`Continuation.lookup`): the gateway's rule, applied by the target to the same sequence, so each side would
    draft the same tokens at the same position.

    At each step the target looks the sequence's suffix up (`ngram_draft_matched` on an index of suffixes of
    ngram_min..ngram_max tokens, at most max_draft tokens and none past end_position), keeps `best_draft_length` of
    the proposal when rates are given (the whole proposal otherwise), and verifies those with its step; fewer than
    min_draft: no draft.
    """

    ngram_min: int = NGRAM_MIN
    ngram_max: int = NGRAM_MAX
    max_draft: int = 8
    min_draft: int = 1
    end_position: int = 0  # the sequence length at which the request ends (its max_tokens)
    bucket_rates: tuple[float, ...] = ()  # per MATCH_BUCKETS entry; empty: keep the whole proposal
    round_costs: tuple[float, ...] = ()  # of a round with 0..max_draft drafts
    plain_cost: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max <= MATCH_CAP:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max <= {MATCH_CAP}, got {self.ngram_min}, {self.ngram_max}")
        if self.bucket_rates:
            if len(self.bucket_rates) != len(MATCH_BUCKETS):
                raise ValueError(f"bucket_rates needs {len(MATCH_BUCKETS)} values, got {len(self.bucket_rates)}")
            if len(self.round_costs) != self.max_draft + 1:
                raise ValueError(f"round_costs needs max_draft + 1 = {self.max_draft + 1} values")
            if not self.plain_cost > 0 or not all(c > 0 for c in self.round_costs):
                raise ValueError("costs must be positive")
            if not all(0.0 <= r <= 1.0 for r in self.bucket_rates):
                raise ValueError("bucket rates must lie in [0, 1]")

    def keep(self, match_len: int, available: int) -> int:
        """Draft tokens kept of an `available`-token proposal behind a `match_len`-token match."""
        if available < max(self.min_draft, 1):
            return 0
        if not self.bucket_rates:
            return available
        rates, costs = self.bucket_rates, self.round_costs
        return best_draft_length(match_len, available, self.min_draft, rates, costs, self.plain_cost)

    def draft(self, index: NgramIndex, tokens: Sequence[int], room: int) -> tuple[list[int], int]:
        """(draft tokens for the next step after `tokens`, indexed already, at most `room`; the match length)."""
        cap = min(self.max_draft, self.end_position - len(tokens) - 1, room)
        if cap < max(self.min_draft, 1):
            return [], 0
        proposal, match_len = ngram_draft_matched(index, tokens, cap)
        return proposal[: self.keep(match_len, len(proposal))], match_len


class PromptLookup:
    """One sequence and its index, for a drafter that sees the tokens as they are committed (the gateway's
    --local-ngram): `propose` takes the new tokens, then drafts."""

    def __init__(self, tokens: Sequence[int], n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX) -> None:
        self.tokens = list(tokens)
        self.index = NgramIndex(n_min, n_max)
        self.index.extend(self.tokens)
        self.last_match = 0  # suffix match length behind the last proposal (0: none), for the adaptive policy

    def propose(self, committed: Sequence[int], max_tokens: int) -> list[int]:
        self.tokens.extend(committed)
        self.index.extend(self.tokens)
        draft, self.last_match = ngram_draft_matched(self.index, self.tokens, max_tokens)
        return draft


class RepeatWatch:
    """Whether a growing sequence ends with an n-gram that occurred earlier in it: where prompt lookup can draft.

    The gateway's lookup drafts only behind a suffix match of at least some length n. A target-only call that
    decodes several tokens (`Continuation.stop_at_repeat`) must stop at the first token after which the lookup could
    draft, and the gateway must tell, from the tokens it got back, whether the call behind it will be skipped. Both
    sides ask this class the same question about the same sequence, so they cannot disagree.

    The sequence only grows between calls (a caller that shortens it starts a new watch). The index holds each
    n-gram that ends before the last token (one that has a follower); a call indexes only the new tokens.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        self.n = n
        self._seen: set[tuple[int, ...]] = set()
        self._indexed = 0  # the n-grams followed by a token before position _indexed are in _seen

    def ends_with_repeat(self, tokens: Sequence[int]) -> bool:
        n, end = self.n, len(tokens)
        for stop in range(max(self._indexed, n), end):  # tokens[stop - n:stop] is followed by tokens[stop]
            self._seen.add(tuple(tokens[stop - n : stop]))
        self._indexed = max(self._indexed, end)
        return end > n and tuple(tokens[end - n :]) in self._seen


class RepeatWatches:
    """RepeatWatch objects of one sequence, by n (the length a caller asks for may change from call to call)."""

    LIMIT = 4  # lengths kept; an older one is rebuilt if asked for again

    def __init__(self) -> None:
        self._by_length: dict[int, RepeatWatch] = {}

    def ends_with_repeat(self, tokens: Sequence[int], n: int) -> bool:
        watch = self._by_length.get(n)
        if watch is None:
            if len(self._by_length) >= self.LIMIT:
                self._by_length.pop(next(iter(self._by_length)))
            watch = self._by_length[n] = RepeatWatch(n)
        return watch.ends_with_repeat(tokens)
