"""gRPC servicer for tandem.v1.Draft: protobuf in, DraftService call on the engine thread, protobuf out."""

from __future__ import annotations

import time

import grpc

from services.draft.service import DraftService, ProposeSpec
from tandem import __version__
from tandem.convert import dist_to_pb, info_pb, sampling_from_pb
from tandem.engine import Engine
from tandem.grpc_server import EngineWorker, ServiceLoading, stream_replies
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc


class DraftServicer(pb_grpc.DraftServicer):
    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.service: DraftService | None = None
        self.engine: Engine | None = None  # None for the model-free n-gram drafter

    def _ready(self) -> DraftService:
        if self.service is None:
            raise ServiceLoading("the draft model is still loading")
        return self.service

    def _forward_ns(self) -> int:
        return self.engine.forward_ns if self.engine is not None else 0

    def _timing(self, t0: int, f0: int) -> pb.Timing:
        return pb.Timing(forward_ns=self._forward_ns() - f0, total_ns=time.perf_counter_ns() - t0)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        service = self._ready()
        if self.engine is not None:
            return info_pb(
                self.engine,
                drafter=service.drafter.name,
                active_sessions=len(service.store),
                kv_tokens=service.store.kv_tokens,
            )
        return pb.InfoResponse(
            model_name="ngram",
            architecture="prompt-lookup",
            backend="CPU",
            device="CPU (model-free)",
            version=f"tandem {__version__}",
            max_sessions=service.store.max_sessions,
            drafter=service.drafter.name,
            active_sessions=len(service.store),
        )

    async def Open(self, request: pb.OpenRequest, context: grpc.aio.ServicerContext) -> pb.OpenResponse:
        service = self._ready()
        t0, f0 = time.perf_counter_ns(), self._forward_ns()
        items = [(i.session_id, list(i.prompt_token_ids), sampling_from_pb(i.sampling)) for i in request.items]
        opened = await self.worker.run(service.open, items)
        return pb.OpenResponse(
            results=[pb.OpenResult(session_id=sid, position=pos) for sid, pos in opened],
            timing=self._timing(t0, f0),
        )

    async def Propose(self, request: pb.ProposeRequest, context: grpc.aio.ServicerContext) -> pb.ProposeResponse:
        service = self._ready()
        t0, f0 = time.perf_counter_ns(), self._forward_ns()
        specs = [ProposeSpec(i.session_id, i.position, list(i.append_token_ids), i.max_tokens) for i in request.items]
        results = await self.worker.run(service.propose, specs)
        return pb.ProposeResponse(
            proposals=[
                pb.Proposal(
                    session_id=r.session_id,
                    position=r.position,
                    token_ids=r.draft.tokens,
                    distributions=[dist_to_pb(d) for d in r.draft.dists or ()],
                )
                for r in results
            ],
            timing=self._timing(t0, f0),
        )

    async def ProposeStream(self, requests, context: grpc.aio.ServicerContext):
        async for response in stream_replies(
            requests, self.Propose, pb.ProposeResponse, context, "/tandem.v1.Draft/Propose"
        ):
            yield response

    async def Rollback(self, request: pb.RollbackRequest, context: grpc.aio.ServicerContext) -> pb.RollbackResponse:
        service = self._ready()
        t0, f0 = time.perf_counter_ns(), self._forward_ns()
        await self.worker.run(service.rollback, [(i.session_id, i.position) for i in request.items])
        return pb.RollbackResponse(timing=self._timing(t0, f0))

    async def Close(self, request: pb.CloseRequest, context: grpc.aio.ServicerContext) -> pb.CloseResponse:
        service = self._ready()
        return pb.CloseResponse(closed=await self.worker.run(service.close, list(request.session_ids)))
