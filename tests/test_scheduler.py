"""The step scheduler (continuous batching, chunked jobs) on a real engine thread, with plain functions as work."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from tandem.errors import InvalidArgument
from tandem.scheduler import DEFER, StepScheduler
from tandem.worker import EngineWorker


def run(coro):
    return asyncio.run(coro)


def verify_scheduler(verify, **options) -> StepScheduler:
    """A scheduler on a real engine thread with `verify` registered as the batched kind "verify"."""
    scheduler = StepScheduler(EngineWorker(), **options)
    scheduler.register("verify", verify)
    return scheduler


@contextlib.asynccontextmanager
async def engine_busy(scheduler: StepScheduler) -> AsyncIterator[None]:
    """Hold the engine thread with a job; calls made inside the block wait, and run once it is released."""
    gate, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        gate.wait()

    blocker = asyncio.create_task(scheduler.job(hold))
    # Wait until the engine thread really runs the job: a fixed sleep was not always long enough on a loaded
    # machine, and calls made before the engine is held may run at once (a suspected flake of the suite).
    assert await asyncio.to_thread(holding.wait, 10), "the engine thread never started the blocking job"
    try:
        yield
        await asyncio.sleep(0.05)  # let the calls made inside reach the queue
    finally:
        gate.set()
        await blocker


def test_calls_waiting_for_the_engine_run_as_one_step() -> None:
    steps: list[list[list[int]]] = []

    def verify(groups):
        steps.append([list(g) for g in groups])
        return [[x * 10 for x in g] for g in groups]

    async def main():
        scheduler = verify_scheduler(verify)
        async with engine_busy(scheduler):  # when the engine is free, all five waiting calls go in one step
            calls = [asyncio.create_task(scheduler.batched("verify", [i, i + 100])) for i in range(5)]
        return scheduler, await asyncio.gather(*calls)

    scheduler, results = run(main())
    assert results == [[i * 10, (i + 100) * 10] for i in range(5)]
    assert len(steps) == 1 and len(steps[0]) == 5
    assert scheduler.max_groups_seen == 5 and scheduler.batched_groups == 5


def test_max_groups_one_turns_batching_off() -> None:
    sizes = []

    def verify(groups):
        sizes.append(len(groups))
        return [list(g) for g in groups]

    async def main():
        scheduler = verify_scheduler(verify, max_groups=1)
        await asyncio.gather(*(scheduler.batched("verify", [i]) for i in range(4)))

    run(main())
    assert sizes == [1, 1, 1, 1]


def test_a_failing_call_fails_alone_and_a_deferred_one_runs_next_step() -> None:
    seen = []

    def verify(groups):
        seen.append([g[0] for g in groups])
        out = []
        for g in groups:
            if g[0] == "bad":
                out.append(InvalidArgument("bad input"))
            elif g[0] == "busy" and len(seen) == 1:
                out.append(DEFER)
            else:
                out.append(["ok"])
        return out

    async def main():
        scheduler = verify_scheduler(verify)
        async with engine_busy(scheduler):
            good = asyncio.create_task(scheduler.batched("verify", ["good"]))
            bad = asyncio.create_task(scheduler.batched("verify", ["bad"]))
            busy = asyncio.create_task(scheduler.batched("verify", ["busy"]))
        assert await good == ["ok"]
        with pytest.raises(InvalidArgument):
            await bad
        assert await busy == ["ok"]

    run(main())
    assert seen == [["good", "bad", "busy"], ["busy"]]


def test_chunked_job_lets_waiting_calls_run_between_its_steps() -> None:
    order: list[str] = []

    def prefill():
        import time

        for chunk in range(3):
            order.append(f"chunk {chunk}")
            time.sleep(0.02)  # a forward pass over one chunk of the prompt
            yield
        order.append("chunk 3")
        return "prefilled"

    def verify(groups):
        order.append(f"verify x{len(groups)}")
        return [["v"] for _ in groups]

    async def main():
        scheduler = verify_scheduler(verify)
        job = asyncio.create_task(scheduler.job(prefill))
        await asyncio.sleep(0)
        results = []
        for _ in range(3):  # a running stream keeps verifying while the long prompt is prefilled
            results.append(await scheduler.batched("verify", ["s"]))
        return await job, results

    value, results = run(main())
    assert value == "prefilled" and results == [["v"]] * 3
    assert order.index("verify x1") < order.index("chunk 3")  # a verify step ran before the prefill finished


def test_cancelled_calls_cost_nothing() -> None:
    calls = []

    def verify(groups):
        calls.extend(g[0] for g in groups)
        return [["ok"] for _ in groups]

    async def main():
        scheduler = verify_scheduler(verify)
        async with engine_busy(scheduler):
            gone = asyncio.create_task(scheduler.batched("verify", ["gone"]))
            kept = asyncio.create_task(scheduler.batched("verify", ["kept"]))
            await asyncio.sleep(0.05)
            gone.cancel()
        assert await kept == ["ok"]

    run(main())
    assert calls == ["kept"]


@pytest.mark.parametrize("gather_ms", [0.0, 50.0])
def test_a_step_waits_briefly_for_the_callers_of_the_last_step(gather_ms: float) -> None:
    """Four callers, each sending its next call 3-12 ms after its answer (as the gateway does between rounds).

    Without gathering the first one back starts a step alone and the others queue behind it, so steps split;
    with it, every round is one step of all four.
    """
    import time

    sizes: list[int] = []

    def verify(groups):
        sizes.append(len(groups))
        time.sleep(0.03)  # a forward pass
        return [list(g) for g in groups]

    async def caller(scheduler: StepScheduler, i: int) -> None:
        for _ in range(5):
            await scheduler.batched("verify", [i])
            await asyncio.sleep(0.003 * (i + 1))

    async def main():
        scheduler = verify_scheduler(verify, max_gather_s=gather_ms / 1e3)
        async with engine_busy(scheduler):
            tasks = [asyncio.create_task(caller(scheduler, i)) for i in range(4)]
        await asyncio.gather(*tasks)

    run(main())
    assert sum(sizes) == 20
    if gather_ms:
        assert sizes == [4] * 5
    else:
        assert len(sizes) > 5 and sizes.count(4) < 5


def test_a_call_queued_behind_another_for_its_session_waits_for_the_next_step() -> None:
    """Two calls for one session in one step: the second names the position after the first (the gateway keeps two
    target-only calls in flight). It must be deferred, not checked against the position before the first runs."""
    from dataclasses import dataclass

    from tandem.errors import PositionMismatch
    from tandem.scheduler import plan_step

    @dataclass
    class Spec:
        session_id: str
        position: int

    positions = {"a": 5, "b": 9}

    def check(specs):
        for spec in specs:
            if positions[spec.session_id] != spec.position:
                raise PositionMismatch(f"{spec.session_id} is at {positions[spec.session_id]}")
        return [(spec.session_id, None, spec) for spec in specs]

    groups = [[Spec("a", 5)], [Spec("a", 6)], [Spec("b", 9)], [Spec("b", 7)]]
    outcomes, work = plan_step(groups, check)
    assert outcomes[1] is DEFER  # queued behind the first call for "a"
    assert outcomes[3] is DEFER  # also deferred: checked (and refused) at the next step
    assert [g for g, _ in work] == [0, 2]
    positions["a"], positions["b"] = 6, 10  # the step ran
    outcomes, work = plan_step([groups[1], groups[3]], check)
    assert [g for g, _ in work] == [0]
    assert isinstance(outcomes[1], PositionMismatch)


def test_the_next_step_starts_on_the_engine_thread_while_the_event_loop_is_busy() -> None:
    """Scheduling runs on the engine thread: a queued call's step starts when the engine is free, even while the
    event loop is still busy (with the last step's answers, in a service), not after a hop through the loop."""
    import time

    ran_at: list[float] = []

    def verify(groups):
        ran_at.append(time.monotonic())
        return [["ok"] for _ in groups]

    async def main():
        scheduler = verify_scheduler(verify)
        gate = threading.Event()
        blocker = asyncio.create_task(scheduler.job(gate.wait))
        await asyncio.sleep(0.05)
        call = asyncio.create_task(scheduler.batched("verify", ["a"]))
        await asyncio.sleep(0.01)  # the call is queued behind the blocking job
        gate.set()
        time.sleep(0.2)  # the event loop is busy: nothing on it can start the step
        loop_free = time.monotonic()
        await blocker
        assert await call == ["ok"]
        return loop_free

    loop_free = run(main())
    assert len(ran_at) == 1 and ran_at[0] < loop_free - 0.1


def test_an_idle_scheduler_gives_the_engine_thread_back() -> None:
    """After IDLE_LINGER_S without work the loop returns, so other engine work (and shutdown) can use the thread."""
    worker = EngineWorker()

    async def main():
        scheduler = StepScheduler(worker)
        scheduler.register("verify", lambda groups: [["ok"] for _ in groups])
        assert await scheduler.batched("verify", [1]) == ["ok"]
        await asyncio.sleep(StepScheduler.IDLE_LINGER_S * 3)
        assert await asyncio.wait_for(worker.run(lambda: "free"), 1.0) == "free"
        assert await scheduler.batched("verify", [2]) == ["ok"]  # and it starts again on the next call

    run(main())
    worker.shutdown()


def test_a_single_stream_call_runs_inline_on_the_calling_thread() -> None:
    threads: list[str] = []

    def verify(groups):
        threads.append(threading.current_thread().name)
        return [[x + 1 for x in g] for g in groups]

    async def main():
        scheduler = verify_scheduler(verify, inline=lambda _: True)
        first = await scheduler.batched("verify", [1])
        async with engine_busy(scheduler):  # the engine thread is busy: the call queues and runs there
            queued = asyncio.create_task(scheduler.batched("verify", [2]))
        return first, await queued

    first, queued = run(main())
    assert (first, queued) == ([2], [3])
    assert threads[0] == threading.main_thread().name
    assert threads[1].startswith("engine")


def test_inline_calls_keep_their_errors_and_do_not_overtake_a_running_step() -> None:
    """A call eligible for inline while the engine thread is inside a step (engine lock held, queue empty) queues and
    runs after it; an inline call's error is raised to its caller."""
    order: list[str] = []
    threads: dict[str, str] = {}
    gate = threading.Event()

    def verify(groups):
        out = []
        for g in groups:
            if g[0] == "slow":
                gate.wait(5)
            order.append(g[0])
            threads[g[0]] = threading.current_thread().name
            out.append(InvalidArgument("bad") if g[0] == "bad" else list(g))
        return out

    async def main():
        scheduler = verify_scheduler(verify, inline=lambda items: items[0] != "slow")
        with pytest.raises(InvalidArgument):
            await scheduler.batched("verify", ["bad"])
        slow = asyncio.create_task(scheduler.batched("verify", ["slow"]))  # to the engine thread, where it blocks
        await asyncio.sleep(0.05)
        fast = asyncio.create_task(scheduler.batched("verify", ["fast"]))  # eligible, but the engine is busy
        await asyncio.sleep(0.05)
        gate.set()
        return await slow, await fast

    assert run(main()) == (["slow"], ["fast"])
    assert order == ["bad", "slow", "fast"]
    assert threads["bad"] == threading.main_thread().name
    assert threads["slow"].startswith("engine") and threads["fast"].startswith("engine")


def test_calls_of_one_session_keep_their_order_whichever_path_they_take() -> None:
    """Two calls sent back to back, the first eligible for inline and the second not: the first still runs first."""
    order: list[str] = []

    def verify(groups):
        order.extend(g[0] for g in groups)
        return [list(g) for g in groups]

    async def main():
        scheduler = verify_scheduler(verify, inline=lambda items: items[0] == "first")
        first = asyncio.create_task(scheduler.batched("verify", ["first"]))
        second = asyncio.create_task(scheduler.batched("verify", ["second"]))
        return await first, await second

    assert run(main()) == (["first"], ["second"])
    assert order == ["first", "second"]


def test_no_inline_step_after_shutdown() -> None:
    ran: list[str] = []

    def verify(groups):
        ran.append("step")
        return [list(g) for g in groups]

    async def main():
        scheduler = verify_scheduler(verify, inline=lambda _: True)
        scheduler.worker.shutdown()
        with pytest.raises(RuntimeError):
            await scheduler.batched("verify", [1])

    run(main())
    assert ran == []


def test_inline_off_when_the_predicate_says_so() -> None:
    threads: list[str] = []

    def verify(groups):
        threads.append(threading.current_thread().name)
        return [list(g) for g in groups]

    async def main():
        scheduler = verify_scheduler(verify, inline=lambda _: False)
        await scheduler.batched("verify", [1])

    run(main())
    assert threads[0].startswith("engine")


def test_single_stream_inline_setting() -> None:
    """auto: inline for a GPU model and for the n-gram drafter (no model), not for a CPU model; on/off force it."""
    from tandem.config import DraftSettings, TargetSettings

    auto = TargetSettings()
    assert auto.inline_steps("CUDA") and auto.inline_steps("Vulkan") and not auto.inline_steps("CPU")
    assert DraftSettings().inline_steps(None)
    assert TargetSettings(single_stream_inline="on").inline_steps("CPU")
    assert not TargetSettings(single_stream_inline="off").inline_steps("CUDA")


@dataclass(frozen=True)
class _Step:
    session_id: str
    position: int
    fail: bool = False


@pytest.mark.parametrize("inline", [False, True], ids=["engine-thread", "inline"])
def test_a_multi_step_call_batches_each_step_and_holds_back_its_session(inline: bool) -> None:
    """A call with `then` (a multi-token target-only call) runs several steps; each of them batches with the other
    calls waiting, a call for its session queued behind it runs only after its last step, and a failure at a later
    step reaches `then`, which decides what the call returns."""
    from tandem.scheduler import Again, plan_step, step_results

    steps: list[list[_Step]] = []
    positions = {"a": 0, "b": 0}

    def check(specs):
        for spec in specs:
            if positions[spec.session_id] != spec.position:
                raise InvalidArgument(f"{spec.session_id} is at {positions[spec.session_id]}, not {spec.position}")
        return [(spec.session_id, None, (g, spec)) for g, spec in enumerate(specs)]

    def verify(groups):
        outcomes, work = plan_step(groups, check)
        steps.append([spec for _, (_, spec) in work])
        for g, (_, spec) in work:
            if spec.fail:
                outcomes[g] = InvalidArgument(f"{spec.session_id} failed at {spec.position}")
            elif not isinstance(outcomes[g], BaseException):
                positions[spec.session_id] = spec.position + 1
                outcomes[g][spec.session_id] = spec.position
        return step_results(groups, outcomes)

    def chain(sid: str, start: int, n: int, fail_at: int | None = None):
        done: list[int] = []

        def then(outcome):
            if isinstance(outcome, BaseException):
                return done if done else outcome
            done.extend(outcome)
            pos = start + len(done)
            return done if len(done) == n else Again([_Step(sid, pos, pos == fail_at)])

        return [_Step(sid, start, start == fail_at)], then

    async def main():
        scheduler = verify_scheduler(verify, inline=(lambda _: True) if inline else None)
        first, then = chain("a", 0, 4)
        async with engine_busy(scheduler):
            a = asyncio.create_task(scheduler.batched("verify", first, then=then))
            b = asyncio.create_task(scheduler.batched("verify", [_Step("b", 0)]))
            behind = asyncio.create_task(scheduler.batched("verify", [_Step("a", 4)]))
        results = await asyncio.gather(a, b, behind)
        failing, then = chain("b", 1, 5, fail_at=3)
        partial = await scheduler.batched("verify", failing, then=then)
        failing, then = chain("b", 3, 2, fail_at=3)
        with pytest.raises(InvalidArgument):
            await scheduler.batched("verify", failing, then=then)
        return results, partial

    (a, b, behind), partial = run(main())
    assert a == [0, 1, 2, 3] and b == [0] and behind == [4]
    assert steps[0] == [_Step("a", 0), _Step("b", 0)]  # the first step batched both sessions
    assert [spec.position for step in steps for spec in step if spec.session_id == "a"] == [0, 1, 2, 3, 4]
    assert partial == [1, 2]  # the step at 3 failed: the tokens so far stand
    assert positions["b"] == 3
