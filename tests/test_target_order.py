"""The target runs a session's Verify calls in the order they arrive, in process (the real servicer, engine and
scheduler, no gRPC), so that the interleaving that once broke it can be set up exactly."""

from __future__ import annotations

import asyncio
import uuid

from services.target.__main__ import build_target
from tandem.config import TargetSettings
from tandem.v1 import tandem_pb2 as pb
from tests.conftest import THREADS


def test_a_one_step_call_is_not_overtaken_by_a_call_sent_after_it() -> None:
    """A one-step call that arrives while another call of its session is in flight waits for it. If that call ends
    before the next call arrives, the next one finds nothing in flight: it must still wait for the one-step call.
    It once did not (the one-step call waited without registering), reached the scheduler first and failed on the
    position: a lookup round's follow-up, skipped, then a stretch's first call and the call pipelined behind it."""

    async def scenario() -> tuple[pb.VerifyResponse, pb.VerifyResponse, int]:
        servicer, worker, load = build_target(TargetSettings(n_threads=THREADS, single_stream_inline="off"))
        await load()
        try:
            sid = uuid.uuid4().hex
            prompt = list((await servicer.Tokenize(pb.TokenizeRequest(text="Count: one, two, three,"), None)).token_ids)
            item = pb.OpenItem(session_id=sid, prompt_token_ids=prompt)
            position = (await servicer.Open(pb.OpenRequest(items=[item]), None)).results[0].position
            in_flight = asyncio.get_running_loop().create_future()
            servicer._chains[sid] = in_flight  # a call of this session in flight, registered as every call is
            one_step = asyncio.create_task(
                servicer.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=position)]), None)
            )
            await asyncio.sleep(0)  # it arrives, and waits behind the call in flight
            in_flight.set_result(None)  # that call ends, as the servicer ends one: unregistered unless a later one
            if servicer._chains.get(sid) is in_flight:  # registered since
                del servicer._chains[sid]
            behind = asyncio.create_task(
                servicer.Verify(
                    pb.VerifyRequest(
                        items=[
                            pb.VerifyItem(
                                session_id=sid, position=position + 1, continuation=pb.Continuation(plain_steps=2)
                            )
                        ]
                    ),
                    None,
                )
            )
            return await one_step, await behind, position
        finally:
            worker.shutdown()

    first, second, position = asyncio.run(scenario())
    assert first.results[0].position == position + 1
    assert second.results[0].position == position + 3 and len(second.results[0].tokens) == 2
