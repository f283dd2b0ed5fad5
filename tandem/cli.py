"""Command-line entry shared by the services: settings from flags/env, logging configured before heavy imports."""

from __future__ import annotations

import logging
import sys
from typing import TypeVar

from pydantic_settings import BaseSettings, CliApp

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
