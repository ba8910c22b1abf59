"""Waiting for an engine's first byte: a bound from its usual time, cut short when
the deployment says the engine went silent; and the gateway's other waits with a
timeout, without a task of their own.

A hung engine (a stopped process, a dead host whose kernel still accepts) takes
connections and answers nothing. Waiting out a bound long enough for a healthy
engine under load costs every request sent to it meanwhile; a short bound fails
healthy engines on a busy host. Two facts together are a sure sign, though: the
request has had no answer for ``SILENT_WAIT_S`` and the engine has not reported for
longer than its own reports ever pause (the latest snapshot names it a laggard that
long). An engine reports at its step pace, so one whose steps are long (a big
prefill, a front end starved of CPU) pauses its reports and is alive: its bound is a
few times its own recent gaps between reports (``AsyncRouter.silent_after_s``), at
least ``SILENT_AFTER_S``. A stopped one does not report at all, whatever its pace.
Then the wait ends at once, and the attempt's connection is dropped, which the
engine takes as the client leaving (it aborts the request).

Whether an engine went silent is checked every ``CHECK_EVERY_S`` by one
``SilenceWatch`` per deployment for all the requests waiting on it, not by each
request: a whole (non-streamed) answer comes only at its end, so a gateway with a
thousand of them in flight would otherwise wake twenty thousand times a second.
"""

from __future__ import annotations

import asyncio
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

__all__ = [
    "CHECK_EVERY_S",
    "SILENT_WAIT_S",
    "ChunkWatch",
    "SilenceWatch",
    "Silent",
    "first_byte",
    "timeout",
    "within",
]


class Silent(Exception):
    """No answer, and the engine's own reports have stopped: hung or gone."""

    def __init__(self, silent_s: float) -> None:
        super().__init__(f"no answer, and no report from it for {silent_s:.1f}s")
        self.silent_s = silent_s


class _Wait:
    """One request waiting on an engine: its task, since when, and the engine's silent
    seconds once the watch ended the wait."""

    __slots__ = ("silent_s", "since", "task")

    def __init__(self, task: asyncio.Task[Any], since: float) -> None:
        self.task, self.since = task, since
        self.silent_s: float | None = None


class SilenceWatch:
    """Ends the waits of requests whose engine has gone silent: one timer every
    ``CHECK_EVERY_S`` while any request waits, asking ``silent_s(engine)`` (seconds
    since the engine last reported, as the latest snapshot says) once per engine, and
    cancelling the tasks that have waited ``SILENT_WAIT_S`` on an engine silent for
    ``silent_after_s(engine)`` (its own bound; ``SILENT_AFTER_S`` when not given)."""

    def __init__(
        self,
        silent_s: Callable[[str], float],
        silent_after_s: Callable[[str], float] | None = None,
    ) -> None:
        self._silent_s = silent_s
        self._silent_after_s = silent_after_s or (lambda _eid: SILENT_AFTER_S)
        self._waiting: dict[str, set[_Wait]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, engine_id: str) -> _Wait:
        """Watch the current task's wait on ``engine_id``; ``forget`` it when it ends."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        wait = _Wait(task, loop.time())
        self._waiting.setdefault(engine_id, set()).add(wait)
        if self._timer is None:
            self._timer = loop.call_later(CHECK_EVERY_S, self._check, loop)
        return wait

    def forget(self, engine_id: str, wait: _Wait) -> None:
        waiting = self._waiting.get(engine_id)
        if waiting is not None:
            waiting.discard(wait)
            if not waiting:
                del self._waiting[engine_id]

    def waiting(self) -> int:
        """Requests being watched now (what the tests check is left behind)."""
        return sum(map(len, self._waiting.values()))

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        long_ago = loop.time() - SILENT_WAIT_S
        # a cancel only schedules the task's wake-up: forget() runs later, in the task,
        # so nothing changes these sets while they are walked
        for eid, waiting in self._waiting.items():
            quiet = self._silent_s(eid)
            if quiet < SILENT_AFTER_S or quiet < self._silent_after_s(eid):
                continue
            for wait in waiting:
                if wait.since > long_ago or wait.silent_s is not None:
                    continue
                wait.silent_s = quiet
                wait.task.cancel()  # first_byte turns this cancel into Silent
        if self._waiting:  # the timer runs only while someone waits
            self._timer = loop.call_later(CHECK_EVERY_S, self._check, loop)


class _WhileQueued:
    """Moves a wait's timeout ``step_s`` on each time it is nearly due while
    ``queues()`` says the engine queues requests, never past ``end`` (loop time)."""

    def __init__(self, cm: Any, step_s: float, queues: Callable[[], bool], end: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._cm, self._step_s, self._queues, self._end = cm, step_s, queues, end
        self._handle = self._arm()

    def _when(self) -> float:
        """The timeout's deadline (``asyncio.timeout``'s ``when()``; async-timeout's
        ``deadline`` on Python 3.10)."""
        cm = self._cm
        return float(cm.when() if hasattr(cm, "when") else cm.deadline)

    def _arm(self) -> asyncio.TimerHandle:
        # just before the timeout's own callback: both due, this one runs first
        return self._loop.call_at(self._when() - 0.005, self._check)

    def _check(self) -> None:
        when = self._when()
        if when < self._end and self._queues():
            self._cm.reschedule(min(when + self._step_s, self._end))
            self._handle = self._arm()

    def cancel(self) -> None:
        self._handle.cancel()


async def first_byte(
    answer: Awaitable[T],
    bound_s: float,
    watch: SilenceWatch,
    engine_id: str,
    queues: Callable[[], bool] | None = None,
    longest_s: float = 0.0,
) -> T:
    """``answer``'s result, or ``asyncio.TimeoutError`` after ``bound_s``, or
    ``Silent`` once it waited ``SILENT_WAIT_S`` while ``engine_id`` has not reported
    for longer than its reports pause (``watch`` says so). ``answer`` runs in the caller's task,
    cancelled by whichever ends the wait, as ``asyncio.timeout`` does: a task of its
    own and ``asyncio.wait`` per request cost more CPU than all the rest of the wait.

    ``queues``: asked as ``bound_s`` runs out; True (the engine says requests wait for
    room there: this one most likely among them) waits another ``bound_s``, up to
    ``longest_s`` in all."""
    if bound_s <= SILENT_WAIT_S:
        async with timeout(bound_s):
            return await answer
    wait = watch.watch(engine_id)
    try:
        async with timeout(bound_s) as cm:
            if queues is None or longest_s <= bound_s:
                return await answer
            moving = _WhileQueued(cm, bound_s, queues, wait.since + longest_s)
            try:
                return await answer
            finally:
                moving.cancel()
    except asyncio.CancelledError:
        # the watch's cancel, unless another came too (the client left): that one wins
        uncancel = getattr(wait.task, "uncancel", None)  # (Python 3.10 has no counts)
        if wait.silent_s is not None and (uncancel is None or uncancel() == 0):
            raise Silent(wait.silent_s) from None
        raise
    finally:
        watch.forget(engine_id, wait)


async def within(answer: Awaitable[T], seconds: float | None) -> T:
    """``answer``'s result, or ``asyncio.TimeoutError`` after ``seconds``; with
    ``None`` no timer is set (for what has already arrived, as most short bodies
    and answers have: a timer per request is a measurable part of the gateway's CPU)."""
    if seconds is None:
        return await answer
    async with timeout(seconds):
        return await answer


class ChunkWatch:
    """A stream's bound on the wait for each next chunk: ``idle_s`` from when the wait
    began, never past ``end`` (loop time). While a wait is on, its task is cancelled
    once the bound passes; ``expired()`` then says the cancel was this watch's. One
    timer per stream, set again when it fires early, stands for a timer per chunk
    (``asyncio.timeout`` around each wait), which cost a tenth of a stream's CPU.

    ``queues``: asked when a wait reaches ``idle_s``; True (the engine says requests
    wait there while it steps: vLLM sends nothing for a request it preempted until it
    runs it again) waits another ``idle_s``, up to ``end``."""

    def __init__(self, idle_s: float, end: float, queues: Callable[[], bool] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task, self._idle_s, self._end = task, idle_s, end
        self._queues = queues
        self._since = self._loop.time()
        self._waiting = False
        self._fired = False
        self._timer = self._loop.call_at(min(self._since + idle_s, end), self._check)

    def wait(self) -> None:
        """A wait for a chunk begins."""
        self._since = self._loop.time()
        self._waiting = True

    def got(self) -> None:
        """The wait ended: the chunk came (writing it on is not bounded here)."""
        self._waiting = False

    def _check(self) -> None:
        now = self._loop.time()
        if self._waiting:
            due = min(self._since + self._idle_s, self._end)
            if now >= due and now < self._end and self._queues is not None and self._queues():
                due = min(now + self._idle_s, self._end)
            elif now >= due:
                self._fired = True
                self._task.cancel()
                return
        else:  # writing a chunk on: look again once a wait may have run out
            due = now + self._idle_s if now >= self._end else min(now + self._idle_s, self._end)
        self._timer = self._loop.call_at(due, self._check)

    def expired(self) -> bool:
        """Whether a CancelledError the task got is this watch's alone (another cancel,
        the client leaving, wins)."""
        if not self._fired:
            return False
        uncancel = getattr(self._task, "uncancel", None)  # (Python 3.10 has no counts)
        return uncancel is None or uncancel() == 0

    def silent_s(self) -> float:
        """How long the current wait for a chunk has lasted."""
        return self._loop.time() - self._since

    def close(self) -> None:
        """The stream ended: no more checks."""
        self._timer.cancel()
