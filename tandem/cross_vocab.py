"""Cross-vocabulary drafting: the pieces both sides need to let a draft of one vocabulary serve a target of another.

Two ways across (docs/decisions/0015):

- String level (the default): the draft works in its own tokens and sends text; the target tokenizes that text and
  verifies the tokens as deterministic drafts, as it verifies an n-gram draft, so the output keeps exactly the
  target's distribution. `DraftTranslator` is the target's half; `valid_utf8_prefix` keeps raw bytes raw (a draft's
  byte token may end inside a character: that text is never decoded with replacement, it waits).
- Token-level intersection (TLI, Timor et al., ICML 2025): the draft samples from its distribution restricted to the
  tokens whose text is one token of the target's vocabulary too, renormalised, and sends that q in the target's ids
  (`SharedTokens`), so the usual min(1, p/q) acceptance and norm(max(0, p - q)) residual stay exact.

`VocabularyText` is a vocabulary as text, as it travels on the wire (tandem.v1.Vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from tandem.sampling import SparseDist

if TYPE_CHECKING:
    from tandem.engine import Engine


def valid_utf8_prefix(data: bytes | bytearray, start: int = 0) -> int:
    """End of the longest prefix of data[start:] that is valid UTF-8 (an absolute offset into data).

    Text that ends inside a character (a byte token) or holds bytes that are not UTF-8 is cut there: tokenizers replace
    such bytes (llama.cpp's BPE turns a lone continuation byte into U+FFFD's token), which would change the text."""
    view = memoryview(data)[start:]
    try:
        str(view, "utf-8")
        return len(data)
    except UnicodeDecodeError as exc:
        return start + exc.start


@dataclass(frozen=True)
class VocabularyText:
    """A vocabulary as text: each token's piece as output shows it (control tokens empty), control tokens' markup,
    and the byte-fallback tokens (a one-byte piece a normal token may spell too)."""

    fingerprint: str
    pieces: Sequence[bytes]
    markup: dict[int, bytes] = field(default_factory=dict)
    byte_tokens: frozenset[int] = frozenset()
    bos_id: int | None = None

    @classmethod
    def of_engine(cls, engine: Engine) -> VocabularyText:
        markup, byte_tokens = engine.vocabulary_markup()
        return cls(engine.fingerprint, engine.pieces, markup, frozenset(byte_tokens), engine.bos_id)

    def spell(self, token_ids: Sequence[int], markup: bool = False) -> bytes:
        """The text of a token sequence; with `markup`, control tokens as a prompt spells them (BOS left out: the
        reader adds its own)."""
        if not markup:
            return b"".join(self.pieces[t] for t in token_ids)
        return b"".join(self.markup.get(t, self.pieces[t]) for t in token_ids if t != self.bos_id)


def strict_prefix_tokens(pieces: Sequence[bytes]) -> frozenset[bytes]:
    """Pieces that a longer piece of the same vocabulary starts with.

    In sorted order every piece that starts with s follows s directly, so comparing neighbours finds them all
    (~0.3 s for 262k pieces, once per target)."""
    ordered = sorted({p for p in pieces if p})
    return frozenset(a for a, b in pairwise(ordered) if b.startswith(a))


class DraftTranslator:
    """The target's half of string-level drafting: a draft's text as the target's own tokens (VerifyItem.draft_text).

    Tokenized without BOS and without parsing control markup, so text never becomes a control token; cut before the
    first byte that is not valid UTF-8; and a last token that a longer token of the vocabulary starts with is dropped
    (" wor" may be the start of " world": text that ends inside a target token waits for the next round). The tokens
    are checked to spell a prefix of the text, so what is verified is always what the draft wrote."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.extendable = strict_prefix_tokens(engine.pieces)

    def tokens(self, text: bytes, limit: int) -> list[int]:
        end = valid_utf8_prefix(text)
        if end == 0 or limit <= 0:
            return []
        ids = self.engine.tokenize(text[:end].decode("utf-8"), add_special=False, parse_special=False)
        pieces = self.engine.pieces
        spelled = 0
        for i, token in enumerate(ids):  # keep the tokens that spell the text as written
            piece = pieces[token]
            if not piece or text[spelled : spelled + len(piece)] != piece:
                del ids[i:]
                break
            spelled += len(piece)
        if ids and pieces[ids[-1]] in self.extendable:
            ids.pop()
        return ids[:limit]


class SharedTokens:
    """Token-level intersection: the draft's tokens whose text is one token of the target's vocabulary.

    `target_of[d]` is the target's id for draft token d (-1: no target token spells it; control tokens never count),
    `mask` the shared draft tokens. Where several target tokens spell one text (a byte-fallback token and a normal
    token), the normal one is chosen, the one the target's tokenizer produces. Several draft tokens may share one
    target token: their probabilities add up in the q that is sent (`to_target`), since that is the probability that
    the draft proposes that target token."""

    def __init__(self, draft: VocabularyText, target: VocabularyText) -> None:
        by_text: dict[bytes, int] = {}
        for token, piece in enumerate(target.pieces):
            if not piece or token in target.markup:
                continue
            if piece not in by_text or (by_text[piece] in target.byte_tokens and token not in target.byte_tokens):
                by_text[piece] = token
        self.target_of = np.full(len(draft.pieces), -1, dtype=np.int64)
        for token, piece in enumerate(draft.pieces):
            if piece and token not in draft.markup:
                self.target_of[token] = by_text.get(piece, -1)
        self.mask = self.target_of >= 0
        self.target_fingerprint = target.fingerprint

    @property
    def size(self) -> int:
        return int(self.mask.sum())

    def restrict(self, row: np.ndarray) -> np.ndarray:
        """The draft's logits with every token outside the intersection at -inf (masked before the warp, as a grammar
        masks: the renormalisation of the restricted distribution is the warp's own)."""
        return np.where(self.mask, row, -np.inf)

    def to_target(self, q: SparseDist) -> SparseDist:
        """q over shared draft tokens as the distribution over target ids that the proposal was drawn from."""
        ids = self.target_of[q.token_ids]
        if np.any(ids < 0):
            raise ValueError("q has mass outside the shared tokens")
        unique, inverse = np.unique(ids, return_inverse=True)
        if unique.size == ids.size:
            return SparseDist.exact(ids, q.probs.copy())
        probs = np.zeros(unique.size, dtype=np.float64)
        np.add.at(probs, inverse, q.probs)
        return SparseDist.exact(unique.astype(np.int64), probs)
