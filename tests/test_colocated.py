"""The co-located gateway (`--colocate`): target and draft in the gateway's process, called without gRPC.

Real models, real HTTP; only the transport between gateway and models is gone, so everything the separate services
guarantee must hold here too: lossless output with continuous batching and overlapped drafting, OpenAI-shaped
errors for bad input, health and metrics.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from services.gateway.colocated import Deadlines, invoke
from tandem.config import DraftSettings, TargetSettings, pin_colocated
from tandem.errors import InvalidArgument, SessionNotFound
from tandem.launch import start_colocated_gateway, start_gateway, start_model_service
from tests.conftest import THREADS, Service

PROMPTS = [
    "Write a Python function that parses a CSV file into a list of dictionaries, with comments.",
    "Explain how a hash map works to a new programmer, step by step.",
    "List twelve tips for writing clean code, each with one sentence of explanation.",
    "Rewrite this function with type hints and a docstring:\n\ndef area(shape, a, b=None):\n    if shape == 'square':\n"
    "        return a * a\n    if shape == 'rect':\n        return a * b\n    raise ValueError(shape)\n",
]


@pytest.fixture(scope="module")
def colocated(service_tmp: Path) -> Iterator[Service]:
    """Target and a same-model draft in one process, flash attention on (batch rows then round like single tokens,
    see test_lossless_e2e), overlapped drafting on. No prefix cache: a prompt whose prefix is reused is prefilled in
    other chunks than a cold one, which moves logits by an ulp (on this model, one of these prompts then flips a
    near-tie between its target-only run and its speculative run, with separate services just the same).
    Single-stream inline steps forced on (a CPU model has them off by default): a request alone runs its steps on the
    event loop, except a Verify sent while the draft drafts ahead, which goes to the target's engine thread."""
    common = {"n_threads": THREADS, "flash_attn": "on", "max_sessions": "8", "n_ctx": "8192", "prefix_cache": "false"}
    common["single_stream_inline"] = "on"
    # The draft prefills in whole chunks, as the target does, although other requests step beside it: its chunk budget
    # under load (decision 0024) would cost the same-model draft its bit-exact agreement, which this test checks.
    draft = {**common, "drafter": "model", "prefill_chunk_ms": "0"}
    gateway = start_colocated_gateway(service_tmp, common, draft, "--overlap-draft")
    yield gateway
    gateway.stop()


def _chat(gateway: Service, prompt: str, n_max: int, **extra) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 96,
        "timings_detail": True,
        "temperature": 0,
        "logprobs": True,
        "speculative.n_max": n_max,
        "speculative.adaptive": False,
        **extra,
    }
    response = httpx.post(f"{gateway.address}/v1/chat/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def test_colocated_speculation_is_lossless(colocated: Service) -> None:
    """One request at a time (inline steps) and four at a time (batched steps), same-model draft: every text and
    logprob equals target-only decoding, every draft token is accepted, and drafting overlapped verification."""
    plain = [_chat(colocated, p, n_max=0) for p in PROMPTS]
    alone = [_chat(colocated, p, n_max=4) for p in PROMPTS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda p: _chat(colocated, p, n_max=4), PROMPTS))
    for spec in (alone, together):
        for prompt, a, b in zip(PROMPTS, plain, spec, strict=True):
            assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"], prompt
            got = [t["logprob"] for t in b["choices"][0]["logprobs"]["content"]]
            assert got == [t["logprob"] for t in a["choices"][0]["logprobs"]["content"]], prompt
        drafted = sum(s["timings"]["draft_n"] for s in spec)
        assert drafted > 0 and sum(s["timings"]["draft_n_accepted"] for s in spec) == drafted
        assert sum(s["timings"]["overlapped_rounds"] for s in spec) > 0
    spec = together
    # No transport: the gateway's view of a Verify call is the service's own time plus microseconds.
    t = spec[0]["timings"]
    assert t["verify_rpc_ms"] - t["verify_service_ms"] < 0.5 * t["verify_calls"]


def test_colocated_seeded_sampling_is_reproducible(colocated: Service) -> None:
    args = {"temperature": 0.8, "seed": 7, "logprobs": False}
    first = _chat(colocated, PROMPTS[1], n_max=4, **args)
    second = _chat(colocated, PROMPTS[1], n_max=4, **args)
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    assert first["timings"]["draft_n"] > 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [5, 10**7], "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 9000}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature"),
    ],
)
def test_colocated_bad_input_gets_openai_errors(colocated: Service, path: str, body: dict, param: str) -> None:
    response = httpx.post(f"{colocated.address}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.get(f"{colocated.address}/health").status_code == 200


def _sessions(gateway: Service) -> dict[str, float]:
    """tandem_sessions_active by service, from the gateway's /metrics (refreshed from Info on each scrape)."""
    out = {}
    for line in httpx.get(f"{gateway.address}/metrics").text.splitlines():
        if line.startswith("tandem_sessions_active{"):
            out[line.split('service="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_colocated_client_disconnect_frees_sessions(colocated: Service) -> None:
    """A client that leaves mid-stream cancels the request's task, which here runs the model calls themselves; the
    sessions on both models must still close."""
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 400, "stream": True,
            "speculative.n_max": 4}  # fmt: skip
    with httpx.stream("POST", f"{colocated.address}/v1/chat/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 4:
                break  # leave mid-stream
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _sessions(colocated) != {"target": 0.0, "draft": 0.0}:
        time.sleep(0.1)
    assert _sessions(colocated) == {"target": 0.0, "draft": 0.0}
    assert httpx.get(f"{colocated.address}/health").json()["status"] == "ok"


def test_colocated_model_that_fails_to_load_is_reported(tmp_path: Path) -> None:
    """A bad model path: the gateway stays up and says why on /health (503), and /v1 answers 503, as it does while
    separate services are unreachable."""
    gateway = start_colocated_gateway(tmp_path, {"model": str(tmp_path / "missing.gguf")}, None, wait_healthy=False)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = httpx.get(f"{gateway.address}/health")
            if health.json().get("status") == "error":
                break
            time.sleep(0.2)
        assert health.status_code == 503
        assert "missing.gguf" in health.json()["error"]
        reply = httpx.post(f"{gateway.address}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "loading"
    finally:
        gateway.stop()


def test_colocated_health_and_metrics(colocated: Service) -> None:
    health = httpx.get(f"{colocated.address}/health").json()
    assert health["status"] == "ok"
    assert health["target"]["serving"] and health["draft"]["serving"] and health["draft"]["drafter"] == "model"
    metrics = httpx.get(f"{colocated.address}/metrics").text
    assert 'tandem_upstream_up{service="target"} 1.0' in metrics
    assert 'tandem_upstream_up{service="draft"} 1.0' in metrics


def _raising(exc: BaseException):
    async def handler(request, context):
        raise exc

    return handler


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidArgument("bad token"), grpc.StatusCode.INVALID_ARGUMENT),
        (SessionNotFound("gone"), grpc.StatusCode.NOT_FOUND),
        (ZeroDivisionError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_local_calls_raise_the_status_a_remote_call_would(exc: BaseException, code: grpc.StatusCode) -> None:
    async def run() -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await invoke(_raising(exc), None, 5.0, "/tandem.v1.Target/Verify", None)
        return info.value

    error = asyncio.run(run())
    assert error.code() == code
    assert str(exc) in error.details()


def test_local_call_deadline() -> None:
    async def slow(request, context):
        await asyncio.sleep(5)

    async def run() -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await invoke(slow, None, 0.05, "/tandem.v1.Draft/Propose", None)
        return info.value

    assert asyncio.run(run()).code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_pin_colocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPUs of one backend: both visible, each model pinned to its own by index; a CPU model offloads nothing;
    GPUs of two backends cannot share a process."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    target = TargetSettings(device="cuda:3", n_gpu_layers=-1)
    draft = DraftSettings(device="cuda:1", n_gpu_layers=-1, split_mode="layer")
    pin_colocated(target, draft)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert (target.main_gpu, draft.main_gpu, draft.split_mode) == (0, 1, "none")
    assert target.device is None and draft.device is None

    cpu_draft = DraftSettings(device="cpu", n_gpu_layers=-1)
    pin_colocated(TargetSettings(device="cuda:0", n_gpu_layers=-1), cpu_draft)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0" and cpu_draft.n_gpu_layers == 0

    with pytest.raises(ValueError, match="one GPU backend"):
        pin_colocated(TargetSettings(device="cuda:0"), DraftSettings(device="rocm:0"))


def test_stack_colocate_runs_in_one_process(tmp_path: Path) -> None:
    """`python -m tandem.stack --colocate` (what `make run COLOCATE=1` starts): one process serves the API, and
    stopping it by its PID leaves nothing behind."""
    import signal
    import subprocess
    import sys

    from tandem.launch import ROOT, free_port, wait_http_ok

    port = free_port()
    log = tmp_path / "stack.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.stack", "--colocate", "--port", str(port), "--threads", THREADS],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc, 120)
        body = {"prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):", "max_tokens": 24, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()
        assert reply["usage"]["completion_tokens"] > 0
        assert reply["timings"]["speculation"] == "on"
        assert "gateway with co-located models" in log.read_text()
        assert "starting target" not in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-2000:]


def test_local_call_continues_the_callers_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a trace to continue, an in-process call opens a server span under the caller's span, as a service would;
    without one (tracing off), it opens none."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import services.gateway.colocated as colocated_module

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(colocated_module, "tracer", lambda: provider.get_tracer("test"))

    async def echo(request, context):
        return request

    caller = provider.get_tracer("test").start_span("verify")
    assert asyncio.run(invoke(echo, "traced", 5.0, "/tandem.v1.Target/Verify", trace.set_span_in_context(caller)))
    assert asyncio.run(invoke(echo, "untraced", 5.0, "/tandem.v1.Target/Verify", None)) == "untraced"
    (server,) = exporter.get_finished_spans()
    assert server.name == "/tandem.v1.Target/Verify" and server.kind == trace.SpanKind.SERVER
    assert server.parent.span_id == caller.get_span_context().span_id


def test_local_call_deadline_in_a_second_event_loop_and_its_timing() -> None:
    """Deadlines keep one timer per event loop: a new loop (as each asyncio.run makes) gets its own, and a call is
    cut within a check period of its deadline."""

    async def slow(request, context):
        await asyncio.sleep(5)

    async def run() -> float:
        t0 = time.perf_counter()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await invoke(slow, None, 0.1, "/tandem.v1.Draft/Propose", None)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return time.perf_counter() - t0

    for _ in range(2):
        assert 0.1 <= asyncio.run(run()) < 0.1 + Deadlines.PERIOD_S + 0.5


def test_local_call_cancelled_by_its_caller_stays_cancelled() -> None:
    """A cancel from outside (a client gone) is a CancelledError, never a deadline; and a call that answered in time
    leaves nothing armed that could cancel its task later."""

    async def slow(request, context):
        await asyncio.sleep(5)

    async def quick(request, context):
        return "answer"

    async def run() -> None:
        call = asyncio.ensure_future(invoke(slow, None, 10.0, "/tandem.v1.Target/Verify", None))
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await invoke(quick, None, 0.05, "/tandem.v1.Target/Verify", None) == "answer"
        await asyncio.sleep(0.05 + 2 * Deadlines.PERIOD_S)  # past the answered call's deadline: still not cancelled
        assert asyncio.current_task().cancelling() == 0

    asyncio.run(run())


@pytest.fixture(scope="module")
def target_here(service_tmp: Path) -> Iterator[tuple[Service, Service]]:
    """`--colocate-target`: the target in the gateway's process, a same-model draft as its own gRPC service (the
    mixed-vendor box's layout). Same numerics settings as `colocated`, so target-only text is comparable."""
    common = {"n_threads": THREADS, "flash_attn": "on", "max_sessions": "8", "n_ctx": "8192", "prefix_cache": "false"}
    flags = ["--drafter", "model", "--n-threads", THREADS, "--flash-attn", "on", "--max-sessions", "8"]
    draft = start_model_service("services.draft", [*flags, "--n-ctx", "8192", "--no-prefix-cache"], service_tmp)
    env = {f"TANDEM_TARGET_{k.upper()}": v for k, v in common.items()}
    gateway = start_gateway("in-process", draft.address, service_tmp, "--colocate-target", env=env)
    yield gateway, draft
    gateway.stop()
    draft.stop()


def test_the_target_in_the_gateway_with_a_remote_draft_is_lossless(target_here: tuple[Service, Service]) -> None:
    gateway, _ = target_here
    health = httpx.get(f"{gateway.address}/health").json()
    assert health["draft"]["drafter"] == "model" and health["draft"]["serving"]
    for prompt in PROMPTS[:2]:
        plain, spec = _chat(gateway, prompt, n_max=0), _chat(gateway, prompt, n_max=4)
        assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        t = spec["timings"]
        assert t["draft_n"] > 0 and t["draft_n_accepted"] == t["draft_n"]
        # The target is local (no transport on Verify), the draft remote (each Propose crosses gRPC).
        assert t["verify_rpc_ms"] - t["verify_service_ms"] < 0.5 * t["verify_calls"]


def test_the_target_in_the_gateway_survives_losing_its_draft(target_here: tuple[Service, Service]) -> None:
    gateway, draft = target_here
    draft.stop()
    reply = _chat(gateway, PROMPTS[2], n_max=4)
    assert reply["choices"][0]["message"]["content"] and reply["timings"]["speculation"] in ("degraded", "off")
