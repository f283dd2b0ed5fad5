"""Per-session state shared by the draft and the target services.

A session is one generation: its token sequence, the KV sequence (seq_id) it owns in the engine, its sampling
settings and random generator, and the last answered call (so that an exact retry is answered from memory instead
of being applied twice). The store hands out a bounded number of KV sequences and closes idle sessions.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.errors import InvalidArgument, PositionMismatch, ResourceExhausted, SessionNotFound
from tandem.ngram import LookupRule, NgramIndex, RepeatWatches
from tandem.sampling import SamplingParams


@dataclass
class Session:
    session_id: str
    seq_id: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    rng: np.random.Generator
    top_logprobs: int = -1
    #: The committed sequence: prompt followed by every token the target emitted.
    tokens: list[int] = field(default_factory=list)
    #: Tokens whose KV cells are in the engine, positions 0..len-1 (model-backed sessions only).
    kv_tokens: list[int] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    last_call: tuple[Hashable, Any] | None = None
    #: Drafter-specific state (e.g. the n-gram index).
    extra: Any = None
    #: Set when the session is closed; long work on the engine thread checks it to stop early.
    closed: bool = False
    #: Logits of the last prompt token (target). Kept with the slot, so that a repeat of the same prompt starts from
    #: the very row a cold prefill computed (recomputing it alone can round differently and change greedy text).
    prompt_row: Any = None
    #: Where the caller's prompt lookup could draft (Continuation.stop_at_repeat); built on first use.
    repeats: RepeatWatches | None = None
    #: The caller's prompt lookup run here (Continuation.lookup): an index of the sequence; built on first use.
    lookup_index: NgramIndex | None = None
    #: Constrained decoding (OpenItem.constraint): a tandem.grammar.GrammarState over the emitted tokens.
    grammar: Any = None
    #: Draft only: the drafting types the request narrowed a chained drafter to (OpenItem.draft_types; empty: all).
    draft_types: tuple[str, ...] = ()

    @property
    def position(self) -> int:
        return len(self.tokens)

    def ends_with_repeat(self, n: int) -> bool:
        """Whether the sequence ends with n tokens that occurred together earlier in it."""
        if self.repeats is None:
            self.repeats = RepeatWatches()
        return self.repeats.ends_with_repeat(self.tokens, n)

    def lookup_draft(self, rule: LookupRule, room: int) -> tuple[list[int], int]:
        """The draft the caller's prompt lookup (`rule`) would send after this sequence, and its match length."""
        index = self.lookup_index
        if (
            index is None
            or (index.n_min, index.n_max) != (rule.ngram_min, rule.ngram_max)
            or index.indexed > len(self.tokens)
        ):
            index = self.lookup_index = NgramIndex(rule.ngram_min, rule.ngram_max)
        index.extend(self.tokens)
        return rule.draft(index, self.tokens, room)

    def expect_position(self, position: int, key: Hashable) -> Any | None:
        """Check a call keyed by position; return the cached answer when it is an exact retry of the last call."""
        if self.last_call is not None and self.last_call[0] == key:
            return self.last_call[1]
        if position != self.position:
            raise PositionMismatch(
                f"session {self.session_id} is at position {self.position}, the call assumed {position}"
            )
        return None

    def kv_catch_up(self, tokens: Sequence[int]) -> int:
        """Keep the KV cells shared with `tokens` (longest common prefix) and return how many are kept.

        The caller evaluates tokens[kept:] and records them in kv_tokens.
        """
        kept = common_prefix(self.kv_tokens, tokens)
        del self.kv_tokens[kept:]
        return kept


@dataclass
class CachedSlot:
    """What a free slot's KV cells still hold: tokens, and the prompt that produced them (prefix cache)."""

    tokens: list[int] = field(default_factory=list)
    prompt_len: int = 0
    prompt_row: Any = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Called for every step of every session, with sequences as long as the context, and almost always one is a prefix
    of the other: slices compare in C, so the common case costs ~1 us per thousand tokens instead of ~50 us for a
    Python loop, and a mismatch is found by bisection over slices."""
    if type(a) is not type(b):  # a list never equals a tuple: compare like with like
        a, b = list(a), list(b)
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo], and a[:hi] != b[:hi]
    while hi - lo > 8:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


def make_rng(seed: int | None, salt: int = 0) -> np.random.Generator:
    """A per-session generator: seeded requests are reproducible, unseeded ones draw fresh entropy."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, salt])


class SessionStore:
    """Sessions by id, with a pool of KV sequence ids bounded by the engine's max_sessions.

    Closing is two-step so that it never waits behind engine work: `close` (any thread) drops the session at once,
    so later calls for it fail with NOT_FOUND and it no longer counts as live; `take_closed` + `release` (the engine
    thread, before its next job) clear its KV cells and return its sequence id to the pool.
    """

    def __init__(self, max_sessions: int, idle_timeout_s: float) -> None:
        self._sessions: dict[str, Session] = {}
        self._closed: list[Session] = []
        self._lock = threading.Lock()
        self.max_sessions = max_sessions
        #: Free sequence ids, least recently released first, each with the tokens its KV cells still hold
        #: (prefix cache: a new session whose prompt starts with them reuses those cells instead of recomputing).
        self._free: OrderedDict[int, CachedSlot] = OrderedDict((i, CachedSlot()) for i in range(max_sessions))
        self.idle_timeout_s = idle_timeout_s
        self.reused_tokens = 0  # prompt tokens served from the prefix cache, for metrics and tests

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def kv_tokens(self) -> int:
        """Tokens held in the KV cache by all live sessions."""
        with self._lock:
            return sum(len(s.kv_tokens) for s in self._sessions.values())

    def find(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"unknown session {session_id!r} (closed, expired, or the service restarted)")
        session.last_used = time.monotonic()
        return session

    def create(
        self,
        session_id: str,
        prompt: Sequence[int],
        sampling: SamplingParams,
        rng: np.random.Generator,
        top_logprobs: int,
    ) -> Session:
        if not session_id:
            raise InvalidArgument("session_id must not be empty")
        if not prompt:
            raise InvalidArgument("prompt_token_ids must not be empty")
        if session_id in self._sessions:
            raise InvalidArgument(f"session {session_id!r} already exists with a different prompt")
        with self._lock:
            if not self._free:
                raise ResourceExhausted(f"all {len(self._sessions)} session slots are busy; retry later")
            seq_id, cached, row = self._pick_slot(prompt)
            session = Session(
                session_id=session_id,
                seq_id=seq_id,
                prompt=tuple(prompt),
                sampling=sampling,
                rng=rng,
                top_logprobs=top_logprobs,
                tokens=list(prompt),
                kv_tokens=cached,
                prompt_row=row,
            )
            self.reused_tokens += len(cached)
            self._sessions[session_id] = session
        return session

    def _pick_slot(self, prompt: Sequence[int]) -> tuple[int, list[int], Any]:
        """The free slot whose cached tokens share the longest prefix with `prompt`, else the least recently used.

        Returns the slot, the reusable prefix (the caller truncates the slot's KV cells to it) and, when the slot
        last served this very prompt, that prompt's last logits row.
        """
        best_id, best_len = next(iter(self._free)), 0
        for seq_id, cached in self._free.items():
            n = common_prefix(cached.tokens, prompt)
            if n > best_len:
                best_id, best_len = seq_id, n
        slot = self._free.pop(best_id)
        same_prompt = best_len >= len(prompt) and slot.prompt_len == len(prompt)
        return best_id, slot.tokens[:best_len], slot.prompt_row if same_prompt else None

    def rollback(self, items: Sequence[tuple[str, int]]) -> list[Session]:
        """Shorten each session's sequence to `position` tokens (never into the prompt); all are checked first."""
        sessions = [(self.get(sid), pos) for sid, pos in items]
        for session, pos in sessions:
            if not len(session.prompt) <= pos <= session.position:
                raise InvalidArgument(f"rollback position {pos} outside [{len(session.prompt)}, {session.position}]")
        for session, pos in sessions:
            del session.tokens[pos:]
            session.last_call = None
            session.repeats = None  # its watches index only a growing sequence
            session.lookup_index = None  # as does the lookup's index
        return [session for session, _ in sessions]

    def close(self, session_id: str) -> Session | None:
        """Drop a live session at once (safe from any thread); its KV is reclaimed by `take_closed`/`release`."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                session.closed = True
                self._closed.append(session)
        return session

    def take_closed(self) -> list[Session]:
        """Closed sessions whose KV cells still need clearing (engine thread)."""
        with self._lock:
            closed, self._closed = self._closed, []
        return closed

    def release(self, session: Session, keep_cache: bool) -> None:
        """Return a closed session's sequence id to the pool: with `keep_cache`, its KV cells stay for reuse by a
        later prompt with the same prefix; otherwise the caller has cleared them."""
        with self._lock:
            self._free[session.seq_id] = (
                CachedSlot(list(session.kv_tokens), len(session.prompt), session.prompt_row)
                if keep_cache
                else CachedSlot()
            )
            self._free.move_to_end(session.seq_id)

    @property
    def cached_tokens(self) -> int:
        """Tokens kept in free slots for prefix reuse."""
        with self._lock:
            return sum(len(c.tokens) for c in self._free.values())

    def idle(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            return [sid for sid, s in self._sessions.items() if now - s.last_used > self.idle_timeout_s]
