"""One process reporting two deployments of a Redis Cluster: one's primary is killed.

The reports of both go through one ``ReportSender``. The victim's engines report a
step every ``step_s`` (an engine's own cadence); the other deployment's engines
step as fast as their barrier allows: each step is reported by both engines with
``wait=True`` and the next starts once both are accepted, so every completed step
is a published snapshot. How many steps the other deployment completes while the
victim's primary is dead, and its longest pause, say whether it waited on the
victim. ``scripts/bench_isolation.py`` measures this; tests/processes/test_failover.py runs it.

``run_one_loop`` is the same failover as an application holding both deployments
sees it: a router for each, and one loop (a thread, or a task) reporting every
engine of both in turn with ``wait=True``. The other's snapshots are counted where
they arrive, at its router. tests/processes/test_shard_isolation.py runs it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from redisbal.errors import InvalidArgument
from redisbal.reporting.reporter import AsyncReporter, Counts, Reporter
from redisbal.reporting.sender import ReportSender
from redisbal.routing.router import AsyncRouter, Router

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
        t_kill, t_promoted = await _fail_over(kill, promoted, timeout_s)
        deadline = t_kill + timeout_s
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


# -- the same failover seen by an application: routers, and one loop reporting every engine --


@dataclass
class OneLoop:
    """What one run of ``run_one_loop`` saw (seconds; monotonic times relative to the kill)."""

    kind: str  # "blocking" (Router, Reporter, a thread) or "async" (AsyncRouter, AsyncReporter)
    cadence_s: float = 0.0  # the other's median gap between adopted snapshots before the kill
    other_max_gap_s: float = 0.0  # its longest gap from the kill to the victim's return
    other_snapshots: int = 0  # the snapshots its router adopted in that time
    slowest_report_s: float = 0.0  # the reporting loop's longest report() call after the kill
    promoted_s: float = 0.0  # kill -> the victim's slot has a new primary
    victim_back_s: float = 0.0  # kill -> the victim's router adopts a snapshot again
    load_avg: tuple[float, float, float] = (0.0, 0.0, 0.0)


def _stamp(core: Any, into: list[float]) -> None:
    """Record when ``core`` adopts a snapshot."""
    adopt = core.apply_snapshot

    def apply_snapshot(snap: Any) -> bool:
        adopted = bool(adopt(snap))
        if adopted:
            into.append(time.monotonic())
        return adopted

    core.apply_snapshot = apply_snapshot


async def run_one_loop(
    url: str,
    victim: str,
    other: str,
    kill: Callable[[], None],
    promoted: Callable[[], bool],
    *,
    kind: str = "blocking",
    step_s: float = 0.05,
    warmup_s: float = 2.0,
    timeout_s: float = 30.0,
) -> OneLoop:
    """The setup of an application that holds both deployments: a router for each, and
    one loop (a thread for ``Reporter``, a task for ``AsyncReporter``) that reports
    every engine of both in turn, each report with ``wait=True``, one step every
    ``step_s``. The victim's primary is killed; the other deployment's snapshots, as its
    router adopts them, should keep their cadence."""
    if kind not in ("blocking", "async"):
        raise InvalidArgument(f"kind must be 'blocking' or 'async', got {kind!r}")
    loop = asyncio.get_running_loop()
    adopted: dict[str, list[float]] = {victim: [], other: []}
    calls: list[tuple[float, float]] = []  # (start, seconds) of each report() call
    stop = threading.Event()
    deps = (victim, other)
    routers: list[Any]
    if kind == "blocking":
        routers = [Router(url, d) for d in deps]
        reporters: list[Any] = [Reporter(url, d, e) for d in deps for e in ENGINES]
    else:
        routers = [AsyncRouter(url, d) for d in deps]
        reporters = [AsyncReporter(url, d, e) for d in deps for e in ENGINES]
    for router, d in zip(routers, deps, strict=True):
        _stamp(router.core, adopted[d])

    def blocking_loop() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            started = time.monotonic()
            for rep in reporters:
                t = time.monotonic()
                rep.report(Counts(step=step, waiting=0, running=1), wait=True)
                calls.append((t, time.monotonic() - t))
            time.sleep(max(0.0, step_s - (time.monotonic() - started)))

    async def async_loop() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            started = time.monotonic()
            for rep in reporters:
                t = time.monotonic()
                await rep.report(Counts(step=step, waiting=0, running=1), wait=True)
                calls.append((t, time.monotonic() - t))
            await asyncio.sleep(max(0.0, step_s - (time.monotonic() - started)))

    if kind == "blocking":
        for router in routers:
            await loop.run_in_executor(None, router.start, 2.0)
        reporting: Any = loop.run_in_executor(None, blocking_loop)
    else:
        for router in routers:
            await router.start(2.0)
        for rep in reporters:
            await rep.register(wait=True)
        reporting = asyncio.create_task(async_loop())
    try:
        await asyncio.sleep(warmup_s)
        t_kill, t_promoted = await _fail_over(kill, promoted, timeout_s)
        deadline = t_kill + timeout_s
        while not any(t > t_promoted for t in adopted[victim]):
            if time.monotonic() > deadline:
                raise TimeoutError("the victim's router adopted no snapshot after the failover")
            await asyncio.sleep(0.02)
        t_back = time.monotonic()
    finally:
        stop.set()
        await asyncio.gather(reporting, return_exceptions=True)
        for rep in reporters:
            if kind == "blocking":
                await loop.run_in_executor(None, partial(rep.close, leave=False, timeout=0.5))
            else:
                await rep.aclose(leave=False, timeout=0.5)
        for router in routers:
            if kind == "blocking":
                await loop.run_in_executor(None, router.close)
            else:
                await router.aclose()
    before = [t for t in adopted[other] if t_kill - warmup_s / 2 <= t < t_kill]
    during = [t for t in adopted[other] if t_kill <= t <= t_back]
    out = OneLoop(kind)
    out.cadence_s = statistics.median(b - a for a, b in itertools.pairwise(before))
    out.other_max_gap_s = max(b - a for a, b in itertools.pairwise([t_kill, *during, t_back]))
    out.other_snapshots = len(during)
    out.slowest_report_s = max((d for t, d in calls if t >= t_kill), default=0.0)
    out.promoted_s, out.victim_back_s = t_promoted - t_kill, t_back - t_kill
    out.load_avg = os.getloadavg()
    return out


async def _fail_over(
    kill: Callable[[], object], promoted: Callable[[], bool], timeout_s: float
) -> tuple[float, float]:
    """Kill the victim's primary and wait for its replica's promotion (off the loop:
    both block); returns when each happened (monotonic)."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, kill)
    t_kill = time.monotonic()
    while not await loop.run_in_executor(None, promoted):
        if time.monotonic() > t_kill + timeout_s:
            raise TimeoutError("the victim's replica was not promoted")
        await asyncio.sleep(0.05)
    return t_kill, time.monotonic()
