"""`python -m bench.gpu.plain_ab`: target-only decoding at real model sizes, several tokens per Verify call or one.

Target-only calls ask the target for as many tokens as it computes in `--plain-burst-ms` (40 ms by default); with 0
they ask for one. Where steps are short (an 8B model on an H200: ~3 ms), a message per token is a large share of each
step. For each target shape this starts a target service on GPU 0 with two gateways on it (the default, and
`--plain-burst-ms 0`), optionally the same pair as co-located gateways (each loads its own copy of the model), and
llama-server's plain decoding as the peer, then sends the same completion to every configuration, interleaved over
the repetitions so that noise hits them alike. Random-weight models (bench/random_gguf.py): the text means nothing,
the step costs are real.

    python -m bench.gpu.plain_ab --models /tmp/models --shapes 8b,70b --colocated 8b --peer PATH --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.gpu.synth import TARGET_FLAGS, complete, start_peer, stop
from tandem.launch import Process, settings_from_flags, start_colocated_gateway, start_gateway, start_model_service


def log(msg: str) -> None:
    print(f"plain_ab: {msg}", file=sys.stderr, flush=True)


def row(shape: str, name: str, replies: list[dict]) -> dict:
    t = [r["timings"] for r in replies]
    rate = statistics.median(x["predicted_per_second"] for x in t)
    out = {"shape": shape, "config": name, "tok_s": round(rate, 1), "n": len(replies)}
    if "verify_compute_ms" in t[0]:
        predicted = sum(x["predicted_ms"] for x in t)
        out["overhead_pct"] = round(100 * (predicted - sum(x["verify_compute_ms"] for x in t)) / predicted, 1)
        out["tokens_per_call"] = round(sum(x["verify_steps"] for x in t) / max(sum(x["verify_calls"] for x in t), 1), 2)
    return out


def run_shape(args, client: httpx.Client, shape: str, log_dir: Path) -> list[dict]:
    model = args.models / f"{shape}.gguf"
    flags = [*TARGET_FLAGS, "--no-prefix-cache", "--flash-attn", "on"]
    procs: list[Process] = []
    peers = []
    configs: dict[str, str] = {}
    try:
        log(f"{shape}: target service and two gateways ...")
        target = start_model_service("services.target", ["--model", str(model), *flags], log_dir, timeout=900)
        procs.append(target)
        for name, extra in (("services", ()), ("services, 1-token calls", ("--plain-burst-ms", "0"))):
            procs.append(start_gateway(target.address, None, log_dir, *extra))
            configs[name] = procs[-1].address
        if shape in args.colocated:
            settings = settings_from_flags(flags) | {"model": str(model)}
            for name, extra in (("co-located", ()), ("co-located, 1-token calls", ("--plain-burst-ms", "0"))):
                log(f"{shape}: {name} gateway ...")
                procs.append(start_colocated_gateway(log_dir, settings, None, *extra, timeout=900))
                configs[name] = procs[-1].address
        if args.peer:
            log(f"{shape}: llama-server ...")
            proc, url = start_peer(
                args.peer, ["-m", str(model), "-ngl", "99", "-dev", "CUDA0", "-c", "4096", "-t", "4",
                            "--no-cache-prompt", "-fa", "on"], log_dir,
            )  # fmt: skip
            peers.append(proc)
            configs["llama-server"] = url
        names = list(configs)
        replies: dict[str, list[dict]] = {name: [] for name in names}
        for name in names:
            complete(client, configs[name], 8, {"speculative.n_max": 0})  # warm-up
        for rep in range(args.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                extra = {} if name == "llama-server" else {"speculative.n_max": 0}
                replies[name].append(complete(client, configs[name], args.max_tokens, extra))
            log(f"{shape}: repetition {rep + 1} of {args.reps} done")
        return [row(shape, name, replies[name]) for name in names]
    finally:
        for proc in reversed(procs):
            proc.stop()
        for proc in peers:
            stop(proc)


def table(rows: list[dict]) -> str:
    lines = ["| shape | config | tok/s | vs 1-token calls | vs llama-server | overhead % | tokens a call |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    by = {(r["shape"], r["config"]): r for r in rows}
    for r in rows:
        one = by.get((r["shape"], f"{r['config']}, 1-token calls"))
        peer = by.get((r["shape"], "llama-server"))
        vs_one = f"{r['tok_s'] / one['tok_s']:.3f}" if one else ""
        vs_peer = f"{r['tok_s'] / peer['tok_s']:.3f}" if peer and r["config"] != "llama-server" else ""
        lines.append(f"| {r['shape']} | {r['config']} | {r['tok_s']} | {vs_one} | {vs_peer} | "
                     f"{r.get('overhead_pct', '')} | {r.get('tokens_per_call', '')} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="folder with <shape>.gguf files")
    parser.add_argument("--shapes", default="8b,70b")
    parser.add_argument("--colocated", default="8b", help="shapes that also get the co-located pair (one copy each)")
    parser.add_argument("--peer", default=None, help="llama-server binary (CUDA build)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.colocated = set(args.colocated.split(",")) if args.colocated else set()
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.out / "logs"
    log_dir.mkdir(exist_ok=True)
    rows: list[dict] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with httpx.Client() as client:
        for shape in args.shapes.split(","):
            rows += run_shape(args, client, shape, log_dir)
            (args.out / "plain-ab.json").write_text(json.dumps({"started": started, "argv": sys.argv, "rows": rows}))
    text = f"`python -m bench.gpu.plain_ab {' '.join(sys.argv[1:])}`, {started}\n\n{table(rows)}\n"
    (args.out / "plain-ab.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
