"""Write random-weight GGUF files of real Llama shapes, for benchmarks only (never used in serving).

Why: the speed of speculative decoding across mismatched hardware depends on the sizes of the draft and the target
(a 70B target on one GPU, a 1B draft on another, or on the CPU), and real weights of those sizes cannot be downloaded
on the benchmark machines. A file with the right tensor shapes and the right quantisation (Q4_0) costs llama.cpp
exactly the same memory traffic and compute per token as the real model, so forward-pass timings are real.

What it is not: the weights are random, so the text is noise and a draft model of this kind agrees with its target
no more often than chance. Acceptance rates in benchmarks that use these files must therefore be synthetic (a fixed
or simulated acceptance), never measured from the models' own outputs.

Two files written with the same ``--vocab`` share exactly the same vocabulary (texts, scores, types, special ids),
whatever their ``--seed`` or shape, so a draft/target pair has identical vocabulary fingerprints and the services
accept it as a pair.

Usage::

    python -m bench.random_gguf --shape 70b|8b|1b|0.5b|tiny --out PATH [--vocab 32000] [--seed 0] [--ctx 4096]

The tensor data are generated and written in chunks of about 64 MiB, so a 70B file (~40 GB) never sits in memory;
the file is written to ``PATH.partial`` and renamed to ``PATH`` only when complete.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shutil
import string
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import gguf
import numpy as np

ARCH = "llama"
Q4_0 = gguf.GGMLQuantizationType.Q4_0
F32 = gguf.GGMLQuantizationType.F32
QK4_0 = 32  # weights per Q4_0 block
Q4_0_BLOCK_BYTES = 18  # f16 scale d + 16 bytes of packed nibbles; weight = (nibble - 8) * d
CHUNK_BYTES = 64 << 20  # tensor data generated and written per step
# E[(n - 8)^2] for a nibble n uniform on 0..15: the variance of one quantised weight in units of d^2.
_NIBBLE_VARIANCE = sum((n - 8) ** 2 for n in range(16)) / 16
# Special tokens of the synthetic SentencePiece vocabulary, at ids 0, 1, 2 as in Llama 2.
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
N_SPECIAL = 3
N_BYTE_TOKENS = 256
MIN_VOCAB = N_SPECIAL + N_BYTE_TOKENS + 1
# Characters that ordinary pieces are built from; "▁" is SentencePiece's visible space.
_PIECE_ALPHABET = "▁" + string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation


@dataclass(frozen=True)
class Shape:
    """The dimensions of one Llama-architecture model."""

    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


SHAPES: dict[str, Shape] = {
    "70b": Shape("70b", n_layer=80, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8),
    "8b": Shape("8b", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8),
    "1b": Shape("1b", n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8),
    # Qwen2-0.5B's dimensions, written as the llama architecture (head_dim 64).
    "0.5b": Shape("0.5b", n_layer=24, n_embd=896, n_ff=4864, n_head=14, n_head_kv=2),
    "tiny": Shape("tiny", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2),  # for tests
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file. `dims` are in numpy order (rows, columns): a weight matrix is (out, in)."""

    name: str
    dims: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        if self.qtype == F32:
            return math.prod(self.dims) * 4
        rows, cols = self.dims
        return rows * (cols // QK4_0) * Q4_0_BLOCK_BYTES


def tensor_plan(shape: Shape | str, vocab: int) -> list[TensorSpec]:
    """Every tensor of a Llama model of `shape` with `vocab` tokens, in file order.

    The 2-D matrices (embeddings, attention, feed-forward, output) are Q4_0; the RMS norms are F32.
    """
    s = SHAPES[shape] if isinstance(shape, str) else shape
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    for cols in (s.n_embd, s.n_ff, q_dim):
        if cols % QK4_0:
            raise ValueError(f"shape {s.name}: row length {cols} is not a multiple of the Q4_0 block ({QK4_0})")
    plan = [TensorSpec("token_embd.weight", (vocab, s.n_embd), Q4_0)]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        plan += [
            TensorSpec(p + "attn_norm.weight", (s.n_embd,), F32),
            TensorSpec(p + "attn_q.weight", (q_dim, s.n_embd), Q4_0),
            TensorSpec(p + "attn_k.weight", (kv_dim, s.n_embd), Q4_0),
            TensorSpec(p + "attn_v.weight", (kv_dim, s.n_embd), Q4_0),
            TensorSpec(p + "attn_output.weight", (s.n_embd, q_dim), Q4_0),
            TensorSpec(p + "ffn_norm.weight", (s.n_embd,), F32),
            TensorSpec(p + "ffn_gate.weight", (s.n_ff, s.n_embd), Q4_0),
            TensorSpec(p + "ffn_up.weight", (s.n_ff, s.n_embd), Q4_0),
            TensorSpec(p + "ffn_down.weight", (s.n_embd, s.n_ff), Q4_0),
        ]
    plan += [
        TensorSpec("output_norm.weight", (s.n_embd,), F32),
        TensorSpec("output.weight", (vocab, s.n_embd), Q4_0),
    ]
    return plan


def _padded(n: int, alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def expected_size_bytes(shape: Shape | str, vocab: int) -> int:
    """Bytes of the tensor data section of the file (each tensor padded to the GGUF alignment), without writing it.

    The whole file is this plus the header, metadata and tensor infos (about 1 MB for a 32k vocabulary).
    """
    return sum(_padded(t.nbytes) for t in tensor_plan(shape, vocab))


# ---------------------------------------------------------------------------------------------- vocabulary


def _ordinary_pieces() -> Iterator[str]:
    """Unique piece texts, shortest first: every character of the alphabet, then every pair, then every triple...

    Since every prefix chain of a piece is in the vocabulary too, SentencePiece-style merging builds long pieces
    from characters, so tokenisation behaves like a real tokenizer's (several characters per token).
    """
    taken = {UNK, BOS, EOS}
    for length in itertools.count(1):
        for chars in itertools.product(_PIECE_ALPHABET, repeat=length):
            piece = "".join(chars)
            if piece not in taken:
                yield piece


def synthetic_vocab(vocab: int) -> tuple[list[str], list[float], list[int]]:
    """Token texts, scores and types of a SentencePiece-style vocabulary of `vocab` tokens.

    Depends on `vocab` alone (never on a seed), so every model written with the same `vocab` shares it exactly.
    Ids: 0 <unk>, 1 <s> (bos), 2 </s> (eos), then the 256 byte tokens <0x00>..<0xFF> (byte fallback: any text can
    be tokenised), then ordinary pieces with descending scores.
    """
    if vocab < MIN_VOCAB:
        raise ValueError(f"vocab must be at least {MIN_VOCAB} (3 special tokens, 256 bytes, 1 piece)")
    tokens = [UNK, BOS, EOS] + [f"<0x{b:02X}>" for b in range(N_BYTE_TOKENS)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * N_BYTE_TOKENS
    scores = [0.0] * len(tokens)
    n_pieces = vocab - len(tokens)
    tokens += list(itertools.islice(_ordinary_pieces(), n_pieces))
    types += [gguf.TokenType.NORMAL] * n_pieces
    scores += [-float(i) for i in range(n_pieces)]
    return tokens, scores, [int(t) for t in types]


# ---------------------------------------------------------------------------------------------- weights


def _q4_0_scale_bytes(cols: int) -> tuple[int, int]:
    """Low and high byte of the f16 block scale d for rows of `cols` weights.

    d makes the weights' standard deviation 1/sqrt(cols) (variance-preserving initialisation): activations keep
    their size through the layers, so logits stay finite and spread out instead of overflowing or all equal.
    """
    d = 1.0 / math.sqrt(_NIBBLE_VARIANCE * cols)
    raw = int(np.array(d, dtype="<f2").view("<u2"))
    return raw & 0xFF, raw >> 8


def _q4_0_chunks(spec: TensorSpec, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's Q4_0 data as uint8 arrays of about CHUNK_BYTES each (whole rows).

    Nibbles are uniform random; each block's scale is +d or -d at random, which cancels the -0.5 d mean of
    (nibble - 8), so the weights have mean zero.
    """
    rows, cols = spec.dims
    blocks_per_row = cols // QK4_0
    rows_per_chunk = max(1, CHUNK_BYTES // (blocks_per_row * Q4_0_BLOCK_BYTES))
    lo, hi = _q4_0_scale_bytes(cols)
    for r0 in range(0, rows, rows_per_chunk):
        nb = min(rows_per_chunk, rows - r0) * blocks_per_row
        # random_raw is ~4x faster than integers(0, 256, dtype=uint8); 16 bytes of nibbles + 1 sign byte per block.
        rand = rng.bit_generator.random_raw(-(-nb * 17 // 8)).view(np.uint8)
        blocks = np.empty((nb, Q4_0_BLOCK_BYTES), dtype=np.uint8)
        blocks[:, 0] = lo
        blocks[:, 1] = hi | (rand[nb * 16 : nb * 17] & 0x80)  # f16 sign bit
        blocks[:, 2:] = rand[: nb * 16].reshape(nb, 16)
        yield blocks


def _tensor_chunks(spec: TensorSpec, rng: np.random.Generator) -> Iterator[np.ndarray]:
    if spec.qtype == F32:
        yield np.ones(spec.dims, dtype="<f4")  # RMS norm weights: 1.0
    else:
        yield from _q4_0_chunks(spec, rng)


class _Progress:
    """GB written, to stderr, about every 1 GB (only for files of more than 1 GB)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.next_report = total, 0, 1 << 30
        self.t0 = time.perf_counter()
        self.enabled = total > 1 << 30

    def add(self, n: int) -> None:
        self.done += n
        if self.enabled and (self.done >= self.next_report or self.done == self.total):
            self.next_report += 1 << 30
            dt = time.perf_counter() - self.t0
            print(
                f"  {self.done / 1e9:6.1f} / {self.total / 1e9:.1f} GB  ({self.done / 1e9 / max(dt, 1e-9):.2f} GB/s)",
                file=sys.stderr,
                flush=True,
            )


def _write_tensor_data(fout: BinaryIO, plan: list[TensorSpec], seed: int) -> None:
    rng = np.random.default_rng(seed)
    progress = _Progress(sum(t.nbytes for t in plan))
    for spec in plan:
        written = 0
        for chunk in _tensor_chunks(spec, rng):
            fout.write(memoryview(chunk).cast("B"))
            written += chunk.nbytes
            progress.add(chunk.nbytes)
        if written != spec.nbytes:
            raise AssertionError(f"{spec.name}: wrote {written} bytes, expected {spec.nbytes}")
        fout.write(b"\0" * (_padded(written) - written))


# ---------------------------------------------------------------------------------------------- file


def write_random_gguf(shape: Shape | str, out: Path | str, vocab: int = 32000, seed: int = 0, ctx: int = 4096) -> Path:
    """Write a random-weight Llama GGUF of `shape` to `out` and return its path.

    `seed` picks the weights only; the vocabulary depends on `vocab` alone. Memory stays at about two chunks
    (~150 MB) whatever the shape.
    """
    s = SHAPES[shape] if isinstance(shape, str) else shape
    out = Path(out)
    plan = tensor_plan(s, vocab)
    tokens, scores, types = synthetic_vocab(vocab)

    free = shutil.disk_usage(out.parent if str(out.parent) else ".").free
    need = expected_size_bytes(s, vocab) + (16 << 20)
    if free < need:
        raise OSError(f"not enough disk space for {out}: need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")

    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, ARCH)
    try:
        writer.add_name(f"random-llama-{s.name}")
        writer.add_description("random weights for benchmarks (bench/random_gguf.py): the text is noise")
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_vocab_size(vocab)
        writer.add_context_length(ctx)
        writer.add_embedding_length(s.n_embd)
        writer.add_block_count(s.n_layer)
        writer.add_feed_forward_length(s.n_ff)
        writer.add_head_count(s.n_head)
        writer.add_head_count_kv(s.n_head_kv)
        writer.add_rope_dimension_count(s.head_dim)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(10000.0)

        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        # No implicit leading space: detokenize(tokenize(text)) gives back `text` exactly.
        writer.add_add_space_prefix(False)

        for spec in plan:
            # A non-uint8 dtype with raw_dtype: the shape is taken as given, in elements.
            writer.add_tensor_info(spec.name, spec.dims, np.dtype(np.float32), spec.nbytes, raw_dtype=spec.qtype)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None and len(writer.fout) == 1
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())  # tensor data start aligned
        _write_tensor_data(fout, plan, seed)
        fout.flush()
        os.fsync(fout.fileno())
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    writer.close()
    partial.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.random_gguf",
        description="Write a random-weight Llama GGUF (Q4_0) of a real model's shape, for benchmarks only.",
    )
    parser.add_argument("--shape", required=True, choices=list(SHAPES), help="model dimensions")
    parser.add_argument("--out", required=True, type=Path, help="GGUF file to write")
    parser.add_argument("--vocab", type=int, default=32000, help="tokens; same value = same vocabulary (fingerprint)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (not of the vocabulary)")
    parser.add_argument("--ctx", type=int, default=4096, help="llama.context_length written in the metadata")
    args = parser.parse_args(argv)

    size = expected_size_bytes(args.shape, args.vocab)
    print(f"writing {args.out}: shape {args.shape}, vocab {args.vocab}, ~{size / 1e9:.2f} GB", file=sys.stderr)
    t0 = time.perf_counter()
    path = write_random_gguf(args.shape, args.out, vocab=args.vocab, seed=args.seed, ctx=args.ctx)
    dt = time.perf_counter() - t0
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {dt:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
