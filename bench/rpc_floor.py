"""The floor under tandem's per-call cost on this machine: a bare grpc aio bidi-stream round trip between two Python
processes, with no tandem code at all (an echo service), and optionally the same through a running target service.

    python -m bench.rpc_floor                         # echo only
    python -m bench.rpc_floor --target 127.0.0.1:50051  # plus Verify calls the target answers NOT_FOUND at once

A speculative round makes two such calls (Propose and Verify), so twice the echo figure is what the transport alone
costs a round on this host, however lean the services are. The echo also reports the CPU time each side spent per
round trip (on two cores, what one process burns the other processes wait for). gRPC's own settings come from the
environment as usual, e.g. `GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener` for the poller I/O that
grpcio used before 1.80 (docs/decisions/0003-grpc-streams-and-io.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable

import grpc

from bench.procstat import process_cpu_s

SERVICE, METHOD = "floor.Echo", "Stream"


async def _serve(port: int) -> None:
    async def echo(requests, context):
        async for message in requests:
            yield message

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(bound, flush=True)
    await server.wait_for_termination()


async def _time_round_trips(call, messages: Iterable[object]) -> list[int]:
    """Nanoseconds per write-then-read on an open bidi stream, one per message; cancels the stream after."""
    times = []
    for message in messages:
        t = time.perf_counter_ns()
        await call.write(message)
        await call.read()
        times.append(time.perf_counter_ns() - t)
    call.cancel()
    return times


async def _echo_round_trips(address: str, calls: int, server_pid: int) -> tuple[list[int], float, float]:
    """(round trip times, then CPU seconds per round trip of this client and of the server) over `calls` echoes."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(f"/{SERVICE}/{METHOD}")()
        client0, server0 = time.process_time(), process_cpu_s(server_pid)
        times = await _time_round_trips(call, [b"x" * 64] * calls)
        client1, server1 = time.process_time(), process_cpu_s(server_pid)
        return times, (client1 - client0) / calls, (server1 - server0) / calls


async def _target_round_trips(address: str, calls: int) -> list[int]:
    from tandem.v1 import tandem_pb2 as pb
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    requests = (
        pb.VerifyRequest(request_id=i + 1, items=[pb.VerifyItem(session_id="absent", position=1)]) for i in range(calls)
    )
    async with grpc.aio.insecure_channel(address) as channel:
        return await _time_round_trips(pb_grpc.TargetStub(channel).VerifyStream(), requests)


def _summary(times: list[int]) -> dict[str, float]:
    kept = times[len(times) // 10 :]  # the first tenth warms up
    return {"median_us": statistics.median(kept) / 1e3, "p90_us": statistics.quantiles(kept, n=10)[-1] / 1e3}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--target", help="host:port of a running target service (loopback)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: run the echo server
    args = parser.parse_args(argv)
    if args.serve is not None:
        asyncio.run(_serve(args.serve))
        return
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.rpc_floor", "--serve", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        times, client_cpu, server_cpu = asyncio.run(_echo_round_trips(f"127.0.0.1:{port}", args.calls, server.pid))
        out = {"echo": {**_summary(times), "client_cpu_us": client_cpu * 1e6, "server_cpu_us": server_cpu * 1e6}}
    finally:
        server.terminate()
        server.wait(timeout=10)
    if args.target:
        out["target NOT_FOUND"] = _summary(asyncio.run(_target_round_trips(args.target, args.calls)))
    for name, figures in out.items():
        cpu = (
            f", CPU {figures['client_cpu_us']:.0f} us client / {figures['server_cpu_us']:.0f} us server"
            if "client_cpu_us" in figures
            else ""
        )
        print(f"{name}: median {figures['median_us']:.0f} us, p90 {figures['p90_us']:.0f} us per round trip{cpu}")
    print("GRPC_EXPERIMENTS:", os.environ.get("GRPC_EXPERIMENTS", "(unset: grpcio's defaults)"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
