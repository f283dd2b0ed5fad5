"""The draft service's job: keep each session's committed sequence and ask the drafter for proposals.

Propose is keyed by position: the caller names the sequence length it believes the draft has and appends what
the target committed since. A stale position is FAILED_PRECONDITION; an exact retry returns the previous answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.draft.drafters import Draft, Drafter
from tandem.errors import InvalidArgument
from tandem.sampling import SamplingParams
from tandem.sessions import SessionStore, make_rng

DRAFT_RNG_SALT = 1  # the draft's random stream must differ from the target's for the same seed


@dataclass(frozen=True)
class ProposeSpec:
    session_id: str
    position: int
    append: Sequence[int]
    max_tokens: int


@dataclass(frozen=True)
class ProposeResult:
    session_id: str
    position: int
    draft: Draft


class DraftService:
    def __init__(
        self, drafter: Drafter, max_sessions: int, idle_timeout_s: float, n_vocab: int | None, n_ctx: int | None
    ) -> None:
        self.drafter = drafter
        self.store = SessionStore(max_sessions, idle_timeout_s)
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        if self.n_vocab is None:
            if any(t < 0 for t in tokens):
                raise InvalidArgument("token ids must be >= 0")
            return
        for t in tokens:
            if not 0 <= t < self.n_vocab:
                raise InvalidArgument(f"token id {t} is outside the vocabulary (0..{self.n_vocab - 1})")

    def open(self, items: Sequence[tuple[str, Sequence[int], SamplingParams]]) -> list[tuple[str, int]]:
        fresh = []
        answered: dict[str, int] = {}
        for sid, prompt, _ in items:
            self._check_tokens(prompt)
            if self.n_ctx is not None and len(prompt) >= self.n_ctx:
                raise InvalidArgument(f"prompt of {len(prompt)} tokens does not fit the context size {self.n_ctx}")
            existing = self.store.find(sid)
            if existing is not None and existing.prompt == tuple(prompt) and existing.last_call is None:
                answered[sid] = existing.position  # retried Open before any Propose
        try:
            for sid, prompt, params in items:
                if sid not in answered:
                    fresh.append(self.store.create(sid, prompt, params, make_rng(params.seed, DRAFT_RNG_SALT), -1))
            self.drafter.open(fresh)
        except Exception:
            for s in fresh:
                self.drafter.close(s)
                self.store.close(s.session_id)
            raise
        return [(sid, self.store.get(sid).position) for sid, _, _ in items]

    def propose(self, specs: Sequence[ProposeSpec]) -> list[ProposeResult]:
        out: dict[str, ProposeResult] = {}
        work = []
        for spec in specs:
            session = self.store.get(spec.session_id)
            key = ("propose", spec.position, tuple(spec.append), spec.max_tokens)
            hit = session.expect_position(spec.position, key)
            if hit is not None:
                out[spec.session_id] = hit
                continue
            self._check_tokens(spec.append)
            work.append((session, spec, key))
        for session, spec, key in work:
            start = session.position
            session.tokens.extend(spec.append)
            if spec.append:
                self.drafter.appended(session, start)
            room = spec.max_tokens if self.n_ctx is None else min(spec.max_tokens, self.n_ctx - session.position - 1)
            draft = self.drafter.propose(session, max(room, 0)) if room > 0 else Draft([], None)
            result = ProposeResult(spec.session_id, session.position, draft)
            session.last_call = (key, result)
            out[spec.session_id] = result
        return [out[spec.session_id] for spec in specs]

    def rollback(self, items: Sequence[tuple[str, int]]) -> None:
        for session in self.store.rollback(items):
            self.drafter.truncated(session)

    def close(self, session_ids: Sequence[str]) -> int:
        closed = 0
        for sid in session_ids:
            session = self.store.close(sid)
            if session is not None:
                self.drafter.close(session)
                closed += 1
        return closed

    def expire_idle(self) -> int:
        return self.close(self.store.idle())
