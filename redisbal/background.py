"""An asyncio event loop on a daemon thread: how the blocking classes run the async ones.

Everything in the library that waits on Redis is written once, with asyncio
(``AsyncRouter``, ``AsyncReporter`` and its ``ReportSender``). Each blocking
twin (``Router``, ``Reporter``) is a thin facade that runs that code on a
private ``BackgroundLoop``, so the two can never drift and a blocking caller's
thread never waits on a socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from redisbal.errors import InvalidState

T = TypeVar("T")


class BackgroundLoop:
    """A private event loop running forever on a daemon thread until ``close()``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, daemon=True, name=name)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (TimeoutError after ``timeout``,
        the coroutine then cancelled). Never call it from the loop's own thread."""
        if self.in_loop_thread():
            coro.close()
            raise InvalidState("BackgroundLoop.run called from its own thread: it would deadlock")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result within {timeout} s") from None

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Call ``fn(*args)`` on the loop's thread (thread-safe)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop and join its thread (idempotent). Tasks still pending are dropped."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive() and not self.in_loop_thread():
            with contextlib.suppress(TimeoutError, RuntimeError):
                self.run(_cancel_all(), timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it ended. The cancel is repeated: one that lands
    inside a redis-py call can be swallowed (seen with 8.1: the task then ran on, and
    an await on it never returned)."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning


async def _cancel_all() -> None:
    """Cancel the loop's other tasks and let them finish (no "destroyed but pending")."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
