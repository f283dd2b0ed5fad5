"""`python -m services.draft --help`: run the draft service (n-gram or model drafter)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tandem.config import MAX_DEFAULT_SESSIONS, DraftSettings

if TYPE_CHECKING:
    from services.draft.servicer import DraftServicer
    from tandem.worker import EngineWorker


def build_draft(settings: DraftSettings) -> tuple[DraftServicer, EngineWorker, Callable[[], Awaitable[None]]]:
    """The draft's servicer, its engine thread, and the coroutine that loads the drafter into it.

    Shared by the gRPC service and the co-located gateway (services.gateway.colocated).
    """
    from services.draft.drafters import Drafter, ModelDrafter, NgramDrafter
    from services.draft.service import DraftService
    from services.draft.servicer import DraftServicer
    from tandem.worker import EngineWorker

    worker = EngineWorker()
    servicer = DraftServicer(worker)

    async def load() -> None:
        drafter: Drafter
        engine = n_vocab = n_ctx = None
        if settings.drafter in ("model", "ngram,model"):
            from services.draft.chained import ChainedDrafter
            from tandem.engine import Engine

            engine = await worker.run(Engine, settings)
            if settings.drafter == "model":
                drafter = ModelDrafter(engine, settings.draft_support)
            else:
                drafter = ChainedDrafter(engine, settings.draft_support, settings.ngram_min, settings.ngram_max)
            n_vocab, n_ctx = engine.n_vocab, engine.n_ctx
        else:
            drafter = NgramDrafter(settings.ngram_min, settings.ngram_max)
        # An n-gram draft holds no KV: its slots follow the setting, or the default of a model service's most slots.
        slots = engine.max_sessions if engine is not None else settings.max_sessions or MAX_DEFAULT_SESSIONS
        service = DraftService(drafter, slots, settings.session_idle_timeout_s, n_vocab, n_ctx, settings.prefix_cache)
        servicer.attach(
            service,
            engine,
            settings.max_batch,
            settings.batch_wait_ms,
            settings.inline_steps(engine.backend if engine else None),
        )

    return servicer, worker, load


async def _serve(settings: DraftSettings) -> None:
    from tandem.grpc_server import frame_offer, serve_service
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    servicer, worker, load = build_draft(settings)
    servicer.frames = frame_offer(settings, servicer.frame_methods())
    await serve_service(
        settings,
        service_name="tandem.v1.Draft",
        register=lambda server: pb_grpc.add_DraftServicer_to_server(servicer, server),
        load=load,
        periodic=servicer.expire_idle,
        frames=servicer.frames,
    )
    worker.shutdown()


def main(argv: list[str] | None = None) -> None:
    from tandem.cli import service_main

    service_main(DraftSettings, "tandem-draft", _serve, argv)


if __name__ == "__main__":
    main()
