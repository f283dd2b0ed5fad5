"""`python -m services.gateway --help`: run the OpenAI-compatible gateway."""

from __future__ import annotations

from collections.abc import Callable

from tandem.cli import parse_settings
from tandem.config import GatewaySettings


def main(argv: list[str] | None = None, verifier_factory: Callable[[], type] | None = None) -> None:
    """Run the gateway; the class `verifier_factory` returns replaces a co-located target's Verifier (benchmarks
    only). A factory, called once the process is prepared: the Verifier's module imports numpy and the grammar engine,
    which must come after llama_cpp (on the CUDA image loading a model segfaulted otherwise)."""
    settings = parse_settings(GatewaySettings, argv)
    colocated = None
    if settings.colocate and settings.colocate_target:
        raise SystemExit("--colocate loads both models here; --colocate-target only the target: pick one")
    if settings.colocate or settings.colocate_target:
        colocated = colocated_models(settings, verifier_factory)
    elif verifier_factory is not None:
        raise SystemExit("verifier_factory needs --colocate or --colocate-target: the target runs in another process")
    import uvicorn

    from services.gateway.app import create_app

    uvicorn.run(
        create_app(settings, colocated),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,  # prompts and completions are never logged; request lines are noise here
    )


def colocated_models(settings: GatewaySettings, verifier_factory: Callable[[], type] | None):
    """The models to load into this process, with the process prepared for them as the services prepare theirs
    (tandem.config.prepare_process). Nothing imported so far pulls in grpc or numpy."""
    from tandem.config import DraftSettings, TargetSettings, prepare_process

    target = TargetSettings()
    remote = settings.colocate_target and not settings.local_ngram and bool(settings.draft)
    draft = None if settings.local_ngram or not settings.draft or settings.colocate_target else DraftSettings()
    prepare_process(*(m for m in (target, draft) if m is not None), colocated=True)
    from services.gateway.app import Colocated

    verifier_class = verifier_factory() if verifier_factory is not None else None
    return Colocated(target, draft, verifier_class, overlap=settings.overlap_draft, remote_draft=remote)


if __name__ == "__main__":
    main()
