"""`python -m services.target --help`: run the target service."""

from __future__ import annotations

from tandem.config import TargetSettings


async def _serve(settings: TargetSettings) -> None:
    from services.target.servicer import TargetServicer
    from services.target.verifier import Verifier
    from tandem.engine import Engine
    from tandem.grpc_server import EngineWorker, serve_service
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    worker = EngineWorker()
    servicer = TargetServicer(worker)

    async def load() -> None:
        engine = await worker.run(Engine, settings)
        servicer.verifier = Verifier(engine, settings.session_idle_timeout_s, settings.verify_mode)

    async def expire() -> None:
        if servicer.verifier is not None:
            await worker.run(servicer.verifier.expire_idle)

    await serve_service(
        settings,
        service_name="tandem.v1.Target",
        register=lambda server: pb_grpc.add_TargetServicer_to_server(servicer, server),
        load=load,
        periodic=expire,
    )
    worker.shutdown()


def main(argv: list[str] | None = None) -> None:
    from tandem.grpc_server import service_main

    service_main(TargetSettings, "tandem-target", _serve, argv)


if __name__ == "__main__":
    main()
