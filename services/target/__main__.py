"""`python -m services.target --help`: run the target service."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tandem.config import TargetSettings

if TYPE_CHECKING:
    from services.target.servicer import TargetServicer
    from services.target.verifier import Verifier
    from tandem.worker import EngineWorker


def build_target(
    settings: TargetSettings, verifier_class: type[Verifier] | None = None
) -> tuple[TargetServicer, EngineWorker, Callable[[], Awaitable[None]]]:
    """The target's servicer, its engine thread, and the coroutine that loads the model into it.

    Shared by the gRPC service and the co-located gateway (services.gateway.colocated), which calls the same
    servicer in its own process. `verifier_class` replaces the Verifier (benchmarks: bench.synthetic_target).
    """
    from services.target.servicer import TargetServicer
    from tandem.engine import Engine
    from tandem.worker import EngineWorker

    worker = EngineWorker()
    servicer = TargetServicer(worker)

    async def load() -> None:
        engine = await worker.run(Engine, settings)
        from services.target.verifier import Verifier

        cls = verifier_class or Verifier
        verifier = cls(engine, settings.session_idle_timeout_s, settings.verify_mode, settings.prefix_cache)
        servicer.attach(verifier, settings.max_batch, settings.batch_wait_ms, settings.inline_steps(engine.backend))

    return servicer, worker, load


async def serve_target(settings: TargetSettings, verifier_class: type[Verifier] | None = None) -> None:
    """Run the target service; `verifier_class` replaces the Verifier (benchmarks only)."""
    from tandem.grpc_server import frame_offer, serve_service
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    servicer, worker, load = build_target(settings, verifier_class)
    servicer.frames = frame_offer(settings, servicer.frame_methods())
    await serve_service(
        settings,
        service_name="tandem.v1.Target",
        register=lambda server: pb_grpc.add_TargetServicer_to_server(servicer, server),
        load=load,
        periodic=servicer.expire_idle,
        frames=servicer.frames,
    )
    worker.shutdown()


def main(argv: list[str] | None = None) -> None:
    from tandem.cli import service_main

    service_main(TargetSettings, "tandem-target", serve_target, argv)


if __name__ == "__main__":
    main()
