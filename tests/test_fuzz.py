"""Property-based fuzzing of the gateway from its own OpenAPI schema (schemathesis): no input may cause a 5xx.

The fuzzed gateway caps max_tokens low so that the valid requests among the generated ones finish fast; everything
else about it is the real stack. Also fuzzes the gRPC services with invalid sessions, positions and tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.conftest import Service, start_gateway

# The GET operations have no inputs (one example each): the two POST operations carry the 1,000+ requests.
EXAMPLES_PER_OPERATION = 550


@pytest.fixture(scope="module")
def fuzz_gateway(target: Service, ngram_draft: Service, service_tmp: Path) -> Iterator[Service]:
    gateway = start_gateway(
        target.address, ngram_draft.address, service_tmp, "--max-tokens-limit", "8", "--max-tokens-default", "4"
    )
    yield gateway
    gateway.stop()


def test_no_input_causes_a_server_error(fuzz_gateway: Service) -> None:
    """Every operation of the gateway's OpenAPI schema, fuzzed by schemathesis' generator: never a 5xx."""
    schema = schemathesis.openapi.from_url(f"{fuzz_gateway.address}/openapi.json")
    sent: list[int] = []
    server_errors: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 5

    for operation in operations:

        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(case=operation.as_strategy())
        def fuzz(case) -> None:
            response = case.call(base_url=fuzz_gateway.address, timeout=60)
            sent.append(response.status_code)
            if response.status_code >= 500:
                server_errors.append(f"{case.method} {case.path} {case.body!r:.200} -> {response.status_code}")

        fuzz()
    print(f"\nfuzzed {len(sent)} requests; statuses: { {s: sent.count(s) for s in sorted(set(sent))} }")
    assert len(sent) >= 1000
    assert not server_errors, server_errors[:5]


def test_gateway_still_healthy_after_fuzzing(fuzz_gateway: Service) -> None:
    assert httpx.get(f"{fuzz_gateway.address}/health").status_code == 200
    metrics = httpx.get(f"{fuzz_gateway.address}/metrics").text
    served = [line for line in metrics.splitlines() if line.startswith("tandem_requests_total{")]
    assert served, "the fuzzer sent no requests"
    assert not [line for line in served if 'status="5' in line], served


def test_grpc_services_reject_garbage(target: Service, ngram_draft: Service) -> None:
    """Random invalid sessions, positions and tokens: every call ends with a client-error status, never INTERNAL."""
    rng = random.Random(7)
    allowed = {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
    with grpc.insecure_channel(target.address) as tc, grpc.insecure_channel(ngram_draft.address) as dc:
        target_stub, draft_stub = pb_grpc.TargetStub(tc), pb_grpc.DraftStub(dc)
        sid = "fuzz-session"
        target_stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=[1, 2, 3])]))
        draft_stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=[1, 2, 3])]))
        codes = []
        for _ in range(200):
            session = rng.choice([sid, "", "nope", "x" * 300])
            position = rng.choice([0, 1, 3, 5, 2**31, rng.randrange(2**32)])
            tokens = [rng.choice([-1, 0, 49151, 49152, 2**31 - 1, rng.randrange(-(2**31), 2**31)]) for _ in range(3)]
            kind = rng.randrange(4)
            try:
                if kind == 0:
                    item = pb.VerifyItem(session_id=session, position=position, draft_token_ids=tokens)
                    target_stub.Verify(pb.VerifyRequest(items=[item]))
                elif kind == 1:
                    target_stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=session, prompt_token_ids=tokens)]))
                elif kind == 2:
                    item = pb.RollbackItem(session_id=session, position=position)
                    target_stub.Rollback(pb.RollbackRequest(items=[item]))
                else:
                    item = pb.ProposeItem(session_id=session, position=position, append_token_ids=tokens, max_tokens=4)
                    draft_stub.Propose(pb.ProposeRequest(items=[item]))
            except grpc.RpcError as exc:
                codes.append(exc.code())
        assert codes, "no invalid call was refused"
        assert set(codes) <= allowed, set(codes) - allowed
        for stub in (target_stub, draft_stub):
            stub.Close(pb.CloseRequest(session_ids=[sid, "nope", "x" * 300]))
