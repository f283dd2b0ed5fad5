"""Under load, whether drafting pays this deployment: measured, not priced.

`costs.CostModel` prices a round from the target's forward passes. What the price leaves out can decide the outcome:
the Python around each step (filling the batch, reading and accepting every drafted row) and the handling of the
calls that speculative rounds make and pipelined plain decoding does not. On one H100 (SmolLM2-135M target, n-gram
drafts, the `make run` stack, 2026-12-06) code edits, chat and JSON ran at 0.76-0.98x of not drafting at 2-16
streams while the price said their drafts paid; alone they ran at 1.61x, 1.00x and 1.13x.

So under load the deployment also measures what it delivers: the tokens every generation emits per second, in short
epochs, labelled by whether drafts were sent in them, by load level (generations running at the target: this
gateway's, or the sessions of the target's latest step where more, `CostModel.target_load`). Epochs are compared in
adjacent pairs (one of each kind, back to back at one level): what the deployment delivers moves with the mix of
requests far more than drafting moves it (on one H100 a level's plain epochs ranged 1,464-2,528 tok/s in one run), and
a pair sees the same mix. Where epochs with drafts deliver less than the epochs beside them without, no request at
that load drafts; one epoch in `EXPLORE_EVERY` runs the other way (and makes two pairs), so that a changed mix of text
(or of load) can change the answer. A lone generation at the target is never governed: its own steps
price it directly. This is a check on the price, per deployment, as the issue's "never slower than not drafting"
asks; the price still chooses each round's draft length while drafting is allowed.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LOAD_LEVELS = (2, 3, 5, 9, 17)  # generations running, by level: 2, 3-4, 5-8, 9-16, 17 and more
EPOCH_MIN_S = 0.25  # an epoch lasts at least this long ...
EPOCH_STEPS = 16  # ... and until it emitted this many tokens per running generation (about this many target steps)
EPOCH_MAX_S = 10.0  # an epoch that took longer (a stall, a gap with nothing running) is discarded
MIN_PAIRS = 3  # adjacent pairs of epochs (one of each kind) at a level before it decides: two pairs can share an epoch
PAIR_GAP_S = 1.0  # two epochs at one level pair up only if the second began within this long of the first's end
PAIR_WINDOW = 9  # a level decides on the median of its last this many pairs
EXPLORE_EVERY = 8  # once decided, every 8th epoch at a level runs the other way
RATE_EMA = 0.3  # weight of the newest epoch in a level's rate (reported, not decided on)
# A level's verdict changes only when the other kind leads by this much: on the 2-core CPU the two rates at 16 streams
# of chat were within 1-2% and the verdict flipped every few seconds (2026-12-06).
HYSTERESIS = 0.03
# A pair of epochs whose kinds differ by more than HYSTERESIS the other way doubts a level's verdict: the level's next
# epoch runs the other kind than the one before it (as while learning), and this many such pairs in a row overturn the
# verdict (the level's older pairs are dropped). A change of text (edits, then JSON) must not wait for the window's
# median to turn: with one exploring epoch in eight it took 4.7 s of a fake deployment that went from drafting 1.3x to
# 0.85x of not drafting, most of a benchmark's 3 s sample on a GPU, where JSON at 4 streams inherited edits' verdict.
DOUBTING_PAIRS = 3


def load_level(running: int) -> int | None:
    """The index of the load level of `running` generations (None: fewer than two, not governed)."""
    return None if running < LOAD_LEVELS[0] else bisect.bisect_right(LOAD_LEVELS, running) - 1


def level_name(level: int) -> str:
    """How a load level reads in logs and metrics: "2", "3-4", ..., "17+"."""
    low = LOAD_LEVELS[level]
    if level + 1 == len(LOAD_LEVELS):
        return f"{low}+"
    high = LOAD_LEVELS[level + 1] - 1
    return str(low) if high == low else f"{low}-{high}"


@dataclass
class LevelRecord:
    """Tokens a second delivered by the epochs of one kind at one level (an EMA), and how many were recorded."""

    rate: float = 0.0
    epochs: int = 0

    def add(self, rate: float) -> None:
        self.rate = rate if self.epochs == 0 else self.rate + RATE_EMA * (rate - self.rate)
        self.epochs += 1


@dataclass
class PairedRatio:
    """log(tokens a second with drafts / without) from adjacent pairs of epochs at one level: the median of the last
    `PAIR_WINDOW` pairs (a pair that straddles a change of mix is far off, and a mean would follow it)."""

    recent: deque[float] = field(default_factory=lambda: deque(maxlen=PAIR_WINDOW))
    pairs: int = 0

    def add(self, log_ratio: float) -> None:
        self.recent.append(log_ratio)
        self.pairs += 1

    @property
    def log_ratio(self) -> float:
        ordered = sorted(self.recent)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@dataclass
class LoadGovernor:
    """Epochs of drafting and of not drafting under load, and which delivered more at each level."""

    clock: Callable[[], float] = time.monotonic
    # (level, drafted) -> the epochs' rate: drafted is True for epochs in which drafts were sent
    records: dict[tuple[int, bool], LevelRecord] = field(default_factory=dict)
    ratios: dict[int, PairedRatio] = field(default_factory=dict)  # level -> what its pairs of epochs said
    _last: dict[int, tuple[bool, float, float]] = field(default_factory=dict)  # level -> last epoch: kind, rate, end
    _begun: dict[int, int] = field(default_factory=dict)  # epochs begun per level
    _said: dict[int, bool] = field(default_factory=dict)  # each level's verdict (logged when it changes)
    _doubts: dict[int, int] = field(default_factory=dict)  # level -> pairs in a row against its verdict
    # Called with each recorded epoch: (level name, whether drafts were sent, tokens a second); the gateway's metrics.
    on_epoch: Callable[[str, bool, float], None] | None = None
    _allow: bool = True  # whether the current epoch allows drafts
    _start: float | None = None
    _tokens: int = 0
    _drafted: int = 0
    _load_sum: int = 0
    _own_sum: int = 0  # this gateway's generations, summed like _load_sum (the epoch's token goal)
    _load_n: int = 0
    _level: int | None = None  # the level whose schedule chose this epoch's kind (the load when it began)

    def allows_drafting(self, running: int, own: int | None = None) -> bool:
        """Whether a request may draft now, with `running` generations at the target, `own` of them this gateway's
        (default: all)."""
        self._roll(running, own)
        return self._allow or load_level(running) is None

    @property
    def allowing(self) -> bool:
        """Whether the current epoch allows drafts (read without rolling epochs)."""
        return self._allow

    def emitted(self, tokens: int, drafted: int, running: int, own: int | None = None) -> None:
        """A generation emitted `tokens` tokens, and had `drafted` draft tokens verified since it last emitted, with
        `running` generations at the target, `own` of them this gateway's (default: all)."""
        self._roll(running, own)
        self._tokens += tokens
        self._drafted += drafted

    def decided(self, level: int) -> bool | None:
        """What the pairs say at `level`: True (drafting delivers at least as much), False, or None (too few)."""
        ratio = self.ratios.get(level)
        if ratio is None or ratio.pairs < MIN_PAIRS:
            return None
        return ratio.log_ratio >= 0.0

    def _record(self, level: int, drafted: bool, rate: float, start: float, now: float) -> None:
        """An epoch's rate, and a pair with the level's previous epoch if that was of the other kind, just before."""
        self.records.setdefault((level, drafted), LevelRecord()).add(rate)
        last = self._last.get(level)
        if last is not None and last[0] != drafted and start - last[2] <= PAIR_GAP_S and rate > 0 and last[1] > 0:
            with_drafts, without = (rate, last[1]) if drafted else (last[1], rate)
            self._add_pair(level, math.log(with_drafts / without))
        self._last[level] = (drafted, rate, now)
        if self.on_epoch is not None:
            self.on_epoch(level_name(level), drafted, rate)

    def _add_pair(self, level: int, log_ratio: float) -> None:
        """A pair's verdict on drafting at `level`, and whether it doubts the level's verdict (`DOUBTING_PAIRS`)."""
        ratio = self.ratios.setdefault(level, PairedRatio())
        ratio.add(log_ratio)
        said = self._said.get(level)
        if said is None:
            return
        margin = math.log1p(HYSTERESIS)
        if not (log_ratio < -margin if said else log_ratio > margin):
            self._doubts[level] = 0
            return
        doubts = self._doubts[level] = self._doubts.get(level, 0) + 1
        if doubts >= DOUBTING_PAIRS:  # the verdict's time has passed: only the pairs that doubt it remain
            recent = list(ratio.recent)[-doubts:]
            ratio.recent.clear()
            ratio.recent.extend(recent)
            self._doubts[level] = 0
            log.info(
                "at %s generations running, %d pairs of epochs in a row say drafting %s: the older pairs are dropped",
                level_name(level), doubts, "stops" if said else "goes on",
            )  # fmt: skip

    def prior(self, level: int) -> bool | None:
        """What an undecided level starts from: a step costs more the more rows it carries, so drafting pays less the
        higher the load. Where a lower level stopped drafting, this one starts without drafts; where a higher level
        goes on, this one starts with them. Its own epochs decide once they make enough pairs (each exploring epoch
        makes two); None: no neighbour says, the level learns from scratch.
        """
        if any(self._said.get(lower) is False for lower in range(level)):
            return False
        if any(self._said.get(higher) is True for higher in range(level + 1, len(LOAD_LEVELS))):
            return True
        return None

    def _roll(self, running: int, own: int | None) -> None:
        """Ends the epoch once it is long enough, recording it at the level of its mean load, and begins the next.
        Long enough: EPOCH_STEPS tokens per generation of this gateway's (the tokens it counts are its own; with
        replicas sharing the target, `running` also holds theirs; None: all of them)."""
        own = running if own is None else own
        now = self.clock()
        if self._start is None:
            self._begin(running, now, own)
            return
        self._load_sum += running
        self._own_sum += own
        self._load_n += 1
        elapsed = now - self._start
        mean_load = self._load_sum / self._load_n
        if elapsed > EPOCH_MAX_S:
            self._begin(running, now, own)  # discarded: it measured a stall or an idle gap, not the decoding
            return
        if elapsed < EPOCH_MIN_S or self._tokens < EPOCH_STEPS * max(self._own_sum / self._load_n, 1.0):
            return
        level = load_level(round(mean_load))
        # An epoch whose mean load left the level it began at measured a change of load, not a kind: discarded (and
        # its level's alternation stays where it was).
        if level is not None and level == self._level:
            drafted = self._allow and self._drafted > 0  # allowed, but nothing drafted: it decoded plainly
            self._record(level, drafted, self._tokens / elapsed, self._start, now)
        self._begin(running, now, own)

    def _begin(self, running: int, now: float, own: int) -> None:
        self._start, self._tokens, self._drafted, self._load_sum, self._load_n = now, 0, 0, running, 1
        self._own_sum = own
        level = self._level = load_level(running)
        if level is None:
            self._allow = True
            return
        n = self._begun[level] = self._begun.get(level, 0) + 1
        best = self.decided(level)
        if best is None:
            prior = self.prior(level)
            if prior is not None:  # follow the neighbour's verdict, exploring as a decided level does
                self._allow = prior if n % EXPLORE_EVERY else not prior
                return
            # The two kinds by turns, drafts first: each epoch pairs with the one before it. Where the price sends
            # no drafts at this load, the allowed epochs are recorded as plain and drafting stays allowed: no pair,
            # and the price decides.
            self._allow = self._other_kind(level)
            return
        lead = math.exp(self.ratios[level].log_ratio) - 1.0
        said = self._said.get(level)
        if said is not None and best != said and abs(lead) < HYSTERESIS:
            best = said
        if said != best:
            self._said[level] = best
            self._doubts[level] = 0  # a doubt was about the verdict before
            log.info(
                "at %s generations running, drafting %s: epochs with drafts delivered %.2fx of the epochs beside them"
                " without (%d pairs)",
                level_name(level), "goes on" if best else "stops", 1.0 + lead, self.ratios[level].pairs,
            )  # fmt: skip
        if self._doubts.get(level):  # a pair doubted the verdict: by turns again, as while learning
            self._allow = self._other_kind(level)
            return
        self._allow = best if n % EXPLORE_EVERY else not best

    def _other_kind(self, level: int) -> bool:
        """Whether the next epoch at `level` drafts, taking turns: the other kind than its last epoch's (drafts first),
        so that the two make a pair."""
        last = self._last.get(level)
        return last is None or not last[0]
