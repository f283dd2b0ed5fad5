"""`python -m bench.gpu.synth`: tandem and llama-server at real model sizes, with synthetic acceptance.

Random-weight GGUFs of real shapes (bench/random_gguf.py) give real step costs; acceptance is imposed with
`bench.synthetic_target` (tandem) and `--spec-synth-len` (llama-server), both as a mean acceptance length L at draft
length k. For each target/draft pair, draft placement (same GPU, CPU, second GPU), L and k, it measures decode
tok/s, speedup over target-only, the round split, and tandem with overlapped drafting on and off; then the same
configurations through llama-server `-md`. Runs against a deadline and records what it had to skip.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tandem.launch import (
    Process,
    free_port,
    settings_from_flags,
    start_colocated_gateway,
    start_gateway,
    start_model_service,
    wait_http_ok,
)

PROMPT = "Once upon a time there was a"
PLACEMENTS = {
    # name: (tandem draft flags, llama-server draft flags). CPU threads: 4 for the target, and 4 for a GPU draft
    # (it computes little on the CPU) or 12 for a CPU draft, 16 in all on the 16-core host. With more, two models in
    # one process (co-located, or llama-server) oversubscribe it: OpenMP then cuts its spin-waits short and every
    # forward pass waits on sleeping workers.
    "same GPU": ("--n-gpu-layers -1 --device cuda:0 --n-threads 4", "-ngld 99 -devd CUDA0 -td 4"),
    "CPU": ("--device cpu --n-threads 12", "-ngld 0 -devd none -td 12"),
    "GPU 1": ("--n-gpu-layers -1 --device cuda:1 --n-threads 4", "-ngld 99 -devd CUDA1 -td 4"),
}


def log(msg: str) -> None:
    print(f"synth: {msg}", file=sys.stderr, flush=True)


def complete(client: httpx.Client, url: str, max_tokens: int, extra: dict) -> dict:
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "timings_detail": True,
        "temperature": 0,
        "cache_prompt": False,
        **extra,
    }
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    data = r.json()
    data["wall_s"] = time.perf_counter() - t0
    return data


def tok_s(replies: list[dict]) -> float:
    return statistics.median(r["timings"]["predicted_per_second"] for r in replies)


def tandem_row(pair, placement, length, k, overlap, replies, base) -> dict:
    t = [r["timings"] for r in replies]
    predicted = sum(x["predicted_ms"] for x in t)
    draft = sum(x.get("draft_compute_ms", 0) for x in t)
    verify = sum(x.get("verify_compute_ms", 0) for x in t)
    rate = tok_s(replies)
    calls = max(sum(x.get("verify_calls", 0) for x in t), 1)

    def per_call(key: str) -> float:
        return sum(x.get(key, 0) for x in t) / calls

    draft_rpc, verify_rpc = per_call("draft_rpc_ms"), per_call("verify_rpc_ms")
    services = per_call("draft_service_ms") + per_call("verify_service_ms")
    mean_len = statistics.mean(x["mean_accepted_length"] or 1 for x in t)
    return {
        "engine": "tandem", "pair": pair, "draft_on": placement, "L": length, "k": k,
        "overlap": overlap, "tok_s": round(rate, 1), "speedup": round(rate / base, 2),
        "mean_len": round(mean_len, 2),
        "tok_s_at_L": round(rate * length / mean_len, 1),
        "draft_pct": round(100 * draft / predicted, 1), "verify_pct": round(100 * verify / predicted, 1),
        # With overlap the draft runs during verification, so compute can exceed wall time: overhead is then < 0.
        "overhead_pct": round(100 * (predicted - draft - verify) / predicted, 1),
        # Where the overhead goes, in ms per round (Verify call): the gateway's own time between calls, gRPC
        # (call wall seen by the gateway minus wall inside the service) and the services' Python around compute.
        "round_ms": round(predicted / calls, 2),
        "gw_ms": round(predicted / calls - draft_rpc - verify_rpc, 2),
        "grpc_ms": round(draft_rpc + verify_rpc - services, 2),
        "svc_ms": round(services - (draft + verify) / calls, 2),
        "overlapped_rounds": sum(x.get("overlapped_rounds", 0) for x in t),
        "rounds": sum(x.get("rounds", 0) for x in t),
    }  # fmt: skip


def measure_tandem(args, client, pair, placement, length, gateways: dict[str, Process], base, rows, mode) -> float:
    """Target-only (once per base) and every k with each gateway (overlap on/off); returns the target-only rate."""
    first = next(iter(gateways.values()))
    complete(client, first.address, 8, {"speculative.n_max": 2})  # warm-up
    if base is None:
        base = tok_s([complete(client, first.address, args.max_tokens, {"speculative.n_max": 0})
                      for _ in range(args.reps)])  # fmt: skip
        rows.append({"engine": "tandem", "mode": mode, "pair": pair, "draft_on": "-", "L": length, "k": 0,
                     "overlap": "-", "tok_s": round(base, 1), "speedup": 1.0})  # fmt: skip
    for k in args.ks:
        if length > k + 1:
            continue
        for overlap, gw in gateways.items():
            spec = {"speculative.n_max": k, "speculative.adaptive": False, "speculative.overlap": overlap == "on"}
            replies = [complete(client, gw.address, args.max_tokens, spec) for _ in range(args.reps)]
            rows.append({"mode": mode, **tandem_row(pair, placement, length, k, overlap, replies, base)})
            log(f"{pair} {mode} {placement} L={length} k={k} overlap {overlap}: {rows[-1]['tok_s']} tok/s")
    return base


def run_tandem_colocated(args, client, pair, target_path, draft_path, rows, deadline, log_dir) -> None:
    """The same rows with the target and the draft loaded into the gateway's process (services.gateway --colocate):
    no gRPC between them. One gateway (one 70B copy) at a time."""
    target = settings_from_flags([*args.target_flags, "--no-prefix-cache"])
    target |= {"model": str(target_path), "flash_attn": args.flash_attn}
    for length in args.lengths:
        base = None
        for placement in args.placements:
            if time.monotonic() > deadline:
                rows.append({"engine": "tandem", "mode": "co-located", "pair": pair, "L": length,
                             "draft_on": placement, "skipped": "deadline"})  # fmt: skip
                continue
            draft = settings_from_flags([*PLACEMENTS[placement][0].split(), *args.draft_flags, "--no-prefix-cache"])
            draft |= {"drafter": "model", "model": str(draft_path), "flash_attn": args.flash_attn}
            log(f"{pair}: co-located gateway L={length}, draft on {placement} ...")
            gw = start_colocated_gateway(
                log_dir, target, draft, "--synth-len", str(length), "--colocated-gateway", timeout=900,
                module="bench.synthetic_target",
            )  # fmt: skip
            try:  # overlap is a request key (speculative.overlap): one load of both models serves both
                base = measure_tandem(
                    args, client, pair, placement, length, {"on": gw, "off": gw}, base, rows, "co-located"
                )
            finally:
                gw.stop()


def run_tandem_target_in_gateway(
    args, client, pair, target_path, draft_path, rows, deadline, log_dir, mode: str = "target-in-gateway"
) -> None:
    """The middle layout (`--colocate-target`): the target loaded into the gateway's process, the draft a gRPC service
    in its own process (on the same GPU or the CPU). Mode `target-in-gateway-grpc`: Propose over the gRPC stream
    instead of the draft's frame port (`--no-upstream-frames`), for an A/B of the transport."""
    transport = ["--no-upstream-frames"] if mode.endswith("-grpc") else []
    target = settings_from_flags([*args.target_flags, "--no-prefix-cache"])
    target |= {"model": str(target_path), "flash_attn": args.flash_attn}
    env = {f"TANDEM_TARGET_{k.upper()}": v for k, v in target.items()}
    for length in args.lengths:
        base = None
        for placement in args.placements:
            if time.monotonic() > deadline:
                rows.append({"engine": "tandem", "mode": mode, "pair": pair, "L": length,
                             "draft_on": placement, "skipped": "deadline"})  # fmt: skip
                continue
            draft = start_model_service(
                "services.draft",
                ["--drafter", "model", "--model", str(draft_path), *PLACEMENTS[placement][0].split(), *args.draft_flags,
                 "--no-prefix-cache", "--flash-attn", args.flash_attn],
                log_dir, timeout=600,
            )  # fmt: skip
            try:
                log(f"{pair}: {mode} L={length}, draft on {placement} ...")
                gw = start_gateway(
                    "in-process", draft.address, log_dir, "--synth-len", str(length), "--colocated-gateway", "target",
                    *transport, timeout=900, module="bench.synthetic_target", env=env,
                )  # fmt: skip
                try:  # overlap is a request key (speculative.overlap): one target load serves both
                    gateways = {"on": gw, "off": gw}
                    base = measure_tandem(args, client, pair, placement, length, gateways, base, rows, mode)
                finally:
                    gw.stop()
            finally:
                draft.stop()


TARGET_FLAGS = ["--n-gpu-layers", "-1", "--device", "cuda:0", "--n-threads", "4", "--max-sessions", "2",
                "--n-ctx", "4096"]  # fmt: skip
DRAFT_FLAGS = ["--max-sessions", "2", "--n-ctx", "4096"]


def run_tandem(args, client, pair, target_path, draft_path, rows, deadline, log_dir) -> None:
    for length in args.lengths:
        if time.monotonic() > deadline:
            rows.append({"engine": "tandem", "pair": pair, "L": length, "skipped": "deadline"})
            continue
        log(f"{pair}: synthetic target L={length} ...")
        target = start_model_service(
            "bench.synthetic_target",
            ["--synth-len", str(length), "--model", str(target_path), *args.target_flags, "--no-prefix-cache",
             "--flash-attn", args.flash_attn],
            log_dir, timeout=900,
        )  # fmt: skip
        procs: list[Process] = [target]
        try:
            base = None
            for placement in args.placements:
                if time.monotonic() > deadline:
                    rows.append({"engine": "tandem", "pair": pair, "L": length, "draft_on": placement,
                                 "skipped": "deadline"})  # fmt: skip
                    continue
                flags = PLACEMENTS[placement][0].split()
                draft = start_model_service(
                    "services.draft",
                    ["--drafter", "model", "--model", str(draft_path), *flags, *args.draft_flags, "--no-prefix-cache",
                     "--flash-attn", args.flash_attn],
                    log_dir, timeout=600,
                )  # fmt: skip
                gw_on = start_gateway(target.address, draft.address, log_dir, "--overlap-draft")
                gw_off = start_gateway(target.address, draft.address, log_dir, "--no-overlap-draft")
                procs += [draft, gw_on, gw_off]
                gateways = {"on": gw_on, "off": gw_off}
                base = measure_tandem(args, client, pair, placement, length, gateways, base, rows, "services")
                for p in (gw_off, gw_on, draft):
                    p.stop()
                    procs.remove(p)
        finally:
            for p in reversed(procs):
                p.stop()


def start_peer(binary: str, flags: list[str], log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log_path = log_dir / f"llama-server-{port}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "--no-webui",
                                 *flags], stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    wait_http_ok(f"http://127.0.0.1:{port}/health", proc, 900)
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_peer(args, client, pair, target_path, draft_path, rows, deadline, log_dir) -> None:
    common = ["-m", str(target_path), "-ngl", "99", "-dev", "CUDA0", "-c", "4096", "-t", "4", "--no-cache-prompt",
              "-fa", args.flash_attn]  # fmt: skip
    proc, url = start_peer(args.peer, common, log_dir)
    try:
        complete(client, url, 8, {})
        base = tok_s([complete(client, url, args.max_tokens, {}) for _ in range(args.reps)])
    finally:
        stop(proc)
    rows.append({"engine": "llama-server", "pair": pair, "draft_on": "-", "k": 0, "tok_s": round(base, 1),
                 "speedup": 1.0})  # fmt: skip
    for placement in args.peer_placements:
        for length in args.lengths:
            for k in args.peer_ks:
                if length > k + 1:
                    continue
                if time.monotonic() > deadline:
                    rows.append({"engine": "llama-server", "pair": pair, "draft_on": placement, "L": length, "k": k,
                                 "skipped": "deadline"})  # fmt: skip
                    continue
                flags = [*common, "-md", str(draft_path), *PLACEMENTS[placement][1].split(), "--spec-type",
                         "draft-simple", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                         "--spec-draft-p-min", "0", "--spec-synth-len", str(length)]  # fmt: skip
                proc, url = start_peer(args.peer, flags, log_dir)
                try:
                    complete(client, url, 8, {})
                    replies = [complete(client, url, args.max_tokens, {}) for _ in range(args.reps)]
                finally:
                    stop(proc)
                rate = tok_s(replies)
                t = [r["timings"] for r in replies]
                drafted = sum(x.get("draft_n", 0) for x in t)
                accepted = sum(x.get("draft_n_accepted", 0) for x in t)
                # Its synthetic acceptance is drawn at random per token: the realised mean length (each round drafts
                # k) wanders around L, so tok_s_at_L rescales the rate to exactly L for comparison with tandem's.
                mean_len = 1 + k * accepted / drafted if drafted else None
                rows.append({"engine": "llama-server", "pair": pair, "draft_on": placement, "L": length, "k": k,
                             "tok_s": round(rate, 1), "speedup": round(rate / base, 2),
                             "mean_len": round(mean_len, 2) if mean_len else None,
                             "tok_s_at_L": round(rate * length / mean_len, 1) if mean_len else None,
                             "acceptance": round(accepted / drafted, 3) if drafted else None})  # fmt: skip
                log(f"llama-server {pair} {placement} L={length} k={k}: {rows[-1]['tok_s']} tok/s")


def table(rows: list[dict]) -> str:
    keys = ["engine", "mode", "pair", "draft_on", "L", "k", "overlap", "tok_s", "tok_s_at_L", "speedup", "mean_len",
            "acceptance", "draft_pct", "verify_pct", "overhead_pct", "round_ms", "gw_ms", "grpc_ms", "svc_ms",
            "overlapped_rounds", "rounds", "skipped"]  # fmt: skip
    keys = [k for k in keys if any(k in r for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=Path, required=True, help="folder with <shape>.gguf files")
    parser.add_argument("--pairs", default="70b:1b,8b:0.5b", help="target:draft shapes")
    parser.add_argument("--placements", default="same GPU,CPU", help="comma-separated: same GPU, CPU, GPU 1")
    parser.add_argument("--lengths", default="2,3,5")
    parser.add_argument("--ks", default="2,4,8")
    parser.add_argument("--peer", default=None, help="llama-server binary (CUDA build)")
    parser.add_argument("--peer-ks", default="4")
    parser.add_argument("--peer-placements", default=None, help="default: --placements")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--deadline-s", type=float, default=540)
    parser.add_argument("--only", choices=("both", "tandem", "peer"), default="both")
    parser.add_argument(
        "--flash-attn", choices=("on", "off"), default="on",
        help="for both engines alike (llama-server's own default on CUDA is on)",
    )  # fmt: skip
    parser.add_argument(
        "--modes", default="services",
        help="tandem's deployments, comma-separated: services (draft, target and gateway as processes, gRPC between"
        " them), target-in-gateway (the target inside the gateway's process, the draft a service: --colocate-target;"
        " target-in-gateway-grpc: the same with Propose over gRPC, not frames),"
        " co-located (both models inside the gateway's process: services.gateway --colocate)",
    )  # fmt: skip
    parser.add_argument(
        "--device-argmax", choices=("auto", "on", "off"), default="auto",
        help="tandem's target and draft alike (greedy argmax in llama.cpp, decision 0020; auto: on a GPU)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    # Every tandem process of this run takes them (the module's lists stay as they are: plain_ab imports them).
    args.target_flags = [*TARGET_FLAGS, "--device-argmax", args.device_argmax]
    args.draft_flags = [*DRAFT_FLAGS, "--device-argmax", args.device_argmax]
    args.modes = args.modes.split(",")
    args.placements = args.placements.split(",")
    args.peer_placements = args.peer_placements.split(",") if args.peer_placements else args.placements
    args.lengths = [float(x) for x in args.lengths.split(",")]
    args.ks = [int(x) for x in args.ks.split(",")]
    args.peer_ks = [int(x) for x in args.peer_ks.split(",")]
    missing = [
        str(args.models / f"{shape}.gguf")
        for pair in args.pairs.split(",")
        for shape in pair.split(":")
        if not (args.models / f"{shape}.gguf").is_file()
    ]
    if missing:  # before any server starts: a gateway without its model waits for a health that never comes
        parser.error(f"model files not found: {', '.join(missing)} (write them with python -m bench.random_gguf)")
    deadline = time.monotonic() + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.out / "logs"
    log_dir.mkdir(exist_ok=True)
    rows: list[dict] = []
    try:
        with httpx.Client() as client:
            for pair in args.pairs.split(","):
                target_shape, draft_shape = pair.split(":")
                paths = args.models / f"{target_shape}.gguf", args.models / f"{draft_shape}.gguf"
                if args.only != "peer" and "services" in args.modes:
                    run_tandem(args, client, pair, *paths, rows, deadline, log_dir)
                for mode in ("target-in-gateway", "target-in-gateway-grpc"):
                    if args.only != "peer" and mode in args.modes:
                        run_tandem_target_in_gateway(args, client, pair, *paths, rows, deadline, log_dir, mode)
                if args.only != "peer" and "co-located" in args.modes:
                    run_tandem_colocated(args, client, pair, *paths, rows, deadline, log_dir)
                if args.peer and args.only != "tandem":
                    run_peer(args, client, pair, *paths, rows, deadline, log_dir)
    finally:
        meta = {"command": " ".join(["python -m bench.gpu.synth", *(argv or sys.argv[1:])]),
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip
        (args.out / "synth.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        report = (
            f"# Synthetic acceptance at real model sizes ({meta['date']})\n\n`{meta['command']}`\n\n{table(rows)}\n"
        )
        (args.out / "synth.md").write_text(report)
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
