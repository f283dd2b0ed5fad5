"""`make run`: the whole stack on this machine — target, draft and gateway as three processes on 127.0.0.1.

(`--drafter local-ngram` drafts inside the gateway instead: two processes. `--colocate` loads both models into the
gateway's process: one process, no gRPC between the models and the gateway.)

Each service is its own process (as it would be its own container), started with the settings below; the gateway
waits for both to report SERVING. Ctrl-C stops all three, by PID.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def _spawn(name: str, module: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    print(f"tandem: starting {name}: python -m {module} {' '.join(args)}", flush=True)
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env)


def _as_env(prefix: str, flags: list[str]) -> dict[str, str]:
    """['--n-threads', '2', ...] -> {'<prefix>N_THREADS': '2', ...}: a service's flags as its settings variables."""
    from tandem.launch import settings_from_flags

    return {prefix + name.upper(): value for name, value in settings_from_flags(flags).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)), help="gateway HTTP port")
    parser.add_argument("--host", default="127.0.0.1", help="gateway HTTP address")
    parser.add_argument(
        "--drafter",
        choices=["ngram", "model", "local-ngram"],
        default="ngram",
        help="local-ngram: prompt lookup inside the gateway, no draft process (two processes)",
    )
    parser.add_argument("--model", default=None, help="target GGUF path, or smollm2-135m (default) or gemma3-270m")
    parser.add_argument("--draft-model", default=None, help="draft GGUF path or short name, for --drafter model")
    parser.add_argument("--target-port", type=int, default=50051)
    parser.add_argument("--draft-port", type=int, default=50052)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per model service (0 = all cores)")
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="one process: the gateway loads the target and the draft itself and calls them without gRPC",
    )
    args = parser.parse_args(argv)

    env = dict(os.environ)
    target_args = ["--port", str(args.target_port), "--n-threads", str(args.threads)]
    if args.model:
        target_args += ["--model", str(args.model)]
    local = args.drafter == "local-ngram"
    draft_args = ["--port", str(args.draft_port), "--drafter", args.drafter, "--n-threads", str(args.threads)]
    if args.draft_model:
        draft_args += ["--model", str(args.draft_model)]
    gateway_args = [
        "--host", args.host, "--port", str(args.port),
        "--target", f"127.0.0.1:{args.target_port}", "--draft", f"127.0.0.1:{args.draft_port}",
    ]  # fmt: skip
    if local:
        gateway_args.append("--local-ngram")
    if args.colocate:
        # The models' settings travel as their TANDEM_TARGET_* / TANDEM_DRAFT_* variables (see GatewaySettings).
        env |= _as_env("TANDEM_TARGET_", target_args) | _as_env("TANDEM_DRAFT_", draft_args)
        procs = [_spawn("gateway with co-located models", "services.gateway", [*gateway_args, "--colocate"], env)]
    else:
        procs = [_spawn("target", "services.target", target_args, env)]
        if not local:
            procs.append(_spawn("draft", "services.draft", draft_args, env))
        procs.append(_spawn("gateway", "services.gateway", gateway_args, env))
    print(f"tandem: OpenAI API at http://{args.host}:{args.port}/v1 once /health says ok; Ctrl-C stops", flush=True)

    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    try:
        while not stopping:
            for proc in procs:
                if proc.poll() is not None:
                    print(f"tandem: pid {proc.pid} exited with {proc.returncode}; stopping the stack", flush=True)
                    code = proc.returncode or 1
                    stopping = True
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
    return code


if __name__ == "__main__":
    sys.exit(main())
