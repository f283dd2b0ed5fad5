"""The draft service's job: keep each session's committed sequence and ask the drafter for proposals.

Propose is keyed by position: the caller names the sequence length it believes the draft has and appends what
the target committed since. A stale position is FAILED_PRECONDITION; an exact retry returns the previous answer.
A text session (a target of another vocabulary: services.draft.text_sessions) counts its position in bytes of text.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from services.draft.drafters import Draft, Drafter, ModelDrafter
from services.draft.text_sessions import TextPrompt, TextProposal, TextSessions, TextState
from tandem.cross_vocab import VocabularyText
from tandem.errors import InvalidArgument, PositionMismatch, SessionNotFound
from tandem.grammar import Constraint
from tandem.sampling import SamplingParams
from tandem.scheduler import plan_step, step_results
from tandem.sessions import Session, SessionStore, make_rng

DRAFT_RNG_SALT = 1  # the draft's random stream must differ from the target's for the same seed


# (session id, prompt, sampling, constraint or None, text prompt or None, drafting types or None); the last three may
# be left out
OpenSpec = (
    tuple[str, Sequence[int], SamplingParams]
    | tuple[str, Sequence[int], SamplingParams, Constraint | None]
    | tuple[str, Sequence[int], SamplingParams, Constraint | None, TextPrompt | None]
    | tuple[str, Sequence[int], SamplingParams, Constraint | None, TextPrompt | None, Sequence[str] | None]
)


@dataclass(frozen=True)
class ProposeSpec:
    session_id: str
    position: int
    append: Sequence[int]
    max_tokens: int
    rewind: bool = False  # position may be behind the session: drop the tentative tokens past it first
    append_text: bytes = b""  # a text session's committed text since `position` (bytes)


@dataclass(frozen=True)
class ProposeResult:
    session_id: str
    position: int
    draft: Draft
    text: TextProposal | None = None  # a text session's proposal
    translate_ns: int = 0  # time spent re-tokenizing text and spelling the proposal


def is_text(session: Session) -> bool:
    return isinstance(session.extra, TextState)


def position_of(session: Session) -> int:
    """Where the caller sees the session: tokens, or bytes of text for a text session."""
    return len(session.extra.text) if is_text(session) else session.position


class DraftService:
    def __init__(
        self,
        drafter: Drafter,
        max_sessions: int,
        idle_timeout_s: float,
        n_vocab: int | None,
        n_ctx: int | None,
        prefix_cache: bool = True,
    ) -> None:
        self.drafter = drafter
        self.store = SessionStore(max_sessions, idle_timeout_s)
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.prefix_cache = prefix_cache and isinstance(drafter, ModelDrafter)
        #: Text sessions, for a target of another vocabulary (a model drafter only).
        self.texts = (
            TextSessions(drafter.engine, n_ctx or drafter.engine.n_ctx) if isinstance(drafter, ModelDrafter) else None
        )

    def put_vocabulary(self, target: VocabularyText) -> int:
        """Keep a target's vocabulary for token-level intersection; returns how many tokens the two share."""
        if self.texts is None:
            raise InvalidArgument("the n-gram drafter drafts in the target's own tokens: it needs no vocabulary")
        return self.texts.learn_vocabulary(target)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        if self.n_vocab is None:
            if any(t < 0 for t in tokens):
                raise InvalidArgument("token ids must be >= 0")
            return
        for t in tokens:
            if not 0 <= t < self.n_vocab:
                raise InvalidArgument(f"token id {t} is outside the vocabulary (0..{self.n_vocab - 1})")

    def open(self, items: Sequence[OpenSpec]) -> list[tuple[str, int]]:
        steps = self.open_steps(items)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value

    def open_steps(self, items: Sequence[OpenSpec]) -> Generator[None, None, list[tuple[str, int]]]:
        items = [(*item, *(None,) * (6 - len(item))) for item in items]
        fresh = []
        answered: dict[str, int] = {}
        texts: dict[str, TextState] = {}
        offered = tuple(self.drafter.name.split(","))
        for i, (sid, prompt, params, constraint, text, types) in enumerate(items):
            unknown = [t for t in types or () if t not in offered]
            if unknown:
                names = ", ".join(offered)
                raise InvalidArgument(f"drafting type {unknown[0]!r} is not offered here (offered: {names})")
            if text is not None:
                if self.texts is None:
                    raise InvalidArgument("prompt_text needs a model drafter (--drafter model)")
                prompt, texts[sid] = self.texts.open(text)
                items[i] = (sid, prompt, params, constraint, text, types)
            self._check_tokens(prompt)
            if self.n_ctx is not None and len(prompt) >= self.n_ctx:
                raise InvalidArgument(f"prompt of {len(prompt)} tokens does not fit the context size {self.n_ctx}")
            existing = self.store.find(sid)
            if existing is not None and existing.prompt == tuple(prompt) and existing.last_call is None:
                answered[sid] = position_of(existing)  # retried Open before any Propose
        try:
            for sid, prompt, params, constraint, _, types in items:
                if sid not in answered:
                    session = self.store.create(sid, prompt, params, make_rng(params.seed, DRAFT_RNG_SALT), -1)
                    session.extra = texts.get(sid)
                    session.draft_types = tuple(types or ())
                    if constraint is not None:
                        self.drafter.constrain(session, constraint)
                    fresh.append(session)
            for _ in self.drafter.open_steps(fresh):
                yield
                if any(s.closed for s in fresh):
                    raise SessionNotFound("a session was closed while its prompt was being prefilled")
        except BaseException:
            for s in fresh:
                self.store.close(s.session_id)
            self.reclaim()
            raise
        return [(sid, position_of(self.store.get(sid))) for sid, *_ in items]

    def propose_groups(self, groups: Sequence[Sequence[ProposeSpec]]) -> list[Any]:
        """Proposals for many calls in one engine step; each call is validated whole and fails alone."""
        outcomes, work = plan_step(groups, self._check_group)
        asks = []
        spent: dict[str, int] = {}  # text sessions: time spent translating
        for _, (session, spec, _) in work:
            if is_text(session):
                t0 = time.perf_counter_ns()
                self.texts.learn(session, spec.append_text)
                spent[spec.session_id] = time.perf_counter_ns() - t0
                asks.append((session, min(spec.max_tokens, self.texts.room(session))))
                continue
            if spec.rewind and spec.position < session.position:
                self.store.rollback([(spec.session_id, spec.position)])
                self.drafter.truncated(session)
            start = session.position
            session.tokens.extend(spec.append)
            if spec.append:
                self.drafter.appended(session, start)
            room = spec.max_tokens if self.n_ctx is None else min(spec.max_tokens, self.n_ctx - session.position - 1)
            asks.append((session, max(room, 0)))
        drafts = self.drafter.propose_many(asks)
        for (g, (session, spec, key)), draft, (_, asked) in zip(work, drafts, asks, strict=True):
            if is_text(session):
                t0 = time.perf_counter_ns()
                full = spec.max_tokens > 0 and asked == 0
                text = self.texts.proposal(session, draft.tokens, draft.dists, full)
                translate_ns = spent[spec.session_id] + time.perf_counter_ns() - t0
                shared = Draft(text.token_ids, text.dists)
                result = ProposeResult(spec.session_id, position_of(session), shared, text, translate_ns)
            else:
                result = ProposeResult(spec.session_id, session.position, draft)
            session.last_call = (key, result)
            outcomes[g][spec.session_id] = result
        return step_results(groups, outcomes)

    def _check_group(
        self, specs: Sequence[ProposeSpec]
    ) -> list[tuple[str, ProposeResult | None, tuple[Session, ProposeSpec, tuple]]]:
        checked = []
        for spec in specs:
            session = self.store.get(spec.session_id)
            if is_text(session):
                checked.append(
                    (spec.session_id, self._check_text(session, spec), (session, spec, self._text_key(spec)))
                )
                continue
            if spec.append_text:
                raise InvalidArgument(
                    f"session {spec.session_id} was opened with tokens: append_text needs prompt_text"
                )
            key = ("propose", spec.position, tuple(spec.append), spec.max_tokens, spec.rewind)
            if spec.rewind and len(session.prompt) <= spec.position < session.position:
                hit = session.last_call[1] if session.last_call and session.last_call[0] == key else None
            else:
                hit = session.expect_position(spec.position, key)
            if hit is None:
                self._check_tokens(spec.append)
            checked.append((spec.session_id, hit, (session, spec, key)))
        if len({spec.session_id for spec in specs}) != len(specs):
            raise InvalidArgument("a session appears twice in one Propose call")
        return checked

    @staticmethod
    def _text_key(spec: ProposeSpec) -> tuple:
        return ("propose-text", spec.position, bytes(spec.append_text), spec.max_tokens)

    def _check_text(self, session: Session, spec: ProposeSpec) -> ProposeResult | None:
        """A text session's Propose: keyed by byte position; an exact retry gets the last answer."""
        if spec.rewind or spec.append:
            raise InvalidArgument(f"session {spec.session_id} was opened with text: send append_text, no rewind")
        if session.last_call is not None and session.last_call[0] == self._text_key(spec):
            return session.last_call[1]
        if spec.position != len(session.extra.text):
            raise PositionMismatch(
                f"session {spec.session_id} holds {len(session.extra.text)} bytes of text, the call assumed "
                f"{spec.position}"
            )
        return None

    def propose(self, specs: Sequence[ProposeSpec]) -> list[ProposeResult]:
        """One call's proposals on their own (tests and tools); the service batches calls with propose_groups."""
        (outcome,) = self.propose_groups([specs])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def rollback(self, items: Sequence[tuple[str, int]]) -> None:
        if any(is_text(self.store.get(sid)) for sid, _ in items):
            raise InvalidArgument("a text session cannot be rolled back")
        for session in self.store.rollback(items):
            self.drafter.truncated(session)

    def close(self, session_ids: Sequence[str]) -> int:
        """Drop sessions at once (any thread); the engine thread reclaims their slots before its next step."""
        return sum(self.store.close(sid) is not None for sid in session_ids)

    def reclaim(self) -> None:
        """Engine thread: free closed sessions' slots (keeping a model drafter's KV for prefix reuse)."""
        for session in self.store.take_closed():
            self.drafter.close(session, keep_cache=self.prefix_cache)
            self.store.release(session, keep_cache=self.prefix_cache)

    def expire_idle(self) -> int:
        closed = self.close(self.store.idle())
        self.reclaim()
        return closed
