"""The engine wrapper over llama.cpp, on the real embedded model: batching many sequences in one call must give
each sequence exactly the logits it gets alone."""

from __future__ import annotations

import os
import random
import time

import tandem.engine as engine_module  # isort: skip  (llama_cpp before numpy)
import llama_cpp  # isort: skip
import numpy as np
import pytest

from tandem.config import EngineSettings, graph_reuse
from tandem.engine import OTHERS_STEPPING_NS, DecodeItem, Engine
from tests.conftest import run_steps


@pytest.fixture(scope="module")
def engine() -> Engine:
    assert engine_module.Engine is Engine
    eng = Engine(EngineSettings(n_threads=1, max_sessions=4, n_ctx=8192, n_batch=64))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def unified_engine() -> Engine:
    """One KV buffer for all sessions and flash attention, as on a GPU by default, with steps packed into one call."""
    settings = EngineSettings(
        n_threads=1, max_sessions=4, n_ctx=8192, n_batch=64, kv_unified="on", flash_attn="on", pack_steps="on"
    )
    eng = Engine(settings)
    yield eng
    eng.close()


def _unequal_drafts(engine: Engine) -> list[tuple[list[int], list[DecodeItem], list[np.ndarray], list[np.ndarray]]]:
    """Steps of sequences with different token counts, decoded together and each alone from the same state:
    (counts, items, rows together, rows alone) per step."""
    prompts = [engine.tokenize(t) for t in ("a b c " * 5, "Write a haiku.", "Explain caches. " * 4, "Tips? " * 9)]

    def fresh() -> None:
        for seq, prompt in enumerate(prompts):
            engine.clear(seq)
            engine.decode([DecodeItem(seq, prompt, 0, "none")])

    rng = random.Random(0)
    steps = []
    for counts in ([1, 9, 1, 0], [1, 2, 2, 9], [5, 3, 3, 2], [3, 3, 3, 3], [40, 70, 1, 2]):
        items = [
            DecodeItem(seq, [rng.randrange(100, 5000) for _ in range(n)], len(prompts[seq]), "all")
            for seq, n in enumerate(counts)
            if n
        ]
        fresh()
        together = engine.decode(items)
        alone = []
        for item in items:
            fresh()
            alone += engine.decode([item])
        steps.append((counts, items, together, alone))
    return steps


def test_one_kv_buffer_takes_unequal_drafts_in_one_call(unified_engine: Engine) -> None:
    """With one KV buffer and `pack_steps` a step of sequences with different token counts is one llama_decode call
    (a call per length changes the step's size call after call, which costs on CUDA), and each sequence's rows
    equal decoding it alone, bit for bit. (With flash attention off this CPU build rounds a batch differently from
    one sequence, packed or grouped by length alike: up to 0.71 apart, measured; that is test_batch_rows' subject.)
    Without `pack_steps`, the CPU default, a step goes by length."""
    engine = unified_engine
    mixed = [DecodeItem(seq, [100] * n, 0, "all") for seq, n in enumerate([1, 9, 2, 5])]
    assert len(engine._plan(mixed)) == 1
    assert [len(call) for call in engine._plan([*mixed, DecodeItem(3, [100] * 60, 0, "all")])] == [4, 1]
    engine.pack_steps = False
    try:
        by_length = [DecodeItem(seq, [100] * n, 0, "all") for seq, n in enumerate([1, 9, 1, 5])]
        assert sorted(len(call) for call in engine._plan(by_length)) == [1, 1, 2]
    finally:
        engine.pack_steps = True
    for counts, items, together, alone in _unequal_drafts(engine):
        for item, rows, single in zip(items, together, alone, strict=True):
            assert rows.shape == (len(item.tokens), engine.n_vocab)
            np.testing.assert_array_equal(rows, single, err_msg=f"counts {counts}, seq {item.seq_id}")


def _rotating_verifies(engine: Engine, steps: int, seed: int) -> list[np.ndarray]:
    """Packed steps of four sequences, each step one of them verifying five tokens (a different one each step) and
    the others one token, with a rollback of the verifier's rejected tokens: the step's token and row counts hold
    while its composition changes, so llama.cpp reuses its previous graph (on CUDA the recorded graph is replayed)."""
    rng = random.Random(seed)
    rows: list[np.ndarray] = []
    lengths = [0, 0, 0, 0]
    for seq in range(4):
        engine.clear(seq)
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(20, 60))]
        rows += engine.decode([DecodeItem(seq, prompt, 0, "last")])
        lengths[seq] = len(prompt)
    for step in range(steps):
        verifier = step % 4
        items = [
            DecodeItem(seq, [rng.randrange(100, 30000) for _ in range(5 if seq == verifier else 1)], lengths[seq],
                       "all" if seq == verifier else "last")
            for seq in range(4)
        ]  # fmt: skip
        rows += [np.array(r) for r in engine.decode(items)]
        for item in items:
            lengths[item.seq_id] += len(item.tokens)
        lengths[verifier] -= rng.randint(0, 4)
        engine.truncate(verifier, lengths[verifier])
    return rows


def _graphs_reused(engine: Engine) -> int:
    """How many llama_decode calls of this context ran the previous call's graph again (llama.cpp's own count)."""
    return llama_cpp.llama_perf_context(engine._ctx).n_reused


def test_packed_steps_give_the_same_rows_with_graph_reuse_on_and_off(
    unified_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The suspect of packing's CUDA crash (decision 0022) is llama.cpp reusing its previous graph for a step of the
    same shape and another composition. On this backend reuse is exact: every row of 24 such steps equals, bit for
    bit, the same steps in a context created with reuse off (`graph_reuse`, as packed steps on a GPU run)."""
    monkeypatch.delenv("LLAMA_GRAPH_REUSE_DISABLE", raising=False)
    with graph_reuse(allowed=False):  # as a packed engine on a GPU creates its context
        no_reuse = Engine(unified_engine.settings)
    assert "LLAMA_GRAPH_REUSE_DISABLE" not in os.environ  # only that context: the next one reuses again
    try:
        without = _rotating_verifies(no_reuse, steps=24, seed=5)
        assert _graphs_reused(no_reuse) == 0
    finally:
        no_reuse.close()
    reused = _graphs_reused(unified_engine)
    with_reuse = _rotating_verifies(unified_engine, steps=24, seed=5)
    assert _graphs_reused(unified_engine) - reused >= 20  # the steps after each verifier's first: the case in question
    assert len(with_reuse) == len(without) == 4 + 24 * 4
    for i, (a, b) in enumerate(zip(with_reuse, without, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"row block {i}")
    for seq in range(4):
        unified_engine.clear(seq)


def test_steps_go_by_length_unless_packing_is_asked_for(engine: Engine) -> None:
    """Packing is off by default on the CPU (on a GPU it is on, decision 0022), and asking for it without one KV buffer
    packs nothing: with a slice per sequence unequal counts in one call give wrong logits. The groups keep the order
    of their first item, each in seq_id order, as before packing existed."""
    assert EngineSettings().pack_steps == "auto"  # on a GPU only
    assert not EngineSettings().resolved_pack_steps(on_gpu=False) and EngineSettings().resolved_pack_steps(on_gpu=True)
    assert engine.pack_steps is False
    sliced = Engine(EngineSettings(n_threads=1, max_sessions=2, n_ctx=512, kv_unified="off", pack_steps="on"))
    try:
        assert sliced.pack_steps is False
    finally:
        sliced.close()
    items = [DecodeItem(3, [100], 0, "all"), DecodeItem(0, [100] * 5, 0, "all"), DecodeItem(1, [100], 0, "all")]
    assert engine._plan(items) == [[(2, 0, 1), (0, 0, 1)], [(1, 0, 5)]]


def test_the_engine_counts_calls_whose_batch_layout_changed(engine: Engine) -> None:
    """Load.reshaped_*: a llama_decode call whose layout (sequences, token counts, rows wanted) differs from the call
    before counts as reshaped, with its forward time; on CUDA such a call runs without a replayed graph."""
    prompt = engine.tokenize("Count the calls, please.")
    engine.clear(0)
    engine.decode([DecodeItem(0, prompt, 0, "last")])
    calls, reshaped, reshaped_ns = engine.decode_calls, engine.reshaped_calls, engine.reshaped_ns
    position = len(prompt)
    for tokens in ([100], [101], [102, 103], [104], [105]):  # changed, same, changed, changed, same
        engine.decode([DecodeItem(0, tokens, position, "all")])
        position += len(tokens)
    assert engine.decode_calls - calls == 5
    assert engine.reshaped_calls - reshaped == 3
    assert 0 < engine.reshaped_ns - reshaped_ns <= engine.forward_ns
    engine.clear(0)


def test_unequal_drafts_in_one_batch_match_decoding_alone(engine: Engine) -> None:
    """Sequences with different token counts in one decode: llama.cpp 0.3.36 gets these wrong when they share a
    llama_decode call with a KV slice per sequence, so the engine splits them; this is the regression test."""
    assert [
        len(call) for call in engine._plan([DecodeItem(s, [100] * n, 0, "all") for s, n in enumerate([1, 9, 1])])
    ] == [
        2,
        1,
    ]
    for counts, items, together, alone in _unequal_drafts(engine):
        for item, rows, single in zip(items, together, alone, strict=True):
            assert rows.shape == (len(item.tokens), engine.n_vocab)
            np.testing.assert_array_equal(rows, single, err_msg=f"counts {counts}, seq {item.seq_id}")


def test_logits_views_equal_copies_and_stay_valid_across_calls_of_one_decode(engine: Engine) -> None:
    """decode(copy=False) hands out views of llama.cpp's buffer (a verify step reads them at once): same values as
    copies, read-only, and when the batch needs several llama_decode calls (unequal lengths) every row still holds
    its own logits, not those of the last call."""
    prompt = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 3)

    def fresh() -> None:
        for seq in (0, 1):
            engine.clear(seq)
            engine.decode([DecodeItem(seq, prompt, 0, "none")])

    one = [DecodeItem(0, [500, 600, 700], len(prompt), "all")]
    fresh()
    (copied,) = engine.decode(one)
    fresh()
    (viewed,) = engine.decode(one, copy=False)
    np.testing.assert_array_equal(viewed, copied)
    assert not viewed.flags.writeable and not viewed.flags.owndata
    two = [DecodeItem(0, [500, 600, 700], len(prompt), "all"), DecodeItem(1, [800], len(prompt), "all")]
    fresh()
    expected = engine.decode(two)
    fresh()
    got = engine.decode(two, copy=False)
    for want, rows in zip(expected, got, strict=True):
        np.testing.assert_array_equal(rows, want)


def test_prefill_in_chunks_equals_one_pass(engine: Engine) -> None:
    prompt = engine.tokenize("The history of lighthouses. " * 20)  # over n_batch=64 tokens: several chunks
    engine.clear(0)
    steps = engine.prefill_steps([DecodeItem(0, prompt, 0, "last")])
    chunks = 0
    while True:
        try:
            next(steps)
            chunks += 1
        except StopIteration as stop:
            (chunked,) = stop.value
            break
    assert chunks == (len(prompt) - 1) // 64
    engine.clear(0)
    (whole,) = engine.decode([DecodeItem(0, prompt, 0, "last")])
    np.testing.assert_array_equal(chunked, whole)


@pytest.mark.parametrize(
    ("setting", "on_gpu", "unified"),
    [("auto", False, False), ("auto", True, True), ("on", False, True), ("off", True, False)],
)
def test_kv_layout_auto_shares_the_buffer_only_on_a_gpu(setting: str, on_gpu: bool, unified: bool) -> None:
    assert EngineSettings(kv_unified=setting).resolved_kv_unified(on_gpu) is unified


def test_flash_attention_auto_follows_the_device() -> None:
    """auto: on for GPU layers (faster there) and for a quantised V cache (which needs it), off on the CPU."""
    assert EngineSettings().resolved_flash_attn(on_gpu=True)
    assert not EngineSettings().resolved_flash_attn(on_gpu=False)
    assert EngineSettings(cache_type_v="q8_0").resolved_flash_attn(on_gpu=False)
    assert not EngineSettings(flash_attn="off").resolved_flash_attn(on_gpu=True)
    assert EngineSettings(flash_attn="on").resolved_flash_attn(on_gpu=False)


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_batch_rows_against_one_token_rows(flash_attn: str) -> None:
    """Why greedy speculation is exact or not on this CPU: with flash attention on, every row of a verify batch equals
    decoding its token alone, bit for bit (what the flash-attention lossless e2e test relies on). With it off, a build
    with llamafile's sgemm (the PyPI wheel) rounds some batch differently, and a build without it does not."""
    from bench.exactness import build_flags, max_batch_difference

    engine = Engine(EngineSettings(max_sessions=2, n_ctx=2048, flash_attn=flash_attn))
    try:
        differences = max_batch_difference(engine)
        llamafile = build_flags(engine.backend) == "llamafile on"
    finally:
        engine.close()
    if flash_attn == "on" or not llamafile:
        assert all(d == 0.0 for d in differences.values()), differences
    else:
        assert any(d > 0.0 for d in differences.values()), differences


def test_prefill_chunks_shrink_only_while_other_sessions_step(engine: Engine) -> None:
    """With a chunk budget (a draft's default), a prompt goes in n_batch chunks when nothing else steps, and in
    chunks the budget allows (here the floor of 32 tokens) while another sequence decodes between them; a prompt that
    follows a finished one shrinks only its first chunk. The rows come out the same (a prefill reads the last row)."""
    prompt = engine.tokenize("The history of the lighthouse and the keepers who lived in it. " * 25)[:300]
    other = engine.tokenize("Write a haiku.")

    def prefill(interleave: bool) -> tuple[int, np.ndarray]:
        engine.clear(0)
        calls = engine.decode_calls
        position = [len(other)]

        def other_step() -> None:  # another session's step between the chunks, as the scheduler runs pending calls
            engine.decode([DecodeItem(1, [other[-1]], position[0], "none")])
            position[0] += 1

        steps = engine.prefill_steps([DecodeItem(0, prompt, 0, "last")])
        rows = run_steps(steps, other_step if interleave else None)
        own = engine.decode_calls - calls - (position[0] - len(other))
        return own, rows[0][-1]

    engine.clear(1)
    engine.decode([DecodeItem(1, other, 0, "none")])
    budget = engine.prefill_chunk_ns
    try:
        engine.prefill_chunk_ns = 0
        _, reference = prefill(interleave=False)
        engine.prefill_chunk_ns = 1  # smaller than any chunk: the floor
        time.sleep(OTHERS_STEPPING_NS / 1e9)  # the last step of the other sequence is not recent
        assert prefill(interleave=False)[0] == 5  # 300 tokens in chunks of 64: nobody else stepped
        calls, row = prefill(interleave=True)
        assert calls == 1 + 8  # 64 (nothing stepped lately), then 236 tokens in chunks of 32 as the other steps
        np.testing.assert_allclose(row, reference, atol=1e-3)
        engine.clear(1)
        engine.decode([DecodeItem(1, other, 0, "none")])  # a step that just ended, as a finished request's last
        assert prefill(interleave=False)[0] == 1 + 5  # one chunk of 32, then 268 tokens in chunks of 64
    finally:
        engine.prefill_chunk_ns = budget
        engine.clear(0)
        engine.clear(1)
