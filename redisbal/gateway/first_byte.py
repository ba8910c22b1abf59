"""Waiting for an engine's first byte: a bound from its usual time, cut short when
the deployment says the engine went silent.

A hung engine (a stopped process, a dead host whose kernel still accepts) takes
connections and answers nothing. Waiting out a bound long enough for a healthy
engine under load costs every request sent to it meanwhile; a short bound fails
healthy engines on a busy host. Two facts together are a sure sign, though: the
request has had no answer for ``SILENT_WAIT_S`` and the engine's reporter, which
heartbeats from a thread of its own, has been silent for ``SILENT_AFTER_S`` (the
latest snapshot names it a laggard). Then the wait ends at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redisbal.routing.outcomes import SILENT_AFTER_S

T = TypeVar("T")

SILENT_WAIT_S = 0.25  # a request has waited this long on a silent engine: it is hung
CHECK_EVERY_S = 0.05


class Silent(Exception):
    """No answer, and the engine's own reports have stopped: hung or gone."""

    def __init__(self, silent_s: float) -> None:
        super().__init__(f"no answer, and no report from it for {silent_s:.1f}s")
        self.silent_s = silent_s


async def first_byte(answer: Awaitable[T], bound_s: float, silent_s: Callable[[], float]) -> T:
    """``answer``'s result, or ``asyncio.TimeoutError`` after ``bound_s``, or
    ``Silent`` once it waited ``SILENT_WAIT_S`` while ``silent_s()`` (seconds since
    the engine last reported) is at least ``SILENT_AFTER_S``."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(answer)
    start = loop.time()
    try:
        while True:
            waited = loop.time() - start
            left = bound_s - waited
            if left <= 0:
                raise asyncio.TimeoutError
            done, _ = await asyncio.wait({task}, timeout=min(left, CHECK_EVERY_S))
            if done:
                return task.result()
            if waited >= SILENT_WAIT_S and (quiet := silent_s()) >= SILENT_AFTER_S:
                raise Silent(quiet)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
