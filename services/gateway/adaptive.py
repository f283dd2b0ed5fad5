"""Adaptive draft length: choose each round's k from measured costs and the request's running acceptance.

A round with k draft tokens emits E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens, where a_j is the probability that
draft position j is accepted given that position j-1 was. Acceptance is estimated per position, not as one rate,
because drafts are correlated: once an n-gram drafter is copying a passage, later positions are as safe as the
first. A round's cost comes from `services.gateway.costs.CostModel`; k = argmax E(k) / cost(k), with k = 0 (plain
decoding) as one of the choices and a cheap probe now and then so a request that stopped drafting can start again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.costs import FIXED_PRIORS, PRIOR_WEIGHT, CostModel, count_round
from tandem.ngram import MATCH_BUCKETS, MATCH_CAP, best_draft_length, match_bucket, shortest_kept_match

PRIOR_RATE = 0.5  # acceptance assumed at a position before anything is observed
DECAY = 0.97  # per round: the estimate follows the request's recent behaviour (about 30 rounds)
PROBE_EVERY = 8  # rounds of plain decoding before one probing round with a short draft


@dataclass
class AcceptanceTracker:
    """Per-position acceptance of one request's drafts, decayed so it follows the text as it changes."""

    n_max: int
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = [0.0] * self.n_max
        self.accepted = [0.0] * self.n_max

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(self.n_max):
            self.reached[i] *= DECAY
            self.accepted[i] *= DECAY
        for i in range(min(drafted, accepted + 1, self.n_max)):
            self.reached[i] += 1
            if i < accepted:
                self.accepted[i] += 1

    def rates(self, k: int) -> list[float]:
        """Estimated P(position i accepted | positions before it accepted) for i < k (0-based).

        Each position's prior is the estimate of the position before it (the first one's is PRIOR_RATE): drafts
        are correlated, so a position never reached yet is assumed as safe as the last one seen. With a fixed prior
        instead, a request that drafted short kept the prior's 0.5 at every longer position and never chose to draft
        longer, even at 99% acceptance (the n-gram drafter on code edits: mean 3.7 tokens a round against 4.8 fixed).
        """
        out, prior = [], PRIOR_RATE
        for i in range(min(k, self.n_max)):
            prior = (self.accepted[i] + prior * PRIOR_WEIGHT) / (self.reached[i] + PRIOR_WEIGHT)
            out.append(prior)
        return out + [prior] * (k - len(out))

    def rate(self, i: int) -> float:
        return self.rates(i + 1)[i]

    def all_pass(self, k: int) -> float:
        """Estimated probability that positions 0..k-1 are all accepted."""
        p = 1.0
        for r in self.rates(k):
            p *= r
        return p

    def expected_tokens(self, k: int) -> float:
        total, survive = 1.0, 1.0
        for r in self.rates(k):
            survive *= r
            total += survive
        return total


@dataclass
class DraftLengthPolicy:
    """Chooses k for each round of one request.

    With `stop_when_futile` (drafting not overlapped with verification), a request whose draft costs more per token
    than drafting can save (`CostModel.drafting_can_pay` is False) makes one short probe, which measures the draft
    again, and then stops for good (`futile`): the caller decodes the rest target-only. Probing every few rounds
    instead would cost a model drafter its catch-up over every token it skipped: on the 2-core CPU a same-size draft
    made "adaptive" 0.51-0.71x of target-only decoding that way, though most requests asked for 0.2-0.4 draft
    tokens a round.
    """

    costs: CostModel
    n_min: int
    n_max: int
    tracker: AcceptanceTracker | None = None
    stop_when_futile: bool = False
    futile: bool = False  # drafting cannot pay on this deployment: this request decodes target-only from here on
    _plain_rounds: int = 0
    _explore: int = 0
    _probed: bool = False
    last_choice: int = 0

    def __post_init__(self) -> None:
        if self.tracker is None:
            self.tracker = AcceptanceTracker(max(self.n_max, 1))

    def choose(self, cap: int) -> int:
        """Draft tokens for the next round, at most `cap` (tokens left to generate)."""
        hi = min(self.n_max, cap)
        if hi <= 0:
            return 0
        lo = max(self.n_min, 1)
        if self.stop_when_futile and self.costs.drafting_can_pay() is False:
            if self._probed:
                self.futile = True
                self.last_choice = 0
                return 0
            self._probed = True  # one short draft: the shared costs may be stale (the draft was busy, say)
            self.last_choice = min(lo, hi)
            return self.last_choice
        costs = self.costs.round_costs(hi)
        if costs is None:
            # Cost curve not known yet: alternate full and half drafts, so that the fit sees two step sizes.
            self._explore += 1
            k = hi if self._explore % 2 else max(min(lo, hi), hi // 2)
        else:
            best_k, best_rate = 0, 1.0 / costs[0]
            expected, survive = 1.0, 1.0
            for k, r in enumerate(self.tracker.rates(hi), start=1):
                survive *= r
                expected += survive  # = tracker.expected_tokens(k)
                if k >= lo and expected / costs[k] > best_rate:
                    best_k, best_rate = k, expected / costs[k]
            k = best_k
        if k == 0:
            self._plain_rounds += 1
            if self._plain_rounds >= PROBE_EVERY:  # probe: is drafting worth it again?
                self._plain_rounds = 0
                k = min(lo, hi)
        else:
            self._plain_rounds = 0
        self.last_choice = k
        return k


OVERLAP_MIN_HIT = 0.5  # draft ahead only when the guess is likely right: a miss costs about what a hit saves


def worth_drafting_ahead(tracker: AcceptanceTracker, k: int) -> bool:
    """Overlapped drafting pays when P(all k drafts accepted and the bonus guess right) >= OVERLAP_MIN_HIT.

    On a hit the next round's draft is ready; on a miss the draft first finishes the useless proposal (measured on
    the H200: with low acceptance, drafting ahead made every placement slower), so below about even odds it loses.
    """
    if k <= 0:
        return False
    # The guess is one more position; drafts of length k never reach it, so its rate is taken from position k-1.
    return tracker.all_pass(k) * tracker.rate(k - 1) >= OVERLAP_MIN_HIT


FOLLOW_UP_MIN_MISS = 0.35  # send a lookup round's follow-up call when its first draft is rejected at least this often


def worth_following_up(tracker: AcceptanceTracker) -> bool:
    """A lookup round's follow-up call (see LookupStrategy.follow_up) pays when the round often ends at its first
    draft: it then saves the target a round trip of idling (~1.3-1.7 ms on the 2-core CPU); otherwise the target
    skips it, which costs both sides a message (~0.2-0.3 ms of CPU there)."""
    return 1.0 - tracker.rate(0) >= FOLLOW_UP_MIN_MISS


@dataclass
class MatchLengthPolicy:
    """Adaptive k for prompt lookup, whose drafts come with a confidence: the length of the match behind them.

    The drafter proposes the continuation of the longest earlier occurrence of the text's suffix (m tokens long, at
    most m - 1 draft tokens under its confidence rule, the default). Draft position i then continues a match of m +
    i tokens, and how often such a position is accepted depends on that length far more than on i: a copied passage
    stays safe however long the draft, a two-token coincidence does not. So acceptance is tracked per match-length
    bucket (decayed, so it follows the text), with a prior that trusts long matches, and each round keeps the k of
    the proposal that maximises expected tokens per unit of round cost (k = 0: do not draft this round).

    Why not `DraftLengthPolicy`: by position alone, the rejected drafts of short matches pulled the estimate for
    every draft down: replayed on the benchmark's texts (`python -m bench.replay_ngram`), this policy did better
    (docs/decisions/0004).
    """

    costs: CostModel
    n_min: int = 0
    reached: list[float] = field(default_factory=lambda: [0.0] * len(MATCH_BUCKETS))
    accepted: list[float] = field(default_factory=lambda: [0.0] * len(MATCH_BUCKETS))
    _match: int = 0
    last_choice: int = 0

    def rate(self, n: int) -> float:
        """Estimated P(a draft position continuing an n-token match is accepted)."""
        return self._bucket_rate(match_bucket(n))

    def _bucket_rate(self, b: int, priors: tuple[float, ...] | None = None) -> float:
        prior = (priors if priors is not None else self._priors())[b]
        return (self.accepted[b] + prior * PRIOR_WEIGHT) / (self.reached[b] + PRIOR_WEIGHT)

    def bucket_rates(self) -> tuple[float, ...]:
        priors = self._priors()
        return tuple(self._bucket_rate(b, priors) for b in range(len(MATCH_BUCKETS)))

    def _priors(self) -> tuple[float, ...]:
        """Under load the deployment's recent acceptance by bucket (`MatchPrior`): a draft there slows every session
        in the step, and must pay on evidence. Alone, the fixed prior: a wrong guess costs one round of one request,
        and trying long matches is how a request finds text it copies."""
        if self.costs.loaded:
            return self.costs.match_prior.rates()
        return FIXED_PRIORS

    def choose(self, match_len: int, available: int) -> int:
        """How many of the `available` proposed tokens (behind a `match_len`-token match) to send this round."""
        self._match = match_len
        self.last_choice = self.best_k(match_len, available)
        return self.last_choice

    def best_k(self, match_len: int, available: int) -> int:
        """`choose` without recording the choice (the gateway asks it ahead, for pipelined rounds)."""
        if available < max(self.n_min, 1):
            return 0
        priced = self.pricing(available)
        if priced is None:
            return available  # cost curve not known yet: the drafter's own rule (and the fit sees varied step sizes)
        return best_draft_length(match_len, available, self.n_min, *priced)

    def shortest_kept_match(self, first: int, cap: int) -> int:
        """The shortest match length from `first` behind which a round would send a draft of at most
        min(cap, m - 1) tokens (0: none up to MATCH_CAP): `best_k(m, min(cap, m - 1)) >= n_min` for the first such m,
        with the rounds priced once."""
        lo = max(self.n_min, 1)
        if cap < lo:
            return 0
        if first <= MATCH_CAP and self.best_k(first, min(cap, first - 1)) >= lo:
            return first  # the common case alone, where the priors trust long matches: priced for one length
        priced = self.pricing(cap)
        if priced is None:  # every proposal is kept whole: the first match long enough to draft lo tokens
            return next((m for m in range(first, MATCH_CAP + 1) if min(cap, m - 1) >= lo), 0)
        return shortest_kept_match(first, cap, self.n_min, *priced)

    def pricing(self, max_draft: int) -> tuple[tuple[float, ...], list[float], float] | None:
        """What `best_draft_length` weighs with: the rate by match bucket, the cost of a round with 0..max_draft
        drafts and of a plain token. None until the cost curve is known (then every proposal is kept whole)."""
        costs = self.costs.round_costs(max_draft, priced_alone=True)
        if costs is None:
            return None
        return self.bucket_rates(), costs, self.costs.plain_from_round(costs[0])  # costs[0]: the plain round

    def observe_round(self, match_len: int, drafted: int, accepted: int) -> None:
        """A round the target drafted itself (`LookupRule`), behind a `match_len`-token match."""
        self._match = match_len
        self.observe(drafted, accepted)

    def observe(self, drafted: int, accepted: int) -> None:
        """One round's outcome (every round, drafted or not: the decay runs per round); a drafted one also informs
        the deployment's prior."""
        self.costs.match_prior.observe(self._match, drafted, accepted)
        for b in range(len(MATCH_BUCKETS)):
            self.reached[b] *= DECAY
            self.accepted[b] *= DECAY
        count_round(self.reached, self.accepted, self._match, drafted, accepted)
