"""The co-located gateway: the target (and the draft) run in the gateway's own process, called without gRPC.

When both models sit on one host and one llama.cpp build (two NVIDIA GPUs, or a GPU and the CPU), the two gRPC calls
of every speculative round buy nothing but cost: ~2.4-3 ms a round on the H200 host, 6-11% of a 70B round
(docs/decisions/0006). Here the gateway loads the same servicers the services run and
calls their methods directly: the same protobuf messages, the same step scheduler batching every request's calls into
one forward pass, the same errors as gRPC status codes (an `AioRpcError`, as a remote call raises), so the
speculative loop in services.gateway.speculation runs unchanged. Only the transport is gone.

Separate services stay the default: they are what lets a draft run on another machine, or on a GPU of another vendor
(one process loads one llama.cpp build). Between the two, `--colocate-target` loads only the target here and keeps the
draft a gRPC service (`--draft ADDRESS`): the mixed-vendor box's layout, one network call a round (Propose) instead of
two, and a draft the target survives losing.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from services.gateway.streams import StreamMux, upstream_error
from services.gateway.upstream import (
    ChannelSecurity,
    Upstreams,
    check_compatible,
    check_protocol,
    wait_serving,
    with_frames,
)
from tandem.config import DraftSettings, TargetSettings
from tandem.frames import PROPOSE
from tandem.grpc_server import error_status
from tandem.telemetry import context_from_metadata, tracer
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tandem.worker import EngineWorker

log = logging.getLogger(__name__)

EXPIRE_PERIOD_S = 5.0  # how often idle sessions are closed (the services' own period)


class _LocalContext:
    """The little of grpc.aio.ServicerContext that the servicers' unary methods use."""

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise upstream_error(code, details)


_CONTEXT = _LocalContext()


async def invoke(
    handler: Callable[[Any, Any], Awaitable[Any]], request: Any, timeout: float | None, name: str, parent
) -> Any:
    """Call a servicer method as the gRPC server would: a server span, the call's deadline, and the error mapping
    of tandem.grpc_server.ErrorInterceptor, raised as the AioRpcError a remote call would raise.

    Without a trace to continue (tracing off, or a call sent without context) there is no span: making a no-op one
    cost ~4% of the gateway's time a round (py-spy)."""
    if not trace.get_current_span(parent).get_span_context().is_valid:
        return await _call(handler, request, timeout, name, trace.INVALID_SPAN)
    with tracer().start_as_current_span(name, context=parent, kind=SpanKind.SERVER) as span:
        return await _call(handler, request, timeout, name, span)


class Deadlines:
    """Cancels the local calls of one event loop that outlive their deadline, with one timer for all of them.

    `asyncio.timeout` arms a timer per call and cancels it when the call returns: ~6 us a call, and a cancelled handle
    left in the event loop's heap each time, at two calls a round. Deadlines here are seconds long, so a check every
    `PERIOD_S` is precise enough, and a call costs two dict operations. Each task runs one local call at a time.
    """

    PERIOD_S = 0.2  # a check re-arms one timer: every 50 ms it was ~8% of the gateway's Python on the 2-core CPU

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: dict[asyncio.Task, tuple[float, int]] = {}  # task -> (deadline, its cancel requests at the start)
        self._expired: dict[asyncio.Task, int] = {}  # task cancelled by its deadline -> its cancel requests before
        self._timer: asyncio.TimerHandle | None = None

    def start(self, task: asyncio.Task, timeout: float) -> None:
        self._due[task] = (self._loop.time() + timeout, task.cancelling())
        if self._timer is None:
            self._timer = self._loop.call_later(self.PERIOD_S, self._check)

    def finish(self, task: asyncio.Task) -> None:
        self._due.pop(task, None)
        self._expired.pop(task, None)

    def expired(self, task: asyncio.Task) -> bool:
        """After a CancelledError in `task`: whether its deadline cancelled it and nothing else did. The deadline's
        cancel request is then taken back, as asyncio.timeout does, and the caller raises DEADLINE_EXCEEDED."""
        if task not in self._expired:
            return False
        return task.uncancel() <= self._expired.pop(task)

    def _check(self) -> None:
        now = self._loop.time()
        for task, (deadline, cancelling) in list(self._due.items()):
            if now >= deadline:
                del self._due[task]
                self._expired[task] = cancelling
                task.cancel()
        self._timer = self._loop.call_later(self.PERIOD_S, self._check) if self._due else None


_deadlines: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines] = weakref.WeakKeyDictionary()


def _deadlines_of(loop: asyncio.AbstractEventLoop) -> Deadlines:
    deadlines = _deadlines.get(loop)
    if deadlines is None:
        deadlines = _deadlines[loop] = Deadlines(loop)
    return deadlines


async def _call(handler: Callable[[Any, Any], Awaitable[Any]], request: Any, timeout: float | None, name: str, span):
    task = asyncio.current_task()
    deadlines = _deadlines_of(task.get_loop()) if timeout is not None and task is not None else None
    if deadlines is not None:
        deadlines.start(task, timeout)
    try:
        return await handler(request, _CONTEXT)
    except asyncio.CancelledError:
        if deadlines is not None and deadlines.expired(task):
            raise upstream_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: no answer in {timeout} s") from None
        raise
    except grpc.aio.AioRpcError:
        raise
    except Exception as exc:
        raise upstream_error(*error_status(exc, name, span)) from None
    finally:
        if deadlines is not None:
            deadlines.finish(task)


class LocalStub:
    """A stub whose methods call a servicer in this process: `await stub.Open(request, timeout=..., metadata=...)`."""

    def __init__(self, servicer: Any, service: str) -> None:
        self._servicer = servicer
        self._service = service

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        handler = getattr(self._servicer, method)
        name = f"/{self._service}/{method}"

        def call(request: Any, timeout: float | None = None, metadata=None) -> Awaitable[Any]:
            return invoke(handler, request, timeout, name, context_from_metadata(metadata))

        return call


class LocalMux:
    """StreamMux's interface (`call(request, timeout)`) over a servicer method in this process."""

    def __init__(self, handler: Callable[[Any, Any], Awaitable[Any]], name: str) -> None:
        self._handler = handler
        self.name = name

    async def call(self, request: Any, timeout: float) -> Any:
        carrier = request.trace_context
        parent = propagate.extract(dict(carrier)) if carrier else otel_context.Context()
        return await invoke(self._handler, request, timeout, self.name, parent)

    async def close(self) -> None:
        """Nothing to close: there is no stream."""


class LocalHealth:
    """grpc.health.v1's Check for a servicer in this process: SERVING once its model is loaded."""

    def __init__(self, servicer: Any) -> None:
        self._servicer = servicer

    async def Check(self, request: health_pb2.HealthCheckRequest, timeout: float | None = None):
        serving = self._servicer.scheduler is not None
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


@dataclass
class ColocatedUpstreams(Upstreams):
    """Upstreams whose services live in this process; closing it stops their engine threads."""

    workers: list[EngineWorker] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Nothing to open: the calls and health checks are passed in ready-made, and there are no channels."""

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.propose is not None:
            await self.propose.close()
        for channel in self.channels:  # a remote draft's
            await channel.close()
        for worker in self.workers:
            await asyncio.to_thread(worker.shutdown)


@dataclass(frozen=True)
class RemoteDraft:
    """A draft service the co-located target drafts with over gRPC (`--colocate-target`)."""

    address: str
    security: ChannelSecurity = field(default_factory=ChannelSecurity)
    timeout_s: float = 600.0
    frames: bool = True  # Propose over the draft's frame port where it offers one (tandem/frames.py)


async def start_colocated(
    target_settings: TargetSettings,
    draft_settings: DraftSettings | None,
    verifier_class: type | None = None,
    overlap: bool = False,
    remote_draft: RemoteDraft | None = None,
) -> ColocatedUpstreams:
    """Load the target (and the draft, or connect to a remote one) into this process and return them as the gateway's
    upstreams.

    With `overlap` (the gateway drafts ahead), a Verify that carries a bonus guess never runs inline on the event
    loop: the draft's step for the next round runs there meanwhile, and the target's step on its engine thread.

    The models must already be pinned (tandem.config.pin_colocated) and llama_cpp imported before grpc and numpy
    (see tandem.cli.service_main); services.gateway.__main__ does both.
    """
    from services.draft.__main__ import build_draft
    from services.target.__main__ import build_target

    target, target_worker, load_target = build_target(target_settings, verifier_class)
    target.inline_guessed = not overlap
    workers = [target_worker]
    draft = None
    channels: list[grpc.aio.Channel] = []
    propose: Any = None
    draft_health: Any = None
    try:
        print("tandem: loading the target model in this process", flush=True)
        await load_target()
        if draft_settings is not None:
            draft, draft_worker, load_draft = build_draft(draft_settings)
            workers.append(draft_worker)
            print(f"tandem: loading the {draft_settings.drafter} drafter in this process", flush=True)
            await load_draft()
        target_stub = LocalStub(target, "tandem.v1.Target")
        target_info = await target_stub.Info(pb.InfoRequest())
        check_protocol(target_info, "target")
        draft_stub = draft_info = None
        if draft is not None:
            draft_stub = LocalStub(draft, "tandem.v1.Draft")
            draft_info = await draft_stub.Info(pb.InfoRequest())
            check_compatible(target_info, draft_info)
            propose, draft_health = LocalMux(draft.Propose, "/tandem.v1.Draft/Propose"), LocalHealth(draft)
        elif remote_draft is not None:
            channel = remote_draft.security.open(remote_draft.address)
            channels.append(channel)
            print(f"tandem: waiting for the draft service at {remote_draft.address}", flush=True)
            await wait_serving(channel, "tandem.v1.Draft", remote_draft.timeout_s)
            draft_stub = pb_grpc.DraftStub(channel)
            draft_info = await draft_stub.Info(pb.InfoRequest(), timeout=10)
            check_compatible(target_info, draft_info)
            metadata = remote_draft.security.stream_metadata() or None
            propose = StreamMux(lambda: draft_stub.ProposeStream(metadata=metadata), "draft")
            if remote_draft.frames:
                args = (remote_draft.address, draft_info, draft_stub.Info, PROPOSE, pb.ProposeResponse)
                propose = with_frames(propose, *args, remote_draft.security)
            draft_health = health_pb2_grpc.HealthStub(channel)
    except BaseException:
        for channel in channels:
            await channel.close()
        for worker in workers:
            worker.shutdown()
        raise
    upstreams = ColocatedUpstreams(
        target_stub,
        target_info,
        draft_stub,
        draft_info,
        channels=channels,
        verify=LocalMux(target.Verify, "/tandem.v1.Target/Verify"),
        propose=propose,
        target_health=LocalHealth(target),
        draft_health=draft_health,
        workers=workers,
    )
    upstreams.tasks.append(asyncio.create_task(_expire_idle([s for s in (target, draft) if s is not None])))
    log.info(
        "co-located: target %s on %s; draft %s",
        target_info.model_name,
        target_info.device,
        f"{draft_info.drafter}:{draft_info.model_name} on {draft_info.device}" if draft_info else "none",
    )
    return upstreams


async def _expire_idle(servicers: list) -> None:
    """Close idle sessions periodically, as each service does on its own."""
    while True:
        await asyncio.sleep(EXPIRE_PERIOD_S)
        for servicer in servicers:
            try:
                await servicer.expire_idle()
            except Exception:
                log.exception("closing idle sessions failed")
