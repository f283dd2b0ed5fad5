"""Command-line entry shared by the services: settings from flags/env, logging configured before heavy imports."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic_settings import BaseSettings, CliApp

from tandem.config import prepare_process

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
    """Entry point shared by the model services: settings, the process prepared for llama.cpp (device pinning, spin
    count, llama_cpp imported first: see tandem.config.prepare_process), tracing, then `run`. Nothing imported above
    this point pulls in grpc or numpy.
    """
    settings = parse_settings(settings_type, argv)
    prepare_process(settings)
    from tandem.telemetry import setup_tracing

    setup_tracing(tracing_name)
    asyncio.run(run(settings))
