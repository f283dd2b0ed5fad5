"""The gateway's stream multiplexer against a real target service: concurrency, errors, and a service restart."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import grpc
import pytest

from services.gateway.streams import StreamMux
from tandem.launch import start_model_service
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.conftest import Service

GREEDY = pb.SamplingParams(temperature=0.0)


async def _open(stub: pb_grpc.TargetStub, prompt: list[int]) -> tuple[str, int]:
    sid = uuid.uuid4().hex
    reply = await stub.Open(
        pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)])
    )
    return sid, reply.results[0].position


async def decode_steps(mux, sid: str, pos: int, steps: int = 4) -> list[int]:
    """`steps` target-only tokens of session `sid` from `pos`, one Verify call each through `mux` (any mux)."""
    out = []
    for _ in range(steps):
        reply = await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]), timeout=30)
        out.append(reply.results[0].tokens[0].id)
        pos = reply.results[0].position
    return out


def test_concurrent_calls_share_one_stream(target: Service) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = pb_grpc.TargetStub(channel)
            mux = StreamMux(stub.VerifyStream, "target")
            sessions = [await _open(stub, [1, 504, 2573, 1244 + i]) for i in range(3)]

            together = await asyncio.gather(*(decode_steps(mux, sid, pos) for sid, pos in sessions))
            # Each session alone gives the same tokens: calls did not get mixed up between sessions.
            for i, tokens in enumerate(together):
                sid, pos = await _open(stub, [1, 504, 2573, 1244 + i])
                sessions.append((sid, pos))
                assert await decode_steps(mux, sid, pos) == tokens
            closed = await stub.Close(pb.CloseRequest(session_ids=[sid for sid, _ in sessions]))
            assert closed.closed == len(sessions)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id="nope", position=1)]), timeout=30)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            await mux.close()

    asyncio.run(main())


def test_stream_reopens_after_service_restart(service_tmp) -> None:
    async def main() -> None:
        svc = start_model_service("services.target", ["--n-threads", "1"], service_tmp)
        address = svc.address
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.TargetStub(channel)
                mux = StreamMux(stub.VerifyStream, "target")
                sid, pos = await _open(stub, [1, 504, 2573])
                await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]), timeout=30)
                svc.stop()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await mux.call(
                        pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos + 1)]), timeout=10
                    )
                assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                # The service comes back on the same port (sessions are gone): the next call opens a new stream.
                port = address.rsplit(":", 1)[1]
                svc = start_model_service("services.target", ["--n-threads", "1", "--port", port], service_tmp)
                sid, pos = await _open(stub, [1, 504, 2573])
                reply = await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]), 30)
                assert reply.results[0].position == pos + 1
                await stub.Close(pb.CloseRequest(session_ids=[sid]))
                await mux.close()
        finally:
            svc.stop()

    asyncio.run(main())


def test_callers_cancelled_mid_call_do_not_break_the_shared_stream(target: Service) -> None:
    """A client that disconnects (or a pipelined call no longer needed) cancels its call at any point, also while
    its message is being written. In grpc aio a cancelled write cancels the whole RPC, so before the mux had its own
    writer this failed every other request on the stream with UNAVAILABLE (seen with 13 concurrent requests)."""

    async def main() -> None:
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = pb_grpc.TargetStub(channel)
            mux = StreamMux(stub.VerifyStream, "target")
            sid, pos = await _open(stub, [1, 504, 2573, 1300])
            keeper_sid, keeper_pos = await _open(stub, [1, 504, 2573, 1301])

            async def keep_decoding() -> int:
                nonlocal keeper_pos
                for _ in range(30):
                    reply = await mux.call(
                        pb.VerifyRequest(items=[pb.VerifyItem(session_id=keeper_sid, position=keeper_pos)]), 30
                    )
                    keeper_pos = reply.results[0].position
                return keeper_pos

            keeper = asyncio.create_task(keep_decoding())
            for i in range(200):
                call = asyncio.create_task(
                    mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]), 30)
                )
                for _ in range(i % 6):
                    await asyncio.sleep(0)  # cancel at different points of the call
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    reply = await call
                    pos = reply.results[0].position
            assert await keeper == keeper_pos  # every call of the other session got its answer
            # The stream still serves: the session answers at its real position (cancelled calls never ran twice).
            info = await stub.Info(pb.InfoRequest())
            assert info.load.active_sessions >= 2
            await stub.Close(pb.CloseRequest(session_ids=[sid, keeper_sid]))
            await mux.close()

    asyncio.run(main())


def test_a_call_without_answer_times_out_and_is_forgotten() -> None:
    """A stream that never answers (a hung service): the call fails DEADLINE_EXCEEDED after its timeout, leaves no
    pending entry behind, and a later call on the same stream times out on its own timer too."""

    async def silent(requests, context):
        async for _ in requests:
            pass  # reads every call, answers none
        yield pb.VerifyResponse()  # pragma: no cover - the client never ends its stream first

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(
            silent,
            request_deserializer=pb.VerifyRequest.FromString,
            response_serializer=pb.VerifyResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("tandem.v1.Target", {"VerifyStream": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                mux = StreamMux(pb_grpc.TargetStub(channel).VerifyStream, "target")
                for timeout in (0.2, 0.4):
                    started = asyncio.get_running_loop().time()
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id="s", position=1)]), timeout)
                    waited = asyncio.get_running_loop().time() - started
                    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    assert timeout <= waited < timeout + 1.0
                    assert mux._stream is not None and not mux._stream.pending
                await mux.close()
        finally:
            await server.stop(None)

    asyncio.run(main())
