"""`python -m bench.gpu.pack_stress --model M.gguf [--pack] [--seconds S]`: the target's step pattern without the stack.

Packed steps (`--pack-steps`) crashed the target on an H100 under load in some runs (a CUDA error at
`llama_synchronize`, docs/decisions/0022), never on the CPU. This drives `tandem.engine` directly as the target's
verifier does under load, to find out whether the engine and llama.cpp alone reproduce it: `--sessions` sequences in
one KV buffer, rollbacks of rejected tokens after a verify, and sessions that end and start over (prefill of a new
prompt into a freed slot). Seeded: a crash repeats with the same arguments. Patterns (`--pattern`):

- `random`: each step a random subset of the sessions, each with 1 token or, at `--verify-share`, 2..k+1 (every
  step a new shape: CUDA graphs are never replayed);
- `rotate`: every session every step, one of them verifying k + 1 tokens, a different one each step. The step keeps
  its token and output counts while its composition changes, so llama.cpp reuses its graph and the CUDA backend
  replays the recorded one (a reused graph skips the backend's property check): the suspect of the crash;
- `steady`: every session every step, one token each, and at `--verify-share` of the steps one random session
  verifies 2..k+1 tokens (plain decoding at a steady load with drafts now and then, as under load).

llama.cpp's error lines go straight to stderr (fd 2) from a C-level callback, so the CUDA error text survives the
abort that follows it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import time

import llama_cpp  # before numpy: see shared notes on the GPU image

from tandem.config import EngineSettings, prepare_process
from tandem.engine import DecodeItem, Engine

_KEEP = None


def errors_to_stderr() -> None:
    """Warnings and errors of llama.cpp and ggml written to fd 2 at once (no Python stream in between)."""
    global _KEEP

    def write(level: int, text: bytes, _data: ctypes.c_void_p) -> None:
        if level in (2, 3) and text:
            os.write(2, text)

    _KEEP = llama_cpp.llama_log_callback(write)
    llama_cpp.llama_log_set(_KEEP, ctypes.c_void_p(0))


def step_sizes(args: argparse.Namespace, rng: random.Random, step: int) -> list[tuple[int, int]]:
    """(session, tokens) of one step, by `--pattern`."""
    if args.pattern == "random":
        members = [s for s in range(args.sessions) if rng.random() < 0.8] or [0]
        return [(s, rng.randint(2, args.k + 1) if rng.random() < args.verify_share else 1) for s in members]
    if args.pattern == "rotate":
        verifier = step % args.sessions
        return [(s, args.k + 1 if s == verifier else 1) for s in range(args.sessions)]
    verifier = rng.randrange(args.sessions) if rng.random() < args.verify_share else -1
    return [(s, rng.randint(2, args.k + 1) if s == verifier else 1) for s in range(args.sessions)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--pack", action="store_true", help="one llama_decode call a step (--pack-steps)")
    parser.add_argument("--device-argmax", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--flash-attn", default="off", choices=("auto", "on", "off"))
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--k", type=int, default=4, help="longest draft: a verify step carries up to k + 1 tokens")
    parser.add_argument("--verify-share", type=float, default=0.3, help="share of a step's sessions that verify")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--reuse", action="store_true", help="with --pack, keep llama.cpp's graph reuse (packing turns it off on a GPU)"
    )
    parser.add_argument("--restart", type=float, default=0.002, help="per session and step: it ends, another starts")
    parser.add_argument("--pattern", default="rotate", choices=("random", "rotate", "steady"))
    args = parser.parse_args(argv)
    errors_to_stderr()
    rng = random.Random(args.seed)
    settings = EngineSettings(
        model=args.model, n_gpu_layers=args.n_gpu_layers, max_sessions=args.sessions, n_ctx=args.sessions * 2048,
        device_argmax=args.device_argmax, flash_attn=args.flash_attn, kv_unified="on",
        pack_steps="on" if args.pack and not args.reuse else "off",
    )  # fmt: skip
    prepare_process(settings)
    engine = Engine(settings)
    engine.pack_steps = args.pack  # --reuse: packed steps in a context created as an unpacked one (graph reuse on)
    vocab = min(engine.n_vocab, 32000)
    lengths = [0] * args.sessions  # tokens each sequence holds

    def restart(seq: int) -> None:
        """A session ends and another starts in its slot: a new prompt of 64-400 tokens."""
        engine.clear(seq)
        if seq < 4:
            engine.set_device_argmax(seq, rng.random() < 0.5)  # sessions that read rows and sessions that do not
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(64, 400))]
        engine.decode([DecodeItem(seq, prompt, 0, "last")])
        lengths[seq] = len(prompt)

    for seq in range(args.sessions):
        restart(seq)
    steps = tokens = restarts = 0
    t0 = time.perf_counter()
    last_report = t0
    while time.perf_counter() - t0 < args.seconds:
        items, verifying = [], []
        for seq, n in step_sizes(args, rng, steps):
            toks = [rng.randrange(100, vocab) for _ in range(n)]
            items.append(DecodeItem(seq, toks, lengths[seq], "all" if n > 1 else "last"))
            if n > 1:
                verifying.append((seq, n))
        engine.decode(items, copy=False)
        for item in items:
            lengths[item.seq_id] += len(item.tokens)
        for seq, n in verifying:  # rejected drafts roll back
            kept = lengths[seq] - rng.randint(0, n - 1)
            engine.truncate(seq, kept)
            lengths[seq] = kept
        steps += 1
        tokens += sum(len(i.tokens) for i in items)
        for seq in range(args.sessions):
            if lengths[seq] > 1500 or rng.random() < args.restart:
                restart(seq)
                restarts += 1
        now = time.perf_counter()
        if now - last_report > 5:
            calls = f"{engine.decode_calls} llama_decode calls ({engine.reshaped_calls} of a new layout)"
            print(f"{now - t0:5.1f} s: {steps} steps, {tokens} tokens, {restarts} restarts, {calls}", flush=True)
            last_report = now
    print(f"done: {steps} steps in {time.perf_counter() - t0:.1f} s, {engine.decode_calls} calls, no crash", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
