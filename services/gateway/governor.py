"""Under load, whether drafting pays this deployment: measured, not priced.

`costs.CostModel` prices a round from the target's forward passes. What the price leaves out can decide the outcome:
the Python around each step (filling the batch, reading and accepting every drafted row) and the handling of the
calls that speculative rounds make and pipelined plain decoding does not. On one H100 (SmolLM2-135M target, n-gram
drafts, the `make run` stack, 2026-12-06) code edits, chat and JSON ran at 0.76-0.98x of not drafting at 2-16
streams while the price said their drafts paid; alone they ran at 1.61x, 1.00x and 1.13x.

So under load the deployment also measures what it delivers: the tokens every generation emits per second, in short
epochs, labelled by whether drafts were sent in them, by load level (generations running). Where epochs with drafts
deliver less than epochs without, no request at that load drafts; one epoch in `EXPLORE_EVERY` runs the other way, so
that a changed mix of text (or of load) can change the answer. A lone generation is never governed: its own steps
price it directly. This is a check on the price, per deployment, as the issue's "never slower than not drafting"
asks; the price still chooses each round's draft length while drafting is allowed.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LOAD_LEVELS = (2, 3, 5, 9, 17)  # generations running, by level: 2, 3-4, 5-8, 9-16, 17 and more
EPOCH_MIN_S = 0.25  # an epoch lasts at least this long ...
EPOCH_STEPS = 16  # ... and until it emitted this many tokens per running generation (about this many target steps)
EPOCH_MAX_S = 10.0  # an epoch that took longer (a stall, a gap with nothing running) is discarded
MIN_EPOCHS = 2  # epochs of each kind at a level before the level decides
EXPLORE_EVERY = 8  # once decided, every 8th epoch at a level runs the other way
RATE_EMA = 0.3  # weight of the newest epoch in a level's rate
# A level's verdict changes only when the other kind leads by this much: on the 2-core CPU the two rates at 16 streams
# of chat were within 1-2% and the verdict flipped every few seconds (2026-12-06).
HYSTERESIS = 0.03


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
class LoadGovernor:
    """Epochs of drafting and of not drafting under load, and which delivered more at each level."""

    clock: Callable[[], float] = time.monotonic
    # (level, drafted) -> the epochs' rate: drafted is True for epochs in which drafts were sent
    records: dict[tuple[int, bool], LevelRecord] = field(default_factory=dict)
    _begun: dict[int, int] = field(default_factory=dict)  # epochs begun per level
    _said: dict[int, bool] = field(default_factory=dict)  # each level's verdict (logged when it changes)
    # Called with each recorded epoch: (level name, whether drafts were sent, tokens a second); the gateway's metrics.
    on_epoch: Callable[[str, bool, float], None] | None = None
    _allow: bool = True  # whether the current epoch allows drafts
    _start: float | None = None
    _tokens: int = 0
    _drafted: int = 0
    _load_sum: int = 0
    _load_n: int = 0

    def allows_drafting(self, running: int) -> bool:
        """Whether a request may draft now, with `running` generations in the gateway."""
        self._roll(running)
        return self._allow or load_level(running) is None

    def emitted(self, tokens: int, drafted: int, running: int) -> None:
        """A generation emitted `tokens` tokens, and had `drafted` draft tokens verified since it last emitted."""
        self._roll(running)
        self._tokens += tokens
        self._drafted += drafted

    def decided(self, level: int) -> bool | None:
        """What the records say at `level`: True (drafting delivers at least as much), False, or None (too few)."""
        drafted, plain = self.records.get((level, True)), self.records.get((level, False))
        if drafted is None or plain is None or min(drafted.epochs, plain.epochs) < MIN_EPOCHS:
            return None
        return drafted.rate >= plain.rate

    def prior(self, level: int) -> bool | None:
        """What an undecided level starts from: a step costs more the more rows it carries, so drafting pays less the
        higher the load. Where a lower level stopped drafting, this one starts without drafts; where a higher level
        goes on, this one starts with them. Its own epochs decide once it has enough of each kind (exploring
        epochs supply the other kind); None: no neighbour says, the level learns from scratch.
        """
        if any(self._said.get(lower) is False for lower in range(level)):
            return False
        if any(self._said.get(higher) is True for higher in range(level + 1, len(LOAD_LEVELS))):
            return True
        return None

    def _roll(self, running: int) -> None:
        """Ends the epoch once it is long enough, recording it at the level of its mean load, and begins the next."""
        now = self.clock()
        if self._start is None:
            self._begin(running, now)
            return
        self._load_sum += running
        self._load_n += 1
        elapsed = now - self._start
        mean_load = self._load_sum / self._load_n
        if elapsed > EPOCH_MAX_S:
            self._begin(running, now)  # discarded: it measured a stall or an idle gap, not the decoding
            return
        if elapsed < EPOCH_MIN_S or self._tokens < EPOCH_STEPS * mean_load:
            return
        level = load_level(round(mean_load))
        if level is not None:
            drafted = self._allow and self._drafted > 0  # allowed, but nothing drafted: it decoded plainly
            self.records.setdefault((level, drafted), LevelRecord()).add(self._tokens / elapsed)
            if self.on_epoch is not None:
                self.on_epoch(level_name(level), drafted, self._tokens / elapsed)
        self._begin(running, now)

    def _begin(self, running: int, now: float) -> None:
        self._start, self._tokens, self._drafted, self._load_sum, self._load_n = now, 0, 0, running, 1
        level = load_level(running)
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
            drafted = self.records.get((level, True))
            # Epochs with drafts first (if the price sends none at this load, they are recorded as plain), then
            # epochs without, to compare with.
            self._allow = drafted is None or drafted.epochs < MIN_EPOCHS
            return
        drafted = self.records[(level, True)]
        with_drafts, without = drafted.rate, self.records[(level, False)].rate
        said = self._said.get(level)
        lead = with_drafts / without - 1.0 if without > 0 else 1.0
        if said is not None and best != said and abs(lead) < HYSTERESIS:
            best = said
        if said != best:
            self._said[level] = best
            log.info(
                "at %s generations running, drafting %s: %.0f tok/s in epochs with drafts, %.0f without",
                level_name(level), "goes on" if best else "stops", with_drafts, without,
            )  # fmt: skip
        self._allow = best if n % EXPLORE_EVERY else not best
