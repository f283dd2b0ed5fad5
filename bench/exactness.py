"""Are batched verification rows bit-identical to one-token decoding, and what do exact kernels cost?

Speculative greedy output equals target-only output exactly only if the logits of row i of a k-token verify batch
equal the logits of decoding that token alone. This measures, for the llama.cpp build that is installed and the
chosen flash-attention setting, the largest difference between the two (over several batch sizes and start
positions) and the cost of prefill, one-token decoding and verify batches of 4-32 tokens.

    python -m bench.exactness --flash-attn off      # stock wheel: llamafile's sgemm rounds batches differently
    python -m bench.exactness --flash-attn on       # same kernels for batches and single tokens: exact, slower here
    PYTHONPATH=/path/to/a/llamafile-off/build python -m bench.exactness --flash-attn off

(A build without llamafile: CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" pip install --no-cache-dir --target DIR
llama-cpp-python==0.3.36.) Each configuration runs in its own process, so run them one after another and compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tandem.engine import DecodeItem, Engine  # isort: skip  (llama_cpp before numpy: the other order crashed the H200)
import numpy as np

from tandem.config import EngineSettings

# Token ids, not text, so that any model (a random-weight GGUF of a real shape on a GPU too) runs the same sequence.
PROMPT_IDS = [1, *range(1000, 1024)]
CONTEXT_IDS = [100 + (i * 7919) % 20000 for i in range(500)]
BATCHES = (2, 4, 8, 16)
STARTS = (0, 5, 17)
VERIFY_SIZES = (4, 8, 16, 32)


def progress(message: str) -> None:
    print(f"exactness: {message}", file=sys.stderr, flush=True)


def build_flags(backend: str) -> str:
    """Whether llama.cpp's CPU backend was built with llamafile's sgemm (the CPU's batch kernels)."""
    if backend != "CPU":
        return "GPU build"  # the CPU backend's kernel flags say nothing about the GPU's
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    return "llamafile on" if "LLAMAFILE = 1" in info else "llamafile off"


def max_batch_difference(engine: Engine, n_tokens: int = 40) -> dict[str, float]:
    """Largest |batch row - one-token row| over greedy continuations, per batch size (0.0 means bit-identical)."""
    prompt = PROMPT_IDS
    n = len(prompt)
    last = engine.decode([DecodeItem(0, prompt, 0, "last")])[0][-1].copy()
    tokens, single = [], []
    for i in range(n_tokens):
        tokens.append(int(np.argmax(last)))
        last = engine.decode([DecodeItem(0, [tokens[-1]], n + i, "all")])[0][-1].copy()
        single.append(last)
    out = {}
    for k in BATCHES:
        worst = 0.0
        for start in STARTS:
            engine.truncate(0, n)
            for i in range(start):  # the prefix one token at a time, as target-only decoding builds it
                engine.decode([DecodeItem(0, [tokens[i]], n + i, "none")])
            rows = engine.decode([DecodeItem(0, tokens[start : start + k], n + start, "all")])[0]
            worst = max(worst, float(np.abs(rows - np.stack(single[start : start + k])).max()))
        out[f"k={k}"] = worst
    engine.truncate(0, 0)
    return out


def step_costs(engine: Engine, reps: int) -> dict[str, float]:
    """Median ms of a 500-token prefill, a one-token decode and verify batches, on a 560-token context."""
    prompt = CONTEXT_IDS
    n = len(prompt)
    t = time.perf_counter()
    engine.decode([DecodeItem(0, prompt, 0, "last")])
    out = {"prefill 500": (time.perf_counter() - t) * 1e3}
    times = []
    for i in range(60):
        t = time.perf_counter()
        engine.decode([DecodeItem(0, [100 + i], n + i, "all")])
        times.append(time.perf_counter() - t)
    out["decode 1"] = statistics.median(times) * 1e3
    for k in VERIFY_SIZES:
        times = []
        for _ in range(reps):
            engine.truncate(0, n + 60)
            t = time.perf_counter()
            engine.decode([DecodeItem(0, list(range(200, 200 + k)), n + 60, "all")])
            times.append(time.perf_counter() - t)
        out[f"verify {k}"] = statistics.median(times) * 1e3
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = all cores)")
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="-1 = every layer on the GPU")
    parser.add_argument("--reps", type=int, default=12, help="repetitions per verify size")
    args = parser.parse_args(argv)
    settings = EngineSettings(
        model=args.model,
        n_gpu_layers=args.n_gpu_layers,
        max_sessions=2,
        n_ctx=4096,
        flash_attn=args.flash_attn,
        n_threads=args.threads,
    )
    progress("loading the model")
    engine = Engine(settings)
    try:
        label = f"{build_flags(engine.backend)}, {engine.device}, flash attention {args.flash_attn}"
        progress(f"{label}: batch rows against one-token rows")
        diff = max_batch_difference(engine)
        progress("step costs")
        costs = step_costs(engine, args.reps)
    finally:
        engine.close()
    print(f"| build | {' | '.join(diff)} | {' | '.join(f'{k} ms' for k in costs)} |")
    print(f"|---|{'---|' * (len(diff) + len(costs))}")
    cells = [f"{v:.4f}" for v in diff.values()] + [f"{v:.1f}" for v in costs.values()]
    print(f"| {label} | {' | '.join(cells)} |")
    print(json.dumps({"build": label, "max_abs_difference": diff, "ms": costs}))


if __name__ == "__main__":
    main()
