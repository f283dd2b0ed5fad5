"""`python -m services.gateway --help`: run the OpenAI-compatible gateway."""

from __future__ import annotations

from tandem.cli import parse_settings
from tandem.config import GatewaySettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(GatewaySettings, argv)
    import uvicorn

    from services.gateway.app import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,  # prompts and completions are never logged; request lines are noise here
    )


if __name__ == "__main__":
    main()
