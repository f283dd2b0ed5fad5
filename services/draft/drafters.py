"""Drafters: propose the next tokens of a session cheaply, behind one interface.

Two implementations:
- NgramDrafter (model-free prompt lookup): find the longest recent suffix of the sequence that occurred earlier
  and propose what followed it. Costs microseconds; wins when the output repeats the input (code edits, quoting).
- ModelDrafter: a small GGUF with the target's vocabulary, run autoregressively with per-session KV.

Both are deterministic for greedy requests (no distributions sent). The model drafter samples sampled requests
from a truncated copy of its warped distribution and sends that distribution, so the target can verify losslessly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import numpy as np

from tandem import sampling
from tandem.engine import DecodeItem, Engine
from tandem.sampling import SparseDist
from tandem.sessions import Session

SINGLE_STEP_CATCH_UP = 4


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    dists: list[SparseDist] | None  # None: deterministic proposal


class Drafter(ABC):
    """Per-session drafting strategy; the DraftService owns sessions and positions, this owns the proposal."""

    name: str

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

    def appended(self, session: Session, start: int) -> None:  # noqa: B027 - optional hook
        """session.tokens[start:] were just committed."""

    def truncated(self, session: Session) -> None:  # noqa: B027 - optional hook
        """session.tokens was shortened (rollback)."""

    def close(self, session: Session, keep_cache: bool = False) -> None:  # noqa: B027 - optional hook
        """Free what the session holds (keep_cache: leave its KV cells for a later prompt with the same prefix)."""


INDEXED_LONG_LENGTHS = (6, 8, 12, 16, 24, 32)
MATCH_CAP = 32


class NgramIndex:
    """For each indexed n: the latest position that followed each n-gram of the sequence.

    Example with n=2 and tokens [5, 6, 7, 5, 6]: the suffix (5, 6) occurred before at positions 0-1 and was followed
    by 7 (position 2), so the proposal continues 7, 5, 6, ... from there.

    Every n up to 4 is indexed, longer ones sparsely (6, 8, 12, ...), so memory stays a few entries per token; the
    exact length of a match is then measured by comparing tokens backwards (`match`).
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        lengths = [n for n in range(n_min, n_max + 1) if n <= 4 or n in INDEXED_LONG_LENGTHS or n == n_max]
        self.follow: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in lengths}
        self._longest_first = sorted(self.follow, reverse=True)
        self.indexed = 0  # tokens[:indexed] are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        # The n-gram ending just before position j is followed by tokens[j].
        for j in range(max(self.indexed, 1), len(tokens)):
            for n, table in self.follow.items():
                if j >= n:
                    table[tuple(tokens[j - n : j])] = j
        self.indexed = len(tokens)

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(position that follows the best earlier occurrence of the sequence's suffix, matched length), or (-1, 0).

        The best occurrence is the latest one of the longest indexed suffix; its matched length is then counted
        exactly, up to MATCH_CAP tokens.
        """
        end = len(tokens)
        for n in self._longest_first:
            if n > end:
                continue
            j = self.follow[n].get(tuple(tokens[end - n :]))
            if j is not None:
                m = n
                while m < MATCH_CAP and j - m - 1 >= 0 and tokens[j - m - 1] == tokens[end - m - 1]:
                    m += 1
                return j, m
        return -1, 0

    def lookup(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        j, _ = self.match(tokens)
        return list(tokens[j : j + max_tokens]) if j >= 0 else []


class NgramDrafter(Drafter):
    """Prompt lookup with a confidence rule: a suffix matched over m tokens earns at most m - 1 draft tokens.

    A one- or two-token match is often a coincidence, and every rejected draft token costs verify time (on a CPU
    about a third of a one-token step each); a long match usually continues a verbatim copy. Measured offline on the
    benchmark's target-only texts (SmolLM2-135M, this CPU's verify costs), drafting m - 1 tokens gave a mean 1.50x
    over the 4 greedy workloads against 1.44x for a flat k=8 after a 3-token match and 1.20x for k=4 after any match.
    """

    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4, scaled: bool = True) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.scaled = scaled

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
        j, m = session.extra.match(session.tokens)
        n = min(max_tokens, m - 1) if self.scaled else max_tokens
        if j < 0 or n <= 0:
            return Draft([], None)
        return Draft(list(session.tokens[j : j + n]), None)


class ModelDrafter(Drafter):
    """A small model proposing autoregressively; its KV holds the committed tokens plus its last proposal.

    Proposals for all sessions of a step run together: each drafting step is one multi-sequence llama_decode.
    """

    name = "model"

    def __init__(self, engine: Engine, support: int = 32) -> None:
        self.engine = engine
        self.support = support

    def open(self, sessions: Sequence[Session]) -> None:
        for _ in self.open_steps(sessions):
            pass

    def open_steps(self, sessions: Sequence[Session]) -> Generator[None, None, None]:
        items = []
        for s in sessions:
            kept = len(s.kv_tokens)  # a prefix reused from a finished session's slot (prefix cache)
            self.engine.truncate(s.seq_id, kept)
            if kept < len(s.tokens):
                items.append(DecodeItem(s.seq_id, s.tokens[kept:], kept, "none"))
        yield from self.engine.prefill_steps(items)
        for s in sessions:
            s.kv_tokens = list(s.tokens)

    def _catch_up(self, sessions: Sequence[Session]) -> list[np.ndarray]:
        """Bring each KV cache to its committed sequence, reusing accepted proposals; return each last logits row.

        A short catch-up goes one token per pass, like the draft's own proposals and like target-only decoding: the
        draft's KV then matches one-token numerics exactly, so a same-model draft agrees with the target bit for bit.
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
        last: list[np.ndarray | None] = [None] * len(sessions)
        # Pass 0 takes long catch-ups whole; short ones advance one token per pass.
        step = 0
        while True:
            items, owners = [], []
            for i, (session, todo, start) in enumerate(zip(sessions, missing, starts, strict=True)):
                if len(todo) > SINGLE_STEP_CATCH_UP:
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

    def propose(self, session: Session, max_tokens: int) -> Draft:
        return self.propose_many([(session, max_tokens)])[0]

    def propose_many(self, work: Sequence[tuple[Session, int]]) -> list[Draft]:
        work = [(s, n) for s, n in work]
        active = [i for i, (_, n) in enumerate(work) if n > 0]
        rows = dict(zip(active, self._catch_up([work[i][0] for i in active]), strict=True))
        tokens: list[list[int]] = [[] for _ in work]
        dists: list[list[SparseDist]] = [[] for _ in work]
        while active:
            items, still = [], []
            for i in active:
                session, max_tokens = work[i]
                params = session.sampling
                if params.greedy:
                    token = int(np.argmax(rows[i]))
                else:
                    q = sampling.truncate(sampling.warp(rows[i], params), self.support)
                    token = sampling.sample(q, session.rng)
                    dists[i].append(q)
                tokens[i].append(token)
                if self.engine.is_eog(token) or len(tokens[i]) >= max_tokens or session.closed:
                    continue
                items.append(DecodeItem(session.seq_id, [token], len(session.kv_tokens), "last"))
                session.kv_tokens.append(token)
                still.append(i)
            if items:
                for i, r in zip(still, self.engine.decode(items), strict=True):
                    rows[i] = r[-1]
            active = still
        return [Draft(tokens[i], None if session.sampling.greedy else dists[i]) for i, (session, _) in enumerate(work)]

    def truncated(self, session: Session) -> None:
        kept = session.kv_catch_up(session.tokens)
        self.engine.truncate(session.seq_id, kept)

    def close(self, session: Session, keep_cache: bool = False) -> None:
        if keep_cache:  # the slot keeps exactly the cells of session.kv_tokens, for prefix reuse
            self.engine.truncate(session.seq_id, len(session.kv_tokens))
        else:
            self.engine.clear(session.seq_id)
