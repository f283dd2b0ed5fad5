"""Cross-vocabulary drafting on this machine: string level against token-level intersection, by temperature.

Starts a Gemma 3 270M / SmolLM2-135M stack in each direction (real services, real gateway, loopback only), sends the
same chat prompts target-only and with each way across at a fixed draft length, and prints per mode and temperature:
acceptance, tokens per round (mean accepted length), translation time per round and decode rate against target-only.
The numbers behind docs/decisions/0015-cross-vocabulary-drafting.md:

    python tools/cross_vocab_acceptance.py [--max-tokens 96] [--k 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import httpx

from tandem.launch import start_gateway, start_model_service

PROMPTS = [
    "Write a Python function that parses a CSV file into a list of dictionaries, with comments.",
    "Explain how a hash map works to a new programmer, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List twelve tips for writing clean code, each with one sentence of explanation.",
    "Summarise the causes of the French Revolution in a few paragraphs.",
]
DIRECTIONS = [("gemma3-270m", "smollm2-135m"), ("smollm2-135m", "gemma3-270m")]


def run(gateway: str, temperature: float, mode: str | None, k: int, max_tokens: int) -> dict:
    totals = {"draft_n": 0, "draft_n_accepted": 0, "rounds": 0, "translate_ms": 0.0, "predicted_n": 0, "ms": 0.0}
    for seed, prompt in enumerate(PROMPTS):
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "timings_detail": True,
            "speculative.n_max": 0 if mode is None else k,
            "speculative.adaptive": False,
        }
        if mode is not None:
            body["speculative.cross_vocab"] = mode
        timings = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=600).json()["timings"]
        for key in ("draft_n", "draft_n_accepted", "rounds", "translate_ms", "predicted_n"):
            totals[key] += timings[key]
        totals["ms"] += timings["predicted_ms"]
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="draft tokens a round (fixed)")
    parser.add_argument("--threads", default="1", help="CPU threads of each model service")
    parser.add_argument("--temperatures", default="0,0.7,1.0")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="cross-vocab-"))
    print("| target | draft | T | mode | acceptance | tokens/round | translate ms/round | tok/s | vs target-only |")
    print("|---|---|---|---|---|---|---|---|---|")
    for target_model, draft_model in DIRECTIONS:
        common = ["--n-threads", args.threads, "--max-sessions", "2", "--n-ctx", "16384"]
        target = start_model_service("services.target", ["--model", target_model, *common, "--flash-attn", "on"], tmp)
        draft = start_model_service("services.draft", ["--drafter", "model", "--model", draft_model, *common], tmp)
        gateway = start_gateway(target.address, draft.address, tmp)
        try:
            run(gateway.address, 0.0, "intersection", args.k, 8)  # warm-up: the vocabularies travel once
            for temperature in temperatures:
                plain = run(gateway.address, temperature, None, args.k, args.max_tokens)
                plain_rate = plain["predicted_n"] / plain["ms"] * 1e3
                for mode in (None, "string", "intersection"):
                    t = plain if mode is None else run(gateway.address, temperature, mode, args.k, args.max_tokens)
                    rate = t["predicted_n"] / t["ms"] * 1e3
                    row = {
                        "target": target_model,
                        "draft": draft_model,
                        "temperature": temperature,
                        "mode": mode or "target-only",
                        "acceptance": t["draft_n_accepted"] / t["draft_n"] if t["draft_n"] else None,
                        "tokens_per_round": (t["draft_n_accepted"] + t["rounds"]) / t["rounds"]
                        if t["rounds"]
                        else None,
                        "translate_ms_per_round": t["translate_ms"] / t["rounds"] if t["rounds"] else None,
                        "tok_s": rate,
                        "vs_target_only": rate / plain_rate,
                    }
                    rows.append(row)
                    cells = [
                        f"{row[key]:.3f}"
                        if isinstance(row[key], float)
                        else str(row[key] if row[key] is not None else "-")
                        for key in ("acceptance", "tokens_per_round", "translate_ms_per_round")
                    ]
                    print(
                        f"| {target_model} | {draft_model} | {temperature} | {row['mode']} | {' | '.join(cells)} |"
                        f" {rate:.1f} | {row['vs_target_only']:.2f} |",
                        flush=True,
                    )
        finally:
            for service in (gateway, draft, target):
                service.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
