"""Constrained decoding: a grammar the target masks every position it samples or verifies with.

Structured output (`response_format`), forced tool calls and Codex's custom tools all become a `Constraint`: a JSON
Schema, a Lark grammar or a regular expression, compiled by llguidance (docs/decisions/0013). The target keeps one
`GrammarState` per constrained session. A Verify of [pending, d1..dk] masks row i with the grammar's state after
d1..di, so a draft token the grammar forbids has probability 0 and is rejected, and the target's own token is drawn
from the masked row: the accepted output then has exactly the constrained target distribution, defined as the
distribution masked first and then warped (temperature, top-k, top-p), so truncation never leaves no valid token.
The matcher follows the emitted tokens and rolls back with the KV cache.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from tandem.errors import EngineFailure, InvalidArgument

if TYPE_CHECKING:
    from tandem.engine import Engine

ConstraintKind = Literal["json_schema", "lark", "regex"]


@dataclass(frozen=True)
class Constraint:
    """What the output must match: a JSON Schema (JSON text), a Lark grammar (llguidance's dialect) or a regex.

    `named`: (name, Lark grammar) pairs a Lark grammar references as `@name` (a custom tool's input format)."""

    kind: ConstraintKind
    source: str
    named: tuple[tuple[str, str], ...] = ()

    def grammar(self) -> str:
        """llguidance's grammar for this constraint; InvalidArgument naming the problem if it does not compile.
        Compiled once per distinct constraint in a process (the gateway checks a request's grammar before the
        target, or a co-located target, compiles the same one)."""
        return _compile(self.kind, self.source, self.named)


@functools.lru_cache(maxsize=64)
def _compile(kind: ConstraintKind, source: str, named: tuple[tuple[str, str], ...]) -> str:
    try:
        if kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(json.loads(source))
        elif kind == "lark" and named:
            grammars = [{"lark_grammar": source}]
            grammars += [{"name": name, "lark_grammar": sub} for name, sub in named]
            grammar = json.dumps({"grammars": grammars})
        elif kind == "lark":
            grammar = LLMatcher.grammar_from_lark(source)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(source)
        else:
            raise InvalidArgument(f"unknown constraint kind {kind!r}")
    except (ValueError, TypeError, RuntimeError) as exc:  # json.JSONDecodeError is a ValueError
        raise InvalidArgument(f"the {kind.replace('_', ' ')} does not compile: {_first_line(exc)}") from exc
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidArgument(f"the {kind.replace('_', ' ')} does not compile: {_first_line(messages[0])}")
    return grammar


def _first_line(message: object, limit: int = 300) -> str:
    """llguidance's message without the grammar it quotes (a tools grammar can run to 50 kB)."""
    line = str(message).strip().splitlines()[0] if str(message).strip() else "unknown error"
    return line if len(line) <= limit else line[:limit] + "..."


def tokenizer_for(engine: Engine) -> LLTokenizer:
    """llguidance's view of the engine's vocabulary (~1 s to build: build once per engine). Every end-of-generation
    token may end the output where the grammar is complete."""
    from llguidance.llamacpp import lltokenizer_from_vocab

    return lltokenizer_from_vocab(engine._vocab, n_vocab=engine.n_vocab, eos_token=list(engine.eog_ids))


class GrammarState:
    """One session's matcher over the tokens it emitted (not the prompt)."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str, n_vocab: int) -> None:
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        self.n_vocab = n_vocab
        self.busy_ns = 0  # time in masks and matcher updates, for the call's Timing.mask_ns
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise EngineFailure(f"grammar matcher failed: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """Which tokens the grammar allows next (bool per vocabulary entry)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        return np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)

    def mask_rows(self, rows: np.ndarray, drafts: Sequence[int]) -> tuple[np.ndarray, int]:
        """Masked copies of the logits rows of [pending, d1..dk]: row i with the state after d1..di.

        The drafts are consumed tentatively up to the first one the grammar forbids (its row and the ones after it are
        masked as well as known: that draft is rejected, so no later row is read). Returns the rows and how many drafts
        were consumed, for `settle`."""
        t0 = time.perf_counter_ns()
        masked = np.empty(rows.shape, dtype=np.float32)
        consumed = 0
        for i in range(len(rows)):
            allowed = self.allowed()
            np.copyto(masked[i], rows[i])
            masked[i][~allowed] = -np.inf
            if i >= len(drafts):
                break
            if not allowed[drafts[i]] or not self.matcher.consume_token(drafts[i]):
                masked[i + 1 :] = masked[i]  # never read: the draft at i is rejected
                break
            consumed += 1
        self.busy_ns += time.perf_counter_ns() - t0
        return masked, consumed

    def settle(self, consumed: int, accepted: int, own: int) -> None:
        """After a verification: keep the accepted drafts, then take the target's own token."""
        t0 = time.perf_counter_ns()
        if consumed > accepted:
            self.matcher.rollback(consumed - accepted)
        self.take(own)
        self.busy_ns += time.perf_counter_ns() - t0

    def take(self, token: int) -> None:
        """An emitted token, drawn from a masked row (so the grammar allows it)."""
        if not self.matcher.consume_token(token):
            self._check()

    def rollback(self, tokens: int) -> None:
        if tokens > 0 and not self.matcher.rollback(tokens):
            self._check()
