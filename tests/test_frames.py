"""The frame transport (tandem/frames.py) against real services: matched answers, in-band errors, a restart onto a new
port, a fallback to the gRPC stream, refusals of bad peers, and a gateway serving over it."""

from __future__ import annotations

import asyncio
import socket

import grpc
import httpx
import pytest

from services.gateway.streams import FrameMux, StreamMux
from services.gateway.upstream import ChannelSecurity, frame_host, with_frames
from tandem.frames import ERROR, HELLO, MAGIC, MAX_FRAME_BYTES, VERIFY, FrameError, FrameReader, frame
from tandem.launch import free_port, start_model_service
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.conftest import Service, start_gateway
from tests.test_streams import _open, decode_steps


async def _verify_mux(stub: pb_grpc.TargetStub, address: str) -> StreamMux | FrameMux:
    info = await stub.Info(pb.InfoRequest())
    stream = StreamMux(stub.VerifyStream, "target")
    return with_frames(stream, address, info, stub.Info, VERIFY, pb.VerifyResponse, ChannelSecurity())


def test_frame_reader_splits_any_chunking_alike() -> None:
    stream = frame(VERIFY, b"abc") + frame(HELLO, b"") + frame(7, bytes(range(200)))
    expected = [(VERIFY, b"abc"), (HELLO, b""), (7, bytes(range(200)))]
    for cut in range(len(stream) + 1):
        reader = FrameReader()
        assert reader.feed(stream[:cut]) + reader.feed(stream[cut:]) == expected
    reader = FrameReader()
    assert [f for b in stream for f in reader.feed(bytes([b]))] == expected  # a byte at a time
    with pytest.raises(FrameError):
        FrameReader().feed((MAX_FRAME_BYTES + 1).to_bytes(4, "little") + bytes([VERIFY]))


def test_frame_host_of_addresses() -> None:
    assert frame_host("127.0.0.1:50051") == "127.0.0.1"
    assert frame_host("target:50051") == "target"
    assert frame_host("[::1]:50051") == "::1"
    assert frame_host("unix:/tmp/target.sock") is None
    assert frame_host("dns:///target:50051") is None


def test_concurrent_calls_over_frames_get_their_own_answers(target: Service) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = pb_grpc.TargetStub(channel)
            mux = await _verify_mux(stub, target.address)
            assert isinstance(mux, FrameMux)  # the target offers frames by default
            sessions = [await _open(stub, [1, 504, 2573, 1244 + i]) for i in range(3)]

            together = await asyncio.gather(*(decode_steps(mux, sid, pos) for sid, pos in sessions))
            assert mux.on_frames
            stream = StreamMux(stub.VerifyStream, "target")  # each session alone, over the gRPC stream
            for i, tokens in enumerate(together):
                sid, pos = await _open(stub, [1, 504, 2573, 1244 + i])
                sessions.append((sid, pos))
                assert await decode_steps(stream, sid, pos) == tokens
            await stub.Close(pb.CloseRequest(session_ids=[sid for sid, _ in sessions]))
            with pytest.raises(grpc.aio.AioRpcError) as info:  # an in-band error status, raised as a call's error
                await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id="nope", position=1)]), timeout=30)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert mux.on_frames  # the connection serves on after an error
            await mux.close()
            await stream.close()

    asyncio.run(main())


def test_frames_follow_a_restarted_service_to_its_new_port(service_tmp) -> None:
    async def main() -> None:
        svc = start_model_service("services.target", ["--n-threads", "1"], service_tmp)
        try:
            async with grpc.aio.insecure_channel(svc.address) as channel:
                stub = pb_grpc.TargetStub(channel)
                mux = await _verify_mux(stub, svc.address)
                first_port = (await stub.Info(pb.InfoRequest())).frame_port
                sid, pos = await _open(stub, [1, 504, 2573])
                await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]), timeout=30)
                assert mux.on_frames
                svc.stop()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos + 1)]), 10)
                assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                # Back on the same gRPC port, frames elsewhere: the mux asks Info again and reconnects.
                port = svc.address.rsplit(":", 1)[1]
                svc = start_model_service("services.target", ["--n-threads", "1", "--port", port], service_tmp)
                assert (await stub.Info(pb.InfoRequest())).frame_port != first_port
                sid, pos = await _open(stub, [1, 504, 2573])
                reply = await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]), 30)
                assert reply.results[0].position == pos + 1
                assert mux.on_frames
                await mux.close()
        finally:
            svc.stop()

    asyncio.run(main())


def test_unreachable_frame_port_falls_back_to_the_grpc_stream(target: Service) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = pb_grpc.TargetStub(channel)
            info = await stub.Info(pb.InfoRequest())
            info.frame_port = free_port()  # as behind a port mapping that forwards only gRPC: nothing listens
            stream = StreamMux(stub.VerifyStream, "target")
            mux = with_frames(stream, target.address, info, stub.Info, VERIFY, pb.VerifyResponse, ChannelSecurity())
            sid, pos = await _open(stub, [1, 504, 2573])
            reply = await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]), 30)
            assert reply.results[0].position == pos + 1
            assert not mux.on_frames
            await stub.Close(pb.CloseRequest(session_ids=[sid]))
            await mux.close()

    asyncio.run(main())


def _exchange(port: int, data: bytes) -> list[tuple[int, bytes]]:
    """Send raw bytes to a frame port; the frames answered until the service hangs up (or 10 s pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        reader, frames = FrameReader(), []
        while chunk := sock.recv(65536):
            frames += reader.feed(chunk)
        return frames


def test_service_refuses_a_bad_hello_or_frame_and_serves_on(target: Service) -> None:
    with grpc.insecure_channel(target.address) as channel:
        stub = pb_grpc.TargetStub(channel)
        port = stub.Info(pb.InfoRequest()).frame_port
        assert port > 0
        answered = _exchange(port, frame(HELLO, b"someone-else/1\n"))
        assert answered[-1][0] == ERROR and b"hello" in answered[-1][1]
        answered = _exchange(port, frame(HELLO, MAGIC + b"\n") + frame(99, b"x"))
        assert answered[0] == (HELLO, MAGIC)
        assert answered[-1][0] == ERROR and b"unknown frame kind 99" in answered[-1][1]
        answered = _exchange(port, frame(HELLO, MAGIC + b"\n") + frame(VERIFY, b"\xff\xff\xff"))  # not a message
        assert answered[-1][0] == ERROR
        assert stub.Info(pb.InfoRequest()).frame_port == port  # the service is unharmed


def test_service_without_frames_is_served_over_the_stream(service_tmp) -> None:
    svc = start_model_service("services.target", ["--n-threads", "1", "--frame-port", "-1"], service_tmp)
    try:

        async def main() -> None:
            async with grpc.aio.insecure_channel(svc.address) as channel:
                stub = pb_grpc.TargetStub(channel)
                assert (await stub.Info(pb.InfoRequest())).frame_port == 0
                mux = await _verify_mux(stub, svc.address)
                assert isinstance(mux, StreamMux)
                sid, pos = await _open(stub, [1, 504, 2573])
                reply = await mux.call(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]), 30)
                assert reply.results[0].position == pos + 1
                await mux.close()

        asyncio.run(main())
    finally:
        svc.stop()


def test_gateway_over_frames_answers_as_over_grpc_streams(
    target: Service, ngram_draft: Service, gateway: Service, service_tmp
) -> None:
    """The default gateway calls both services over frames; one told --no-upstream-frames uses the streams; greedy
    text is the same either way."""
    streams = start_gateway(target.address, ngram_draft.address, service_tmp, "--no-upstream-frames")
    try:
        body = {"messages": [{"role": "user", "content": "Repeat: red green blue red green blue"}], "max_tokens": 32,
                "temperature": 0}  # fmt: skip
        replies = [httpx.post(f"{gw.address}/v1/chat/completions", json=body, timeout=120) for gw in (gateway, streams)]
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        texts = [r.json()["choices"][0]["message"]["content"] for r in replies]
        assert texts[0] == texts[1]
        assert replies[0].json()["timings"]["speculation"] == "on"
        assert "target: calls over frames" in gateway.log() and "draft: calls over frames" in gateway.log()
        assert "over frames" not in streams.log()
    finally:
        streams.stop()
