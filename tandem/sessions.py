"""Per-session state shared by the draft and the target services.

A session is one generation: its token sequence, the KV sequence (seq_id) it owns in the engine, its sampling
settings and random generator, and the last answered call (so that an exact retry is answered from memory instead
of being applied twice). The store hands out a bounded number of KV sequences and closes idle sessions.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.errors import InvalidArgument, PositionMismatch, ResourceExhausted, SessionNotFound
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

    @property
    def position(self) -> int:
        return len(self.tokens)

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
        kept = 0
        limit = min(len(self.kv_tokens), len(tokens))
        while kept < limit and self.kv_tokens[kept] == tokens[kept]:
            kept += 1
        del self.kv_tokens[kept:]
        return kept


def make_rng(seed: int | None, salt: int = 0) -> np.random.Generator:
    """A per-session generator: seeded requests are reproducible, unseeded ones draw fresh entropy."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, salt])


class SessionStore:
    """Sessions by id, with a pool of KV sequence ids bounded by the engine's max_sessions."""

    def __init__(self, max_sessions: int, idle_timeout_s: float) -> None:
        self._sessions: dict[str, Session] = {}
        self.max_sessions = max_sessions
        self._free_seq_ids = list(range(max_sessions - 1, -1, -1))
        self.idle_timeout_s = idle_timeout_s

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def kv_tokens(self) -> int:
        """Tokens held in the KV cache by all sessions."""
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
        if not self._free_seq_ids:
            raise ResourceExhausted(f"all {len(self._sessions)} session slots are busy; retry later")
        session = Session(
            session_id=session_id,
            seq_id=self._free_seq_ids.pop(),
            prompt=tuple(prompt),
            sampling=sampling,
            rng=rng,
            top_logprobs=top_logprobs,
            tokens=list(prompt),
        )
        self._sessions[session_id] = session
        return session

    def rollback(self, items: Sequence[tuple[str, int]]) -> list[Session]:
        """Shorten each session's sequence to `position` tokens (never into the prompt); all are checked first."""
        sessions = [(self.get(sid), pos) for sid, pos in items]
        for session, pos in sessions:
            if not len(session.prompt) <= pos <= session.position:
                raise InvalidArgument(f"rollback position {pos} outside [{len(session.prompt)}, {session.position}]")
        for session, pos in sessions:
            del session.tokens[pos:]
            session.last_call = None
        return [session for session, _ in sessions]

    def close(self, session_id: str) -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._free_seq_ids.append(session.seq_id)
        return session

    def idle(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [sid for sid, s in self._sessions.items() if now - s.last_used > self.idle_timeout_s]
