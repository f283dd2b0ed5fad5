"""`python -m services.target --help`: run the target service."""

from __future__ import annotations

import asyncio

from tandem.cli import parse_settings
from tandem.config import TargetSettings


async def _serve(settings: TargetSettings) -> None:
    from services.target.servicer import TargetServicer
    from services.target.verifier import Verifier
    from tandem.engine import Engine
    from tandem.grpc_server import EngineWorker, serve, server_credentials
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    worker = EngineWorker()
    servicer = TargetServicer(worker)

    async def load() -> None:
        engine = await worker.run(Engine, settings)
        servicer.verifier = Verifier(engine, settings.session_idle_timeout_s, settings.verify_mode)

    async def expire() -> None:
        if servicer.verifier is not None:
            await worker.run(servicer.verifier.expire_idle)

    await serve(
        host=settings.host,
        port=settings.port,
        service_name="tandem.v1.Target",
        register=lambda server: pb_grpc.add_TargetServicer_to_server(servicer, server),
        load=load,
        periodic=expire,
        credentials=server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca),
        auth_token=settings.auth_token,
    )
    worker.shutdown()


def main(argv: list[str] | None = None) -> None:
    from tandem.telemetry import setup_tracing

    setup_tracing("tandem-target")
    settings = parse_settings(TargetSettings, argv)
    settings.pin_device()  # before llama_cpp loads and enumerates devices
    import tandem.engine  # noqa: F401  llama_cpp before numpy: the other order crashes model loading on some images

    asyncio.run(_serve(settings))


if __name__ == "__main__":
    main()
