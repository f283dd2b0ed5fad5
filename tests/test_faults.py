"""Faults, limits and security with real processes: kill the draft or the target mid-request, disconnect a
client, overfill the queue, send oversized bodies and wrong keys."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.conftest import THREADS, Service, start_gateway, start_model_service

PROMPT = "Write a long story about a lighthouse keeper and a storm."
# A fixed draft length: these tests need the draft in use all along. With adaptive k, a same-size draft on this CPU
# stops being called after a probe (drafting cannot pay), and a fault in it would then change nothing.
FIXED_K = {"speculative.adaptive": False}


def _chat(gateway: Service, stream: bool = False, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 96, "temperature": 0, **FIXED_K, **extra}
    if stream:
        body["stream"] = True
    return httpx.post(f"{gateway.address}/v1/chat/completions", json=body, timeout=120)


def _active_sessions(address: str, stub_type) -> int:
    with grpc.insecure_channel(address) as channel:
        return stub_type(channel).Info(pb.InfoRequest()).load.active_sessions


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _stream_with_fault(gateway: Service, victim: Service, sig: signal.Signals) -> tuple[str, dict]:
    """Stream PROMPT at temperature 0 and send `sig` to `victim` once the first chunks arrived.

    Returns the streamed text and the final chunk's timings; any in-band error fails the test.
    """
    text, sent = [], False
    final: dict = {}
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 96, "temperature": 0, "stream": True}
    body.update(FIXED_K)
    with httpx.stream("POST", f"{gateway.address}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("choices"):
                text.append(chunk["choices"][0]["delta"].get("content") or "")
            if not sent and len(text) >= 3:
                victim.proc.send_signal(sig)
                sent = True
            if chunk.get("timings"):
                final = chunk["timings"]
    assert sent, "the stream ended before the fault could be injected"
    return "".join(text), final


@pytest.fixture(scope="module")
def fault_stack(service_tmp: Path) -> Iterator[dict]:
    """A sequential-verify target (speculative text == target-only text, bit for bit), a model draft, a gateway."""
    target = start_model_service(
        "services.target", ["--verify-mode", "sequential", "--n-threads", THREADS, "--max-sessions", "4"], service_tmp
    )
    draft = start_model_service("services.draft", ["--drafter", "model", "--n-threads", THREADS], service_tmp)
    gateway = start_gateway(target.address, draft.address, service_tmp, "--rpc-timeout-s", "10")
    stack = {"target": target, "draft": draft, "gateway": gateway, "tmp": service_tmp}
    yield stack
    for svc in (stack["gateway"], stack["draft"], stack["target"]):
        svc.stop()


def _restart(stack: dict, name: str, args: list[str]) -> Service:
    port = stack[name].address.rsplit(":", 1)[1]
    module = "services.target" if name == "target" else "services.draft"
    stack[name] = start_model_service(module, [*args, "--port", port], stack["tmp"])
    return stack[name]


def test_draft_killed_mid_request_loses_nothing(fault_stack: dict) -> None:
    gateway, draft = fault_stack["gateway"], fault_stack["draft"]
    reference = _chat(gateway).json()
    assert reference["timings"]["speculation"] == "on"
    expected = reference["choices"][0]["message"]["content"]

    # Stream the same request and SIGKILL the draft after the first chunks arrive.
    text, final = _stream_with_fault(gateway, draft, signal.SIGKILL)
    assert text == expected  # no token lost, repeated or altered
    assert final["speculation"] == "degraded"

    # New requests are served target-only while the draft is away; health says degraded.
    later = _chat(gateway).json()
    assert later["choices"][0]["message"]["content"] == expected
    assert later["timings"]["speculation"] in ("degraded", "off")
    health = httpx.get(f"{gateway.address}/health").json()
    assert health["status"] == "degraded" and health["draft"]["serving"] is False

    # The draft comes back on its port: speculation resumes without restarting the gateway.
    _restart(fault_stack, "draft", ["--drafter", "model", "--n-threads", THREADS])
    assert _wait_for(lambda: httpx.get(f"{gateway.address}/health").json()["status"] == "ok", 30)
    again = _chat(gateway).json()
    assert again["timings"]["speculation"] == "on" and again["timings"]["draft_n"] > 0
    assert again["choices"][0]["message"]["content"] == expected


def test_target_killed_mid_request_gives_clean_errors(fault_stack: dict) -> None:
    gateway, target = fault_stack["gateway"], fault_stack["target"]
    results: dict = {}

    def slow_request() -> None:
        results["response"] = _chat(gateway, max_tokens=400)

    worker = threading.Thread(target=slow_request)
    worker.start()
    time.sleep(1.0)
    target.proc.send_signal(signal.SIGKILL)
    worker.join(timeout=60)
    response = results["response"]
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable"

    # Streams end with an SSE error event, then [DONE].
    lines = []
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{gateway.address}/v1/chat/completions", json=body, timeout=60) as r:
        status = r.status_code
        lines = [line for line in r.iter_lines() if line]
    assert status == 503 or (lines[-1] == "data: [DONE]" and "error" in lines[-2])

    # The gateway stays up and reports the outage; serving resumes when the target returns.
    health = httpx.get(f"{gateway.address}/health")
    assert health.status_code == 503 and health.json()["target"]["serving"] is False
    _restart(fault_stack, "target", ["--verify-mode", "sequential", "--n-threads", THREADS, "--max-sessions", "4"])
    assert _wait_for(lambda: httpx.get(f"{gateway.address}/health").status_code == 200, 30)
    assert _chat(gateway).status_code == 200


def test_client_disconnect_frees_sessions(fault_stack: dict) -> None:
    gateway = fault_stack["gateway"]
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{gateway.address}/v1/chat/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 4:
                break  # leave mid-stream
    left = time.monotonic()
    target, draft = fault_stack["target"].address, fault_stack["draft"].address
    # Close drops a session at once, without waiting behind queued engine work; the slot's KV is reclaimed before
    # the engine's next step.
    assert _wait_for(lambda: _active_sessions(target, pb_grpc.TargetStub) == 0, 1.0)
    assert _wait_for(lambda: _active_sessions(draft, pb_grpc.DraftStub) == 0, max(1.0 - (time.monotonic() - left), 0))


@pytest.fixture(scope="module")
def guarded_gateway(target: Service, ngram_draft: Service, service_tmp: Path) -> Iterator[Service]:
    gateway = start_gateway(
        target.address, ngram_draft.address, service_tmp,
        "--api-keys", "right-key", "--max-concurrent", "1", "--max-queue", "0", "--max-body-bytes", "4096",
    )  # fmt: skip
    yield gateway
    gateway.stop()


def test_api_keys(guarded_gateway: Service) -> None:
    url = f"{guarded_gateway.address}/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "right-key"}):
        response = httpx.get(url, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": "Bearer right-key"}).status_code == 200
    assert httpx.get(f"{guarded_gateway.address}/health").status_code == 200  # probes need no key


def test_oversized_body_is_413(guarded_gateway: Service) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 10_000}]}
    response = httpx.post(
        f"{guarded_gateway.address}/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer right-key"},
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_full_queue_is_429_with_retry_after(guarded_gateway: Service) -> None:
    headers = {"Authorization": "Bearer right-key"}
    url = f"{guarded_gateway.address}/v1/chat/completions"
    long_request = {
        "messages": [{"role": "user", "content": "Count from 1 to 300, one number per line."}],
        "max_tokens": 400,
        "temperature": 0,
    }
    results: dict = {}
    worker = threading.Thread(
        target=lambda: results.update(first=httpx.post(url, json=long_request, headers=headers, timeout=120))
    )
    worker.start()
    running = lambda: httpx.get(f"{guarded_gateway.address}/health").json()["requests"]["running"] == 1  # noqa: E731
    assert _wait_for(running, 30), "the first request never started"
    second = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, headers=headers)
    worker.join(timeout=120)
    assert results["first"].status_code == 200  # the admitted request is unaffected
    assert second.status_code == 429, second.text
    assert second.headers["retry-after"] == "1"
    assert second.json()["error"]["type"] == "rate_limit_error"


def test_max_tokens_beyond_the_room_is_capped_not_refused(guarded_gateway: Service) -> None:
    """As llama-server does (and as agents need: Claude Code always asks for far more than a small context holds),
    max_tokens past the context's room or the server's --max-tokens-limit is capped and ends with "length"."""
    response = httpx.post(
        f"{guarded_gateway.address}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7, "temperature": 0},
        headers={"Authorization": "Bearer right-key"},
        timeout=600,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 8192  # the default --max-tokens-limit
    # Where the cap lands: tests/test_strategies.py::test_max_tokens_is_capped_at_the_room_and_the_limit


def test_draft_stall_past_deadline_degrades_to_target_only(fault_stack: dict) -> None:
    """SIGSTOP the draft mid-request: its call misses the deadline and the request finishes target-only, unchanged."""
    draft = fault_stack["draft"]
    gateway = start_gateway(fault_stack["target"].address, draft.address, fault_stack["tmp"], "--rpc-timeout-s", "1.5")
    try:
        expected = _chat(gateway).json()["choices"][0]["message"]["content"]
        text, final = _stream_with_fault(gateway, draft, signal.SIGSTOP)
        assert text == expected
        assert final["speculation"] == "degraded"
    finally:
        draft.proc.send_signal(signal.SIGCONT)
        gateway.stop()


def test_orphaned_sessions_expire(service_tmp: Path) -> None:
    """A session nobody closes (its gateway died, say) is dropped after the idle timeout, freeing its KV."""
    target = start_model_service("services.target", ["--n-threads", "1", "--session-idle-timeout-s", "1"], service_tmp)
    try:
        with grpc.insecure_channel(target.address) as channel:
            stub = pb_grpc.TargetStub(channel)
            stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id="orphan", prompt_token_ids=[1, 504, 2573])]))
            assert stub.Info(pb.InfoRequest()).load.active_sessions == 1
            # The expiry sweep runs every 5 s.
            assert _wait_for(lambda: stub.Info(pb.InfoRequest()).load.active_sessions == 0, 12)
            assert stub.Info(pb.InfoRequest()).load.kv_tokens == 0
    finally:
        target.stop()


def test_requests_beyond_the_targets_slots_wait_their_turn_and_none_fails(
    service_tmp: Path, ngram_draft: Service
) -> None:
    """Admission follows the target's session slots (each holds a whole request: its prompt and its answer's room):
    with 2 slots, 5 concurrent requests run 2 at a time, the rest wait in the queue, and every one completes with
    the same text as alone; a slot's cached prefix is given up to a new prompt rather than refusing it."""
    target = start_model_service(
        "services.target", ["--n-threads", THREADS, "--max-sessions", "2", "--n-ctx", "4096"], service_tmp
    )
    gateway = start_gateway(target.address, ngram_draft.address, service_tmp)
    try:
        url = f"{gateway.address}/v1/chat/completions"
        bodies = [
            {
                "messages": [{"role": "user", "content": f"Count from {i} to {i + 40}."}],
                "max_tokens": 48,
                "temperature": 0,
            }
            for i in range(5)
        ]
        alone = [httpx.post(url, json=b, timeout=300).json()["choices"][0]["message"]["content"] for b in bodies[:2]]
        seen: list[dict] = []
        results: dict[int, httpx.Response] = {}
        threads = [
            threading.Thread(target=lambda i=i: results.update({i: httpx.post(url, json=bodies[i], timeout=300)}))
            for i in range(5)
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            seen.append(httpx.get(f"{gateway.address}/health").json()["requests"])
            time.sleep(0.05)
        assert all(results[i].status_code == 200 for i in range(5)), [results[i].text for i in range(5)]
        assert max(s["running"] for s in seen) <= 2
        assert max(s["queued"] for s in seen) >= 1  # some waited rather than failing
        texts = [results[i].json()["choices"][0]["message"]["content"] for i in range(5)]
        assert texts[:2] == alone
    finally:
        gateway.stop()
        target.stop()


def test_a_request_that_starts_on_a_busy_server_sheds_speculation(
    target: Service, ngram_draft: Service, service_tmp: Path
) -> None:
    """--draft-max-running 1: alone a request speculates; one that starts while another runs decodes target-only
    (timings say load_shed), with the same text."""
    gateway = start_gateway(target.address, ngram_draft.address, service_tmp, "--draft-max-running", "1")
    try:
        url = f"{gateway.address}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "Count from 1 to 60."}], "max_tokens": 120, "temperature": 0}
        alone = httpx.post(url, json=body, timeout=300).json()
        assert alone["timings"]["speculation"] == "on" and "load_shed" not in alone["timings"]
        long_body = {**body, "max_tokens": 400, "messages": [{"role": "user", "content": "Count from 1 to 300."}]}
        results: dict = {}
        worker = threading.Thread(target=lambda: results.update(first=httpx.post(url, json=long_body, timeout=300)))
        worker.start()
        running = lambda: httpx.get(f"{gateway.address}/health").json()["requests"]["running"] >= 1  # noqa: E731
        assert _wait_for(running, 30)
        busy = httpx.post(url, json=body, timeout=300).json()
        worker.join(timeout=300)
        assert results["first"].status_code == 200
        assert busy["timings"]["speculation"] == "off" and busy["timings"]["load_shed"] is True
        assert busy["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    finally:
        gateway.stop()
