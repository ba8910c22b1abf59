"""Waiting for an engine's first byte: a bound from its usual time, cut short when
the deployment says the engine went silent; and the gateway's other waits with a
timeout, without a task of their own.

A hung engine (a stopped process, a dead host whose kernel still accepts) takes
connections and answers nothing. Waiting out a bound long enough for a healthy
engine under load costs every request sent to it meanwhile; a short bound fails
healthy engines on a busy host. Two facts together are a sure sign, though: the
request has had no answer for ``SILENT_WAIT_S`` and the engine's reporter, which
heartbeats from a thread of its own, has been silent for ``SILENT_AFTER_S`` (the
latest snapshot names it a laggard). Then the wait ends at once.

Whether an engine went silent is checked every ``CHECK_EVERY_S`` by one
``SilenceWatch`` per deployment for all the requests waiting on it, not by each
request: a whole (non-streamed) answer comes only at its end, so a gateway with a
thousand of them in flight would otherwise wake twenty thousand times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redisbal.routing.outcomes import SILENT_AFTER_S

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # aiohttp brings async-timeout on Python 3.10
    from async_timeout import timeout

T = TypeVar("T")

SILENT_WAIT_S = 0.25  # a request has waited this long on a silent engine: it is hung
CHECK_EVERY_S = 0.05

__all__ = ["CHECK_EVERY_S", "SILENT_WAIT_S", "SilenceWatch", "Silent", "first_byte", "timeout"]


class Silent(Exception):
    """No answer, and the engine's own reports have stopped: hung or gone."""

    def __init__(self, silent_s: float) -> None:
        super().__init__(f"no answer, and no report from it for {silent_s:.1f}s")
        self.silent_s = silent_s


class SilenceWatch:
    """Tells waiting requests when their engine has gone silent: one timer every
    ``CHECK_EVERY_S`` while any request waits, asking ``silent_s(engine)`` (seconds
    since the engine last reported, as the latest snapshot says) once per engine."""

    def __init__(self, silent_s: Callable[[str], float]) -> None:
        self._silent_s = silent_s
        self._waiting: dict[str, set[asyncio.Future[float]]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, engine_id: str) -> asyncio.Future[float]:
        """A future that gets the engine's silent seconds once they reach
        ``SILENT_AFTER_S``; ``forget`` it when the wait ends."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[float] = loop.create_future()
        self._waiting.setdefault(engine_id, set()).add(fut)
        if self._timer is None:
            self._timer = loop.call_later(CHECK_EVERY_S, self._check, loop)
        return fut

    def forget(self, engine_id: str, fut: asyncio.Future[float]) -> None:
        waiting = self._waiting.get(engine_id)
        if waiting is not None:
            waiting.discard(fut)
            if not waiting:
                del self._waiting[engine_id]

    def waiting(self) -> int:
        """Requests being watched now (what the tests check is left behind)."""
        return sum(map(len, self._waiting.values()))

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        for eid in list(self._waiting):
            quiet = self._silent_s(eid)
            if quiet >= SILENT_AFTER_S:
                for fut in self._waiting.pop(eid):
                    if not fut.done():
                        fut.set_result(quiet)
        if self._waiting:  # the timer runs only while someone waits
            self._timer = loop.call_later(CHECK_EVERY_S, self._check, loop)


async def first_byte(
    answer: Awaitable[T], bound_s: float, watch: SilenceWatch, engine_id: str
) -> T:
    """``answer``'s result, or ``asyncio.TimeoutError`` after ``bound_s``, or
    ``Silent`` once it waited ``SILENT_WAIT_S`` while ``engine_id`` has not reported
    for ``SILENT_AFTER_S`` (``watch`` says so). At most two waits, whatever the bound."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(answer)
    start = loop.time()
    silence: asyncio.Future[float] | None = None
    try:
        await asyncio.wait({task}, timeout=min(bound_s, SILENT_WAIT_S))
        if not task.done() and bound_s > SILENT_WAIT_S:
            silence = watch.watch(engine_id)
            left = bound_s - (loop.time() - start)
            either: set[asyncio.Future[Any]] = {task, silence}
            await asyncio.wait(either, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        if silence is not None and silence.done():
            raise Silent(silence.result())
        raise asyncio.TimeoutError
    finally:
        if silence is not None:
            watch.forget(engine_id, silence)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
