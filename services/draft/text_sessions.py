"""Text sessions: a model draft drafting for a target of another vocabulary (docs/decisions/0015).

The draft never sees the target's token ids. It gets the prompt and then the committed text as bytes (the target's
pieces), keeps its own tokens for that text, and answers with text. Each Propose re-tokenizes only the tail that
changed: from a few committed tokens before the old end (a merge across it changes only those), keeping the prompt's
tokens as they are; the model drafter then keeps the KV cells of the longest common prefix with what it computed
(its accepted proposal is usually that very tokenization) and computes the rest. Text that ends inside a UTF-8
character (a byte token) waits as `pending` until the character is complete, and a proposal must spell it first.

With a shared vocabulary (token-level intersection) the draft's rows are restricted to the tokens the target's
vocabulary spells alike (`SharedTokens.restrict`, in the model drafter), and the proposal goes out in the target's
ids with q in those ids too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.cross_vocab import SharedTokens, VocabularyText, valid_utf8_prefix
from tandem.engine import Engine
from tandem.errors import ConditionNotMet, InvalidArgument, PromptTooLong
from tandem.sampling import SparseDist
from tandem.sessions import Session

BACKOFF_TOKENS = 4  # committed tokens re-tokenized together with new text


@dataclass(frozen=True)
class TextPrompt:
    """OpenItem.prompt_text and OpenItem.shared_vocabulary."""

    text: bytes
    shared_vocabulary: str = ""


@dataclass
class TextState:
    """A text session's committed text (the bytes of the target's pieces) and where this draft's tokens end in it."""

    text: bytearray
    prompt_tokens: int  # the prompt's draft tokens: never re-tokenized (their control markup was parsed)
    prompt_bytes: int  # the part of the prompt text they spell
    ends: list[int]  # byte offset where each token after the prompt ends
    shared: SharedTokens | None = None  # token-level intersection with the target's vocabulary
    lost: bool = False  # the tokenizer did not spell the text back: this session proposes nothing more

    @property
    def covered(self) -> int:
        """Bytes of the text the session's tokens spell."""
        return self.ends[-1] if self.ends else self.prompt_bytes

    @property
    def pending(self) -> bytes:
        """Committed bytes after the tokens: the start of a UTF-8 character whose end has not come yet."""
        return bytes(self.text[self.covered :])


@dataclass(frozen=True)
class TextProposal:
    """A text session's Proposal: its text and, with a shared vocabulary, the target's ids of it and their q."""

    text: bytes
    token_ids: list[int] = field(default_factory=list)
    dists: list[SparseDist] | None = None
    context_full: bool = False


@dataclass
class TextSessions:
    """The draft service's text sessions over one model: tokenizing, proposals as text, the shared vocabularies."""

    engine: Engine
    n_ctx: int
    shared: dict[str, SharedTokens] = field(default_factory=dict)  # by the target vocabulary's fingerprint
    _control: frozenset[int] | None = None
    _vocabulary: VocabularyText | None = None

    @property
    def vocabulary(self) -> VocabularyText:
        """This model's vocabulary as text (built on first use: ~0.2 s at 262k tokens)."""
        if self._vocabulary is None:
            self._vocabulary = VocabularyText.of_engine(self.engine)
            self._control = frozenset(self._vocabulary.markup)
        return self._vocabulary

    def learn_vocabulary(self, target: VocabularyText) -> int:
        """Keep a target's vocabulary for OpenItem.shared_vocabulary; returns the number of shared tokens."""
        shared = self.shared.get(target.fingerprint)
        if shared is None:
            shared = self.shared[target.fingerprint] = SharedTokens(self.vocabulary, target)
        return shared.size

    def open(self, prompt: TextPrompt) -> tuple[list[int], TextState]:
        """The prompt's tokens (this model's BOS, control markup parsed) and the session's text state."""
        _ = self.vocabulary  # built here once (the control tokens that end a proposal), not inside a Propose
        shared = None
        if prompt.shared_vocabulary:
            shared = self.shared.get(prompt.shared_vocabulary)
            if shared is None:
                raise ConditionNotMet(
                    f"this draft does not hold vocabulary {prompt.shared_vocabulary[:12]}: send it with PutVocabulary"
                )
        end = valid_utf8_prefix(prompt.text)
        tokens = self.engine.tokenize(prompt.text[:end].decode("utf-8"), add_special=True, parse_special=True)
        if not tokens:
            raise InvalidArgument("prompt_text has no tokens")
        if len(tokens) >= self.n_ctx:
            raise PromptTooLong(f"the prompt is {len(tokens)} tokens here, over this draft's context of {self.n_ctx}")
        return tokens, TextState(bytearray(prompt.text), len(tokens), end, [], shared)

    def learn(self, session: Session, append: bytes) -> None:
        """Append committed text and re-tokenize the tail it changes (session.tokens follows the text)."""
        state: TextState = session.extra
        state.text += append
        backoff = max(0, len(state.ends) - BACKOFF_TOKENS)
        start = state.ends[backoff - 1] if backoff else state.prompt_bytes
        end = valid_utf8_prefix(state.text, start)
        if end == state.covered or state.lost:
            return
        tail = self.engine.tokenize(state.text[start:end].decode("utf-8"), add_special=False, parse_special=False)
        ends, spelled = [], start
        for token in tail:
            spelled += len(self.engine.pieces[token])
            ends.append(spelled)
        if spelled != end:  # a tokenizer that does not spell text back (normalisation): stop drafting here
            state.lost = True
            return
        del session.tokens[state.prompt_tokens + backoff :]
        session.tokens.extend(tail)
        state.ends[backoff:] = ends

    def room(self, session: Session) -> int:
        """Draft tokens the session may still propose: 0 once its tokens fill the context (or its text was lost)."""
        state: TextState = session.extra
        if state.lost:
            return 0
        return max(self.n_ctx - len(session.tokens) - 1, 0)

    def proposal(
        self, session: Session, tokens: Sequence[int], dists: Sequence[SparseDist] | None, full: bool
    ) -> TextProposal:
        """The draft's tokens as text, up to its first control or end-of-generation token, after the pending bytes."""
        state: TextState = session.extra
        _ = self.vocabulary  # the control tokens
        control = self._control or frozenset()
        pieces, skip = [], 0
        for token in tokens:
            if token in control or self.engine.is_eog(token):
                break
            pieces.append(self.engine.pieces[token])
        pending = state.pending
        if pending:  # the proposal must first finish the character the committed text ends inside
            spelled = 0
            while skip < len(pieces) and spelled < len(pending):
                spelled += len(pieces[skip])
                skip += 1
            joined = b"".join(pieces[:skip])
            if not joined.startswith(pending) or (state.shared is not None and spelled != len(pending)):
                pieces, skip = [], 0
        text = b"".join(pieces)[len(pending) :] if pieces else b""
        if state.shared is None:
            return TextProposal(text, context_full=full)
        kept = list(tokens[skip : len(pieces)])
        ids = [int(t) for t in state.shared.target_of[kept]] if kept else []
        shared_dists = [state.shared.to_target(q) for q in dists[skip : len(pieces)]] if dists else None
        return TextProposal(text, ids, shared_dists, full)
