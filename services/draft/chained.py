"""Chained drafting: prompt lookup first, the draft model where lookup finds nothing (`--drafter ngram,model`).

Lookup costs microseconds and, where the output copies its input (code edits, quoting, reformatting), proposes long
runs the model would propose token by token at a forward pass each; elsewhere it finds nothing, and the model drafts.
llama.cpp's server chains its drafting types the same way. A request may narrow the chain to one of the two
(`speculative.type`: `ngram` or `model`, OpenItem.draft_types).

Lookup proposals are deterministic (no distributions), like the n-gram drafter's: a sampled request verifies them as
fixed proposals, which keeps the output exactly the target's distribution; the model's are sampled from its q as
usual. The model's KV follows the committed tokens whichever drafted: it catches up on the next model proposal.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

from services.draft.drafters import Draft, ModelDrafter
from tandem.engine import Engine
from tandem.ngram import NgramIndex, ngram_draft_matched
from tandem.sessions import Session

LOOKUP, MODEL = "ngram", "model"
CHAIN = (LOOKUP, MODEL)


class ChainedDrafter(ModelDrafter):
    """A model drafter that tries prompt lookup first (the lookup's index lives in `Session.lookup_index`)."""

    name = "ngram,model"

    def __init__(self, engine: Engine, support: int = 32, ngram_min: int = 1, ngram_max: int = 4) -> None:
        super().__init__(engine, support)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def _index(self, session: Session) -> NgramIndex:
        if session.lookup_index is None:
            session.lookup_index = NgramIndex(self.ngram_min, self.ngram_max)
            session.lookup_index.extend(session.tokens)
        return session.lookup_index

    def open_steps(self, sessions: Sequence[Session]) -> Generator[None, None, None]:
        yield from super().open_steps(sessions)
        for session in sessions:
            if LOOKUP in drafting_types(session):
                self._index(session)

    def appended(self, session: Session, start: int) -> None:
        super().appended(session, start)
        if session.lookup_index is not None:
            session.lookup_index.extend(session.tokens)

    def truncated(self, session: Session) -> None:
        super().truncated(session)
        session.lookup_index = None  # rebuilt from the shortened sequence on the next lookup

    def lookup(self, session: Session, max_tokens: int) -> Draft | None:
        """The lookup's proposal, or None where it finds nothing (or the session does not look up)."""
        if LOOKUP not in drafting_types(session) or max_tokens <= 0:
            return None
        if getattr(session.extra, "shared", None) is not None:
            return None  # token-level intersection: every proposal must be of the shared tokens, with its q

        tokens, match_len = ngram_draft_matched(self._index(session), session.tokens, max_tokens, True)
        return Draft(tokens, None, match_len) if tokens else None

    def propose_many(self, work: Sequence[tuple[Session, int]]) -> list[Draft]:
        drafts: list[Draft | None] = [self.lookup(session, n) for session, n in work]
        rest = [
            i for i, (session, n) in enumerate(work) if drafts[i] is None and n > 0 and MODEL in drafting_types(session)
        ]
        if rest:
            for i, draft in zip(rest, super().propose_many([work[i] for i in rest]), strict=True):
                drafts[i] = draft
        return [d if d is not None else Draft([], None) for d in drafts]


def drafting_types(session: Session) -> tuple[str, ...]:
    """The drafting types a session asked for (OpenItem.draft_types), else the whole chain."""
    return session.draft_types or CHAIN
