"""Load test: many concurrent streaming clients against a running stack, on loopback, for a bounded time.

Every client streams temperature-0 chat completions in a loop and checks each answer against the single-request
answer to the same prompt (recorded before the load starts). 429s are honoured (Retry-After) and retried. The
report gives requests, tokens, unexpected errors, mismatches, and the RSS of the given processes at start and end.

    python -m bench.load --url http://127.0.0.1:8000 --clients 32 --seconds 60 --pids 123,456,789
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

PROMPTS = (
    "List five colours.",
    "Write one sentence about the sea.",
    "Count from 1 to 10.",
    "Name three programming languages.",
)
MAX_TOKENS = 24


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def stream_once(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, str | None]:
    """(text, error) for one streamed completion; retries after 429 as OpenAI clients do."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}  # fmt: skip
    while True:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code == 429:
                await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                continue
            if response.status_code != 200:
                return "", f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            parts = []
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "".join(parts), f"stream error: {chunk['error'].get('message')}"
                if chunk.get("choices"):
                    parts.append(chunk["choices"][0]["delta"].get("content") or "")
            return "".join(parts), None


async def run(url: str, clients: int, seconds: float, pids: list[int]) -> dict:
    timeout = httpx.Timeout(120.0)
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        reference = {}
        for prompt in PROMPTS:  # single-request answers, one at a time
            text, error = await stream_once(client, url, prompt)
            if error:
                raise RuntimeError(f"reference request failed: {error}")
            reference[prompt] = text
        rss_start = {pid: rss_mib(pid) for pid in pids}
        stats = {"requests": 0, "errors": [], "mismatches": 0}
        deadline = time.monotonic() + seconds

        async def client_loop(i: int) -> None:
            n = i
            while time.monotonic() < deadline:
                prompt = PROMPTS[n % len(PROMPTS)]
                n += 1
                text, error = await stream_once(client, url, prompt)
                stats["requests"] += 1
                if error:
                    stats["errors"].append(error)
                elif text != reference[prompt]:
                    stats["mismatches"] += 1

        started = time.monotonic()
        await asyncio.gather(*(client_loop(i) for i in range(clients)))
        elapsed = time.monotonic() - started
        rss_end = {pid: rss_mib(pid) for pid in pids}
    return {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "requests": stats["requests"],
        "requests_per_s": round(stats["requests"] / elapsed, 2),
        "unexpected_errors": len(stats["errors"]),
        "first_errors": stats["errors"][:3],
        "mismatches": stats["mismatches"],
        "rss_mib": {str(pid): {"start": rss_start[pid], "end": rss_end[pid]} for pid in pids},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--pids", default="", help="comma-separated PIDs whose RSS to report (the three services)")
    args = parser.parse_args(argv)
    pids = [int(p) for p in args.pids.split(",") if p]
    report = asyncio.run(run(args.url, args.clients, args.seconds, pids))
    print(json.dumps(report, indent=1))
    return 0 if report["unexpected_errors"] == 0 and report["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
