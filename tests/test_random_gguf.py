"""bench/random_gguf.py: random-weight Llama GGUFs load in llama.cpp, give usable logits, and pair up as draft/target.

Only the `tiny` shape is written (10 MB); the big shapes are checked by their planned sizes alone.
"""

from __future__ import annotations

# isort: off
import tandem.engine  # noqa: F401  llama_cpp before numpy: the other order crashes model loading on some images
# isort: on

import math
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from bench.random_gguf import (
    SHAPES,
    expected_size_bytes,
    main,
    synthetic_vocab,
    tensor_plan,
    write_random_gguf,
)
from tandem.config import EngineSettings
from tandem.engine import DecodeItem, Engine

VOCAB = 32000


def _engine(path: Path) -> Engine:
    return Engine(EngineSettings(model=path, device=None, n_ctx=256, n_batch=64, max_sessions=1, n_threads=1))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Engine, Engine]]:
    """Two tiny models with the same vocabulary and different weights, as a draft/target pair would be."""
    tmp = tmp_path_factory.mktemp("random_gguf")
    a = write_random_gguf("tiny", tmp / "a.gguf", vocab=VOCAB, seed=0, ctx=512)
    assert main(["--shape", "tiny", "--out", str(tmp / "b.gguf"), "--vocab", str(VOCAB), "--seed", "1"]) == 0
    ea, eb = _engine(a), _engine(tmp / "b.gguf")
    yield a, ea, eb
    ea.close()
    eb.close()


def test_file_layout_and_metadata(pair: tuple[Path, Engine, Engine]) -> None:
    path, _, _ = pair
    reader = gguf.GGUFReader(path)
    plan = tensor_plan("tiny", VOCAB)
    assert [t.name for t in reader.tensors] == [t.name for t in plan]
    assert path.stat().st_size == reader.data_offset + expected_size_bytes("tiny", VOCAB)
    assert not path.with_name(path.name + ".partial").exists()

    def value(key: str) -> object:
        return reader.get_field(key).contents()

    assert value("general.architecture") == "llama"
    assert value("general.name") == "random-llama-tiny"
    assert value("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_0
    assert value("llama.context_length") == 512
    assert value("llama.block_count") == 2
    assert value("llama.attention.head_count_kv") == 2
    assert value("llama.rope.dimension_count") == 64
    assert value("tokenizer.ggml.model") == "llama"
    q = reader.tensors[[t.name for t in reader.tensors].index("blk.0.ffn_down.weight")]
    assert q.tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert list(q.shape) == [512, 256]  # GGUF order: (columns, rows)


def test_engines_share_vocabulary(pair: tuple[Path, Engine, Engine]) -> None:
    _, a, b = pair
    assert a.n_vocab == b.n_vocab == VOCAB
    assert a.fingerprint == b.fingerprint
    assert (a.bos_id, a.eos_id, a.add_bos) == (1, 2, True)
    assert a.architecture == "llama"


def test_tokenize_round_trip(pair: tuple[Path, Engine, Engine]) -> None:
    _, engine, _ = pair
    for text in ("hello world", "Speculative decoding, über-fast: 42!\n"):
        tokens = engine.tokenize(text)
        assert tokens[0] == engine.bos_id
        assert len(tokens) - 1 < len(text.encode())  # pieces merge: fewer tokens than bytes
        assert engine.detokenize(tokens) == text


def test_logits_are_finite_and_spread(pair: tuple[Path, Engine, Engine]) -> None:
    _, a, b = pair
    tokens = a.tokenize("hello world")
    results = []
    for engine in (a, b):
        (logits,) = engine.decode([DecodeItem(0, tokens, 0, "all")])
        engine.clear(0)
        assert logits.shape == (len(tokens), VOCAB)
        assert np.isfinite(logits).all()
        assert (logits.std(axis=1) > 0.1).all()  # not all equal across the vocabulary
        assert (np.abs(logits) < 100).all()
        results.append(logits)
    assert not np.allclose(results[0], results[1])  # different seeds, different weights


def test_vocab_depends_on_size_only() -> None:
    tokens, scores, types = synthetic_vocab(1000)
    assert len(tokens) == len(set(tokens)) == len(scores) == len(types) == 1000
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"
    assert types[3:259] == [gguf.TokenType.BYTE] * 256
    assert scores[259:] == sorted(scores[259:], reverse=True)
    assert synthetic_vocab(VOCAB)[0][:1000] == tokens  # a prefix of any larger vocabulary
    with pytest.raises(ValueError):
        synthetic_vocab(100)


def test_planned_size_of_1b() -> None:
    """The 1b file, computed without writing it: 3 + 9 per layer tensors, Q4_0 at 18 bytes per 32 weights."""
    s = SHAPES["1b"]
    plan = tensor_plan("1b", VOCAB)
    assert len(plan) == 3 + 9 * 16 == 147
    kv = s.n_head_kv * s.head_dim
    per_layer_weights = 2 * s.n_embd * s.n_embd + 2 * kv * s.n_embd + 3 * s.n_ff * s.n_embd
    q4_weights = 16 * per_layer_weights + 2 * VOCAB * s.n_embd
    norm_bytes = (2 * 16 + 1) * s.n_embd * 4
    assert expected_size_bytes("1b", VOCAB) == q4_weights * 18 // 32 + norm_bytes
    assert math.isclose(expected_size_bytes("70b", VOCAB) / 1e9, 38.8, rel_tol=0.01)
