"""Fixtures that start the real services: real processes, real gRPC on ephemeral loopback ports, the real model.

Each service runs as its own process exactly as `make run` starts it; tests talk gRPC and HTTP to it. Processes are
stopped by PID at the end of the session.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
LISTEN = re.compile(r"tandem: \S+ listening on ([\d.]+):(\d+)")
READY = re.compile(r"tandem: \S+ ready on ")
# Two model processes share this 2-core machine in tests: one thread each keeps them from starving each other.
THREADS = os.environ.get("TANDEM_TEST_THREADS", "1")


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    address: str
    log_path: Path
    extra: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(path: Path, pattern: re.Pattern, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = pattern.search(path.read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            raise RuntimeError(
                f"{proc.args} exited with {proc.returncode}:\n{path.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"{proc.args} did not print {pattern.pattern!r} in {timeout} s")


def start_model_service(module: str, args: list[str], tmp: Path, wait_ready: bool = True) -> Service:
    """Start `python -m module --port 0 ...`, learn its port from its first line, wait until it reports ready."""
    name = module.rsplit(".", 1)[-1]
    log_path = tmp / f"{name}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0", *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    match = _wait_for(log_path, LISTEN, proc, 60)
    service = Service(name, proc, f"{match.group(1)}:{match.group(2)}", log_path)
    if wait_ready:
        _wait_for(log_path, READY, proc, 120)
    return service


def start_gateway(target: str, draft: str | None, tmp: Path, *extra: str) -> Service:
    port = free_port()
    log_path = tmp / f"gateway-{port}.log"
    args = ["--host", "127.0.0.1", "--port", str(port), "--target", target, "--draft", draft or "", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
    service = Service("gateway", proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited:\n{service.log()[-3000:]}")
        try:
            if httpx.get(f"{service.address}/health", timeout=2).status_code == 200:
                return service
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    service.stop()
    raise TimeoutError(f"gateway not healthy:\n{service.log()[-3000:]}")


@pytest.fixture(scope="session")
def service_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="session")
def target(service_tmp: Path) -> Iterator[Service]:
    service = start_model_service(
        "services.target", ["--n-threads", THREADS, "--max-sessions", "8", "--n-ctx", "8192"], service_tmp
    )
    yield service
    service.stop()


@pytest.fixture(scope="session")
def ngram_draft(service_tmp: Path) -> Iterator[Service]:
    service = start_model_service("services.draft", ["--drafter", "ngram", "--max-sessions", "8"], service_tmp)
    yield service
    service.stop()


@pytest.fixture(scope="session")
def model_draft(service_tmp: Path) -> Iterator[Service]:
    """The same model as the target, as its own draft: acceptance should then be near 1 (lossless check)."""
    service = start_model_service(
        "services.draft",
        ["--drafter", "model", "--n-threads", THREADS, "--max-sessions", "8", "--n-ctx", "8192"],
        service_tmp,
    )
    yield service
    service.stop()


@pytest.fixture(scope="session")
def gateway(target: Service, ngram_draft: Service, service_tmp: Path) -> Iterator[Service]:
    service = start_gateway(target.address, ngram_draft.address, service_tmp)
    yield service
    service.stop()


@pytest.fixture(scope="session")
def model_gateway(target: Service, model_draft: Service, service_tmp: Path) -> Iterator[Service]:
    service = start_gateway(target.address, model_draft.address, service_tmp)
    yield service
    service.stop()


@pytest.fixture()
def target_channel(target: Service) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(target.address) as channel:
        yield channel


@pytest.fixture()
def draft_channel(model_draft: Service) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(model_draft.address) as channel:
        yield channel
