"""Device argmax (tandem.engine.set_device_argmax): greedy sessions' rows reduced by llama.cpp's backend sampler, on the
real embedded model. `auto` turns it on only on a GPU; these tests force it on the CPU, whose backend runs the same
sampler graph, so what the GPU runs is checked here for exactness: the tokens equal the argmax of the logits rows,
alone and beside sessions that read whole rows, and speculative greedy text is the same with it on and off."""

from __future__ import annotations

import tandem.engine as engine_module  # isort: skip  (llama_cpp before numpy)
from typing import Any

import numpy as np
import pytest

from services.draft.drafters import ModelDrafter
from services.target.verifier import OpenSpec, Verifier, VerifySpec
from tandem.config import EngineSettings
from tandem.engine import DecodeItem, DeviceArgmax, Engine
from tandem.sampling import SamplingParams
from tandem.sessions import Session, make_rng
from tests.conftest import run_steps

GREEDY = SamplingParams(temperature=0.0)


def _engine(device_argmax: str, max_sessions: int = 4) -> Engine:
    assert engine_module.Engine is Engine
    return Engine(
        EngineSettings(n_threads=1, max_sessions=max_sessions, n_ctx=8192, n_batch=64, device_argmax=device_argmax)
    )


def test_auto_is_off_on_the_cpu_and_off_refuses_to_attach() -> None:
    assert not EngineSettings().resolved_device_argmax(on_gpu=False)
    assert EngineSettings().resolved_device_argmax(on_gpu=True)
    assert not EngineSettings(device_argmax="off").resolved_device_argmax(on_gpu=True)
    engine = _engine("auto", max_sessions=1)
    try:
        assert not engine.set_device_argmax(0, True) and not engine.argmax_on(0)
        (rows,) = engine.decode([DecodeItem(0, engine.tokenize("Hello"), 0, "last")])
        assert isinstance(rows, np.ndarray) and rows.shape == (1, engine.n_vocab)
    finally:
        engine.close()


def test_a_backend_that_samples_nothing_turns_device_argmax_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp attaches a chain even where the backend lacks the argmax operation, then returns no token: the
    engine's probe at load sees that and copies rows out instead (the one stand-in here: no such backend is at hand)."""
    monkeypatch.setattr(engine_module.llama_cpp, "llama_get_sampled_token_ith", lambda ctx, i: -1)
    engine = _engine("on", max_sessions=1)
    try:
        assert not engine.device_argmax and not engine.set_device_argmax(0, True)
        (rows,) = engine.decode([DecodeItem(0, engine.tokenize("Hello"), 0, "last")])
        assert isinstance(rows, np.ndarray) and rows.shape == (1, engine.n_vocab)
    finally:
        engine.close()


def test_device_tokens_are_the_argmax_of_the_rows_alone_mixed_and_in_chunks() -> None:
    engine = _engine("on")
    try:
        prompts = [engine.tokenize(t) for t in ("a b c " * 5, "Write a haiku.", "Explain caches. " * 4, "Tips? " * 9)]
        drafts = [engine.tokenize(t, add_special=False) for t in (" d e f", " About", " They keep", " Use")]
        drafts = [(d * 4)[:4] for d in drafts]  # equal lengths: one call for all four

        def step(argmax_seqs: set[int]) -> list[Any]:
            for seq, prompt in enumerate(prompts):
                engine.set_device_argmax(seq, seq in argmax_seqs)
                engine.clear(seq)
                engine.decode([DecodeItem(seq, prompt, 0, "none")])
            return engine.decode(
                [DecodeItem(seq, drafts[seq], len(prompts[seq]), "all") for seq in range(len(prompts))]
            )

        rows = step(set())
        assert all(isinstance(r, np.ndarray) for r in rows)
        expected = [r.argmax(axis=1) for r in rows]
        for argmax_seqs in ({0, 1, 2, 3}, {1, 3}):  # no logits copied out at all; and beside sessions that read rows
            got = step(argmax_seqs)
            for seq, r in enumerate(got):
                if seq in argmax_seqs:
                    assert isinstance(r, DeviceArgmax) and len(r) == 4
                    np.testing.assert_array_equal(r.tokens, expected[seq], err_msg=f"seq {seq} of {argmax_seqs}")
                else:
                    np.testing.assert_array_equal(r, rows[seq])
        # An item longer than n_batch goes in several calls; its tokens are joined in order.
        long = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 12)
        assert len(long) > engine.n_batch
        engine.set_device_argmax(0, False)
        engine.clear(0)
        (full,) = engine.decode([DecodeItem(0, long, 0, "all")])
        engine.set_device_argmax(0, True)
        engine.clear(0)
        (tokens,) = engine.decode([DecodeItem(0, long, 0, "all")])
        assert isinstance(tokens, DeviceArgmax) and len(tokens) == len(long)
        np.testing.assert_array_equal(tokens.tokens, full.argmax(axis=1))
    finally:
        engine.close()


def _speculate(device_argmax: str) -> tuple[list[list[int]], list[bool], list[int | None]]:
    """Greedy speculative decoding with a model draft (the same model) for two greedy prompts, beside a sampled
    session and a greedy one with logprobs: each greedy session's 40 tokens, whether each target session had device
    argmax on, and the logprob of the logprobs session's first token."""
    target, draft = _engine(device_argmax), _engine(device_argmax)
    try:
        verifier = Verifier(target, idle_timeout_s=60.0)
        drafter = ModelDrafter(draft)
        texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "List three colours: red, green,"]
        specs = [OpenSpec(f"g{i}", target.tokenize(t), GREEDY) for i, t in enumerate(texts)]
        specs += [
            OpenSpec("sampled", target.tokenize("Once upon a time"), SamplingParams(temperature=0.8, seed=3)),
            OpenSpec("logprobs", target.tokenize("The capital of France is"), GREEDY, top_logprobs=2),
        ]
        opened = run_steps(verifier.open_steps(specs))
        on = [target.argmax_on(verifier.store.get(s.session_id).seq_id) for s in specs]
        sessions = []
        for i, (spec, first) in enumerate(zip(specs[:2], opened, strict=False)):
            tokens = [*spec.prompt, first.first_token.token_id]
            sessions.append(Session(spec.session_id, i, tuple(spec.prompt), GREEDY, make_rng(0), tokens=tokens))
        drafter.open(sessions)
        while min(len(s.tokens) - len(s.prompt) for s in sessions) < 40:
            work = []
            for s in sessions:
                proposal = drafter.propose(s, 4).tokens
                work.append([VerifySpec(s.session_id, len(s.tokens), tuple(proposal), None)])
            results = verifier.verify_groups(work)
            for s, (result,) in zip(sessions, results, strict=True):
                s.tokens.extend(t.token_id for t in result.tokens)
        return [s.tokens[len(s.prompt) :][:40] for s in sessions], on, [opened[3].first_token.logprob]
    finally:
        target.close()
        draft.close()


def test_speculative_greedy_text_is_the_same_with_device_argmax() -> None:
    with_device, on, logprob = _speculate("on")
    without, off, logprob_off = _speculate("off")
    assert on == [True, True, False, False]  # the sampled and the logprobs sessions read whole rows
    assert off == [False] * 4
    assert with_device == without
    assert logprob[0] is not None and logprob == pytest.approx(logprob_off)
