"""`make run`'s launcher (tandem.stack) keeps serving when a service dies: killed under load, each service is
restarted with backoff while the gateway goes on (target-only without the draft; 503 with Retry-After without the
target), and serving with speculation resumes on its own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.launch import free_port
from tests.conftest import THREADS

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Count from 1 to 200, one number per line."}]


class Stack:
    """`python -m tandem.stack` on free loopback ports, its output collected line by line."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tandem.stack", "--port", str(self.port), "--threads", THREADS,
               "--target-port", str(free_port()), "--draft-port", str(free_port())]  # fmt: skip
        env = {**os.environ, "TANDEM_TARGET_MAX_SESSIONS": "4", "TANDEM_TARGET_N_CTX": "8192"}
        out = subprocess.PIPE
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.log = log
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("w") as out:
            for line in self.proc.stdout:
                self.lines.append(line)
                out.write(line)
                out.flush()

    def pid(self, name: str, after: int = 0) -> tuple[int, int]:
        """(pid, index of the line) of the latest start of `name` at or after line `after`."""
        pattern = re.compile(rf"tandem: started {name} \(pid (\d+)\)")
        for i in range(len(self.lines) - 1, after - 1, -1):
            match = pattern.match(self.lines[i])
            if match:
                return int(match.group(1)), i
        raise LookupError(name)

    def wait(self, predicate, timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                if predicate():
                    return time.monotonic() - t0
            except (httpx.HTTPError, LookupError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"{what} not within {timeout} s; stack output:\n{''.join(self.lines[-30:])}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("stack") / "stack.log")
    try:
        stack.wait(lambda: httpx.get(f"{stack.url}/health").json()["status"] == "ok", 120, "the stack")
        yield stack
    finally:
        stack.stop()


def _chat(stack: Stack, max_tokens: int = 24, **extra) -> httpx.Response:
    body = {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)


def _stream_events(stack: Stack, out: list, max_tokens: int = 400) -> None:
    """A long streamed request; each SSE event with the time it arrived."""
    body = {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=120) as response:
        out.append((time.monotonic(), "status", response.status_code))
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append((time.monotonic(), "event", json.loads(line[6:])))


def test_a_killed_draft_is_restarted_and_nothing_in_flight_is_lost(stack: Stack) -> None:
    reference = _chat(stack, 200, **{"speculative.n_max": 0}).json()["choices"][0]["message"]["content"]
    draft_pid, line = stack.pid("draft")
    events: list = []
    worker = threading.Thread(target=_stream_events, args=(stack, events, 200))
    worker.start()
    stack.wait(lambda: sum(kind == "event" for _, kind, _ in events) >= 3, 60, "the stream's first tokens")
    os.kill(draft_pid, signal.SIGKILL)
    worker.join(timeout=120)
    assert events[0][2] == 200
    text = "".join((e["choices"][0]["delta"].get("content") or "") for _, kind, e in events[1:] if e.get("choices"))
    assert "error" not in events[-1][2] and text == reference  # the stream finished, target-only, no token lost
    # While the draft is away requests are served target-only; it is restarted and speculation resumes.
    assert _chat(stack).status_code == 200
    stack.wait(lambda: stack.pid("draft", line + 1)[0] != draft_pid, 30, "the draft's restart")
    stack.wait(
        lambda: _chat(stack, **{"timings_detail": True}).json()["timings"]["speculation"] == "on",
        30,
        "speculation with the restarted draft",
    )


def test_a_killed_target_ends_streams_at_once_gets_503_and_serving_resumes(stack: Stack) -> None:
    target_pid, line = stack.pid("target")
    events: list = []
    worker = threading.Thread(target=_stream_events, args=(stack, events))
    worker.start()
    stack.wait(lambda: sum(kind == "event" for _, kind, _ in events) >= 3, 60, "the stream's first tokens")
    killed = time.monotonic()
    os.kill(target_pid, signal.SIGKILL)
    worker.join(timeout=60)
    assert not worker.is_alive()
    ended, _, last = events[-1]
    assert "error" in last, last  # an error event, not a silent end
    assert ended - killed < 5.0  # at once, not after an RPC timeout
    during = _chat(stack)
    if during.status_code != 200:  # unless the restarted target already answered
        assert during.status_code == 503 and during.headers["retry-after"]
        assert during.json()["error"]["type"]
    stack.wait(lambda: stack.pid("target", line + 1)[0] != target_pid, 30, "the target's restart")
    restarted = time.monotonic()
    stack.wait(lambda: _chat(stack).status_code == 200, 30, "serving after the target's restart")
    assert time.monotonic() - restarted < 30
