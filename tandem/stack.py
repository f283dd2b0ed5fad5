"""`make run`: the whole stack on this machine — target, draft and gateway as three processes on 127.0.0.1.

(`--drafter local-ngram` drafts inside the gateway instead: two processes. `--colocate` loads both models into the
gateway's process: one process, no gRPC between the models and the gateway. `--colocate target` loads the target into
the gateway and keeps the draft a service: two processes, one gRPC call a round.)

Each service is its own process (as it would be its own container), started with the settings below; the gateway
waits for both to report SERVING. A service that dies is restarted with backoff (1, 2, 4 ... 30 s) while the rest
keeps serving: without the draft, requests go on target-only and speculation resumes when it is back; without the
target, requests get 503 with Retry-After until it is. `--no-restart` stops the whole stack instead. Ctrl-C stops
all, by PID.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

RESTART_BACKOFF_S = (1, 2, 4, 8, 16, 30)  # waits before restarting a service that died, by failures in a row
STABLE_S = 60.0  # a service that ran this long before it died starts its backoff over


@dataclass
class Child:
    """One service process of the stack, restarted with backoff when it dies (as a container runtime would)."""

    name: str
    module: str
    args: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    failures: int = 0
    restart_at: float | None = None

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], env=env)
        self.started, self.restart_at = time.monotonic(), None
        print(f"tandem: started {self.name} (pid {self.proc.pid}): python -m {self.module} {' '.join(self.args)}",
              flush=True)  # fmt: skip

    def exited(self, now: float) -> int | None:
        """The exit code if the process has just died (and schedules its restart), else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code, pid, ran = self.proc.returncode, self.proc.pid, now - self.started
        self.failures = 0 if ran >= STABLE_S else self.failures + 1
        delay = RESTART_BACKOFF_S[min(self.failures, len(RESTART_BACKOFF_S) - 1)]
        self.proc, self.restart_at = None, now + delay
        print(f"tandem: {self.name} (pid {pid}) exited with {code} after {ran:.0f} s", flush=True)
        return code


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
        choices=["ngram", "model", "ngram,model", "local-ngram"],
        default="ngram",
        help="ngram,model: prompt lookup first, the draft model where it finds nothing; local-ngram: prompt lookup"
        " inside the gateway, no draft process (two processes)",
    )
    parser.add_argument("--model", default=None, help="target GGUF path, or smollm2-135m (default) or gemma3-270m")
    parser.add_argument(
        "--draft-model", default=None, help="draft GGUF path or short name, for --drafter model or ngram,model"
    )
    parser.add_argument("--target-port", type=int, default=50051)
    parser.add_argument("--draft-port", type=int, default=50052)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per model service (0 = all cores)")
    parser.add_argument(
        "--colocate",
        nargs="?",
        const="all",
        choices=["all", "target"],
        default=None,
        help="all: one process, the gateway loads the target and the draft itself and calls them without gRPC;"
        " target: the gateway loads the target, the draft stays a service (the mixed-vendor layout)",
    )
    parser.add_argument(
        "--no-restart", action="store_true", help="stop the whole stack when a service dies instead of restarting it"
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
    if args.colocate == "all":
        # The models' settings travel as their TANDEM_TARGET_* / TANDEM_DRAFT_* variables (see GatewaySettings).
        env |= _as_env("TANDEM_TARGET_", target_args) | _as_env("TANDEM_DRAFT_", draft_args)
        children = [Child("gateway with co-located models", "services.gateway", [*gateway_args, "--colocate"])]
    elif args.colocate == "target":
        env |= _as_env("TANDEM_TARGET_", target_args)
        children = [] if local else [Child("draft", "services.draft", draft_args)]
        children.append(Child("gateway with the target", "services.gateway", [*gateway_args, "--colocate-target"]))
    else:
        children = [Child("target", "services.target", target_args)]
        if not local:
            children.append(Child("draft", "services.draft", draft_args))
        children.append(Child("gateway", "services.gateway", gateway_args))
    for child in children:
        child.start(env)
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
            now = time.monotonic()
            for child in children:
                exit_code = child.exited(now)
                if exit_code is not None and args.no_restart:
                    print("tandem: stopping the stack (--no-restart)", flush=True)
                    code, stopping = exit_code or 1, True
                elif exit_code is not None:
                    print(f"tandem: restarting {child.name} in {child.restart_at - now:.0f} s", flush=True)
                if not stopping and child.proc is None and child.restart_at is not None and now >= child.restart_at:
                    child.start(env)
            time.sleep(0.2)
    finally:
        procs = [c.proc for c in children if c.proc is not None]
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
