"""Where a batched step's time goes: 1 stream against 8, target-only, with the engine's share of the wall time.

For each concurrency the probe reports aggregate tok/s, the target's forward time per verify call and the share of
decode time spent inside forward passes (from each response's `timings`): when 8 streams leave the engine idle
most of the time, the orchestration (gateway, gRPC, Python in the services), not the model, limits batching.
`python -m bench.gpu.batching_probe --target-args "--model M --n-gpu-layers -1 --device cuda:0"`
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.features import SHORT_PROMPTS
from tandem.launch import start_gateway, start_model_service


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "timings_detail": True,
        "temperature": 0,
        "speculative.n_max": 0,
    }
    response = await client.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


async def probe(url: str, max_tokens: int, rounds: int) -> None:
    async with httpx.AsyncClient() as client:
        await one(client, url, "warm up", 8)
        for _ in range(rounds):
            for streams in (1, 8):
                t0 = time.perf_counter()
                replies = await asyncio.gather(*(one(client, url, p, max_tokens) for p in SHORT_PROMPTS[:streams]))
                wall = time.perf_counter() - t0
                tokens = sum(r["usage"]["completion_tokens"] for r in replies)
                timings = [r["timings"] for r in replies]
                busy = statistics.mean(t["verify_compute_ms"] / t["predicted_ms"] for t in timings)
                per_call = statistics.mean(t["verify_compute_ms"] / max(t["verify_steps"], 1) for t in timings)
                print(
                    f"streams {streams}: {tokens / wall:7.1f} tok/s aggregate, forward {per_call:6.2f} ms per step, "
                    f"engine busy {100 * busy:5.1f}% of decode time",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target-args", default="")
    parser.add_argument("--gateway-args", default="")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="probe-"))
    target = start_model_service("services.target", ["--no-prefix-cache", *shlex.split(args.target_args)], logs)
    gateway = start_gateway(target.address, None, logs, "--max-concurrent", "16", *shlex.split(args.gateway_args))
    try:
        asyncio.run(probe(gateway.address, args.max_tokens, args.rounds))
    finally:
        gateway.stop()
        target.stop()


if __name__ == "__main__":
    main()
