"""The gateway's FastAPI application factory: lifespan connects the services, routers serve the OpenAI API."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2
from prometheus_client import CONTENT_TYPE_LATEST

from services.gateway import chat, completions, errors, messages, responses
from services.gateway.chat_template import ChatTemplate
from services.gateway.errors import OpenAIError
from services.gateway.guards import OPEN_PATHS, BodyLimit, check_api_key
from services.gateway.metrics import GatewayMetrics
from services.gateway.serving import Serving, now
from services.gateway.upstream import ChannelSecurity, connect
from tandem import __version__
from tandem.config import DraftSettings, GatewaySettings, TargetSettings
from tandem.telemetry import setup_tracing

log = logging.getLogger(__name__)
meta = APIRouter()


@dataclass(frozen=True)
class Colocated:
    """The models a co-located gateway loads itself: the target's settings, the draft's (None: no draft service)."""

    target: TargetSettings
    draft: DraftSettings | None
    verifier_class: type | None = None  # benchmarks only (bench.synthetic_target)
    overlap: bool = False  # the gateway drafts ahead (--overlap-draft)
    remote_draft: bool = False  # --colocate-target: the draft stays a gRPC service at settings.draft


KNOWN_ENDPOINTS = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
}


@meta.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when both upstreams are connected and checked; 503 (with Retry-After) until then."""
    serving: Serving | None = getattr(request.app.state, "serving", None)
    if serving is None:
        failure = getattr(request.app.state, "startup_error", None)
        body = {"status": "error" if failure else "loading"}
        if failure:
            body["error"] = failure
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
    target_ok, draft_ok = await asyncio.gather(
        serving_status(serving.up.target_health, "tandem.v1.Target"),
        serving_status(serving.up.draft_health, "tandem.v1.Draft"),
    )
    info = serving.up.draft_info
    status = "ok" if target_ok and draft_ok is not False else ("degraded" if target_ok else "unavailable")
    body = {
        "status": status,
        "target": {
            "model": serving.up.target_info.model_name,
            "device": serving.up.target_info.device,
            "serving": target_ok,
        },
        "draft": {"drafter": info.drafter, "model": info.model_name, "device": info.device, "serving": draft_ok}
        if info
        else {"drafter": "ngram", "model": None, "device": "gateway", "serving": True}
        if serving.settings.local_ngram
        else None,
        "requests": {"running": serving.admission.running, "queued": serving.admission.waiting},
    }
    # Degraded (draft down) still serves, target-only; without the target nothing can be served.
    return JSONResponse(
        body, status_code=200 if target_ok else 503, headers=None if target_ok else {"Retry-After": "1"}
    )


async def serving_status(stub, service: str) -> bool | None:
    """True if the service answers SERVING within a second, False if not, None if there is no such service."""
    if stub is None:
        return None
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@meta.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus exposition: the gateway's counters plus each service's sessions and KV usage."""
    registry: GatewayMetrics = request.app.state.metrics
    upstreams = getattr(request.app.state, "upstreams", None)
    if upstreams is not None:
        await registry.refresh_upstreams({"target": upstreams.target, "draft": upstreams.draft})
    serving = getattr(request.app.state, "serving", None)
    if serving is not None:
        registry.observe_prices(serving.costs, serving.default_n_max)
    return Response(registry.render(), media_type=CONTENT_TYPE_LATEST)


@meta.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    serving = _serving(request)
    return JSONResponse(
        {
            "object": "list",
            "data": [{"id": serving.model_name, "object": "model", "created": now(), "owned_by": "tandem"}],
        }
    )


def _serving(request: Request) -> Serving:
    serving = getattr(request.app.state, "serving", None)
    if serving is None:
        raise OpenAIError(503, "the model services are not ready yet", None, "loading")
    return serving


def create_app(settings: GatewaySettings | None = None, colocated: Colocated | None = None) -> FastAPI:
    """The gateway app; with `colocated`, its models load into this process (services.gateway.colocated)."""
    settings = settings or GatewaySettings()
    setup_tracing("tandem-gateway")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.serving = None
        app.state.startup_error = None

        async def start() -> None:
            try:
                security = ChannelSecurity(
                    settings.upstream_tls_ca,
                    settings.upstream_tls_cert,
                    settings.upstream_tls_key,
                    settings.upstream_token,
                )
                if colocated is not None:
                    from services.gateway.colocated import RemoteDraft, start_colocated

                    remote = None
                    if colocated.remote_draft:
                        remote = RemoteDraft(
                            settings.draft, security, settings.startup_timeout_s, settings.upstream_frames
                        )
                    upstreams = await start_colocated(
                        colocated.target, colocated.draft, colocated.verifier_class, colocated.overlap, remote
                    )
                else:
                    draft = None if settings.local_ngram else settings.draft or None
                    upstreams = await connect(
                        settings.target, draft, settings.startup_timeout_s, security, settings.upstream_frames
                    )
            except Exception as exc:
                app.state.startup_error = str(exc)
                log.error("gateway start-up failed: %s", exc)
                return
            info = upstreams.target_info
            app.state.chat_template = ChatTemplate(info.chat_template, info.bos_text, info.eos_text, info.architecture)
            app.state.upstreams = upstreams
            app.state.serving = Serving(upstreams, settings, app.state.metrics)
            log.info("gateway ready: serving %s", app.state.serving.model_name)
            print(f"tandem: gateway ready on http://{settings.host}:{settings.port}/v1", flush=True)

        starter = asyncio.create_task(start())
        try:
            yield
        finally:
            starter.cancel()
            upstreams = getattr(app.state, "upstreams", None)
            if upstreams is not None:
                await upstreams.close()

    app = FastAPI(title="tandem", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = GatewayMetrics()
    errors.install(app)

    @app.middleware("http")
    async def require_ready(request: Request, call_next):
        path = request.url.path
        try:
            if path not in OPEN_PATHS:
                check_api_key(request.headers.get("authorization"), settings.api_keys, request.headers.get("x-api-key"))
            if path.startswith("/v1/") and getattr(request.app.state, "serving", None) is None:
                raise OpenAIError(503, "the model services are not ready yet", None, "loading")
            response = await call_next(request)
        except OpenAIError as exc:
            response = exc.response(path)
        if path.startswith("/v1/"):
            endpoint = path if path in KNOWN_ENDPOINTS else "other"
            request.app.state.metrics.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
        return response

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.include_router(meta)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(messages.router)
    app.include_router(responses.router)
    return app
