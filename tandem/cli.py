"""Command-line entry shared by the services: settings from flags/env, logging configured before heavy imports."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic_settings import BaseSettings, CliApp

from tandem.config import limit_omp_spin

S = TypeVar("S", bound=BaseSettings)


def parse_settings(cls: type[S], argv: list[str] | None = None) -> S:
    """Parse `--kebab-case` flags (and TANDEM_* environment variables) into a settings object."""
    args = sys.argv[1:] if argv is None else argv
    settings = CliApp.run(cls, cli_args=args)
    logging.basicConfig(
        level=getattr(settings, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return settings


def service_main(settings_type: type, tracing_name: str, run: Callable[[Any], Awaitable[None]], argv=None) -> None:
    """Entry point shared by the model services: settings, device pinning, llama.cpp, tracing, then `run`.

    Import order matters: the device must be pinned before llama.cpp starts, and llama_cpp must be imported before
    grpc and numpy (on the CUDA image, grpc first makes model loading segfault; numpy first crashes the tokenizer).
    Nothing imported above this point pulls in grpc or numpy.
    """
    settings = parse_settings(settings_type, argv)
    settings.pin_device()
    limit_omp_spin(settings)
    import tandem.engine  # noqa: F401
    from tandem.telemetry import setup_tracing

    setup_tracing(tracing_name)
    asyncio.run(run(settings))
