"""The target's job: prefill prompts, verify drafts losslessly, and keep each session's KV cache consistent.

Positions: a session's sequence is prompt + every emitted token. The last emitted token is "pending": it is known
but not yet in the KV cache, because its logits are only needed when the next round is verified. A verify round
evaluates [pending, d1..dk] in one batch (rows p_0..p_k), accepts a prefix d1..dj, adds the target's own token,
and rolls the KV cache back past the first rejected draft token.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem import acceptance, sampling
from tandem.engine import DecodeItem, DeviceArgmax, Engine, greedy_token
from tandem.errors import ConditionNotMet, InvalidArgument, SessionNotFound, TandemError
from tandem.grammar import Constraint, GrammarState, tokenizer_for
from tandem.ngram import LookupRule
from tandem.sampling import SamplingParams, SparseDist
from tandem.scheduler import plan_step, step_results
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
    constraint: Constraint | None = None


@dataclass(frozen=True)
class OpenResult:
    session_id: str
    position: int
    first_token: EmittedToken


@dataclass(frozen=True)
class StepShape:
    """Sessions and tokens in the forward pass that served a call (several calls share one when batched)."""

    sequences: int = 0
    tokens: int = 0
    forward_ns: int = 0  # the step's time inside llama_decode
    started_ns: int = 0  # time.perf_counter_ns() when the step began: a call's wait before it is its queue time


@dataclass(frozen=True)
class LookupRound:
    """A round drafted here with the caller's prompt-lookup rule (Continuation.lookup), as the call reports it; or, with
    match_len 0 at offset 0, the round of the caller's own drafts that a multi-step call went on from."""

    offset: int  # index of its first token among the call's tokens; it emitted accepted + 1 from there
    match_len: int
    drafted: int
    accepted: int
    step: StepShape


@dataclass(frozen=True)
class PlainChain:
    """A call that decodes several plain tokens, one step each (`Continuation.plain_steps`), as one of its steps sees
    it; its first step may verify the caller's drafts (`drafts`: a round that goes on as target-only decoding).

    The steps are separate verify specs, so that each one batches with other sessions; the chain lets the verifier
    answer an exact retry of the whole call from memory, as it does for a single step.
    """

    start: int  # the call's position
    steps: int  # tokens it asks for
    earlier: tuple[EmittedToken, ...] = ()  # tokens its earlier steps emitted
    stop_at_repeat: int = 0  # end the call once the sequence ends with this many tokens seen together before
    lookup: LookupRule | None = None  # the caller's prompt lookup, drafted here before each step
    earlier_rounds: tuple[LookupRound, ...] = ()  # lookup rounds of its earlier steps
    drafts: tuple[int, ...] = ()  # the caller's own drafts, verified by the first step (a round that goes on)

    @property
    def key(self) -> tuple:
        return ("plain", self.start, self.steps, self.drafts)

    def done(self, result: VerifyResult) -> bool:
        """Whether the call ends with this step's result: all its tokens are out, the last ended the text, or it left
        the sequence where the caller's prompt lookup could draft (`stop_at_repeat`)."""
        return result.position >= self.start + self.steps or result.tokens[-1].is_eog or result.ends_repeat


@dataclass(frozen=True)
class VerifySpec:
    session_id: str
    position: int
    draft_tokens: Sequence[int]
    draft_dists: Sequence[SparseDist] | None  # None: deterministic draft (greedy model or n-gram)
    bonus_guess: int | None = None  # overlapped drafting: the draft's guess for the target's own token
    chain: PlainChain | None = None  # one step of a multi-token plain call
    stop_at_repeat: int = 0  # plain calls: skip if the sequence already ends with a repeat of this many tokens
    lookup_match: int = 0  # a chain step whose drafts the caller's lookup rule chose: the match behind them

    @property
    def key(self) -> tuple:
        """What an exact retry of this call repeats: a whole chain is keyed by its start (see PlainChain)."""
        if self.chain is not None and self.position == self.chain.start:
            return self.chain.key
        return ("verify", self.position, tuple(self.draft_tokens))


@dataclass(frozen=True)
class VerifyResult:
    session_id: str
    num_accepted: int
    tokens: tuple[EmittedToken, ...]
    position: int
    step: StepShape = StepShape()
    ends_repeat: bool = False  # a chain step with stop_at_repeat: the sequence now ends with such a repeat
    lookup_rounds: tuple[LookupRound, ...] = ()  # rounds drafted here with the caller's lookup rule, in order


MAX_TOP_LOGPROBS = 20


def _log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


class Verifier:
    """Sessions plus the verification rule, over one Engine."""

    #: Non-empty only in bench.synthetic_target's subclass, which imposes acceptance (Capabilities field).
    synthetic_label = ""

    def __init__(
        self, engine: Engine, idle_timeout_s: float, verify_mode: str = "batched", prefix_cache: bool = True
    ) -> None:
        self.engine = engine
        self.store = SessionStore(engine.max_sessions, idle_timeout_s)
        self.verify_mode = verify_mode
        self.prefix_cache = prefix_cache
        self._tokenizer = None  # llguidance's view of the vocabulary, for constrained sessions

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

    def _argmax_only(self, session: Session) -> bool:
        """Whether nothing of the session's rows is read but their argmax (the engine may then take it on the device):
        greedy, unconstrained, no logprobs, and batched verification (the sequential mode reads each row)."""
        return (
            session.sampling.greedy
            and session.grammar is None
            and session.top_logprobs < 0
            and self.verify_mode == "batched"
        )

    def _pick(self, session: Session, row: np.ndarray | int) -> int:
        """The target's own token from one logits row, or the row's device argmax (masked first for a constrained
        session, which never has one)."""
        if session.grammar is not None:
            (row,), _ = session.grammar.mask_rows(row[None, :], ())
        if session.sampling.greedy:
            token = greedy_token(row)
        else:
            token = sampling.sample_logits(row, session.sampling, session.rng)
        if session.grammar is not None:
            session.grammar.take(token)
        return token

    def _grammar(self, constraint: Constraint | None) -> GrammarState | None:
        """A constrained session's matcher; the vocabulary's llguidance tokenizer is built once, on first use."""
        if constraint is None:
            return None
        grammar = constraint.grammar()  # InvalidArgument if it does not compile
        if self._tokenizer is None:
            self._tokenizer = tokenizer_for(self.engine)
        return GrammarState(self._tokenizer, grammar, self.engine.n_vocab)

    def _check_room(self, session: Session, extra: int) -> None:
        if session.position + extra > self.engine.n_ctx:
            raise InvalidArgument(
                f"session {session.session_id} would reach {session.position + extra} tokens, "
                f"over the context size {self.engine.n_ctx}"
            )

    # ---------------------------------------------------------------- RPCs

    def open_steps(self, specs: Sequence[OpenSpec]) -> Generator[None, None, list[OpenResult]]:
        """Prefill new sessions, one chunk of at most n_batch tokens per step, and sample each one's first token.

        A generator so that the scheduler can run other sessions' verify steps between chunks (chunked prefill).
        Prompt tokens already in a free slot's KV cells (prefix cache) are not computed again.
        """
        results: dict[str, OpenResult] = {}
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
        fresh: list[Session] = []
        try:
            for spec in specs:
                if spec.session_id not in results:
                    rng = make_rng(spec.sampling.seed, salt=0)
                    grammar = self._grammar(spec.constraint)
                    session = self.store.create(spec.session_id, spec.prompt, spec.sampling, rng, spec.top_logprobs)
                    session.grammar = grammar
                    self.engine.set_device_argmax(session.seq_id, self._argmax_only(session))
                    fresh.append(session)
            last_rows = yield from self._prefill(fresh)
        except BaseException:
            for s in fresh:
                self.store.close(s.session_id)
            self.reclaim()
            raise
        for session in fresh:
            row = last_rows[session.session_id]
            first = self._pick(session, row)
            session.tokens.append(first)
            result = OpenResult(session.session_id, session.position, self._emit(session, first, row))
            session.last_call = (("open",), result)
            results[session.session_id] = result
        return [results[spec.session_id] for spec in specs]

    def _prefill(self, sessions: Sequence[Session]) -> Generator[None, None, dict[str, np.ndarray]]:
        """Fill each session's KV with its prompt (minus a cached prefix); yield between chunks; last logits rows."""
        items, todo = [], []
        for s in sessions:
            kept = len(s.kv_tokens)
            # A cached device argmax serves only a session that reads nothing else; a cached row serves any session.
            cached = s.prompt_row is not None and (not isinstance(s.prompt_row, int) or self.engine.argmax_on(s.seq_id))
            if kept == len(s.tokens) and cached:
                self.engine.truncate(s.seq_id, kept)  # the same prompt again: its cells and last row are cached
                continue
            s.prompt_row = None
            if kept == len(s.tokens):
                kept -= 1  # the whole prompt is cached: recompute the last token, whose logits are needed
                del s.kv_tokens[kept:]
            self.engine.truncate(s.seq_id, kept)
            items.append(DecodeItem(s.seq_id, s.tokens[kept:], kept, "last"))
            todo.append(s)
        steps = self.engine.prefill_steps(items)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                rows = stop.value
                break
            yield
            if any(s.closed for s in todo):
                raise SessionNotFound("a session was closed while its prompt was being prefilled")
        for s, r in zip(todo, rows, strict=True):
            s.kv_tokens = list(s.tokens)
            s.prompt_row = r[-1]
        return {s.session_id: s.prompt_row for s in sessions}

    def verify_groups(self, groups: Sequence[Sequence[VerifySpec]]) -> list[Any]:
        """Verify the drafts of many calls in one forward pass; a failing call fails alone.

        Each group (one call) is validated as a whole before any compute. A group naming a session that an earlier
        group of this step already verifies is deferred to the next step, where an exact retry hits the cache.
        """
        started = time.perf_counter_ns()
        outcomes, work = plan_step(groups, self._check_group)
        forward0 = self.engine.forward_ns
        try:
            all_rows = self._forward([item for _, item in work])
        except TandemError as exc:
            failed = {g for g, _ in work}
            return [exc if g in failed else o for g, o in enumerate(outcomes)]
        step = StepShape(
            len(work),
            sum(len(spec.draft_tokens) + 1 for _, (_, spec) in work),
            self.engine.forward_ns - forward0,
            started,
        )
        for (g, (session, spec)), rows in zip(work, all_rows, strict=True):
            result = self._accept(session, spec, rows, step)
            session.last_call = (spec.key, result)
            chain = spec.chain
            if chain is not None:  # one step of a multi-token call: answer with all of the call's tokens so far
                rounds = chain.earlier_rounds
                if spec.lookup_match:
                    drafted, accepted = len(spec.draft_tokens), result.num_accepted
                    rounds = (*rounds, LookupRound(len(chain.earlier), spec.lookup_match, drafted, accepted, step))
                elif chain.drafts and spec.position == chain.start:  # the caller's round, which the call goes on from
                    rounds = (LookupRound(0, 0, len(chain.drafts), result.num_accepted, step),)
                result = dataclasses.replace(
                    result,
                    tokens=(*chain.earlier, *result.tokens),
                    ends_repeat=bool(chain.stop_at_repeat) and session.ends_with_repeat(chain.stop_at_repeat),
                    lookup_rounds=rounds,
                )
                if chain.done(result):
                    session.last_call = (chain.key, result)  # an exact retry of the whole call gets all of it
            outcomes[g][spec.session_id] = result
        return step_results(groups, outcomes)

    def verify(self, specs: Sequence[VerifySpec]) -> list[VerifyResult]:
        """One call's verification on its own (tests and tools); the service batches calls with verify_groups."""
        (outcome,) = self.verify_groups([specs])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _check_group(
        self, specs: Sequence[VerifySpec]
    ) -> list[tuple[str, VerifyResult | None, tuple[Session, VerifySpec]]]:
        checked = []
        for spec in specs:
            session = self.store.get(spec.session_id)
            hit = session.expect_position(spec.position, spec.key)
            if hit is None and spec.chain is not None and spec.chain.lookup is not None and not spec.draft_tokens:
                # The caller's prompt lookup, run here: the draft it would have sent in a round of its own.
                room = self.engine.n_ctx - session.position - 1
                drafts, match_len = session.lookup_draft(spec.chain.lookup, room)
                if drafts:
                    spec = dataclasses.replace(spec, draft_tokens=tuple(drafts), lookup_match=match_len)
            if hit is None:
                if spec.stop_at_repeat:
                    if spec.draft_tokens:
                        raise InvalidArgument("stop_at_repeat needs an item without draft tokens")
                    if session.ends_with_repeat(spec.stop_at_repeat):
                        raise ConditionNotMet(
                            f"session {session.session_id} ends with a repeat of {spec.stop_at_repeat} tokens"
                        )
                self.engine.check_tokens(spec.draft_tokens)
                if spec.draft_dists is not None and len(spec.draft_dists) != len(spec.draft_tokens):
                    raise InvalidArgument("draft_distributions must be empty or one per draft token")
                self._check_room(session, len(spec.draft_tokens) + 1)
            checked.append((spec.session_id, hit, (session, spec)))
        if len({spec.session_id for spec in specs}) != len(specs):
            raise InvalidArgument("a session appears twice in one Verify call")
        return checked

    def _forward(self, work: Sequence[tuple[Session, VerifySpec]]) -> list[np.ndarray]:
        """Logits rows for [pending, d1..dk] of every session in `work`: one batch, or one pass per token."""
        if self.verify_mode == "sequential":
            return [self._rows_sequential(s, spec.draft_tokens) for s, spec in work]
        items = []
        for s, spec in work:
            s.kv_catch_up(s.tokens[:-1])
            items.append(DecodeItem(s.seq_id, [s.tokens[-1], *spec.draft_tokens], len(s.tokens) - 1, "all"))
        try:
            # Views of llama.cpp's logits: _accept reads them within this step, before the engine decodes again.
            return self.engine.decode(items, copy=False) if items else []
        except BaseException:
            for item in items:  # cells written before the failure would break the next call's positions
                self.engine.truncate(item.seq_id, item.start)
            raise

    def _rows_sequential(self, session: Session, drafts: Sequence[int]) -> np.ndarray:
        """One forward pass per token: numerically identical to target-only decoding (costs k passes).

        Greedy sessions stop at the first mismatch, as target-only decoding would.
        """
        session.kv_catch_up(session.tokens[:-1])
        rows = []
        sequence = [session.tokens[-1], *drafts]
        greedy_stop = session.sampling.greedy and session.grammar is None  # a grammar may change the argmax
        for i, token in enumerate(sequence):
            (row,) = self.engine.decode([DecodeItem(session.seq_id, [token], len(session.tokens) - 1 + i, "last")])
            rows.append(row[-1])
            if greedy_stop and i < len(drafts) and int(row[-1].argmax()) != drafts[i]:
                break
        return np.stack(rows)

    def decide(self, session: Session, spec: VerifySpec, rows: np.ndarray) -> acceptance.VerifyOutcome:
        """The lossless rule: how many drafts the target accepts and its own next token, from the logits rows of
        [pending, d1..dk]. (A benchmark subclass imposes synthetic outcomes here: bench.synthetic_target.)"""
        drafts = list(spec.draft_tokens)
        if session.sampling.greedy:
            # Argmax row by row, up to the first mismatch. Sequential verification may have stopped early: it then
            # has a row for each draft up to the mismatch, plus that one.
            argmaxes = rows.tokens if isinstance(rows, DeviceArgmax) else acceptance.ArgmaxRows(rows)
            return acceptance.verify_greedy(argmaxes, drafts[: len(rows) - 1])
        probs = acceptance.WarpedRows(rows, session.sampling)  # warped as read: up to the first rejection
        dists = list(spec.draft_dists) if spec.draft_dists is not None else [None] * len(drafts)
        return acceptance.verify_stochastic(probs, drafts, dists, session.rng)

    def _accept(self, session: Session, spec: VerifySpec, rows: np.ndarray, step: StepShape) -> VerifyResult:
        drafts = list(spec.draft_tokens)
        k = len(drafts)
        consumed = 0
        if session.grammar is not None:  # mask first: a draft the grammar forbids has probability 0
            rows, consumed = session.grammar.mask_rows(rows, drafts)
        outcome = self.decide(session, spec, rows)
        n = outcome.n_accepted
        if session.grammar is not None:
            session.grammar.settle(consumed, n, outcome.next_token)
        emitted = [*drafts[:n], outcome.next_token]
        # KV now holds [pending, d1..dk] (or fewer in sequential mode); keep pending and the accepted drafts.
        start = len(session.tokens) - 1
        if n < k:  # with every draft accepted there is nothing to drop (and llama_memory_seq_rm walks every cell)
            self.engine.truncate(session.seq_id, start + n + 1)
        session.kv_tokens = [*session.tokens, *drafts[:n]]
        session.tokens.extend(emitted)
        tokens = tuple(self._emit(session, t, rows[i] if i < len(rows) else None) for i, t in enumerate(emitted))
        return VerifyResult(session.session_id, n, tokens, session.position, step)

    def grammar_ns(self, session_ids: Sequence[str]) -> int:
        """Time these sessions' grammars have taken so far (0 for unconstrained or closed sessions)."""
        total = 0
        for sid in session_ids:
            session = self.store.find(sid)
            if session is not None and session.grammar is not None:
                total += session.grammar.busy_ns
        return total

    def rollback(self, items: Sequence[tuple[str, int]]) -> None:
        """Shorten sessions to `position` tokens; the last kept token becomes pending again."""
        before = {sid: self.store.get(sid).position for sid, _ in items}
        for session in self.store.rollback(items):
            if session.grammar is not None:  # the matcher follows the emitted tokens back
                session.grammar.rollback(before[session.session_id] - session.position)
            session.kv_catch_up(session.tokens[:-1])
            self.engine.truncate(session.seq_id, len(session.kv_tokens))

    def close(self, session_ids: Sequence[str]) -> int:
        """Drop sessions at once (any thread); their KV is reclaimed by the engine thread before its next step."""
        return sum(self.store.close(sid) is not None for sid in session_ids)

    def reclaim(self) -> None:
        """Engine thread: free closed sessions' slots, keeping their KV cells as a reusable prefix if configured."""
        for session in self.store.take_closed():
            if not self.prefix_cache:
                self.engine.clear(session.seq_id)
            else:
                self.engine.truncate(session.seq_id, len(session.kv_tokens))
            self.store.release(session, keep_cache=self.prefix_cache)

    def expire_idle(self) -> int:
        closed = self.close(self.store.idle())
        self.reclaim()
        return closed
