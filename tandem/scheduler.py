"""Continuous batching for a model service: one engine step serves every request that is waiting.

gRPC handlers do not call the engine themselves. They submit work here and await it:
- `batched(kind, fn, items)`: calls of one kind (Verify on the target, Propose on the draft) that arrive while the
  engine is busy are merged, and the next step runs them all in one `fn(groups)` call, i.e. one multi-sequence
  llama_decode. Requests join and leave between steps, so a stream never waits for another to finish.
- `job(fn)`: everything else, in arrival order. A job may be a generator: each `next()` is one step, and pending
  batched calls run between its steps. Long prefills are written that way (chunked prefill), so a 4,000-token prompt
  does not stall the streams that are already decoding.

Scheduling and every step run on the EngineWorker's single thread; futures are resolved on the event loop.

Single-stream fast path (`inline`): a call goes to the engine thread and its answer comes back to the event loop,
two thread hand-offs that cost 0.1-0.4 ms a call (0.31-0.44 ms on the H200 host, measured with
bench.round_profile): a tenth of a 70B round's time, for Propose and Verify together. When the `inline` predicate says
so for the call's items (one active session) and the engine is idle with nothing queued, a batched call runs its step
at once on the calling thread instead. There is nothing to batch it with, and the engine lock keeps llama.cpp
single-entry. Other work waits at most that one step, and batching resumes as soon as a second session is active.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tandem.errors import TandemError
from tandem.worker import EngineWorker

log = logging.getLogger(__name__)
S = TypeVar("S")
R = TypeVar("R")


class Defer:
    """Returned by a batch function for a group that must wait for the next step (its session is already busy)."""


DEFER = Defer()
GroupOutcome = list[Any] | BaseException | Defer
BatchFn = Callable[[list[Sequence[Any]]], list[GroupOutcome]]


@dataclass(frozen=True)
class Again:
    """What a call's `then` returns to go on: run `items` in the next step, for the same call (see `batched`)."""

    items: Sequence[Any]


#: Called with each step's outcome for a multi-step call, where the step ran: `Again(items)` for one more step, or
#: the call's final outcome (its results, or an exception to raise).
Then = Callable[[GroupOutcome], "Again | list[Any] | BaseException"]


def plan_step(
    groups: Sequence[Sequence[Any]], check: Callable[[Sequence[Any]], list[tuple[str, Any, Any]]]
) -> tuple[list[Any], list[tuple[int, Any]]]:
    """Validate the calls (groups) merged into one step and pick the work to compute.

    `check(specs)` validates one call as a whole and returns (session id, cached result or None, work item) per
    spec, or raises TandemError. Returns `outcomes`, one per group: its error, DEFER (it names a session an earlier
    group of this step already works on: it waits for the next step, where an exact retry hits the cache and a call
    queued behind it, such as the gateway's next target-only call, finds the position it expects), or a dict
    session id -> result holding the cached results, which the caller completes; and `work`, (group index, item)
    for every spec to compute.
    """
    outcomes: list[Any] = []
    work: list[tuple[int, Any]] = []
    busy: set[str] = set()
    for g, specs in enumerate(groups):
        if any(spec.session_id in busy for spec in specs):  # before checking: its position is the one after this step
            outcomes.append(DEFER)
            continue
        try:
            checked = check(specs)
        except TandemError as exc:
            outcomes.append(exc)
            continue
        outcomes.append({sid: hit for sid, hit, _ in checked if hit is not None})
        for sid, hit, item in checked:
            if hit is None:
                busy.add(sid)
                work.append((g, item))
    return outcomes, work


def step_results(groups: Sequence[Sequence[Any]], outcomes: list[Any]) -> list[GroupOutcome]:
    """Each group's outcome for the scheduler: its error, DEFER, or its results in the order of its specs."""
    return [
        o if isinstance(o, BaseException | Defer) else [o[spec.session_id] for spec in specs]
        for o, specs in zip(outcomes, groups, strict=True)
    ]


@dataclass
class _Submission(Generic[S]):
    items: Sequence[S]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    then: Then | None = None


@dataclass
class _Job:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    steps: Generator[None, None, Any] | None = None


@dataclass
class _Kind:
    fn: BatchFn
    pending: deque[_Submission] = field(default_factory=deque)
    last_served: int = 0  # calls answered by the last step: how many are expected back
    last_step_s: float = 0.0


def _deliver(results: list[tuple[asyncio.Future, Any, bool]]) -> None:
    """On the event loop: resolve each call's future (result, or exception if failed) unless its caller is gone."""
    for future, outcome, failed in results:
        if future.done():
            continue
        if failed:
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


class StepScheduler:
    """Merges concurrent calls into engine steps; see the module docstring.

    The scheduling loop itself runs on the engine thread: when a step ends, the next one starts there at once with
    the calls already queued, instead of after a hop through the event loop (which, busy with the last step's
    answers, left the engine idle ~0.4 ms between steps on the 2-core CPU, measured). The event loop only queues
    calls and receives their results.
    """

    IDLE_LINGER_S = 0.05  # how long the loop waits for new work before it gives the engine thread back

    def __init__(
        self,
        worker: EngineWorker,
        before_step: Callable[[], None] | None = None,
        max_groups: int = 64,
        max_gather_s: float = 0.02,
        gather_ratio: float = 0.5,
        inline: Callable[[Sequence[Any]], bool] | None = None,
    ) -> None:
        self.worker = worker
        self.inline = inline
        self._engine_lock = threading.Lock()  # held by whichever thread runs a step
        self.before_step = before_step
        self.max_groups = max_groups
        self.max_gather_s = max_gather_s
        self.gather_ratio = gather_ratio
        self._kinds: dict[str, _Kind] = {}
        self._jobs: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._running = False  # the scheduling loop occupies the engine thread
        #: Groups per batched step, for metrics and tests (how much batching happened).
        self.steps = 0
        self.batched_groups = 0
        self.max_groups_seen = 0
        self.gather_waits = 0  # steps that waited for returning callers
        self.inline_steps = 0  # steps run on the calling thread (single-stream fast path)

    def register(self, kind: str, fn: BatchFn) -> None:
        self._kinds[kind] = _Kind(fn)

    def _submit(self, add: Callable[[], None]) -> None:
        with self._cond:
            add()
            if not self._running:
                self.worker.submit(self._loop)  # raises once the worker is shut down: the call fails, nothing hangs
                self._running = True
            self._cond.notify()

    async def batched(self, kind: str, items: Sequence[Any], then: Then | None = None) -> list[Any]:
        """Results for `items` (one call's group), computed in the next step together with other calls' groups.

        With `then`, the call may take several steps: after each one, `then(outcome)` says whether to go on (`Again`)
        or what the call returns. On the engine thread the next step is queued ahead of the calls that wait, so a
        multi-step call costs no hop through the event loop between its steps (two thread hand-offs, ~0.3 ms a step
        on the 2-core CPU), and each of its steps still batches with other sessions' calls.
        """
        entry = self._kinds[kind]
        while self.inline is not None:
            # One pass of the event loop first, for every call: an inline call never suspends, so without it a stream
            # of them would starve the loop (no I/O, no other request, and a client's disconnect would cancel nothing
            # until the generation ends). Deciding after it, in the order calls resume, also keeps a session's calls
            # in order: a later call can neither run inline before nor queue ahead of an earlier one. A multi-step
            # call passes through the loop before each of its inline steps for the same reasons.
            await asyncio.sleep(0)
            if not self.inline(items):
                break
            outcome = self._inline_step(entry, items)
            if outcome is None or outcome is DEFER:
                break
            if then is not None:
                outcome = then(outcome)
                if isinstance(outcome, Again):
                    items = outcome.items
                    continue
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(lambda: entry.pending.append(_Submission(items, future, loop, then)))
        return await future

    def _inline_step(self, kind: _Kind, items: Sequence[Any]) -> GroupOutcome | None:
        """The step for one call, on the calling thread, if the engine is idle with nothing queued (else None)."""
        with self._cond:
            if self.worker.closed or self._has_work() or not self._engine_lock.acquire(blocking=False):
                return None
        try:
            (outcome,) = self._run_step(kind, [items])
            self.inline_steps += 1
        finally:
            self._engine_lock.release()
        return outcome

    async def job(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread in order; if it returns a generator, run it one step at a time."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(lambda: self._jobs.append(_Job(fn, future, loop)))
        return await future

    def _has_work(self) -> bool:
        return bool(self._jobs) or any(k.pending for k in self._kinds.values())

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        """The engine thread's scheduling loop; returns (freeing the thread) after IDLE_LINGER_S without work."""
        while True:
            with self._cond:
                if not self._has_work():
                    self._cond.wait(self.IDLE_LINGER_S)
                    if not self._has_work():
                        self._running = False
                        return
            try:
                for kind in self._kinds.values():
                    if kind.pending:
                        self._batch_step(kind)
                if self._jobs:
                    self._job_step(self._jobs[0])
            except Exception:  # a bug here must not stop the service from serving
                log.exception("scheduler step failed")

    @staticmethod
    def _post(results: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, Any, bool]]) -> None:
        """Hand (loop, future, outcome, failed) results to their event loops: one wake-up per loop and step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, future, outcome, failed in results:
            by_loop.setdefault(loop, []).append((future, outcome, failed))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
                loop.call_soon_threadsafe(_deliver, batch)

    def _gather(self, kind: _Kind) -> None:
        """Wait briefly for the callers of the last step that have not sent their next call yet."""
        expected = min(kind.last_served, self.max_groups)
        if self.max_gather_s <= 0 or len(kind.pending) >= expected:
            return
        deadline = time.monotonic() + min(self.max_gather_s, self.gather_ratio * kind.last_step_s)
        self.gather_waits += 1
        with self._cond:
            while len(kind.pending) < expected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)

    def _batch_step(self, kind: _Kind) -> None:
        self._gather(kind)
        taken: list[_Submission] = []
        # Locked from taking the calls to their answers: an inline call must not overtake calls already taken.
        with self._engine_lock:
            with self._cond:
                while kind.pending and len(taken) < self.max_groups:
                    sub = kind.pending.popleft()
                    if not sub.future.done():  # cancelled calls are dropped before they cost anything
                        taken.append(sub)
            if not taken:
                return
            outcomes = self._run_step(kind, [sub.items for sub in taken])
            # Multi-step calls' next steps and deferred calls, in their order, ahead of calls that came later: a
            # deferred call waits behind the call of its session that was ahead of it, whether it ended or goes on.
            requeued, results = [], []
            for sub, outcome in zip(taken, outcomes, strict=True):
                if outcome is DEFER:
                    requeued.append(sub)
                    continue
                if sub.then is not None:
                    try:
                        outcome = sub.then(outcome)
                    except Exception as exc:  # a bug in the callback fails its call alone
                        outcome = exc
                    if isinstance(outcome, Again):
                        requeued.append(_Submission(outcome.items, sub.future, sub.loop, sub.then))
                        continue
                results.append((sub.loop, sub.future, outcome, isinstance(outcome, BaseException)))
            if requeued:
                with self._cond:
                    kind.pending.extendleft(reversed(requeued))
        self._post(results)

    def _run_step(self, kind: _Kind, groups: list[Sequence[Any]]) -> list[GroupOutcome]:
        """One engine step over `groups` (the caller holds the engine lock); every group gets an outcome."""
        started = time.monotonic()
        try:
            if self.before_step is not None:
                self.before_step()
            outcomes = kind.fn(groups)
        except Exception as exc:
            outcomes = [exc] * len(groups)
        kind.last_step_s = time.monotonic() - started
        kind.last_served = sum(1 for o in outcomes if o is not DEFER and not isinstance(o, BaseException))
        self.steps += 1
        self.batched_groups += len(groups)
        self.max_groups_seen = max(self.max_groups_seen, len(groups))
        return outcomes

    def _job_step(self, job: _Job) -> None:
        try:
            with self._engine_lock:
                if self.before_step is not None:
                    self.before_step()
                if job.steps is None:
                    value = job.fn()
                    if isinstance(value, Generator):
                        job.steps = value
                if job.steps is not None:
                    next(job.steps)
                    return  # more steps to come; waiting calls run in between
        except StopIteration as stop:
            value = stop.value
        except Exception as exc:
            self._finish_job(exc, failed=True)
            return
        self._finish_job(value, failed=False)

    def _finish_job(self, outcome: Any, failed: bool) -> None:
        with self._cond:
            job = self._jobs.popleft()
        self._post([(job.loop, job.future, outcome, failed)])
