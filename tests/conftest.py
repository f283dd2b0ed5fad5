"""Fixtures that start the real services: real processes, real gRPC on ephemeral loopback ports, the real model.

Each service runs as its own process exactly as `make run` starts it; tests talk gRPC and HTTP to it. Processes are
stopped by PID at the end of the session.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem.launch import Process, start_gateway, start_model_service

__all__ = ["Service", "run_steps", "start_gateway", "start_model_service"]

Service = Process


def run_steps(steps: Generator[None, None, Any], between: Callable[[], None] | None = None) -> Any:
    """Drive a stepwise engine job (`open_steps`, `prefill_steps`) to its end, as the scheduler would; its value.
    `between` runs at each of its yields, where the scheduler runs other sessions' calls."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        if between is not None:
            between()


# Two model processes share this 2-core machine in tests: one thread each keeps them from starving each other.
THREADS = os.environ.get("TANDEM_TEST_THREADS", "1")


@pytest.fixture(scope="session")
def service_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="session")
def target(service_tmp: Path) -> Iterator[Service]:
    service = start_model_service(
        "services.target", ["--n-threads", THREADS, "--max-sessions", "8", "--n-ctx", "16384"], service_tmp
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
        ["--drafter", "model", "--n-threads", THREADS, "--max-sessions", "8", "--n-ctx", "16384"],
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
