"""Drafters: propose the next tokens of a session cheaply, behind one interface.

Two implementations:
- NgramDrafter (model-free prompt lookup): find the longest recent suffix of the sequence that occurred earlier
  and propose what followed it. Costs microseconds; wins when the output repeats the input (code edits, quoting).
- ModelDrafter: a small GGUF with the target's vocabulary, run autoregressively with per-session KV.

Both are deterministic for greedy requests (no distributions sent). The model drafter samples sampled requests
from a truncated copy of its warped distribution and sends that distribution, so the target can verify losslessly.
For a constrained request (OpenItem.constraint) the model drafter masks its rows with the same grammar first, as the
target does: its drafts stay inside the grammar and q is the masked-then-warped distribution the rule expects. A text
session drafting in the tokens it shares with a target of another vocabulary (services.draft.text_sessions) masks its
rows to those tokens the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import numpy as np

from services.draft.text_sessions import TextState
from tandem import sampling
from tandem.engine import DecodeItem, Engine, greedy_token
from tandem.grammar import Constraint, GrammarState, tokenizer_for
from tandem.ngram import NgramIndex, ngram_draft_matched
from tandem.sampling import SparseDist
from tandem.sessions import Session

SINGLE_STEP_CATCH_UP = 4


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    dists: list[SparseDist] | None  # None: deterministic proposal
    match_len: int = 0  # n-gram drafters: the suffix match the proposal continues (Proposal.match_len)


class Drafter(ABC):
    """Per-session drafting strategy; the DraftService owns sessions and positions, this owns the proposal."""

    name: str

    @property
    def proposes_after_repeat(self) -> int:
        """Shortest repeated suffix behind which this drafter proposes anything (0: it may propose anywhere)."""
        return 0

    def open_steps(self, sessions: Sequence[Session]) -> Generator[None, None, None]:
        """Prepare new sessions (prefill, indexes); a generator so long prefills run in chunks between steps."""
        self.open(sessions)
        yield from ()

    @abstractmethod
    def open(self, sessions: Sequence[Session]) -> None:
        """Prepare new sessions (prefill, indexes) in one go."""

    @abstractmethod
    def propose(self, session: Session, max_tokens: int) -> Draft:
        """Propose up to max_tokens tokens continuing session.tokens."""

    def propose_many(self, work: Sequence[tuple[Session, int]]) -> list[Draft]:
        """Proposals for many sessions at once (one engine step); drafters with a model batch them."""
        return [self.propose(session, n) if n > 0 else Draft([], None) for session, n in work]

    #: Whether this drafter masks its proposals with a session's grammar (Capabilities.constraints).
    knows_grammars = False

    def constrain(self, session: Session, constraint: Constraint) -> None:  # noqa: B027 - optional hook
        """The session's output must match `constraint`; a drafter that cannot use it drafts unconstrained (the
        target masks every draft anyway, so that only costs rejected drafts)."""

    def appended(self, session: Session, start: int) -> None:  # noqa: B027 - optional hook
        """session.tokens[start:] were just committed."""

    def truncated(self, session: Session) -> None:  # noqa: B027 - optional hook
        """session.tokens was shortened (rollback)."""

    def close(self, session: Session, keep_cache: bool = False) -> None:  # noqa: B027 - optional hook
        """Free what the session holds (keep_cache: leave its KV cells for a later prompt with the same prefix)."""


class NgramDrafter(Drafter):
    """Prompt lookup (tandem.ngram) over each session's tokens, with its confidence rule: an m-token suffix match
    drafts at most m - 1 tokens (`scaled`; off only in tests of the lookup itself)."""

    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4, scaled: bool = True) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.scaled = scaled

    @property
    def proposes_after_repeat(self) -> int:
        # The index holds suffixes of n_min tokens and more; scaled, an m-token match drafts at most m - 1 tokens.
        return max(self.n_min, 2) if self.scaled else self.n_min

    def open(self, sessions: Sequence[Session]) -> None:
        for session in sessions:
            session.extra = NgramIndex(self.n_min, self.n_max)
            session.extra.extend(session.tokens)

    def appended(self, session: Session, start: int) -> None:
        session.extra.extend(session.tokens)

    def truncated(self, session: Session) -> None:
        session.extra = NgramIndex(self.n_min, self.n_max)
        session.extra.extend(session.tokens)

    def propose(self, session: Session, max_tokens: int) -> Draft:
        tokens, match_len = ngram_draft_matched(session.extra, session.tokens, max_tokens, self.scaled)
        return Draft(tokens, None, match_len if tokens else 0)


class DraftGrammar:
    """A session's grammar on the draft side: the matcher follows the committed emitted tokens (caught up before
    each proposal, since the draft learns them late and may be rewound) and takes the proposal's tokens tentatively."""

    def __init__(self, state: GrammarState, prompt_len: int) -> None:
        self.state = state
        self.prompt_len = prompt_len
        self.taken: list[int] = []  # emitted tokens the matcher holds

    def catch_up(self, session: Session) -> bool:
        """Bring the matcher to session.tokens; False if the committed text leaves the grammar (then stop masking)."""
        emitted = session.tokens[self.prompt_len :]
        same = 0
        for a, b in zip(self.taken, emitted, strict=False):
            if a != b:
                break
            same += 1
        self.state.rollback(len(self.taken) - same)
        del self.taken[same:]
        for token in emitted[same:]:
            if not self.state.matcher.consume_token(token):
                return False
            self.taken.append(token)
        return not self.state.matcher.is_error()

    def mask(self, row: np.ndarray) -> np.ndarray:
        masked = row.copy()
        masked[~self.state.allowed()] = -np.inf
        return masked


class ModelDrafter(Drafter):
    """A small model proposing autoregressively; its KV holds the committed tokens plus its last proposal.

    Proposals for all sessions of a step run together: each drafting step is one multi-sequence llama_decode.
    """

    name = "model"
    knows_grammars = True

    def __init__(self, engine: Engine, support: int = 32) -> None:
        self.engine = engine
        self.support = support
        self._lltokenizer = None  # built on the first constrained session (~0.5 s at 49k tokens)
        # Tokens up to this many missing from the KV go in one pass each (stepwise numerics), longer runs whole.
        self.stepwise_limit = SINGLE_STEP_CATCH_UP

    def open(self, sessions: Sequence[Session]) -> None:
        for _ in self.open_steps(sessions):
            pass

    def open_steps(self, sessions: Sequence[Session]) -> Generator[None, None, None]:
        items = []
        for s in sessions:
            # Greedy drafting reads only each row's argmax, unless a grammar or another vocabulary masks the row.
            argmax_only = s.sampling.greedy and s.grammar is None and not isinstance(s.extra, TextState)
            self.engine.set_device_argmax(s.seq_id, argmax_only)
            kept = len(s.kv_tokens)  # a prefix reused from a finished session's slot (prefix cache)
            self.engine.truncate(s.seq_id, kept)
            if kept < len(s.tokens):
                items.append(DecodeItem(s.seq_id, s.tokens[kept:], kept, "none"))
        yield from self.engine.prefill_steps(items)
        for s in sessions:
            s.kv_tokens = list(s.tokens)

    def _catch_up(self, sessions: Sequence[Session]) -> list[np.ndarray | int]:
        """Bring each KV cache to its committed sequence, reusing accepted proposals; return each last logits row
        (its device argmax, for a session whose rows the engine reduces on the device).

        A short catch-up goes one token per pass, like the draft's own proposals and like target-only decoding: the
        draft's KV then matches one-token numerics exactly, so a same-model draft agrees with the target bit for bit;
        on CUDA a one-token pass is also several times cheaper than a two-token one (docs/decisions/0007).
        """
        missing: list[list[int]] = []
        starts: list[int] = []
        for session in sessions:
            kept = session.kv_catch_up(session.tokens)
            if kept == len(session.tokens):
                kept -= 1  # the last token's logits are needed again: recompute that one cell
                del session.kv_tokens[kept:]
            self.engine.truncate(session.seq_id, kept)
            missing.append(session.tokens[kept:])
            starts.append(kept)
        last: list[np.ndarray | int | None] = [None] * len(sessions)
        # Pass 0 takes long catch-ups whole; short ones advance one token per pass.
        step = 0
        while True:
            items, owners = [], []
            for i, (session, todo, start) in enumerate(zip(sessions, missing, starts, strict=True)):
                if len(todo) > self.stepwise_limit:
                    if step == 0:
                        items.append(DecodeItem(session.seq_id, todo, start, "last"))
                        owners.append(i)
                elif step < len(todo):
                    items.append(DecodeItem(session.seq_id, [todo[step]], start + step, "last"))
                    owners.append(i)
            if not items:
                break
            for i, rows in zip(owners, self.engine.decode(items), strict=True):
                last[i] = rows[-1]
            step += 1
        for session, todo in zip(sessions, missing, strict=True):
            session.kv_tokens.extend(todo)
        return [row for row in last if row is not None]

    def constrain(self, session: Session, constraint: Constraint) -> None:
        if self._lltokenizer is None:
            self._lltokenizer = tokenizer_for(self.engine)
        try:
            state = GrammarState(self._lltokenizer, constraint.grammar(), self.engine.n_vocab)
        except Exception:  # the target compiles it too and answers for it; here it is only an aid
            return
        session.grammar = DraftGrammar(state, len(session.prompt))
        self.engine.set_device_argmax(session.seq_id, False)  # the mask reads whole rows

    def propose(self, session: Session, max_tokens: int) -> Draft:
        return self.propose_many([(session, max_tokens)])[0]

    def _grammar(self, session: Session) -> DraftGrammar | None:
        grammar = session.grammar
        if grammar is not None and not grammar.catch_up(session):
            session.grammar = grammar = None
        return grammar

    def propose_many(self, work: Sequence[tuple[Session, int]]) -> list[Draft]:
        work = [(s, n) for s, n in work]
        active = [i for i, (_, n) in enumerate(work) if n > 0]
        rows = dict(zip(active, self._catch_up([work[i][0] for i in active]), strict=True))
        tokens: list[list[int]] = [[] for _ in work]
        dists: list[list[SparseDist]] = [[] for _ in work]
        grammars = {i: self._grammar(work[i][0]) for i in active}
        shared = {i: work[i][0].extra.shared for i in active if isinstance(work[i][0].extra, TextState)}
        while active:
            items, still = [], []
            for i in active:
                session, max_tokens = work[i]
                params = session.sampling
                row, grammar = rows[i], grammars[i]
                if grammar is not None:  # masked first, as the target does
                    row = grammar.mask(row)
                if shared.get(i) is not None:  # token-level intersection: only tokens the target spells alike
                    row = shared[i].restrict(row)
                if (grammar is not None or shared.get(i) is not None) and not np.isfinite(row).any():
                    continue  # nothing allowed: the proposal ends here
                if params.greedy:
                    token = greedy_token(row)
                else:
                    q = sampling.draft_distribution(row, params, self.support)
                    token = sampling.sample(q, session.rng)
                    dists[i].append(q)
                tokens[i].append(token)
                if grammar is not None and not grammar.state.matcher.consume_token(token):
                    grammars[i] = None  # cannot happen for an allowed token; stop masking rather than guess
                if self.engine.is_eog(token) or len(tokens[i]) >= max_tokens or session.closed:
                    continue
                items.append(DecodeItem(session.seq_id, [token], len(session.kv_tokens), "last"))
                session.kv_tokens.append(token)
                still.append(i)
            if items:  # views, not copies: each row is read before the next decode overwrites the buffer
                for i, r in zip(still, self.engine.decode(items, copy=False), strict=True):
                    rows[i] = r[-1]
            active = still
        for i, grammar in grammars.items():  # the proposal was tentative: back to the committed tokens
            if grammar is not None:
                grammar.state.rollback(len(tokens[i]))
            elif work[i][0].grammar is not None:
                work[i][0].grammar = None
        return [Draft(tokens[i], None if session.sampling.greedy else dists[i]) for i, (session, _) in enumerate(work)]

    def truncated(self, session: Session) -> None:
        kept = session.kv_catch_up(session.tokens)
        self.engine.truncate(session.seq_id, kept)

    def close(self, session: Session, keep_cache: bool = False) -> None:
        if keep_cache:  # the slot keeps exactly the cells of session.kv_tokens, for prefix reuse
            self.engine.truncate(session.seq_id, len(session.kv_tokens))
        else:
            self.engine.clear(session.seq_id)
