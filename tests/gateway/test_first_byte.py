"""redisbal.gateway.first_byte: the wait for an engine's first byte ends with the
answer, at its bound, or early once the engine is silent; one watch checks silence for
every waiting request at once, and a wait that ends or is cancelled leaves nothing
behind in it. A stream's chunk watch bounds each wait for a chunk, never the writes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from support.helpers import make_snapshot

from redisbal.gateway.first_byte import (
    CHECK_EVERY_S,
    SILENT_WAIT_S,
    ChunkWatch,
    SilenceWatch,
    Silent,
    first_byte,
)
from redisbal.gateway.stream_watch import StreamWatch
from redisbal.routing.outcomes import SILENT_AFTER_S
from redisbal.routing.router_core import RouterCore


class Quiet:
    """``silent_s`` for a watch: engines named in ``silent`` have been silent for
    ``SILENT_AFTER_S``; counts the calls."""

    def __init__(self, *silent: str) -> None:
        self.silent = set(silent)
        self.calls = 0

    def __call__(self, engine_id: str) -> float:
        self.calls += 1
        return SILENT_AFTER_S if engine_id in self.silent else 0.0


async def answer_after(delay: float, value: str = "ok") -> str:
    await asyncio.sleep(delay)
    return value


async def test_an_answer_within_the_bound_is_returned_and_nothing_stays_watched() -> None:
    watch = SilenceWatch(Quiet())
    assert await first_byte(answer_after(0.0), 5.0, watch, "0") == "ok"
    assert await first_byte(answer_after(SILENT_WAIT_S + 0.05), 5.0, watch, "0") == "ok"
    assert watch.waiting() == 0


async def test_the_bound_ends_the_wait_on_an_engine_that_still_reports() -> None:
    watch = SilenceWatch(Quiet())
    slow = asyncio.ensure_future(answer_after(60.0))
    with pytest.raises(asyncio.TimeoutError):
        await first_byte(slow, SILENT_WAIT_S + 0.1, watch, "0")
    assert slow.cancelled()  # the request is dropped, not left running
    assert watch.waiting() == 0
    with pytest.raises(asyncio.TimeoutError):  # a bound below SILENT_WAIT_S: one wait
        await first_byte(answer_after(60.0), 0.01, watch, "0")


async def test_an_engine_that_queues_is_waited_for_past_the_bound_up_to_the_longest() -> None:
    watch = SilenceWatch(Quiet())
    bound = SILENT_WAIT_S + 0.05
    # requests wait there (this one among them): its answer after 3 bounds is taken
    got = await first_byte(answer_after(3 * bound), bound, watch, "0", lambda: True, 60.0)
    assert got == "ok"
    # not past the longest wait
    with pytest.raises(asyncio.TimeoutError):
        await first_byte(answer_after(60.0), bound, watch, "0", lambda: True, 2 * bound)
    # an engine that does not queue: the bound ends the wait, as without the question
    asked: list[int] = []

    def queues() -> bool:
        asked.append(1)
        return False

    with pytest.raises(asyncio.TimeoutError):
        await first_byte(answer_after(3 * bound), bound, watch, "0", queues, 60.0)
    assert asked == [1]
    assert watch.waiting() == 0


async def test_a_silent_engine_ends_the_wait_long_before_its_bound() -> None:
    quiet = Quiet("hung")
    watch = SilenceWatch(quiet)
    with pytest.raises(Silent) as err:
        await first_byte(answer_after(60.0), 60.0, watch, "hung")  # (the test's timeout)
    assert err.value.silent_s == SILENT_AFTER_S
    assert watch.waiting() == 0
    # a request to another, healthy engine is unaffected
    assert await first_byte(answer_after(SILENT_WAIT_S + 2 * CHECK_EVERY_S), 60.0, watch, "0")


async def test_one_check_per_engine_serves_every_waiting_request() -> None:
    quiet = Quiet()
    watch = SilenceWatch(quiet)
    waits = [
        asyncio.ensure_future(first_byte(answer_after(SILENT_WAIT_S + 0.3), 60.0, watch, "0"))
        for _ in range(100)
    ]
    await asyncio.sleep(SILENT_WAIT_S + 0.1)
    assert watch.waiting() == 100
    assert await asyncio.gather(*waits) == ["ok"] * 100
    # each check asks once for engine "0", however many requests wait on it: a poll per
    # request would have asked 100 times per check
    assert 1 <= quiet.calls < 100
    assert watch.waiting() == 0
    await asyncio.sleep(2 * CHECK_EVERY_S)
    calls = quiet.calls
    await asyncio.sleep(3 * CHECK_EVERY_S)
    assert quiet.calls == calls  # nobody waits: the timer stopped


async def test_a_cancelled_wait_cancels_its_request_and_forgets_its_watch() -> None:
    watch = SilenceWatch(Quiet())
    inner = asyncio.ensure_future(answer_after(60.0))
    outer = asyncio.ensure_future(first_byte(inner, 60.0, watch, "0"))
    await asyncio.sleep(SILENT_WAIT_S + 0.1)
    assert watch.waiting() == 1
    outer.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert inner.cancelled()
    assert watch.waiting() == 0


async def test_a_client_leaving_as_the_engine_is_found_silent_is_a_cancel_not_silent() -> None:
    # the watch's cancel and the client's arrive together: the wait must end as the
    # client's cancel (the handler's task is going away), not turn into a retry
    quiet = Quiet()
    watch = SilenceWatch(quiet)
    outer = asyncio.ensure_future(first_byte(answer_after(60.0), 60.0, watch, "hung"))
    await asyncio.sleep(SILENT_WAIT_S + 0.01)
    quiet.silent.add("hung")  # it stops reporting, and in the same tick:
    watch._check(asyncio.get_running_loop())  # the watch's turn (cancels the wait)
    outer.cancel()  # and the client's
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert watch.waiting() == 0


async def _stream(
    idle_s: float,
    end: float,
    gaps: list[float],
    write_s: float = 0.0,
    queues: Callable[[], bool] | None = None,
) -> int:
    """Chunks that come ``gaps`` apart, each written on in ``write_s``, under a chunk
    watch of ``idle_s`` and ``end`` (and ``queues``): how many came before the watch cut
    a wait (CancelledError where the cancel is not the watch's alone)."""
    watch = ChunkWatch(idle_s, end, queues)
    got = 0
    try:
        for gap in gaps:
            watch.wait()
            try:
                await asyncio.sleep(gap)
            except asyncio.CancelledError:
                if not watch.expired():
                    raise
                return got
            watch.got()
            got += 1
            await asyncio.sleep(write_s)
        return got
    finally:
        watch.close()


async def test_a_chunk_watch_cuts_a_silent_wait_and_never_a_write() -> None:
    now = asyncio.get_running_loop().time
    # chunks flowing for longer than the idle bound: none is cut
    assert await _stream(1.0, now() + 60, [0.05] * 30) == 30
    # a wait past the bound is cut, the chunks before it came
    assert await _stream(0.2, now() + 60, [0.01, 0.01, 30.0]) == 2
    # writes (a slow client) take far longer than the bound: not cut
    assert await _stream(0.1, now() + 60, [0.01] * 3, write_s=0.4) == 3
    # the end bounds the whole stream however fast its chunks come
    assert await _stream(30.0, now() + 0.3, [0.02] * 1000) < 1000


async def test_a_silent_stream_of_an_engine_that_queues_is_waited_for_until_it_stops() -> None:
    now = asyncio.get_running_loop().time
    # the engine says requests wait there (a preempted stream): waited for past the bound
    assert await _stream(0.1, now() + 60, [0.01, 0.5, 0.01], queues=lambda: True) == 3
    # ... within the whole-response bound
    assert await _stream(0.1, now() + 0.3, [0.01, 30.0], queues=lambda: True) == 1
    # it stops queueing (or is marked): the next bound cuts the wait
    asked: list[float] = []

    def queues() -> bool:
        asked.append(now())
        return len(asked) < 3

    assert await _stream(0.1, now() + 60, [0.01, 30.0], queues=queues) == 1
    assert len(asked) == 3  # asked at each bound, cut at the first "no"
    # an engine that does not queue: cut at the bound, as without the question
    assert await _stream(0.1, now() + 60, [0.01, 30.0], queues=lambda: False) == 1


async def test_a_client_leaving_during_a_chunk_wait_is_its_cancel_not_the_watch() -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(_stream(30.0, loop.time() + 60, [30.0]))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the client leaves as the watch fires (both cancels land before the task runs):
    # the client's cancel wins
    end = loop.time() + 0.2
    task = asyncio.ensure_future(_stream(30.0, end, [30.0]))
    loop.call_at(end, task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task


class Deployment:
    """A router's view of engines a-d, fed snapshots every 100 ms (Redis time) as
    a coordinator's stall guard forces them while an engine does not report."""

    def __init__(self) -> None:
        self.core = RouterCore(clock=lambda: 0.0)
        self.ms, self.step, self.version = 1_000_000, 1, 0

    def _adopt(self, **fields: Any) -> None:
        self.version += 1
        engines = {e: (0, 1) for e in "abcd"}
        snap = make_snapshot(
            engines, time_ms=self.ms, step=self.step, version=self.version, **fields
        )
        assert self.core.apply_snapshot(snap)

    def complete(self) -> None:
        """Every engine reported: a snapshot at a new cut."""
        self.ms += 100
        self.step += 1
        self._adopt()

    def pause(self, engine: str, ms: int) -> None:
        """``engine`` does not report for ``ms``: forced snapshots at the same cut."""
        for age in range(100, ms + 1, 100):
            self.ms += 100
            self._adopt(forced=True, laggards={engine: age})


class Later:
    """The event loop as a SilenceWatch sees it, ``ahead`` seconds later: the check
    runs on this clock, not on the test's timing."""

    def __init__(self, ahead: float) -> None:
        self.now = asyncio.get_running_loop().time() + ahead

    def time(self) -> float:
        return self.now

    def call_later(self, _delay: float, *_args: Any) -> None:
        return None


async def given_up(dep: Deployment, engine: str) -> bool:
    """Whether a request that waited 1 s on ``engine`` with no answer is given up by
    the gateway's rule, as the router sees the deployment now."""
    core = dep.core
    watch = SilenceWatch(lambda e: core.silent_ms(e) / 1000.0, core.silent_after_s)
    wait = asyncio.ensure_future(first_byte(asyncio.sleep(60.0), 60.0, watch, engine))
    await asyncio.sleep(0)  # it waits
    watch._check(Later(1.0))  # type: ignore[arg-type]
    for _ in range(3):  # (a cancel takes a turn of the loop to land)
        await asyncio.sleep(0)
    if wait.done():
        assert isinstance(wait.exception(), Silent)
        return True
    wait.cancel()
    with pytest.raises(asyncio.CancelledError):
        await wait
    return False


async def test_a_slow_engine_that_still_reports_is_not_given_up_a_stopped_one_is() -> None:
    """Deterministic: what the snapshots say, not the test's timing. An engine whose
    reports pause 1.4 s at a time (long steps) and now paused 1.2 s is slow: a request
    waiting on it waits on. One that usually takes 1.5 s to a first byte is slow too
    after 0.6 s without a report. An engine that reported at once every time and
    answered fast, and has not reported for 0.6 s, nor answered: stopped, and given
    up. One that answered nothing yet (a fresh server) has 2 s: its pace is unknown."""
    dep = Deployment()
    for _ in range(4):
        dep.pause("a", 1400)
        dep.complete()
    for eid in "ab":
        dep.core.outcomes.answered(eid, 0.0, 0.01)
    dep.core.outcomes.answered("c", 0.0, 1.5)
    dep.pause("a", 1200)
    assert await given_up(dep, "a") is False
    dep.complete()
    dep.pause("b", 600)
    assert await given_up(dep, "b") is True
    dep.complete()
    dep.pause("d", 600)
    assert await given_up(dep, "d") is False
    dep.complete()
    dep.pause("d", 2100)
    assert await given_up(dep, "d") is True
    dep.complete()
    dep.pause("c", 600)
    assert await given_up(dep, "c") is False
    dep.complete()
    dep.pause("a", 5000)  # a stopped slow engine: given up after 3 x its usual pause
    assert await given_up(dep, "a") is True


def test_an_engine_that_streams_slowly_is_given_longer_without_a_report() -> None:
    """Each chunk is a step: an engine whose streams' chunks come a second apart steps
    that slowly, and its reports pause as long while it is alive. Its silence bound is
    3 x its usual gap (at most 10 s); an engine streaming fast keeps the router's."""

    class Router:
        def silent_after_s(self, _engine: str) -> float:
            return SILENT_AFTER_S

    watch = StreamWatch(Router())  # type: ignore[arg-type]
    for engine, gap in (("slow", 1.0), ("fast", 0.02), ("stuck", 30.0)):
        s = watch.gaps.opened(engine, 0.0)
        for i in range(1, 9):
            watch.gaps.chunk(s, i * gap)
    assert watch.silent_after_s("slow") == pytest.approx(3.0)
    assert watch.silent_after_s("fast") == SILENT_AFTER_S
    assert watch.silent_after_s("stuck") == 10.0
    assert watch.silent_after_s("unknown") == SILENT_AFTER_S
