"""The target's job: prefill prompts, verify drafts losslessly, and keep each session's KV cache consistent.

Positions: a session's sequence is prompt + every emitted token. The last emitted token is "pending": it is known
but not yet in the KV cache, because its logits are only needed when the next round is verified. A verify round
evaluates [pending, d1..dk] in one batch (rows p_0..p_k), accepts a prefix d1..dj, adds the target's own token,
and rolls the KV cache back past the first rejected draft token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem import sampling
from tandem.engine import DecodeItem, Engine
from tandem.errors import InvalidArgument
from tandem.sampling import SamplingParams, SparseDist
from tandem.sessions import Session, SessionStore, make_rng


@dataclass(frozen=True)
class EmittedToken:
    token_id: int
    piece: bytes
    is_eog: bool
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, bytes, float], ...] = ()


@dataclass(frozen=True)
class OpenSpec:
    session_id: str
    prompt: Sequence[int]
    sampling: SamplingParams
    top_logprobs: int = -1


@dataclass(frozen=True)
class OpenResult:
    session_id: str
    position: int
    first_token: EmittedToken


@dataclass(frozen=True)
class VerifySpec:
    session_id: str
    position: int
    draft_tokens: Sequence[int]
    draft_dists: Sequence[SparseDist] | None  # None: deterministic draft (greedy model or n-gram)


@dataclass(frozen=True)
class VerifyResult:
    session_id: str
    num_accepted: int
    tokens: tuple[EmittedToken, ...]
    position: int


MAX_TOP_LOGPROBS = 20


def _log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


class Verifier:
    """Sessions plus the verification rule, over one Engine."""

    def __init__(self, engine: Engine, idle_timeout_s: float, verify_mode: str = "batched") -> None:
        self.engine = engine
        self.store = SessionStore(engine.settings.max_sessions, idle_timeout_s)
        self.verify_mode = verify_mode

    # ---------------------------------------------------------------- helpers

    def _emit(self, session: Session, token: int, row: np.ndarray | None) -> EmittedToken:
        logprob, top = None, ()
        if session.top_logprobs >= 0 and row is not None:
            lp = _log_softmax(row)
            logprob = float(lp[token])
            n = min(session.top_logprobs, MAX_TOP_LOGPROBS)
            if n:
                best = np.argpartition(-lp, n)[:n]
                best = best[np.argsort(-lp[best], kind="stable")]
                top = tuple((int(t), self.engine.pieces[t], float(lp[t])) for t in best)
        return EmittedToken(token, self.engine.pieces[token], self.engine.is_eog(token), logprob, top)

    def _pick(self, session: Session, row: np.ndarray) -> int:
        if session.sampling.greedy:
            return int(np.argmax(row))
        return sampling.sample(sampling.warp(row, session.sampling), session.rng)

    def _check_room(self, session: Session, extra: int) -> None:
        if session.position + extra > self.engine.n_ctx:
            raise InvalidArgument(
                f"session {session.session_id} would reach {session.position + extra} tokens, "
                f"over the context size {self.engine.n_ctx}"
            )

    # ---------------------------------------------------------------- RPCs

    def open(self, specs: Sequence[OpenSpec]) -> list[OpenResult]:
        """Prefill every new session in one batch and sample each one's first token."""
        results: dict[str, OpenResult] = {}
        fresh: list[Session] = []
        for spec in specs:
            self.engine.check_tokens(spec.prompt)
            if len(spec.prompt) >= self.engine.n_ctx:
                raise InvalidArgument(
                    f"prompt of {len(spec.prompt)} tokens does not fit the context size {self.engine.n_ctx}"
                )
            existing = self.store.find(spec.session_id)
            retried = existing is not None and existing.prompt == tuple(spec.prompt)
            if retried and existing.last_call is not None and existing.last_call[0] == ("open",):
                results[spec.session_id] = existing.last_call[1]  # retried Open: answer it again
        try:
            for spec in specs:
                if spec.session_id in results:
                    continue
                rng = make_rng(spec.sampling.seed, salt=0)
                fresh.append(self.store.create(spec.session_id, spec.prompt, spec.sampling, rng, spec.top_logprobs))
            rows = self.engine.decode([DecodeItem(s.seq_id, s.tokens, 0, "last") for s in fresh]) if fresh else []
        except Exception:
            for s in fresh:
                self.engine.clear(s.seq_id)
                self.store.close(s.session_id)
            raise
        for session, logits in zip(fresh, rows, strict=True):
            session.kv_tokens = list(session.tokens)
            first = self._pick(session, logits[-1])
            session.tokens.append(first)
            result = OpenResult(session.session_id, session.position, self._emit(session, first, logits[-1]))
            session.last_call = (("open",), result)
            results[session.session_id] = result
        return [results[spec.session_id] for spec in specs]

    def verify(self, specs: Sequence[VerifySpec]) -> list[VerifyResult]:
        """Verify each session's draft; all are validated before any compute, and run in one batch."""
        cached: dict[str, VerifyResult] = {}
        work: list[tuple[Session, VerifySpec]] = []
        for spec in specs:
            session = self.store.get(spec.session_id)
            key = ("verify", spec.position, tuple(spec.draft_tokens))
            hit = session.expect_position(spec.position, key)
            if hit is not None:
                cached[spec.session_id] = hit
                continue
            self.engine.check_tokens(spec.draft_tokens)
            if spec.draft_dists is not None and len(spec.draft_dists) != len(spec.draft_tokens):
                raise InvalidArgument("draft_distributions must be empty or one per draft token")
            self._check_room(session, len(spec.draft_tokens) + 1)
            work.append((session, spec))

        if self.verify_mode == "sequential":
            all_rows = [self._rows_sequential(s, spec.draft_tokens) for s, spec in work]
        else:
            items = [
                DecodeItem(s.seq_id, [s.tokens[-1], *spec.draft_tokens], len(s.tokens) - 1, "all") for s, spec in work
            ]
            for s, _ in work:
                s.kv_catch_up(s.tokens[:-1])
            all_rows = self.engine.decode(items) if items else []

        out: dict[str, VerifyResult] = dict(cached)
        for (session, spec), rows in zip(work, all_rows, strict=True):
            result = self._accept(session, spec, rows)
            session.last_call = (("verify", spec.position, tuple(spec.draft_tokens)), result)
            out[spec.session_id] = result
        return [out[spec.session_id] for spec in specs]

    def _rows_sequential(self, session: Session, drafts: Sequence[int]) -> np.ndarray:
        """One forward pass per token: numerically identical to target-only decoding (costs k passes).

        Greedy sessions stop at the first mismatch, as target-only decoding would.
        """
        session.kv_catch_up(session.tokens[:-1])
        rows = []
        sequence = [session.tokens[-1], *drafts]
        for i, token in enumerate(sequence):
            (row,) = self.engine.decode([DecodeItem(session.seq_id, [token], len(session.tokens) - 1 + i, "last")])
            rows.append(row[-1])
            if session.sampling.greedy and i < len(drafts) and int(np.argmax(row[-1])) != drafts[i]:
                break
        return np.stack(rows)

    def _accept(self, session: Session, spec: VerifySpec, rows: np.ndarray) -> VerifyResult:
        drafts = list(spec.draft_tokens)
        k = len(drafts)
        if session.sampling.greedy:
            argmax = np.argmax(rows, axis=1).tolist()
            n = 0
            while n < k and n < len(argmax) - 1 and drafts[n] == argmax[n]:
                n += 1
            outcome = sampling.VerifyOutcome(n, int(argmax[n]))
        else:
            probs = np.stack([sampling.warp(r, session.sampling) for r in rows])
            dists = list(spec.draft_dists) if spec.draft_dists is not None else [None] * k
            outcome = sampling.verify_stochastic(probs, drafts, dists, session.rng)
        n = outcome.n_accepted
        emitted = [*drafts[:n], outcome.next_token]
        # KV now holds [pending, d1..dk] (or fewer in sequential mode); keep pending and the accepted drafts.
        start = len(session.tokens) - 1
        self.engine.truncate(session.seq_id, start + n + 1)
        session.kv_tokens = [*session.tokens, *drafts[:n]]
        session.tokens.extend(emitted)
        tokens = tuple(self._emit(session, t, rows[i] if i < len(rows) else None) for i, t in enumerate(emitted))
        return VerifyResult(session.session_id, n, tokens, session.position)

    def rollback(self, items: Sequence[tuple[str, int]]) -> None:
        """Shorten sessions to `position` tokens; the last kept token becomes pending again."""
        for session in self.store.rollback(items):
            session.kv_catch_up(session.tokens[:-1])
            self.engine.truncate(session.seq_id, len(session.kv_tokens))

    def close(self, session_ids: Sequence[str]) -> int:
        closed = 0
        for sid in session_ids:
            session = self.store.close(sid)
            if session is not None:
                self.engine.clear(session.seq_id)
                closed += 1
        return closed

    def expire_idle(self) -> int:
        return self.close(self.store.idle())
