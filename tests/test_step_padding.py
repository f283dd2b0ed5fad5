"""Padded steps (`--pad-steps`, tandem.step_padding): the rule that picks a step's token count, and on the real
embedded model that padding keeps a step's layout while changing nothing a sequence reads, now or later."""

from __future__ import annotations

import tandem.engine as engine_module  # isort: skip  (llama_cpp before numpy)
import random

import numpy as np
import pytest

from services.draft.drafters import ModelDrafter
from services.target.verifier import OpenSpec, Verifier, VerifySpec
from tandem.config import EngineSettings
from tandem.engine import DecodeItem, DeviceArgmax, Engine
from tandem.sampling import SamplingParams
from tandem.sessions import Session, make_rng
from tandem.step_padding import StepPadding, pad_items, slice_rows
from tests.conftest import run_steps

GREEDY = SamplingParams(temperature=0.0)


def test_a_step_is_padded_to_the_longest_item_and_holds_that_length_for_a_few_steps() -> None:
    rule = StepPadding(hold=2, max_length=9)
    assert rule.length_for([1, 1, 1]) == 1  # plain decoding at a steady load: nothing to pad
    assert rule.length_for([1, 5, 1]) == 5  # a verify: every item to its length
    assert [rule.length_for([1, 1, 1]) for _ in range(3)] == [5, 5, 1]  # held for two plain steps, then dropped
    assert rule.length_for([3, 1]) == 3
    assert rule.length_for([40]) == 1  # a prefill chunk is never padded ...
    assert rule.length == 3 and rule.idle == 0  # ... and leaves the held length as it was
    assert rule.length_for([1, 7]) == 7  # a longer verify lifts it at once
    assert rule.length_for([]) == 1


def test_padded_items_ask_for_all_rows_and_give_back_the_rows_each_asked_for() -> None:
    items = [DecodeItem(0, [5], 10, "last"), DecodeItem(1, [6, 7, 8], 20, "all"), DecodeItem(2, [9, 9], 0, "none")]
    padded = pad_items(items, 4)
    assert [(i.seq_id, list(i.tokens), i.start, i.logits) for i in padded.items] == [
        (0, [5, 5, 5, 5], 10, "all"),
        (1, [6, 7, 8, 8], 20, "all"),
        (2, [9, 9, 9, 9], 0, "all"),
    ]
    blocks = [np.arange(4 * 3).reshape(4, 3) + 100 * i for i in range(3)]
    rows = padded.rows(blocks, slice_rows)
    np.testing.assert_array_equal(rows[0], blocks[0][0:1])  # "last": the item's own last token's row
    np.testing.assert_array_equal(rows[1], blocks[1][0:3])
    assert rows[2].shape == (0, 3)
    tokens = padded.rows([DeviceArgmax(np.array([1, 2, 3, 4], np.int32))] * 3, slice_rows)
    assert [list(t.tokens) for t in tokens] == [[1], [1, 2, 3], []]


def _engine(pad: bool, argmax: bool = True) -> Engine:
    """A KV slice per sequence and flash attention: rows then do not depend on what else shares a call (decoding a
    sequence alone gives them bit for bit), so any difference padding made would be padding's own. With one KV buffer
    (the GPU default) where cells land changes how flash attention's blocks round, padded or not (decision 0023)."""
    assert engine_module.Engine is Engine
    settings = EngineSettings(
        n_threads=1, max_sessions=4, n_ctx=8192, n_batch=64, kv_unified="off", flash_attn="on",
        device_argmax="on" if argmax else "off", pad_steps=pad,
    )  # fmt: skip
    engine = Engine(settings)
    for seq in range(4):
        assert engine.set_device_argmax(seq, True) == argmax
    return engine


def _under_load(engine: Engine, seed: int) -> list[list[int]] | list[np.ndarray]:
    """Four sessions decoding together, one of them verifying a draft of 1-4 tokens every third step and rolling its
    rejected tokens back, as the target's steps go under load; every row (a token, or logits), step by step."""
    rng = random.Random(seed)
    lengths = [0] * 4
    out: list[list[int]] = []
    for seq in range(4):
        engine.clear(seq)
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(20, 50))]
        (rows,) = engine.decode([DecodeItem(seq, prompt, 0, "last")])
        out.append(_read(rows))
        lengths[seq] = len(prompt)
    for step in range(30):
        verifier = step // 3 % 4 if step % 3 == 0 else -1
        items = [
            DecodeItem(seq, [rng.randrange(100, 30000) for _ in range(rng.randint(2, 5) if seq == verifier else 1)],
                       lengths[seq], "all" if seq == verifier else "last")
            for seq in range(4)
        ]  # fmt: skip
        out += [_read(rows) for rows in engine.decode(items, copy=True)]
        for item in items:
            lengths[item.seq_id] += len(item.tokens)
        if verifier >= 0:
            lengths[verifier] -= rng.randint(0, len(items[verifier].tokens) - 1)
            engine.truncate(verifier, lengths[verifier])
    return out


def _read(rows: np.ndarray | DeviceArgmax) -> list[int] | np.ndarray:
    return list(rows.tokens) if isinstance(rows, DeviceArgmax) else np.array(rows)


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    plain, padded = _engine(pad=False), _engine(pad=True)
    yield plain, padded
    plain.close()
    padded.close()


def test_padded_steps_change_no_token_and_keep_their_layout(engines: tuple[Engine, Engine]) -> None:
    """The same steps with and without padding: every row's argmax the same (padding sits after each sequence's own
    tokens and is dropped from the KV cache, so no later step sees it either), and the padded engine's calls keep one
    layout where the unpadded one's change with every verify and back."""
    plain, padded = engines
    calls = {e: (e.decode_calls, e.reshaped_calls) for e in engines}
    assert _under_load(padded, seed=3) == _under_load(plain, seed=3)
    changed = {e: e.reshaped_calls - calls[e][1] for e in engines}
    made = {e: e.decode_calls - calls[e][0] for e in engines}
    # Unpadded: a verify step is two calls (one per length) and the plain step after it a third layout.
    assert changed[plain] >= 25, (changed, made)
    # Padded: one call a step; its layout changes when the held length does (a longer draft, the hold running out).
    assert made[padded] == 34 and changed[padded] <= 14, (changed, made)
    assert padded.padding is not None and padded.padding.length > 1


def test_padded_rows_equal_unpadded_rows_bit_for_bit() -> None:
    """The whole logits rows, padded (sequences that copy logits out padded too, as the rule allows on request)
    against not, over the same steps: equal bit for bit, the padded tokens invisible to every real row."""
    plain, padded = _engine(pad=False, argmax=False), _engine(pad=True, argmax=False)
    try:
        assert padded.padding is not None
        padded.padding.logits_too = True
        with_padding, without = _under_load(padded, seed=8), _under_load(plain, seed=8)
        assert len(with_padding) == len(without) == 4 + 30 * 4
        for i, (a, b) in enumerate(zip(with_padding, without, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"row block {i}")
        assert padded.decode_calls < plain.decode_calls  # it did pad: one call a step
    finally:
        plain.close()
        padded.close()


def test_a_step_with_a_sequence_that_reads_logits_is_not_padded(engines: tuple[Engine, Engine]) -> None:
    """Padding a sequence whose logits are copied out would copy a vocabulary of floats for every padded row."""
    _, padded = engines
    padded.set_device_argmax(3, False)
    try:
        for seq in range(4):
            padded.clear(seq)
        prompt = padded.tokenize("Pad only what is cheap to pad.")
        for seq in range(4):
            padded.decode([DecodeItem(seq, prompt, 0, "last")])
        n = len(prompt)
        before = padded.padding.length if padded.padding else 0
        rows = padded.decode([DecodeItem(seq, [100] * (3 if seq == 0 else 1), n, "all") for seq in range(4)])
        assert [len(r) for r in rows] == [3, 1, 1, 1]
        assert isinstance(rows[3], np.ndarray) and rows[3].shape == (1, padded.n_vocab)
        assert padded.padding is not None and padded.padding.length == before  # the rule did not even see the step
    finally:
        padded.set_device_argmax(3, True)


def test_a_step_without_room_for_its_padding_runs_unpadded() -> None:
    """One KV buffer of 256 cells nearly full: the padded step (four items of five tokens) finds no room where the
    step itself (eight tokens) does; it runs unpadded, with the rows a never-padded engine gives, and padding starts
    over from single tokens."""
    engines = []
    for pad in (False, True):
        settings = EngineSettings(
            n_threads=1, max_sessions=4, n_ctx=256, n_batch=64, kv_unified="on", flash_attn="on", device_argmax="on",
            pad_steps=pad,
        )  # fmt: skip
        engine = Engine(settings)
        for seq in range(4):
            engine.set_device_argmax(seq, True)
        engines.append(engine)
    try:
        results = []
        for engine in engines:
            prompt = engine.tokenize("A long enough prompt to fill most of a small cache. " * 6)[:60]
            for seq in range(4):
                engine.decode([DecodeItem(seq, prompt, 0, "last")])
            n = len(prompt)
            assert 256 - 4 * n < 20  # no room for 4 x 5 tokens, room for 5 + 3
            items = [DecodeItem(seq, [100] * (5 if seq == 0 else 1), n, "all") for seq in range(4)]
            results.append([list(rows.tokens) for rows in engine.decode(items)])
        assert results[0] == results[1] and [len(r) for r in results[1]] == [5, 1, 1, 1]
        assert engines[1].padding is not None and engines[1].padding.length == 1
    finally:
        for engine in engines:
            engine.close()


def _greedy_texts(pad: bool, drafting: bool) -> tuple[list[list[int]], int]:
    """Three greedy sessions through the target's verifier for 40 tokens each: with `drafting`, session 0 verifies
    the model draft's 4-token proposals (the same model), session 1 wrong 3-token drafts (rejected, rolled back) on
    odd steps and single tokens otherwise, session 2 single tokens; without it every session decodes token by token.
    Returns each session's tokens and the target engine's llama_decode calls whose layout changed."""
    target = _engine(pad)
    draft = _engine(pad=False)
    try:
        verifier = Verifier(target, idle_timeout_s=60.0)
        drafter = ModelDrafter(draft)
        texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "List three colours: red,", "Dear Sir,"]
        specs = [OpenSpec(f"g{i}", target.tokenize(t), GREEDY) for i, t in enumerate(texts)]
        opened = run_steps(verifier.open_steps(specs))
        sessions = [
            Session(spec.session_id, i, tuple(spec.prompt), GREEDY, make_rng(0),
                    tokens=[*spec.prompt, first.first_token.token_id])
            for i, (spec, first) in enumerate(zip(specs, opened, strict=True))
        ]  # fmt: skip
        drafter.open(sessions[:1])
        step = 0
        while min(len(s.tokens) - len(s.prompt) for s in sessions) < 40:
            drafts: list[tuple[int, ...]] = [(), (), ()]
            if drafting:
                drafts[0] = tuple(drafter.propose(sessions[0], 4).tokens)
                drafts[1] = (7, 7, 7) if step % 2 else ()
            work = [[VerifySpec(s.session_id, len(s.tokens), d, None)] for s, d in zip(sessions, drafts, strict=True)]
            for s, (result,) in zip(sessions, verifier.verify_groups(work), strict=True):
                s.tokens.extend(t.token_id for t in result.tokens)
            step += 1
        return [s.tokens[len(s.prompt) :][:40] for s in sessions], target.reshaped_calls
    finally:
        target.close()
        draft.close()


def test_speculative_greedy_text_with_padded_steps_is_target_only_text() -> None:
    """Lossless through the target's verifier: greedy speculative decoding with padded steps (drafts accepted,
    drafts rejected and rolled back, plain sessions padded beside them) gives each session the text of target-only
    decoding, token for token."""
    reference, _ = _greedy_texts(pad=False, drafting=False)
    unpadded, changed_unpadded = _greedy_texts(pad=False, drafting=True)
    padded, changed_padded = _greedy_texts(pad=True, drafting=True)
    assert padded == unpadded == reference
    assert changed_padded < changed_unpadded / 2, (changed_padded, changed_unpadded)  # it did pad
