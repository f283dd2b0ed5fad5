"""`python -m bench.gpu.shape_probe --model M.gguf [engine flags]`: what a step costs when its size changes.

A GPU backend replays a recorded graph of kernels (CUDA graphs) only while consecutive steps have one shape; a step of
another size runs its kernels one launch at a time and the next steps record the graph again. Speculative decoding
changes the size every round (a verify step of k + 1 tokens, then single tokens, or a draft's catch-up step), so
it may pay that price where plain decoding does not. This probe times one sequence's steps in patterns of sizes,
each after a warm-up of the same pattern, and prints ms per step and per token.
"""

from __future__ import annotations

import argparse
import time

import llama_cpp  # noqa: F401  (before numpy: see shared notes on the GPU image)

from tandem.config import EngineSettings, prepare_process
from tandem.engine import DecodeItem, Engine

CONSTANT = [1, 2, 3, 4, 5]  # each size alone first: the price of a mixed pattern if changing size were free
PATTERNS = {
    "1,5 alternating": [1, 5],
    "5,1,1,1": [5, 1, 1, 1],
    "2,1,1,1 (a draft's round)": [2, 1, 1, 1],
    "2..5 cycling": [2, 3, 4, 5],
    "4,5 alternating": [4, 5],
}


def run_pattern(engine: Engine, sizes: list[int], steps: int, context: int) -> float:
    """Mean seconds per step over `steps` steps of the repeating `sizes`, after one warm-up pass of the same."""
    engine.truncate(0, context)
    position = context
    for i in range(len(sizes) * 3):  # warm-up
        n = sizes[i % len(sizes)]
        engine.decode([DecodeItem(0, [100 + (position + j) % 50 for j in range(n)], position, "all")])
        position += n
    engine.truncate(0, context)
    position = context
    t0 = time.perf_counter()
    for i in range(steps):
        n = sizes[i % len(sizes)]
        engine.decode([DecodeItem(0, [100 + (position + j) % 50 for j in range(n)], position, "all")])
        position += n
        if position > context + 1500:
            engine.truncate(0, context)
            position = context
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--device-argmax", default="off", choices=("auto", "on", "off"))
    parser.add_argument("--flash-attn", default="on", choices=("auto", "on", "off"))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args(argv)
    settings = EngineSettings(
        model=args.model, n_gpu_layers=args.n_gpu_layers, max_sessions=1, n_ctx=4096,
        device_argmax=args.device_argmax, flash_attn=args.flash_attn,
    )  # fmt: skip
    prepare_process(settings)
    engine = Engine(settings)
    engine.decode([DecodeItem(0, [100 + j % 50 for j in range(args.context)], 0, "last")])
    print(f"| {args.model.split('/')[-1]} ({engine.backend}) | ms/step | ms/token | vs the sizes alone |")
    print("|---|---|---|---|")
    alone: dict[int, float] = {}
    for n in CONSTANT:
        alone[n] = run_pattern(engine, [n], args.steps, args.context)
        print(f"| {n} always | {alone[n] * 1e3:.2f} | {alone[n] * 1e3 / n:.2f} | 1.00 |", flush=True)
    for name, sizes in PATTERNS.items():
        per_step = run_pattern(engine, sizes, args.steps, args.context)
        mean_size = sum(sizes) / len(sizes)
        expected = sum(alone[n] for n in sizes) / len(sizes)
        print(f"| {name} | {per_step * 1e3:.2f} | {per_step * 1e3 / mean_size:.2f} | {per_step / expected:.2f} |",
              flush=True)  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
