"""One process reporting two deployments of a Redis Cluster: one's primary is killed.

The reports of both go through one ``ReportSender``. The victim's engines report a
step every ``step_s`` (an engine's own cadence); the other deployment's engines
step as fast as their barrier allows: each step is reported by both engines with
``wait=True`` and the next starts once both are accepted, so every completed step
is a published snapshot. How many steps the other deployment completes while the
victim's primary is dead, and its longest pause, say whether it waited on the
victim. ``scripts/bench_isolation.py`` measures this; tests/processes/test_failover.py runs it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redisbal.reporting.reporter import AsyncReporter, Counts
from redisbal.reporting.sender import ReportSender

ENGINES = ("e0", "e1")


@dataclass
class Isolation:
    """What one run saw (monotonic times relative to the kill)."""

    promoted_s: float = 0.0  # kill -> the victim's slot has a new primary
    victim_back_s: float = 0.0  # kill -> the victim's next accepted report
    other_steps_while_down: int = 0  # the other's snapshots between kill and promotion
    other_max_gap_s: float = 0.0  # the other's longest pause from kill to victim_back_s
    other_failed: int = 0  # the other's reports not accepted (unavailable, ...)
    load_avg: tuple[float, float, float] = (0.0, 0.0, 0.0)
    other_done: list[float] = field(default_factory=list, repr=False)


async def run_isolation(
    url: str,
    victim: str,
    other: str,
    kill: Callable[[], None],
    promoted: Callable[[], bool],
    *,
    step_s: float = 0.05,
    warmup_s: float = 1.0,
    timeout_s: float = 30.0,
) -> Isolation:
    """Kill the victim's primary (``kill``) while both deployments report; returns once
    the victim's reports are accepted again (``promoted`` tells when the slot moved)."""
    sender = ReportSender(url)
    victims = [AsyncReporter(deployment=victim, engines=e, sender=sender) for e in ENGINES]
    others = [AsyncReporter(deployment=other, engines=e, sender=sender) for e in ENGINES]
    out = Isolation()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def victim_loop() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            for rep in victims:
                rep.report_nowait(Counts(step=step, waiting=0, running=1))
            await asyncio.sleep(step_s)

    async def other_loop() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            outs = await asyncio.gather(
                *(rep.report(Counts(step=step, waiting=0, running=1), wait=True) for rep in others)
            )
            if all(o.accepted for o in outs):
                out.other_done.append(time.monotonic())
            else:
                out.other_failed += 1
                await asyncio.sleep(step_s)

    for rep in (*victims, *others):
        await rep.register(wait=True)
    tasks = [asyncio.create_task(victim_loop()), asyncio.create_task(other_loop())]
    try:
        await asyncio.sleep(warmup_s)
        await loop.run_in_executor(None, kill)
        t_kill = time.monotonic()
        deadline = t_kill + timeout_s
        while not await loop.run_in_executor(None, promoted):
            if time.monotonic() > deadline:
                raise TimeoutError("the victim's replica was not promoted")
            await asyncio.sleep(0.05)
        t_promoted = time.monotonic()
        while True:
            res = await victims[0].report(Counts(step=10**6, waiting=0, running=1), wait=True)
            if res.accepted or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        t_back = time.monotonic()
        if not res.accepted:
            raise TimeoutError("the victim's reports were not accepted after the failover")
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rep in (*victims, *others):
            await rep.aclose(leave=False, timeout=0.5)
        await sender.aclose()
    done = [t for t in out.other_done if t_kill <= t <= t_back]
    out.promoted_s, out.victim_back_s = t_promoted - t_kill, t_back - t_kill
    out.other_steps_while_down = sum(1 for t in done if t <= t_promoted)
    times = [t_kill, *done, t_back]
    out.other_max_gap_s = max(b - a for a, b in itertools.pairwise(times))
    out.load_avg = os.getloadavg()
    return out
