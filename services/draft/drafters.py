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
from collections.abc import Sequence
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

    @abstractmethod
    def open(self, sessions: Sequence[Session]) -> None:
        """Prepare new sessions (prefill, indexes)."""

    @abstractmethod
    def propose(self, session: Session, max_tokens: int) -> Draft:
        """Propose up to max_tokens tokens continuing session.tokens."""

    def appended(self, session: Session, start: int) -> None:  # noqa: B027 - optional hook
        """session.tokens[start:] were just committed."""

    def truncated(self, session: Session) -> None:  # noqa: B027 - optional hook
        """session.tokens was shortened (rollback)."""

    def close(self, session: Session) -> None:  # noqa: B027 - optional hook
        """Free what the session holds."""


class NgramIndex:
    """For n in [n_min, n_max]: the latest position that followed each n-gram of the sequence.

    Example with n=2 and tokens [5, 6, 7, 5, 6]: the suffix (5, 6) occurred before at positions 0-1 and was followed
    by 7 (position 2), so the proposal continues 7, 5, 6, ... from there.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.follow: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0  # tokens[:indexed] are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        # The n-gram ending just before position j is followed by tokens[j].
        for j in range(max(self.indexed, 1), len(tokens)):
            for n, table in self.follow.items():
                if j >= n:
                    table[tuple(tokens[j - n : j])] = j
        self.indexed = len(tokens)

    def lookup(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        end = len(tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            j = self.follow[n].get(tuple(tokens[end - n :]))
            if j is not None:
                return list(tokens[j : j + max_tokens])
        return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        self.n_min, self.n_max = n_min, n_max

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
        if max_tokens <= 0:
            return Draft([], None)
        return Draft(session.extra.lookup(session.tokens, max_tokens), None)


class ModelDrafter(Drafter):
    """A small model proposing autoregressively; its KV holds the committed tokens plus its last proposal."""

    name = "model"

    def __init__(self, engine: Engine, support: int = 32) -> None:
        self.engine = engine
        self.support = support

    def open(self, sessions: Sequence[Session]) -> None:
        items = [DecodeItem(s.seq_id, s.tokens, 0, "none") for s in sessions]
        if items:
            self.engine.decode(items)
        for s in sessions:
            s.kv_tokens = list(s.tokens)

    def _catch_up(self, session: Session) -> np.ndarray:
        """Bring the KV cache to the committed sequence, reusing accepted proposals; return the last logits row."""
        kept = session.kv_catch_up(session.tokens)
        if kept == len(session.tokens):
            kept -= 1  # the last token's logits are needed again: recompute that one cell
            del session.kv_tokens[kept:]
        self.engine.truncate(session.seq_id, kept)
        missing = session.tokens[kept:]
        if len(missing) <= SINGLE_STEP_CATCH_UP:
            # One token per pass, like the draft's own proposals and like target-only decoding: the draft's KV then
            # matches one-token numerics exactly, so a same-model draft agrees with the target bit for bit.
            for i, token in enumerate(missing):
                (rows,) = self.engine.decode([DecodeItem(session.seq_id, [token], kept + i, "last")])
        else:
            (rows,) = self.engine.decode([DecodeItem(session.seq_id, missing, kept, "last")])
        session.kv_tokens.extend(missing)
        return rows[-1]

    def propose(self, session: Session, max_tokens: int) -> Draft:
        row = self._catch_up(session)
        params = session.sampling
        tokens: list[int] = []
        dists: list[SparseDist] = []
        for i in range(max_tokens):
            if params.greedy:
                token = int(np.argmax(row))
            else:
                q = sampling.truncate(sampling.warp(row, params), self.support)
                token = sampling.sample(q, session.rng)
                dists.append(q)
            tokens.append(token)
            if self.engine.is_eog(token) or i == max_tokens - 1:
                break
            (rows,) = self.engine.decode([DecodeItem(session.seq_id, [token], len(session.kv_tokens), "last")])
            session.kv_tokens.append(token)
            row = rows[-1]
        return Draft(tokens, None if params.greedy else dists)

    def truncated(self, session: Session) -> None:
        kept = session.kv_catch_up(session.tokens)
        self.engine.truncate(session.seq_id, kept)

    def close(self, session: Session) -> None:
        self.engine.clear(session.seq_id)
