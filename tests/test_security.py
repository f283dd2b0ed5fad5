"""gRPC between the gateway and the services over TLS, mutual TLS and a shared token, with throw-away certificates."""

from __future__ import annotations

import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.frames import ERROR, HELLO, MAGIC, FrameReader, client_ssl_context, frame
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.conftest import THREADS, Service, start_gateway, start_model_service

TOKEN = "s3cret-token"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all made for this test run."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=tandem-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=tandem-{name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-out", f"{name}.pem", *ext, cwd=d)  # fmt: skip
    return d


@pytest.fixture(scope="module")
def secure_stack(pki: Path, service_tmp: Path) -> Iterator[dict[str, Service]]:
    tls = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
           "--tls-client-ca", str(pki / "ca.pem"), "--auth-token", TOKEN]  # fmt: skip
    target = start_model_service("services.target", ["--n-threads", THREADS, *tls], service_tmp)
    draft = start_model_service("services.draft", ["--drafter", "ngram", *tls], service_tmp)
    gateway = start_gateway(
        target.address, draft.address, service_tmp,
        "--upstream-tls-ca", str(pki / "ca.pem"), "--upstream-tls-cert", str(pki / "client.pem"),
        "--upstream-tls-key", str(pki / "client.key"), "--upstream-token", TOKEN,
    )  # fmt: skip
    yield {"target": target, "draft": draft, "gateway": gateway}
    for svc in (gateway, draft, target):
        svc.stop()


def test_gateway_speaks_mutual_tls_with_token(secure_stack: dict[str, Service]) -> None:
    reply = httpx.post(
        f"{secure_stack['gateway'].address}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Repeat: one two three one two three"}], "max_tokens": 24},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["timings"]["speculation"] == "on"  # the draft stream works through TLS and the token too


def _channel(address: str, pki: Path, client_cert: bool) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
    )
    return grpc.secure_channel(address, credentials)


def test_services_refuse_what_lacks_credentials(secure_stack: dict[str, Service], pki: Path) -> None:
    address = secure_stack["target"].address
    with grpc.insecure_channel(address) as plain:  # no TLS at all
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.TargetStub(plain).Info(pb.InfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with _channel(address, pki, client_cert=False) as no_cert:  # TLS but no client certificate
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.TargetStub(no_cert).Info(pb.InfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with _channel(address, pki, client_cert=True) as mtls:
        stub = pb_grpc.TargetStub(mtls)
        with pytest.raises(grpc.RpcError) as info:  # mutual TLS but no token
            stub.Info(pb.InfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:  # wrong token
            stub.Info(pb.InfoRequest(), timeout=5, metadata=(("authorization", "Bearer nope"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info_reply = stub.Info(pb.InfoRequest(), timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert info_reply.vocab_size == 49152
        # Health checks need no token, so orchestrators' probes keep working.
        health = health_pb2_grpc.HealthStub(mtls).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def _frames_answered(port: int, hello: bytes, context: ssl.SSLContext | None) -> list[tuple[int, bytes]]:
    """Open the frame port (over TLS with `context`), say `hello`; the frames answered until the service hangs up."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        sock = context.wrap_socket(raw, server_hostname="127.0.0.1") if context else raw
        sock.sendall(frame(HELLO, hello))
        reader, frames = FrameReader(), []
        try:
            while chunk := sock.recv(65536):
                frames += reader.feed(chunk)
                if frames:
                    break
        except (ssl.SSLError, ConnectionError):
            pass
        return frames


def test_frames_carry_the_same_tls_and_token(secure_stack: dict[str, Service], pki: Path) -> None:
    """The gateway's Verify and Propose go over the services' frame ports, through the same mutual TLS and token;
    a peer without the token, or without TLS, is not served there either."""
    test_gateway_speaks_mutual_tls_with_token(secure_stack)
    log = secure_stack["gateway"].log()
    assert "target: calls over frames" in log and "draft: calls over frames" in log
    with _channel(secure_stack["target"].address, pki, client_cert=True) as mtls:
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        port = pb_grpc.TargetStub(mtls).Info(pb.InfoRequest(), timeout=5, metadata=metadata).frame_port
    tls = client_ssl_context(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    assert _frames_answered(port, MAGIC + f"\n{TOKEN}".encode(), tls) == [(HELLO, MAGIC)]
    refused = _frames_answered(port, MAGIC + b"\nnope", tls)
    assert refused[0][0] == ERROR and b"wrong token" in refused[0][1]
    assert _frames_answered(port, MAGIC + f"\n{TOKEN}".encode(), None) == []  # plaintext to a TLS port: nothing
    no_cert = client_ssl_context(pki / "ca.pem", None, None)
    assert _frames_answered(port, MAGIC + f"\n{TOKEN}".encode(), no_cert) == []  # TLS without a client certificate
