"""What this deployment has measured, shared by its requests: the target's and the draft's step costs (`CostModel`)
and the recent acceptance of lookup drafts by match length (`MatchPrior`). The draft-length policies in
`services.gateway.adaptive` price their rounds here.

A round with k draft tokens costs

    cost(k) = (fixed + overhead) / B + per_token * (k + 1) + draft_per_token * k

where `fixed + per_token * n` is the target's forward time for n tokens (fitted online from the step shapes the
target reports with every Verify), B the number of sessions sharing a step (continuous batching splits the fixed
cost between them, so under load each extra draft token is relatively dearer and k shrinks), `overhead` the
measured RPC/orchestration time of a round, and `draft_per_token` the draft's measured cost per proposed token.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.governor import LoadGovernor
from tandem.ngram import MATCH_BUCKETS, match_bucket

PRIOR_WEIGHT = 2.0  # a prior acceptance rate is worth this many observations (here and in the policies)
EMA = 0.1
MIN_STEP_VARIANCE = 0.25  # of recent step sizes (tokens^2), below which they do not identify the cost line's slope
FUTILE_MARGIN = 1.25  # drafting counts as futile only when a draft token costs 1.25x the amortisable fixed step
# The draft's cost is measured only when it drafts, which is rare once requests stop; each measurement then weighs
# more, so that it is as fresh as the target's, measured every step (on a busy host both slow down together).
DRAFT_EMA = 0.5
SIZE_TABLE_MAX = 64  # step sizes whose cost is also tracked one by one (`CostModel.step_ns`)
SIZE_EMA = 0.2
SIZE_TRUSTED = 3  # observations of a size before its own measurement replaces the line's estimate
# Mean sessions per target step from which rounds are priced at the batch (`CostModel.loaded`): a session's share of a
# step is then its own tokens' cost plus its part of the fixed cost, and a plain token is priced the same way.
LOADED_SEQUENCES = 1.5
SHARED_STEP_FRESH_NS = 500_000_000  # a target step shared with sessions of other clients says it is busy this recently
# ... and, for the load governor's level, that many sessions run at the target: longer, so that a pause between one
# gateway's calls (a long prefill elsewhere, slow steps under load) does not drop the level to its own count.
TARGET_LOAD_FRESH_NS = 2_000_000_000
# Under load a round must beat plain decoding by this factor as priced. The price is a model (a fitted line, a lone
# round's overhead) and under load it errs towards drafting: chat's lookup drafts, accepted 87% of the time and priced
# ~10% ahead of plain tokens, ran 8 streams at 0.84-0.98x of not drafting (2026-12-06). Copied text (~97% accepted)
# clears it by far; alone the draft amortises the whole fixed step and needs no margin.
LOADED_DRAFT_MARGIN = 1.15
# The line's slope is at least this part of what a token costs a step alone (`CostModel.lone_token_ns`). Batched
# steps at 16 streams vary by a token or two against a host's noise of milliseconds, and their fit put the slope at 0
# (the 2-core CPU, 2026-12-06: a 93 ms intercept): every draft looked free, and json drafted 15 tokens a round on
# its priors. Sane batched fits there gave 2.3-2.75 ms a token against 4.5 ms alone (a batch computes a token more
# cheaply); floored at the whole 4.5 ms, code edits under load lost most of their gain (1.00-1.09x at 8-16 streams).
BATCHED_TOKEN_FLOOR = 0.5


@dataclass
class CostModel:
    """Target and draft step costs on this deployment, learned from the services' timings; shared by requests."""

    # Exponentially weighted least squares of forward_ns against step tokens: sums of w, x, y, xx, xy.
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)
    # The slope last identified, for `drafting_can_pay` while recent steps all have one size (a stretch of plain
    # decoding says nothing about it): without it, a request that stopped drafting would leave the next one
    # exploring again. Choosing k does not use it: a slope remembered from batched steps under load kept an n-gram
    # request alone from drafting at all (measured in the test suite). It waits for a fresh fit, or prices a
    # session stepping alone from the sizes measured alone (`round_ns(priced_alone=True)`).
    _slope: float | None = None
    overhead_ns: float | None = None
    # The same, from rounds whose step carried this session alone: the round's own gRPC and Python, without the wait
    # for other sessions' steps that a round's wall time holds under load (what a round costs beyond its step).
    overhead_alone_ns: float | None = None
    draft_token_ns: float = 0.0
    sequences: float = 1.0  # mean sessions per target step
    plain_step_ns: float | None = None  # a target-only step (one token per session), as the target measured it
    # A token of pipelined target-only decoding as the gateway sees it: the step and everything around it (sampling,
    # messages), measured between the answers of calls that were queued at the target.
    plain_token_ns: float | None = None
    # A one-sequence step's forward time by its size (tokens): (EMA ns, observations, capped). The line is fitted
    # through every size, but on the 2-core CPU the cost is concave (measured at a 700-token context: 1 token
    # 11.7 ms, 2 tokens 19.4, 3 tokens 26.1, then ~+4.5 ms a token), so the line put a plain step ~4 ms above its
    # cost, and short drafts looked cheap beside it.
    _by_size: dict[int, tuple[float, int]] = field(default_factory=dict)
    # The sizes of `_by_size` measured often enough to trust (`step_ns`), ascending: kept as they become trusted, not
    # sorted per call (pricing a lookup's 33 round sizes sorted them 33 times, ~47 us a Verify call of a stretch).
    _trusted_sizes: list[int] = field(default_factory=list)
    # Not a cost, but learned here for the same reason: what this deployment measured, shared by its requests.
    match_prior: MatchPrior = field(default_factory=lambda: MatchPrior())
    # How many generations the gateway runs now (the gateway's admission count); None where nobody counts (replays).
    running: Callable[[], int] | None = None
    clock: Callable[[], int] = time.monotonic_ns
    # Under load, whether the deployment's epochs with drafts delivered as much as those without (`governor.py`).
    governor: LoadGovernor = field(default_factory=LoadGovernor)
    _last_step: tuple[int, int] = (1, 0)  # the latest target step observed: (its sessions, when)

    def observe_verify(self, step_tokens: int, step_sequences: int, forward_ns: int) -> None:
        if step_tokens <= 0 or forward_ns <= 0:
            return
        self._last_step = (max(step_sequences, 1), self.clock())
        x, y = float(step_tokens), float(forward_ns)
        self._s = [v * (1 - EMA) + d for v, d in zip(self._s, (1.0, x, y, x * x, x * y), strict=True)]
        if step_sequences <= 1 and step_tokens <= SIZE_TABLE_MAX:
            ns, n = self._by_size.get(step_tokens, (y, 0))
            self._by_size[step_tokens] = (ns + SIZE_EMA * (y - ns) if n else y, min(n + 1, SIZE_TRUSTED))
            if n + 1 == SIZE_TRUSTED:
                bisect.insort(self._trusted_sizes, step_tokens)
        self.sequences += EMA * (max(step_sequences, 1) - self.sequences)
        var = self._step_variance()
        if var >= MIN_STEP_VARIANCE:  # at least two step sizes in the window: the slope is identified
            w, x, y, _, xy = self._s
            self._slope = (xy / w - (x / w) * (y / w)) / var

    def _step_variance(self) -> float:
        """Weighted variance of the recent steps' sizes (0: they all had one size, which says nothing of the slope)."""
        w, x, _, xx, _ = self._s
        return xx / w - (x / w) ** 2 if w > 0 else 0.0

    def observe_draft(self, tokens: int, forward_ns: int) -> None:
        if tokens > 0:
            per_token = forward_ns / tokens
            self.draft_token_ns += (per_token - self.draft_token_ns) * (DRAFT_EMA if self.draft_token_ns else 1.0)

    def observe_plain_step(self, ns: float) -> None:
        if ns > 0:
            last = self.plain_step_ns
            self.plain_step_ns = ns if last is None else last + EMA * (ns - last)

    def observe_plain_token(self, ns: float) -> None:
        if ns > 0:
            last = self.plain_token_ns
            self.plain_token_ns = ns if last is None else last + EMA * (ns - last)

    def observe_overhead(self, ns: float, step_sequences: int = 1, alone: bool = True) -> None:
        """A round's wall time outside its forward passes and its wait at the target (`Timing.queue_ns`, 0 from a
        service that does not report it). It counts as a lone round's only if its step carried this session alone and
        the gateway ran no other generation beside it (`alone`): other generations share the gateway's event loop
        too. After 16 requests at once on the 2-core CPU the lone overhead read 1.47 s (3.6 ms on a fresh stack) before
        either rule, and lone requests after the burst drafted 0-14 tokens where they had drafted 25-96 (2026-12-07)."""
        self.overhead_ns = ns if self.overhead_ns is None else self.overhead_ns + EMA * (ns - self.overhead_ns)
        if step_sequences <= 1 and alone:
            last = self.overhead_alone_ns
            self.overhead_alone_ns = ns if last is None else last + EMA * (ns - last)

    @property
    def loaded(self) -> bool:
        """Whether target steps are shared by several sessions (continuous batching under concurrent requests)."""
        return self.batch() >= LOADED_SEQUENCES

    def batch(self) -> float:
        """Sessions a step: `sequences`, or 1 while the gateway runs one generation and the target's latest step was
        not shared (within `SHARED_STEP_FRESH_NS`). `sequences` moves only with steps, so after a burst it said ~8 for
        ~20 more, and a lone request drafted nothing on the burst's record; but the target's steps also carry the
        sessions of other gateways (replicas sharing one target), which this gateway's count does not see."""
        if self.running is None or self.running() >= 2:
            return max(self.sequences, 1.0)
        sessions, at_ns = self._last_step
        return float(sessions) if sessions >= 2 and self.clock() - at_ns < SHARED_STEP_FRESH_NS else 1.0

    def own_load(self) -> int:
        """Generations this gateway runs now."""
        return self.running() if self.running is not None else 0

    def target_load(self) -> int:
        """Generations running at the target, as far as this gateway can tell, for the load governor: its own, or
        the sessions of the target's latest step where that is more (within `TARGET_LOAD_FRESH_NS`). A step carries
        the sessions of every gateway that shares the target (replicas), which this gateway's own count misses;
        with one gateway a step holds no more sessions than it runs, but for a moment after one of them ends."""
        own = self.own_load()
        sessions, at_ns = self._last_step
        return max(own, sessions) if self.clock() - at_ns < TARGET_LOAD_FRESH_NS else own

    def line(self, remembered: bool = False) -> tuple[float, float] | None:
        """(fixed ns, ns per token) of a target forward pass, or None until recent steps had two different sizes.

        With `remembered`, the last identified slope stands in while they have not; the fixed cost always follows
        the recent steps (through their means).
        """
        w, x, y, _, _ = self._s
        if w <= 0 or self._slope is None or (not remembered and self._step_variance() < MIN_STEP_VARIANCE):
            return None
        mean_y, mean_x = y / w, x / w
        # Keep it physical: fixed cost >= 0, and a token costs a batch at least a part of what it costs a step alone.
        slope = min(max(self._slope, BATCHED_TOKEN_FLOOR * self.lone_token_ns()), mean_y / mean_x)
        return mean_y - slope * mean_x, slope

    def lone_token_ns(self) -> float:
        """What one more token costs a step of one sequence, between the two largest sizes measured alone (0: fewer
        than two); `BATCHED_TOKEN_FLOOR` of it floors the line's slope."""
        sizes = self._trusted_sizes
        if len(sizes) < 2:
            return 0.0
        a, b = sizes[-2], sizes[-1]
        return max((self._by_size[b][0] - self._by_size[a][0]) / (b - a), 0.0)

    def drafting_can_pay(self) -> bool | None:
        """Whether some draft length beats plain decoding even if every draft token is accepted (None: costs not
        known yet, or a model-free drafter, whose tokens cost nothing).

        With all k drafts accepted a round yields k + 1 tokens, and (k + 1) / round_ns(k) > 1 / round_ns(0) reduces
        to fixed / sessions > draft_token_ns for every k: a draft token must cost less than the part of a target
        step that drafting amortises. The round's measured overhead is left out: much of it grows with k (the
        target warps every row of a sampled round, the draft's Python runs per token), and counted as fixed it made
        a same-size draft look worth it on sampled text. A same-size draft on the target's CPU fails the test (a
        draft token ~9 ms against a ~5.5 ms fixed step on the 2-core machine); a 1B draft for a 70B target passes it
        by far (~1.5 ms against ~20 ms on the H200).
        """
        line = self.line(remembered=True)
        if line is None or self.draft_token_ns <= 0:
            return None
        # Only a clear verdict stops a request: a fitted intercept is noisy, and near the line pausing costs little.
        return line[0] / self.batch() * FUTILE_MARGIN > self.draft_token_ns

    def plain_ns(self, priced_alone: bool = False) -> float | None:
        """What a token costs when the lookup does not draft: it then decodes in a pipelined stretch (several steps
        a call, the next call queued), so a token costs a step and its share of the messages, not a round's
        overhead. `round_ns(0)` charged it a whole round's overhead (~2 ms of gRPC and Python against ~0.7 ms), which
        made short drafts of sampled text look worth it: 1 draft token paid from 29% acceptance instead of ~40%.
        `priced_alone` as for `round_ns`.
        """
        return self.plain_from_round(self.round_ns(0, priced_alone))

    def plain_from_round(self, plain_round: float | None) -> float | None:
        """`plain_ns` for a caller that has priced the plain round (`round_ns(0)`) already.

        Under load the plain round is the price (`loaded_round_ns(0)`): the time between a stream's answers is then a
        whole batched step, every session's tokens in it, against a round priced at this session's share of the step.
        Compared that way, drafting looked ~B times cheaper than it is at B sessions a step, and eight concurrent
        requests drafted at 0.75-0.88x of the aggregate throughput of not drafting (issue 42)."""
        if plain_round is None or self.plain_token_ns is None or self.loaded:
            return plain_round
        return self.plain_token_ns

    def step_ns(self, tokens: int) -> float | None:
        """A one-sequence step of `tokens` tokens as measured at that size (None: not measured often enough)."""
        ns, n = self._by_size.get(tokens, (0.0, 0))
        return ns if n >= SIZE_TRUSTED else None

    def lone_step_ns(self, tokens: int) -> float | None:
        """A one-sequence step of `tokens` tokens from the sizes measured alone: as measured, else interpolated
        between the nearest measured sizes, or extended from the two largest (None: below the smallest, or fewer
        than two sizes measured).

        Unlike the line, these do not fade through a stretch of plain decoding: a size keeps its last measurement
        until it is measured again. The line needs two step sizes among the recent steps, and after ~30 one-token
        steps it had none: the lookup's rounds went unpriced and kept whole proposals. On a 2-core EPYC, where 2
        tokens cost 2.0x a one-token step, sampled chat then drafted in 12-16 rounds a request with 25% accepted;
        replayed at its costs (`python -m bench.replay_ngram`), the adaptive lookup gained (docs/decisions/0004)."""
        measured = self.step_ns(tokens)
        if measured is not None:
            return measured
        sizes = self._trusted_sizes
        i = bisect.bisect_left(sizes, tokens)  # sizes[:i] lie below (`tokens` itself is not trusted: see above)
        if i == 0 or (i == len(sizes) and i < 2):
            return None
        a, b = (sizes[i - 1], sizes[i]) if i < len(sizes) else (sizes[-2], sizes[-1])
        ns_a, ns_b = self.step_ns(a), self.step_ns(b)
        assert ns_a is not None and ns_b is not None
        slope = max((ns_b - ns_a) / (b - a), 0.0)
        return ns_a + slope * (tokens - a)

    def round_ns(self, k: int, priced_alone: bool = False) -> float | None:
        """A round with k draft tokens: the step of k + 1 tokens as measured at that size when this session steps
        alone (else from the line, its fixed part shared by the batch), the round's overhead and the draft's cost.
        None while the line is unknown, unless `priced_alone`: then a session stepping alone is priced from the
        sizes measured alone (`lone_step_ns`) whether the line is known or not.

        `DraftLengthPolicy` prices without it: it chooses k before it sees a draft, from acceptance by position with
        a neutral prior, and the rounds it drafts while the line is unknown are how a request finds out that
        drafting pays (an n-gram draft service on the test suite's single-threaded target stopped drafting copied
        text when priced alone). `MatchLengthPolicy` prices with it: it judges each proposal by the match behind it,
        whose prior already trusts long matches."""
        if self.loaded:
            return self.loaded_round_ns(k)
        return self._alone_round_ns(k, priced_alone, self.line())

    @property
    def lone_overhead_ns(self) -> float | None:
        """A round's overhead as a lone round is priced: measured on lone rounds only (None: none yet, priced as 0).
        Falling back to the overhead of any round priced a lone request by rounds that waited behind other
        generations' work, and with every draft priced out it never measured a lone round again (`observe_overhead`)."""
        return self.overhead_alone_ns

    def _alone_round_ns(self, k: int, priced_alone: bool, line: tuple[float, float] | None) -> float | None:
        """`round_ns` alone, the line computed by the caller; the overhead measured alone (after a burst
        `overhead_ns` held the wait for 8 sessions' steps, and a lone chat request then drafted nothing)."""
        overhead = self.lone_overhead_ns or 0.0
        if priced_alone or line is not None:
            measured = self.lone_step_ns(k + 1) if priced_alone else self.step_ns(k + 1)
            if measured is not None:
                return measured + overhead + self.draft_token_ns * k
        if line is None:
            return None
        fixed, per_token = line
        shared = (fixed + overhead) / self.batch()
        return shared + per_token * (k + 1) + self.draft_token_ns * k

    def loaded_round_ns(self, k: int) -> float | None:
        """A round with k drafts when steps are shared by `sequences` sessions, as this session's share of the
        deployment's compute: its part of the step's fixed cost, its own k + 1 tokens at the line's cost per token (each
        one slows every session in the step), and for k > 0 the round's own overhead (measured on rounds stepping alone,
        the gateway's and the services' work per round, which under load queues with the other sessions' rounds) and
        the draft's cost. k = 0 is a plain token as pipelined decoding costs it: the share of its step.

        Priced this way a draft pays under load only where most of it is accepted: on this 2-core CPU at 8 sessions a
        step (fixed ~12 ms, ~4.5 ms a token) a token decoded plainly costs ~6 ms, and a 4-token draft must yield ~4
        tokens. The fixed cost then amortises over the batch rather than over the draft, as vLLM's rule of drafting
        nothing past a batch size assumes, but measured. The slope is the one last identified if recent steps all
        had one size (a full batch of plain decoding keeps its size)."""
        costs = self._loaded_costs(k)
        return None if costs is None else costs[k]

    def _loaded_costs(self, max_k: int, governed: bool = True) -> list[float] | None:
        """`loaded_round_ns(k)` for k = 0..max_k, the line computed once; `governed`: where the load governor stops
        drafts at this load, every draft is priced out (a reader that only looks passes False: asking rolls epochs)."""
        line = self.line(remembered=True)
        if line is None:
            return None
        fixed, per_token = line
        part = fixed / self.sequences
        # A lone round's overhead where one was measured, else that of any round: both leave out the wait at the
        # target (Timing.queue_ns). Before the target reported it, a round's wall time under load held the other
        # sessions' steps and prefills (11.6 ms after 16 edit requests at once on the 2-core CPU, 2.9 ms without the
        # wait, 1.9-2.5 ms alone), and this fallback divided it by the batch as a guess.
        overhead = self.overhead_alone_ns if self.overhead_alone_ns is not None else (self.overhead_ns or 0.0)
        ask_governor = governed and self.running is not None
        if ask_governor and not self.governor.allows_drafting(self.target_load(), self.own_load()):
            return [part + per_token, *[math.inf] * max_k]  # measured: drafts at this load delivered less
        drafted = [
            (part + per_token * (k + 1) + overhead + self.draft_token_ns * k) * LOADED_DRAFT_MARGIN
            for k in range(1, max_k + 1)
        ]
        return [part + per_token, *drafted]

    def round_costs(self, max_k: int, priced_alone: bool = False, governed: bool = True) -> list[float] | None:
        """`round_ns(k, priced_alone)` for k = 0..max_k, or None while any of them is unknown."""
        if self.loaded:
            return self._loaded_costs(max_k, governed)
        line = self.line()  # once: it sums the fit (~1.5 us), and a lookup's floor prices up to 33 rounds per call
        costs = [self._alone_round_ns(k, priced_alone, line) for k in range(max_k + 1)]
        return None if any(c is None for c in costs) else costs  # type: ignore[return-value]


PRIOR_MISS = 0.125  # prior: a position continuing an n-token match is rejected with probability PRIOR_MISS / n


FIXED_PRIORS = tuple(1.0 - PRIOR_MISS / m for m in MATCH_BUCKETS)
# The deployment's record of lookup rounds fades by half every this many seconds: recent text decides, and where
# drafting stopped everywhere (nothing new to learn from) the fixed prior is back within minutes, so requests try again.
MATCH_PRIOR_HALF_LIFE_S = 60.0


@dataclass
class MatchPrior:
    """The deployment's acceptance of lookup drafts by match bucket, over every request's rounds: the prior of each
    request's `MatchLengthPolicy`, which its own rounds then outweigh.

    A fixed prior trusts long matches (a 16-token match: 99.2% a position), and a request of 128-256 tokens makes
    only a few lookup rounds: at 16 streams of json, ~2 rounds a request were drafted on that prior alone (~55%
    accepted), against a price that under load pays only near the prior's rate (2026-12-06). Learned across requests,
    the prior is the rate this deployment's text has been getting, and the fixed one where it has none recently.
    """

    reached: list[float] = field(default_factory=lambda: [0.0] * len(MATCH_BUCKETS))
    accepted: list[float] = field(default_factory=lambda: [0.0] * len(MATCH_BUCKETS))
    clock: Callable[[], float] = time.monotonic
    _faded_at: float | None = None

    def _fade(self) -> None:
        """Fades the record to now."""
        now = self.clock()
        last, self._faded_at = self._faded_at, now
        if last is None or now <= last:
            return
        factor = 0.5 ** ((now - last) / MATCH_PRIOR_HALF_LIFE_S)
        self.reached = [r * factor for r in self.reached]
        self.accepted = [a * factor for a in self.accepted]

    def rates(self) -> tuple[float, ...]:
        """P(a draft position is accepted) by match bucket, as this deployment's recent rounds and the fixed prior
        say together."""
        self._fade()
        return tuple(
            (a + fixed * PRIOR_WEIGHT) / (r + PRIOR_WEIGHT)
            for a, r, fixed in zip(self.accepted, self.reached, FIXED_PRIORS, strict=True)
        )

    def observe(self, match_len: int, drafted: int, accepted: int) -> None:
        """A round that drafted `drafted` tokens behind a `match_len`-token match and had `accepted` of them taken."""
        if drafted <= 0:
            return
        self._fade()
        count_round(self.reached, self.accepted, match_len, drafted, accepted)


def count_round(reached: list[float], accepted: list[float], match_len: int, drafted: int, taken: int) -> None:
    """Add a lookup round behind a `match_len`-token match to counts by match bucket: each draft position up to the
    first rejected one was reached (position i continues a match of match_len + i tokens), those before it accepted."""
    for i in range(min(drafted, taken + 1)):
        b = match_bucket(match_len + i)
        reached[b] += 1
        if i < taken:
            accepted[b] += 1
