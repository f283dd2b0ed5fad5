"""The engine thread: blocking engine work of one model, run on one dedicated thread.

llama.cpp must never be entered twice at once, so every step of a model service (and of the co-located gateway)
goes through one EngineWorker; the step scheduler (tandem.scheduler) runs its loop on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class EngineWorker:
    """Runs blocking engine work on one dedicated thread, so llama.cpp is never entered twice at once."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.closed = False  # shut down: no more engine work, on its thread or inline on another

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the engine thread and wait for its result."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[[], Any]) -> None:
        """Start fn on the engine thread (the step scheduler's loop), without waiting for it."""
        self._pool.submit(fn)

    def shutdown(self) -> None:
        """Refuse further work, cancel what is queued and wait for the running call to end."""
        self.closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
