"""A slow or frozen Redis never slows an engine: an engine loop of four reporters keeps
stepping while Redis is frozen (SIGSTOP) or paused for writes (CLIENT PAUSE WRITE).

The loop steps every 10 ms (a fixed cadence, no catch-up after a late step) and
reports each engine's counts after every step. For each disturbance the test checks
what happened, never how fast: every report() said "queued" (never a wait, never an
error), the loop stepped in every quarter of the disturbed window (a report() that
waited on the frozen Redis would hold it for the whole window), and after Redis
returns (waiting by state, polling Redis, with deadlines only as hang guards) every
engine's reports land and an unforced snapshot newer than any before the disturbance
follows. How fast is measured, not asserted: each report() call is timed with
time.perf_counter and the step rate compared with an undisturbed window just before;
the figures are printed (``pytest -q -s``) for docs/BENCHMARKS.md.

On a busy host the OS may preempt the engine thread in the middle of a call (tens
of ms with many runnable processes per core); such a call did not wait on
anything. Each call therefore also records the thread's context switches
(getrusage RUSAGE_THREAD): a call with involuntary switches and no voluntary one
was only preempted, never blocked (on a socket, a lock or the GIL): both worst
figures are printed, with and without such calls.

The test's own checks run in another thread of the same process, so a call may also
wait for the GIL while that thread holds it: up to the interpreter's switch interval,
5 ms by default, which alone would dominate the figure. The module lowers the interval
to 1 ms, so the figure measures the reporter, not the test's thread. Likewise a full
garbage collection of the test session's heap (hundreds of tests' objects) stops every
thread for milliseconds: the module freezes the objects that exist before it runs
(gc.freeze), so collections scan what the engine loop and its reporters make.
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from support.helpers import Barrier, wait_until

from redisbal import AsyncReporter, Counts, Reporter, Snapshot
from redisbal.keys import DeploymentKeys
from redisbal.reporting.sender import ReportSender
from redisbal.sim.embedded import RedisServer

pytestmark = pytest.mark.slow

ENGINES = 4
STEP_S = 0.01
FROZEN_S = 3.0
PAUSE_MS = 2000


@dataclass
class LoopLog:
    """What the engine loop saw: when each step ended and how long each report took."""

    steps: list[float] = field(default_factory=list)  # monotonic end of each step
    # (start, duration, preempted: involuntary context switches only, no voluntary one)
    calls: list[tuple[float, float, bool]] = field(default_factory=list)
    statuses: set[str] = field(default_factory=set)

    def timed(self, call: Callable[[], Any]) -> Any:
        ru0 = resource.getrusage(resource.RUSAGE_THREAD)
        t0 = time.perf_counter()
        out = call()
        took = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_THREAD)
        preempted = ru1.ru_nivcsw > ru0.ru_nivcsw and ru1.ru_nvcsw == ru0.ru_nvcsw
        self.calls.append((time.monotonic(), took, preempted))
        return out

    def steps_between(self, t0: float, t1: float) -> int:
        return sum(1 for t in self.steps if t0 <= t < t1)

    def worst_call_between(self, t0: float, t1: float, *, preempted: bool = False) -> float:
        """The longest call; by default among calls the OS did not merely preempt."""
        return max(
            (d for t, d, p in self.calls if t0 <= t < t1 and (preempted or not p)), default=0.0
        )

    def preempted_between(self, t0: float, t1: float) -> int:
        return sum(1 for t, _, p in self.calls if t0 <= t < t1 and p)


def _snapshot(c: redis.Redis, keys: DeploymentKeys) -> Snapshot | None:
    raw = c.get(keys.snapshot)
    return Snapshot.from_json(raw) if raw else None


def _engine_steps(c: redis.Redis, keys: DeploymentKeys) -> dict[str, int]:
    bar = Barrier(c, keys)
    return {f"e{i}": (bar.history(f"e{i}") or [-1])[0] for i in range(ENGINES)}


def _observer(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=10)


def _disturb_and_check(
    server: RedisServer, keys: DeploymentKeys, log: LoopLog, how: str
) -> dict[str, float]:
    """One disturbance ("sigstop" or "pause") while the loop runs; returns its figures."""
    c = _observer(server)
    window = FROZEN_S if how == "sigstop" else PAUSE_MS / 1000
    # an undisturbed window of the same length, just before
    t_calm = time.monotonic()
    time.sleep(window)
    t_start = time.monotonic()
    snap_before = _snapshot(c, keys)
    assert snap_before is not None
    steps_before = _engine_steps(c, keys)
    if how == "sigstop":
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        t_start = time.monotonic()
        try:
            time.sleep(window)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        t_back = time.monotonic()
    else:
        c.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        t_start = time.monotonic()
        # CLIENT PAUSE holds writes for PAUSE_MS from when the server ran it
        t_back = t_start + window
        time.sleep(max(0.0, t_back - time.monotonic()))
    wait_until(
        lambda: all(s > steps_before[e] for e, s in _engine_steps(c, keys).items()),
        10,
        "every engine's reports to resume",
        0.005,
    )
    seen_reports = time.monotonic()

    def newer_unforced() -> bool:
        snap = _snapshot(c, keys)
        return (
            snap is not None
            and not snap.forced
            and snap.cut > snap_before.cut
            and snap.version > snap_before.version
        )

    wait_until(newer_unforced, 10, "an unforced snapshot newer than before", 0.005)
    seen_snapshot = time.monotonic()
    c.close()
    calm_rate = log.steps_between(t_calm, t_calm + window) / window
    hit_rate = log.steps_between(t_start, t_start + window) / window
    quarter = window / 4
    return {
        "quarters_without_a_step": sum(
            1
            for i in range(4)
            if log.steps_between(t_start + i * quarter, t_start + (i + 1) * quarter) == 0
        ),
        "calm_steps_per_s": calm_rate,
        "disturbed_steps_per_s": hit_rate,
        "rate_ratio": hit_rate / calm_rate,
        "worst_call_ms_calm": 1000 * log.worst_call_between(t_calm, t_start),
        "worst_call_ms_disturbed": 1000 * log.worst_call_between(t_start, t_back),
        "worst_call_ms_disturbed_with_preempted": 1000
        * log.worst_call_between(t_start, t_back, preempted=True),
        "preempted_calls_disturbed": log.preempted_between(t_start, t_back),
        "reports_resumed_after_s": max(0.0, seen_reports - t_back),
        "snapshot_resumed_after_s": max(0.0, seen_snapshot - t_back),
    }


def _check(figures: dict[str, float], how: str) -> None:
    print(how, {k: round(v, 4) for k, v in figures.items()})
    # the engine loop kept stepping while Redis could not answer (the waits for the
    # reports and the snapshot to resume already passed): how fast is the benchmark's
    assert figures["quarters_without_a_step"] == 0, figures


def _run_scenario(server: RedisServer, keys: DeploymentKeys, log: LoopLog) -> None:
    c = _observer(server)
    wait_until(lambda: _snapshot(c, keys) is not None, 10, "a first snapshot")
    c.close()
    for how in ("sigstop", "pause"):
        _check(_disturb_and_check(server, keys, log, how), how)
    assert log.statuses <= {"queued"}, log.statuses  # never a wait, never an error


@pytest.fixture
def server(fresh_server: RedisServer) -> Iterator[RedisServer]:
    yield fresh_server
    if fresh_server.proc is not None and fresh_server.proc.poll() is None:
        os.kill(fresh_server.proc.pid, signal.SIGCONT)  # never leave it frozen


def _next_slot(due: float) -> tuple[float, float]:
    """(next due time, seconds to sleep): a step every STEP_S, and a late step makes no
    catch-up, so a blocked report() loses its steps for good, as it would in an engine."""
    now = time.monotonic()
    due += STEP_S
    return (due, due - now) if due > now else (now, 0.0)


def _blocking_loop(reps: list[Reporter], log: LoopLog, stop: threading.Event) -> None:
    step, due = 0, time.monotonic()
    while not stop.is_set():
        due, pause = _next_slot(due)
        time.sleep(pause)
        step += 1
        for i, rep in enumerate(reps):
            res = log.timed(lambda: rep.report(Counts(step=step, waiting=i, running=step % 7)))  # noqa: B023
            log.statuses.add(res.status)
        log.steps.append(time.monotonic())


@pytest.fixture(autouse=True)
def isolated_from_the_test_session() -> Iterator[None]:
    """A 1 ms GIL switch interval and a frozen session heap: see the module docstring."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        sys.setswitchinterval(before)


@pytest.mark.parametrize("shared", [False, True], ids=["default-sender", "given-sender"])
def test_blocking_reporters_never_wait_on_a_frozen_or_paused_redis(
    server: RedisServer, deployment: str, shared: bool
) -> None:
    """Four blocking reporters: by default they share the process's sender for their
    Redis URL; or one given explicitly."""
    keys = DeploymentKeys(deployment)
    sender = ReportSender(server.url, threaded=True) if shared else None
    reps = [Reporter(server.url, deployment, f"e{i}", sender=sender) for i in range(ENGINES)]
    assert all(rep.sender is reps[0].sender for rep in reps)
    log, stop = LoopLog(), threading.Event()
    loop = threading.Thread(target=_blocking_loop, args=(reps, log, stop), daemon=True)
    loop.start()
    try:
        _run_scenario(server, keys, log)
        stats = [rep.stats() for rep in reps]
        assert all(s.coalesced > 0 and s.unavailable > 0 for s in stats), stats
        # the engines travelled together: fewer round trips than steps
        assert reps[0].sender.batches < sum(s.queued for s in stats) / ENGINES, stats
    finally:
        stop.set()
        loop.join(5)
        for rep in reps:
            rep.close()
        if sender is not None:
            sender.close()


def _run_now(coro: Any) -> Any:
    """Await a coroutine that never suspends (a report(), which never waits) in place."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("report() suspended: it waited")


async def _async_loop(reps: list[AsyncReporter], log: LoopLog, stop: asyncio.Event) -> None:
    step, due = 0, time.monotonic()
    while not stop.is_set():
        due, pause = _next_slot(due)
        await asyncio.sleep(pause)
        step += 1
        for i, rep in enumerate(reps):
            # the coroutine's body runs at its first send; time that, as await would
            counts = Counts(step=step, waiting=i, running=step % 7)
            res = log.timed(lambda: _run_now(rep.report(counts)))  # noqa: B023
            log.statuses.add(res.status)
        log.steps.append(time.monotonic())


async def test_async_reporters_never_wait_on_a_frozen_or_paused_redis(
    server: RedisServer, deployment: str
) -> None:
    """Four asyncio reporters sharing one client, hence one sender, on the loop that
    runs the engine; the scenario's checks run in a thread so the loop stays free."""
    import redis.asyncio

    keys = DeploymentKeys(deployment)
    client = redis.asyncio.Redis.from_url(
        server.url, socket_connect_timeout=0.25, socket_timeout=1.0
    )
    reps = [
        AsyncReporter(deployment=deployment, engines=f"e{i}", client=client) for i in range(ENGINES)
    ]
    for rep in reps:
        await rep.register()
    log, stop = LoopLog(), asyncio.Event()
    engine: Awaitable[None] = asyncio.create_task(_async_loop(reps, log, stop))
    try:
        await asyncio.to_thread(_run_scenario, server, keys, log)
        stats = [rep.stats() for rep in reps]
        assert all(s.coalesced > 0 and s.unavailable > 0 for s in stats), stats
        assert reps[0].sender is reps[-1].sender
        assert reps[0].sender.batches < sum(s.queued for s in stats) / ENGINES
    finally:
        stop.set()
        await engine
        for rep in reps:
            await rep.aclose()
        await client.aclose()
