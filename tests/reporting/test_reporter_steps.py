"""Every lockstep step reaches Redis while Redis answers.

A lockstep engine that reports step 3 and then step 4 back-to-back must have its
step-3 counts in the step-3 snapshot: the barrier's cut takes each engine's latest
report at or before the step, so a step-3 report replaced by the step-4 one before
it was sent would leave the engine's step-2 counts in the step-3 snapshot.
Only what an outage or back-pressure holds back may be coalesced.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio
from support.helpers import await_until

from redisbal import (
    AsyncReporter,
    Counts,
    ReporterStats,
    Snapshot,
)
from redisbal.barrier.snapshot import Rosters
from redisbal.keys import DeploymentKeys
from redisbal.reporting.sender import ReportSender

ENGINES = ["e0", "e1", "e2"]


@contextlib.asynccontextmanager
async def _published(url: str, deployment: str) -> AsyncIterator[list[Snapshot]]:
    """Every snapshot published on the deployment's channel while inside."""
    client = redis.asyncio.Redis.from_url(url)
    pubsub = client.pubsub()
    await pubsub.subscribe(DeploymentKeys(deployment).channel)
    await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
    rosters, out = Rosters(), []

    async def run() -> None:
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is not None:
                out.append(Snapshot.from_json(msg["data"], rosters))

    feed = asyncio.create_task(run())
    try:
        yield out
    finally:
        feed.cancel()
        await asyncio.gather(feed, return_exceptions=True)
        await pubsub.aclose()
        await client.aclose()


def _counts(step: int, i: int) -> dict[str, int]:
    return {"step": step, "waiting": step * 10 + i, "running": step * 100 + i}


async def _assert_every_step(snaps: list[Snapshot], stats: list[ReporterStats]) -> None:
    """Steps 1..4 each have a snapshot holding every engine's counts of that step,
    and no report was coalesced."""
    await await_until(lambda: any(s.step == 4 for s in snaps))
    by_step = {s.step: s for s in snaps if not s.forced}
    for step in range(1, 5):
        snap = by_step.get(step)
        assert snap is not None, f"no step-{step} snapshot: {sorted(by_step)}"
        got = {e: (c.step, c.waiting, c.running) for e, c in snap.engines.items()}
        want = {e: (step, step * 10 + i, step * 100 + i) for i, e in enumerate(ENGINES)}
        assert got == want, f"step {step}"
    assert all(st.coalesced == 0 and st.accepted == 4 for st in stats), stats


async def test_batch_back_to_back_steps_each_reach_redis(redis_url: str, deployment: str) -> None:
    async with _published(redis_url, deployment) as snaps:
        rep = AsyncReporter(redis_url, deployment, ENGINES, heartbeat=False)
        try:
            await rep.register()
            # steps 1..4 of all three engines, back to back: the sender runs only after
            # the last (report_many without wait=True never suspends)
            for step in range(1, 5):
                await rep.report_many(
                    {e: Counts(**_counts(step, i)) for i, e in enumerate(ENGINES)}
                )
            assert await rep.flush(10.0)
            await _assert_every_step(snaps, [rep.stats(e) for e in rep.engines])
        finally:
            await rep.aclose()


async def test_engine_reporters_back_to_back_steps_each_reach_redis(
    redis_url: str, deployment: str
) -> None:
    """The same with one engine reporter per engine on one shared sender."""
    async with _published(redis_url, deployment) as snaps:
        sender = ReportSender(redis_url)
        reps = [
            AsyncReporter(deployment=deployment, engines=e, sender=sender, heartbeat=False)
            for e in ENGINES
        ]
        try:
            for r in reps:
                await r.register()
            for step in range(1, 5):
                for i, r in enumerate(reps):
                    r.report_nowait(Counts(**_counts(step, i)))
            for r in reps:
                assert await r.flush(10.0)
            await _assert_every_step(snaps, [r.stats() for r in reps])
        finally:
            for r in reps:
                await r.aclose()
            await sender.aclose()


async def test_back_pressure_coalesces_beyond_the_queue_and_counts_it(
    redis_url: str, deployment: str
) -> None:
    """More steps handed over than MAX_QUEUED before the sender runs (a Redis slower
    than the engine): the newest replaces the last one held, counted as coalesced."""
    from redisbal.reporting.lane import MAX_QUEUED

    rep = AsyncReporter(redis_url, deployment, "e0", heartbeat=False)
    try:
        extra = 4
        for step in range(1, MAX_QUEUED + extra + 1):
            rep.report_nowait(Counts(step=step, waiting=0, running=step))
        assert await rep.flush(10.0)
        st = rep.stats()
        assert (st.queued, st.coalesced, st.sent) == (MAX_QUEUED + extra, extra, MAX_QUEUED)
        assert st.accepted == MAX_QUEUED
    finally:
        await rep.aclose()
