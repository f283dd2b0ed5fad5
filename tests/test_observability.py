"""Prometheus metrics and OpenTelemetry traces, on the real stack."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Service, start_model_service

EDIT = (
    "Return this code unchanged:\n\ndef area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
)


# A fixed draft length: the lookup then drafts wherever the answer copies the prompt. At adaptive k the gateway's
# shared cost model decides, and against the tests' one-thread target it drafted this short answer ("return 2 *
# (w + h)", 10 tokens) in the first request and no more after it: the second of these tests, run alone, saw none.
FIXED_K_EDIT = {
    "messages": [{"role": "user", "content": EDIT}],
    "max_tokens": 48,
    "timings_detail": True,
    "temperature": 0,
    "speculative.adaptive": False,
}


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", re.M)
    match = pattern.search(text)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def test_metrics_count_speculation(gateway: Service) -> None:
    before = httpx.get(f"{gateway.address}/metrics").text
    drafts0 = _metric(before, "tandem_spec_decode_num_drafts_total")
    steps0 = _metric(before, "tandem_upstream_target_steps_total")
    reply = httpx.post(
        f"{gateway.address}/v1/chat/completions",
        json=FIXED_K_EDIT,
        timeout=120,
    ).json()
    after = httpx.get(f"{gateway.address}/metrics").text
    timings = reply["timings"]
    assert _metric(after, "tandem_spec_decode_num_draft_tokens_total") >= timings["draft_n"]
    assert _metric(after, "tandem_spec_decode_num_drafts_total") > drafts0, timings
    assert _metric(after, "tandem_spec_decode_num_accepted_tokens_per_pos_total", '{position="0"}') >= 1
    assert _metric(after, "tandem_requests_total", '{endpoint="/v1/chat/completions",status="200"}') >= 1
    assert _metric(after, "tandem_time_to_first_token_seconds_count") >= 1
    assert _metric(after, "tandem_round_overhead_seconds_count") >= 1
    assert _metric(after, "tandem_active_requests") == 0
    # Sessions are closed once the response is done, on both services.
    assert _metric(after, "tandem_sessions_active", '{service="target"}') == 0
    assert _metric(after, "tandem_sessions_active", '{service="draft"}') == 0
    assert _metric(after, "tandem_upstream_up", '{service="target"}') == 1
    assert _metric(after, "tandem_kv_capacity_tokens", '{service="target"}') == 2048
    # The target's engine steps for the request (one a verify round, several a target-only call): at least one a call,
    # and with its forward time they give a step's cost (bench/concurrency.py records both per sample).
    steps = _metric(after, "tandem_upstream_target_steps_total") - steps0
    assert steps == timings["verify_steps"] and steps >= timings["verify_calls"] >= 1
    assert _metric(after, "tandem_upstream_compute_seconds_total", '{service="target"}') > 0
    # The target engine's calls as it reports them in Info: some changed layout (prefill, then verify steps), none
    # counted twice, their time inside the engine's forward time.
    target = '{service="target"}'
    calls, reshaped = (
        _metric(after, "tandem_engine_decode_calls", target),
        _metric(after, "tandem_engine_reshaped_calls", target),
    )
    assert calls >= steps and 1 <= reshaped <= calls
    assert (
        0
        < _metric(after, "tandem_engine_reshaped_seconds", target)
        <= _metric(after, "tandem_engine_decode_seconds", target)
    )
    # What the gateway prices rounds at, now that it measured the target's steps: a plain round and each draft length
    # up to 8, the plain token they are weighed against, the measured overhead, and the governor's current epoch.
    rounds = [_metric(after, "tandem_price_round_seconds", f'{{drafts="{k}"}}') for k in range(9)]
    assert all(0 < r < 10 for r in rounds), rounds
    assert 0 < _metric(after, "tandem_price_plain_token_seconds") < 10
    assert _metric(after, "tandem_price_step_sequences") >= 1
    assert _metric(after, "tandem_price_round_overhead_seconds") > 0
    assert _metric(after, "tandem_load_governor_allows_drafts") == 1  # nothing ran beside this request


def _epochs_at_two(text: str) -> float:
    return sum(
        float(v) for v in re.findall(r'^tandem_load_epochs_total\{drafts="(?:yes|no)",running="2"\} (\S+)$', text, re.M)
    )


def test_two_concurrent_requests_feed_the_load_governor(gateway: Service) -> None:
    """Under load every emitted token reaches the load governor (decision 0019): two requests at once make epochs at
    the level of two running generations, which /metrics counts (an epoch is at least 0.25 s and 32 tokens here)."""
    before = _epochs_at_two(httpx.get(f"{gateway.address}/metrics").text)
    body = {
        "messages": [{"role": "user", "content": "Count from 1 to 200, separated by commas."}],
        "max_tokens": 160,
        "temperature": 0,
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(
            pool.map(lambda _: httpx.post(f"{gateway.address}/v1/chat/completions", json=body, timeout=300), range(2))
        )
    assert all(r.status_code == 200 for r in replies)
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in replies)
    assert tokens >= 200, tokens  # enough for several epochs of 32 tokens
    after = httpx.get(f"{gateway.address}/metrics").text
    assert _epochs_at_two(after) > before, re.findall(r"^tandem_load_epoch.*$", after, re.M)


def test_response_reports_acceptance(gateway: Service) -> None:
    reply = httpx.post(
        f"{gateway.address}/v1/chat/completions",
        json=FIXED_K_EDIT,
        timeout=120,
    ).json()
    t = reply["timings"]
    assert t["draft_n"] > 0, t
    assert t["acceptance_rate"] == pytest.approx(t["draft_n_accepted"] / t["draft_n"], abs=1e-4)
    assert t["mean_accepted_length"] == pytest.approx((t["draft_n_accepted"] + t["rounds"]) / t["rounds"], abs=1e-4)


@pytest.fixture(scope="module")
def traced_services(service_tmp: Path) -> Iterator[tuple[Service, Service]]:
    env = {"OTEL_TRACES_EXPORTER": "console"}
    target = start_model_service("services.target", ["--n-threads", "1"], service_tmp, env=env)
    draft = start_model_service("services.draft", ["--drafter", "ngram"], service_tmp, env=env)
    yield target, draft
    target.stop()
    draft.stop()


def _spans(log: str) -> list[dict]:
    spans = []
    for line in log.splitlines():
        if line.startswith("{") and '"trace_id"' in line:
            spans.append(json.loads(line))
    return spans


def test_one_trace_per_request_across_services(traced_services: tuple[Service, Service]) -> None:
    from fastapi.testclient import TestClient
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.gateway.app import create_app
    from tandem.config import GatewaySettings

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

    target, draft = traced_services
    app = create_app(GatewaySettings(target=target.address, draft=draft.address))
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        reply = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": EDIT}], "max_tokens": 24, "temperature": 0},
        )
        assert reply.status_code == 200

    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    generate = next(s for s in spans if s.name == "tandem.generate")
    trace_id = generate.context.trace_id
    rounds = [s for s in spans if s.name == "round"]
    assert rounds and all(s.parent.span_id == generate.context.span_id for s in rounds)
    proposes = [s for s in spans if s.name == "propose"]
    verifies = [s for s in spans if s.name == "verify"]
    round_ids = {s.context.span_id for s in rounds}
    assert proposes and all(s.parent.span_id in round_ids for s in proposes)
    assert len(verifies) == len(rounds) and all(s.parent.span_id in round_ids for s in verifies)
    ours = [s for s in spans if s.name in ("tandem.generate", "open", "round", "propose", "verify")]
    assert {s.context.trace_id for s in ours} == {trace_id}, names
    # FastAPI's own request span, where present, is in the same trace: one trace per HTTP request.
    http = [s for s in spans if s.name == "POST /v1/chat/completions"]
    if http:
        assert http[0].context.trace_id == trace_id

    # The services continued the same trace, as children of the gateway's propose/verify spans.
    time.sleep(0.5)
    hex_trace = f"0x{trace_id:032x}"
    target_spans = [s for s in _spans(target.log()) if s["context"]["trace_id"] == hex_trace]
    draft_spans = [s for s in _spans(draft.log()) if s["context"]["trace_id"] == hex_trace]
    verify_ids = {f"0x{s.context.span_id:016x}" for s in verifies}
    propose_ids = {f"0x{s.context.span_id:016x}" for s in proposes}
    assert {s["parent_id"] for s in target_spans if s["name"].endswith("/Verify")} == verify_ids
    assert {s["parent_id"] for s in draft_spans if s["name"].endswith("/Propose")} == propose_ids
    assert any(s["name"].endswith("/Open") for s in target_spans)


def test_traced_service_spans_a_stream_call_sent_without_context(traced_services: tuple[Service, Service]) -> None:
    """A service skips the server span only where there is nothing to record: no trace context in the call and no
    tracer provider of its own. With tracing on, a call from an untraced caller still gets a (root) span."""
    import grpc

    from tandem.v1 import tandem_pb2 as pb
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    _, draft = traced_services
    session = f"untraced-{time.monotonic_ns()}"
    request = pb.ProposeRequest(request_id=7, items=[pb.ProposeItem(session_id=session, position=1, max_tokens=2)])
    with grpc.insecure_channel(draft.address) as channel:
        (reply,) = list(pb_grpc.DraftStub(channel).ProposeStream(iter([request]), timeout=30))
    assert reply.request_id == 7 and reply.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans = [s for s in _spans(draft.log()) if s["name"].endswith("/Propose") and s["parent_id"] is None]
        if spans:
            break
        time.sleep(0.1)
    assert spans, draft.log()[-2000:]
