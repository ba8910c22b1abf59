"""The report sender: carries the reports of one or many engines, one asyncio task per
deployment.

A reporter never waits on Redis: ``report()`` checks the counts, puts them in its
engine's slot (a ``Lane``) and returns. Each deployment's task takes every slot of
that deployment that holds something, sends it all in one round trip (a pipeline
of report calls; one call when it holds one engine) and starts again; a heartbeat
re-sends an engine's latest counts when it has not reported for ``heartbeat_s``.
Deployments do not wait for each other: each has its own task, back-off and (on a
Redis Cluster, where one deployment's primary may fail over while the others' do
not) its own client.

Order and coalescing, per engine:
- while Redis answers, each lockstep step handed over is sent, in order (the
  step-S snapshot holds every engine's step-S counts); during an outage, or
  when ``MAX_QUEUED`` reports of an engine are held (Redis slower than the
  engine's steps), in tick mode and for a re-report of one step, newer counts
  replace the last unsent ones (counted as ``coalesced``), so nothing queues up
  however long Redis is away, and a send carries the freshest counts;
- a lockstep report whose (wave, step) is older than the engine's newest one
  handed over is refused at once as ``stale`` (the barrier would refuse it
  too), so the sender never sends an older tag after a newer one;
- sends are sequential: a round trip ends (delivered or failed) before the next
  starts, and a failed report goes back to its slot only if nothing newer came.

Coalescing never makes the barrier miss a step it waits for: the barrier
publishes step S once every member has reported a step >= S, and a report is
replaced by one with a step >= its own, which satisfies the same wait. The
replaced step's snapshot then holds the engine's counts of an earlier step,
which is why it happens only when Redis cannot take every step.

Failures: an outage (refused, reset, timed out) fails the round; the sender
backs off (``backoff_s`` doubling to ``max_backoff_s``, on a Redis Cluster to
at most ``CLUSTER_MAX_BACKOFF_S``, measured from the
start of the failed attempt, so a call that already waited out a timeout is
retried at once) and retries; callers never retry. While the outage lasts (from
a failed round to the next one answered) a report handed over with ``wait=True`` is
answered "unavailable" at once: it is kept and retried, and a caller that reports
several deployments from one thread never waits on one deployment's dead shard.
The sender's cluster clients do not retry by themselves (redis-py's retries sleep
up to a second each), so a round on a dead primary fails as soon as it is refused.
An error that is not an outage (a permission the user lacks) is counted and
logged, not retried.
Warnings are rate-limited: one when Redis goes away, one a minute while it
stays away, one when it is back.

The module holds the sender whole: its deployments' state (``Group``) and the Redis
I/O of a round (``round_trip``: the calls it makes, pipelined or one at a time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions

from redisbal.background import BackgroundLoop
from redisbal.barrier.operations import Scripts, report_reply
from redisbal.connection import (
    OUTAGE_ERRORS,
    is_cluster,
    make_client,
    redact,
    refresh_slots,
)
from redisbal.errors import InvalidArgument, InvalidState
from redisbal.keys import DeploymentKeys
from redisbal.reporting.lane import MAX_QUEUED, Lane, Pending, ReportResult, Tag, tag_of

log = logging.getLogger("redisbal.reporting.reporter")  # (its warnings are the reporter's)
WARN_EVERY_S = 60.0
# how often an engine's URL is written again: it comes back within this after a
# state loss (restart without persistence, flush, failover to a lagging replica)
URL_REFRESH_S = 5.0

MAX_BATCH = 256
# the longest back-off on a Redis Cluster: a failover hands a dead primary's slots to
# its replica within a few seconds, and the sender's own retries (its clients make
# none) are what find the promoted replica, so they come at least this often
CLUSTER_MAX_BACKOFF_S = 0.4


@dataclass(eq=False)
class Group:
    """One deployment's engines in a sender: its task, its back-off and its client.
    Every field is guarded by the sender's lock."""

    deployment: str
    client: Any
    owns_client: bool
    lanes: list[Lane] = field(default_factory=list)
    rr: int = 0
    wake: asyncio.Event | None = None
    task: asyncio.Task[None] | None = None
    idle: bool = False
    failures: int = 0
    down_until: float = 0.0
    down_since: float | None = None
    warned_at: float = 0.0
    starting: bool = False  # a start of the task is scheduled on the sender's loop

    def out(self, now: float) -> bool:
        """Whether the deployment's Redis is out: backing off, or retrying after a failed
        round and not answered since. A report waited for then is answered "unavailable"
        at once (it is kept and retried): a retry may wait out a refresh of the slot
        map or a timeout, and a caller reporting several deployments from one thread
        would wait with it (caller holds the lock)."""
        return now < self.down_until or self.down_since is not None

    def log_health(self, outage: BaseException | None, now: float, url: str) -> None:
        """Rate-limited warnings on the deployment's Redis: one when it goes away, one a
        minute while it stays away, one when it is back (caller holds the lock)."""
        if outage is not None:
            if self.down_since is None:
                self.down_since = self.warned_at = now
                log.warning(
                    "Redis unavailable (%s, deployment %s): %s; reports are kept (the newest "
                    "per engine) and retried",
                    url,
                    self.deployment,
                    type(outage).__name__,
                )
            elif now - self.warned_at >= WARN_EVERY_S:
                self.warned_at = now
                log.warning(
                    "Redis still unavailable (%s, deployment %s) after %.0f s; %d reports "
                    "coalesced so far",
                    url,
                    self.deployment,
                    now - self.down_since,
                    sum(lane.counts["coalesced"] for lane in self.lanes),
                )
        elif self.down_since is not None:
            log.warning(
                "Redis reachable again after %.1f s (%s, deployment %s)",
                now - self.down_since,
                url,
                self.deployment,
            )
            self.down_since, self.failures, self.down_until = None, 0, 0.0
        else:
            self.failures = 0


def _resolve(waiters: list[Any], value: Any) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(value)


class ReportSender:
    """Sends the reports of the engines attached to it, over one asyncio client.

    Share one between many reporters of a process (``sender=``) and their reports
    travel together, one round trip per deployment and round. ``threaded=True`` runs
    it on its own event loop in a daemon thread (what ``Reporter`` needs); otherwise it
    runs on the event loop of the first reporter that uses it. ``batch=True`` sends the
    reports of one deployment in one lua/report_many.lua call per round (what the
    senders a reporter makes use) instead of one report call each.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        client: Any = None,
        threaded: bool = False,
        backoff_s: float = 0.2,
        max_backoff_s: float = 1.0,
        timeout_s: float = 1.0,
        batch: bool = False,
    ) -> None:
        if client is None:
            if not redis_url:
                raise InvalidArgument("give a redis_url (or client=)")
            self.timeout_s = timeout_s
            client = self._make_client(redis_url)
            self._owns_client = True
        elif not inspect.iscoroutinefunction(getattr(client, "execute_command", None)):
            raise InvalidArgument("a ReportSender needs an asyncio client (redis.asyncio)")
        else:
            self._owns_client = False
        self.client = client
        self.url = redact(redis_url or "")
        self.pubcmd = "SPUBLISH" if is_cluster(client) else "PUBLISH"
        self._cluster = is_cluster(client)
        self.backoff_s = backoff_s
        self.max_backoff_s = max(max_backoff_s, backoff_s)
        self.timeout_s = timeout_s
        self.batch = batch
        self.batches = 0  # round trips made
        self.failed_batches = 0
        self._lock = threading.Lock()
        self._redis_url = redis_url
        self._groups: dict[str, Group] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self.closed = False
        self._users = 0
        self._pid = os.getpid()
        self.background = BackgroundLoop("redisbal-report-sender") if threaded else None

    def _make_client(self, redis_url: str) -> Any:
        # no cluster retries: the sender retries (its back-off) and refreshes the slot
        # map after an outage itself; redis-py's own cluster retries sleep about a
        # second between attempts, so a report on a dead primary took 2 s to fail, and
        # a caller waiting on it (one thread reporting every deployment) waited too
        return make_client(
            redis_url,
            asyncio=True,
            cluster_retries=0,
            socket_connect_timeout=0.25,
            socket_timeout=self.timeout_s,
        )

    @classmethod
    def for_url(cls, redis_url: str | None, **kwargs: Any) -> ReportSender:
        """The process-wide sender for ``redis_url`` (and these options), made on first
        use: blocking reporters of one process share it, one thread and one round trip
        per round for all their engines. Each call counts a user; see ``release``."""
        key = (redis_url, tuple(sorted(kwargs.items())))
        with _REGISTRY_LOCK:
            sender = _BY_URL.get(key)
            # a forked child inherits the registry, not the parent's sender thread
            if sender is None or sender.closed or sender._pid != os.getpid():
                sender = cls(redis_url, **kwargs)
                _BY_URL[key] = sender
            sender._users += 1
            return sender

    def release(self) -> bool:
        """One user of a ``for_url`` sender is done; True when it was the last (the caller
        then closes the sender)."""
        with _REGISTRY_LOCK:
            self._users -= 1
            if self._users > 0:
                return False
            for key, sender in list(_BY_URL.items()):
                if sender is self:
                    del _BY_URL[key]
            self.closed = True  # no new users; close() still runs the shutdown
            return True

    @classmethod
    def for_client(cls, client: Any, **kwargs: Any) -> ReportSender:
        """The sender of ``client``: reporters made with one client share one sender."""
        sender = _SHARED.get(id(client))
        if sender is None or sender.client is not client or sender.closed:
            sender = cls(client=client, **kwargs)
            _SHARED[id(client)] = sender
        return sender

    def client_for(self, deployment: str) -> Any:
        """The client that deployment's reports go through."""
        with self._lock:
            return self._group(deployment).client

    def scripts_for(self, keys: DeploymentKeys) -> Scripts:
        """The operations of deployment ``keys`` on the client its reports go through."""
        return Scripts(self.client_for(keys.deployment), keys, self.pubcmd)

    def _group(self, deployment: str) -> Group:
        """The deployment's group, made on first use (caller holds the lock). On a
        cluster each group has a client of its own when the sender made its client: a
        failed call on one primary makes redis-py's cluster client rebuild its slot map
        before its next call, whatever slot that call is for."""
        group = self._groups.get(deployment)
        if group is None:
            client, owns = self.client, False
            if self._cluster and self._owns_client and self._groups and self._redis_url:
                client, owns = self._make_client(self._redis_url), True
            group = self._groups[deployment] = Group(deployment, client, owns)
        return group

    def _group_of(self, lane: Lane) -> Group:
        return self._group(lane.scripts.keys.deployment)

    # -- hand-over (any thread; never waits) --------------------------------------------------

    def attach(self, lane: Lane) -> None:
        with self._lock:
            if self.closed:
                raise InvalidState("this ReportSender is closed")
            self._group_of(lane).lanes.append(lane)

    def detach(self, lane: Lane) -> None:
        """Take the engine off the sender; what it still held is dropped (counted)."""
        with self._lock:
            lane.attached = False
            lanes = self._group_of(lane).lanes
            if lane in lanes:
                lanes.remove(lane)
            self._drop(lane)
            _resolve(lane.register_waiters, False)
            lane.register_waiters, lane.register = [], False

    def submit(
        self,
        lane: Lane,
        args: list[str],
        tag: Tag | None,
        want_future: bool,
        *,
        first: bool = False,
    ) -> ReportResult | concurrent.futures.Future[ReportResult]:
        """Queue one report (validated by the caller); see the module docstring.
        ``first``: only if the engine has reported nothing yet (else "stale")."""
        wave, step = tag or (0, 0)
        with self._lock:
            if not lane.attached:
                lane.counts["dropped"] += 1
                return ReportResult("unavailable", 0, wave, step)
            if first and lane.last_args is not None:
                return ReportResult("stale", 0, wave, step)
            if tag is not None and lane.newest is not None and tag < lane.newest:
                lane.counts["stale"] += 1
                return ReportResult("stale", 0, wave, step)
            lane.counts["queued"] += 1
            lane.paused, lane.submitted = False, time.monotonic()
            group = self._group_of(lane)
            held = self._hold(lane, args, tag, group)
            lane.last_args = args
            if tag is not None:
                lane.newest = tag
            out: ReportResult | concurrent.futures.Future[ReportResult]
            if not want_future:
                out = ReportResult("queued", 0, wave, step)
            elif group.out(time.monotonic()):  # answer now, retry later
                lane.counts["unavailable"] += 1
                out = ReportResult("unavailable", 0, wave, step)
            else:
                out = concurrent.futures.Future()
                held.waiters.append(out)
            self._kick(group)
        self._ensure_running(group)
        return out

    def pause(self, lane: Lane) -> None:
        """No reports and no heartbeats for the engine until its next report: what it
        held is dropped (counted), so it stalls, then expires."""
        with self._lock:
            lane.paused = True
            self._drop(lane)

    @staticmethod
    def _drop(lane: Lane) -> None:
        """Drop the engine's unsent reports, counted (caller holds the lock)."""
        for held in lane.queue:
            lane.counts["dropped"] += 1
            _resolve(held.waiters, ReportResult("unavailable"))
        lane.queue.clear()

    def submit_register(
        self, lane: Lane, want_future: bool
    ) -> concurrent.futures.Future[bool] | None:
        with self._lock:
            if not lane.attached:
                return None
            lane.register = True
            group = self._group_of(lane)
            fut: concurrent.futures.Future[bool] | None = None
            if want_future:
                if group.out(time.monotonic()):
                    fut = concurrent.futures.Future()
                    fut.set_result(False)
                else:
                    fut = concurrent.futures.Future()
                    lane.register_waiters.append(fut)
            self._kick(group)
        self._ensure_running(group)
        return fut

    def _hold(self, lane: Lane, args: list[str], tag: Tag | None, group: Group) -> Pending:
        """Queue a report behind the engine's unsent ones (caller holds the lock). A
        lockstep step is queued while Redis answers, so every step reaches the barrier;
        the newest replaces the last one held (counted as coalesced) during an outage,
        when MAX_QUEUED are held (back-pressure), in tick mode (the server tags reports)
        and for a re-report of the same step."""
        last = lane.queue[-1] if lane.queue else None
        if last is None or (
            tag is not None
            and tag > tag_of(last.args)
            and len(lane.queue) < MAX_QUEUED
            and group.down_since is None
        ):
            lane.queue.append(Pending(args))
            return lane.queue[-1]
        lane.counts["coalesced"] += 1
        _resolve(last.waiters, ReportResult("coalesced", 0, *tag_of(last.args)))
        if last.args[-1] == "1":  # the replaced report's progress is not lost
            args[-1] = "1"
        last.args, last.waiters, last.retry = args, [], False
        return last

    def _kick(self, group: Group) -> None:
        """Wake the group's task if it sleeps (caller holds the lock). While it backs off
        or sends it is not idle, so a hand-over then costs no system call."""
        if group.idle and self._loop is not None and group.wake is not None:
            group.idle = False
            if threading.get_ident() == self._loop_thread:
                group.wake.set()
            else:
                with contextlib.suppress(RuntimeError):  # loop closed under us
                    self._loop.call_soon_threadsafe(group.wake.set)

    def _ensure_running(self, group: Group) -> None:
        if group.task is not None and not group.task.done():
            return
        if self.closed:
            return
        if self.background is not None:
            with self._lock:  # one start scheduled: no wake of the loop per hand-over
                if group.starting:
                    return
                group.starting = True
            self.background.call_soon(self._start, group)
        else:
            asyncio.get_running_loop()  # RuntimeError outside a loop: the caller's mistake
            self._start(group)

    def _start(self, group: Group) -> None:
        """Start the group's task on the running loop (idempotent)."""
        group.starting = False
        if (group.task is not None and not group.task.done()) or self.closed:
            return
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop and not self._loop.is_closed():
            raise InvalidState("this ReportSender runs on another event loop")
        self._loop, self._loop_thread = loop, threading.get_ident()
        group.wake = asyncio.Event()
        group.task = loop.create_task(self._run(group), name="redisbal-report-sender")

    # -- the task -----------------------------------------------------------------------------

    async def _run(self, group: Group) -> None:
        wake = group.wake
        assert wake is not None
        while not self.closed:
            now = time.monotonic()
            with self._lock:
                if not group.lanes:
                    group.idle, group.task = False, None
                    return  # restarted by the next hand-over (_ensure_running)
                batch = self._take(group, now) if now >= group.down_until else []
                if not batch:
                    timeout = self._sleep_s(group, now)
                    group.idle = now >= group.down_until
            if batch:
                await self._send(group, batch)
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout)
            wake.clear()
            with self._lock:
                group.idle = False

    def _take(self, group: Group, now: float) -> list[Op]:
        """Everything due, registrations first: an engine registered before another's
        report was handed over is a member when that report runs, so the first
        snapshot waits for it (as when registering was a round trip of its own)."""
        registers: list[Op] = []
        reports: list[Op] = []
        lanes = group.lanes[group.rr :] + group.lanes[: group.rr]
        group.rr = (group.rr + 1) % max(1, len(group.lanes))
        for lane in lanes:
            if len(registers) + len(reports) >= MAX_BATCH:
                break
            if lane.register:
                registers.append(Op("register", lane, [], lane.register_waiters))
                lane.register, lane.register_waiters = False, []
                lane.inflight += 1
            if lane.url is not None and lane.attached and now >= lane.url_due:
                registers.append(Op("url", lane, [], []))
                lane.url_due = now + URL_REFRESH_S  # (a failed write makes it due again)
                lane.inflight += 1
            if lane.running_cap is not None and lane.attached and now >= lane.cap_due:
                registers.append(Op("cap", lane, [], []))
                lane.cap_due = now + URL_REFRESH_S  # written as the URL is (docs/DESIGN.md)
                lane.inflight += 1
            if lane.queue:
                for depth, held in enumerate(lane.queue):
                    reports.append(Op("report", lane, held.args, held.waiters, depth=depth))
                lane.inflight += len(lane.queue)
                lane.queue.clear()
            elif lane.beats(now) and now - lane.last_sent >= (lane.heartbeat_s or 0.0):
                beat = [*(lane.last_args or [])[:-1], "0"]  # unchanged counts: no progress
                reports.append(Op("report", lane, beat, [], heartbeat=True))
                lane.inflight += 1
        # each engine's oldest report first, then each one's next: a call carries one
        # report per engine, and the engines' reports of one step travel together
        reports.sort(key=lambda op: op.depth)
        return registers + reports

    @staticmethod
    def _sleep_s(group: Group, now: float) -> float:
        if now < group.down_until:
            return group.down_until - now
        due = [
            lane.last_sent + lane.heartbeat_s - now
            for lane in group.lanes
            if lane.heartbeat_s is not None and lane.beats(now)
        ]
        return max(0.001, min(due, default=1.0))

    async def _send(self, group: Group, batch: list[Op]) -> None:
        started = time.monotonic()
        outs = await round_trip(
            group.client, batch, many=self.batch, cluster=self._cluster, timeout_s=self.timeout_s
        )
        now = time.monotonic()
        self.batches += 1
        outage = next((o for _, o in outs if isinstance(o, OUTAGE_ERRORS)), None)
        with self._lock:
            for op, out in outs:
                op.lane.inflight -= 1
                self._settle(op, out, now)
            if outage is not None:
                self.failed_batches += 1
                group.failures = min(group.failures + 1, 30)
                cap = min(self.max_backoff_s, CLUSTER_MAX_BACKOFF_S) if self._cluster else None
                delay = min(self.backoff_s * 2 ** (group.failures - 1), cap or self.max_backoff_s)
                group.down_until = started + delay
            group.log_health(outage, now, self.url)
        if outage is not None and self._cluster:  # find a promoted replica before the retry
            with contextlib.suppress(Exception):
                await asyncio.wait_for(refresh_slots(group.client), self.timeout_s + 1.0)

    def _settle(self, op: Op, out: Any, now: float) -> None:
        """Apply one op's outcome (caller holds the lock)."""
        lane = op.lane
        if op.kind in ("url", "cap"):  # written again when due, never awaited
            if isinstance(out, OUTAGE_ERRORS):  # write it as soon as Redis is back
                if op.kind == "url":
                    lane.url_due = 0.0
                else:
                    lane.cap_due = 0.0
            elif isinstance(out, Exception):
                log.warning("engine %s: %s refused: %s", lane.engine_id, op.kind, redact(str(out)))
            return
        if isinstance(out, OUTAGE_ERRORS):
            if op.kind == "register":
                _resolve(op.waiters, False)
                lane.register = lane.attached
                return
            lane.counts["unavailable"] += 1
            _resolve(op.waiters, ReportResult("unavailable", 0, *tag_of(op.args)))
            if op.heartbeat or not lane.attached:
                return
            # retried next round, the newest only: a report newer than this one replaces it
            if lane.queue and not lane.queue[0].retry:
                lane.counts["coalesced"] += 1
            elif lane.queue:  # an older report of this round, put back: this one replaces it
                lane.counts["coalesced"] += 1
                lane.queue[0].args = op.args
            else:
                lane.queue.append(Pending(op.args, retry=True))
            return
        if isinstance(out, Exception):
            lane.counts["errors"] += 1
            log.warning("engine %s: %s refused: %s", lane.engine_id, op.kind, redact(str(out)))
            for fut in op.waiters:
                if not fut.done():
                    fut.set_exception(out)
            return
        lane.had_state = True
        if op.kind == "register":
            _resolve(op.waiters, int(out) == 1)
            return
        status, version, wave, step = report_reply(out)
        lane.last_sent = now
        lane.counts["sent"] += 1
        lane.counts[status] += 1
        if status == "conflict":
            lane.log_conflict(out)
        if op.heartbeat:
            lane.counts["heartbeats"] += 1
        _resolve(op.waiters, ReportResult(status, version, wave, step))

    # -- waiting and closing (coroutines; the blocking reporter runs them on its loop) ---------

    async def flush(self, lane: Lane, timeout: float) -> bool:
        """Wait until the engine's handed-over reports are delivered; False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not lane.busy:
                    return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)

    async def leave(self, lane: Lane) -> None:
        """Detach the engine and leave the deployment (an outage is ignored: expiry
        removes the engine instead). A report of the engine already on the wire (a
        heartbeat the sender took just before the detach) is waited for first: sent on
        another connection, the leave could otherwise run before it, and the late report
        would make the engine a member again."""
        self.detach(lane)
        deadline = time.monotonic() + self.timeout_s + 1.0
        while lane.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        with contextlib.suppress(*OUTAGE_ERRORS, asyncio.TimeoutError):
            await asyncio.wait_for(
                lane.scripts.call("leave", lane.engine_id, lane.incarnation), self.timeout_s + 1.0
            )
            client = self._group_of(lane).client
            keys = lane.scripts.keys
            if lane.url is not None:  # gateways stop sending to a URL nobody serves
                await asyncio.wait_for(client.hdel(keys.urls, lane.engine_id), self.timeout_s + 1.0)
            if lane.running_cap is not None:  # nor keep a cap nobody declares
                await asyncio.wait_for(
                    client.hdel(keys.running_caps, lane.engine_id), self.timeout_s + 1.0
                )

    async def aclose(self) -> None:
        """Stop the tasks and close the clients this sender made."""
        self.closed = True
        with self._lock:
            groups = list(self._groups.values())
        for group in groups:
            task = group.task
            if task is None or task.done():
                continue
            if self._loop is asyncio.get_running_loop():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            else:
                self._loop.call_soon_threadsafe(task.cancel)  # type: ignore[union-attr]
        clients = [g.client for g in groups if g.owns_client]
        for client in [self.client] * self._owns_client + clients:
            with contextlib.suppress(Exception):
                await client.aclose()

    def close(self) -> None:
        """Blocking close of a threaded sender."""
        if self.background is None:
            raise InvalidState("close() is for threaded senders; await aclose()")
        if not self.background.running:
            return
        with contextlib.suppress(Exception):
            self.background.run(self.aclose(), timeout=5)
        self.background.close()


_SHARED: weakref.WeakValueDictionary[int, ReportSender] = weakref.WeakValueDictionary()
_BY_URL: dict[tuple[Any, ...], ReportSender] = {}
_REGISTRY_LOCK = threading.Lock()


# -- the Redis I/O of one round: its operations grouped into calls and sent ----------------


@dataclass(eq=False, slots=True)
class Op:
    """One thing a sender's round does for a lane."""

    kind: str  # "report", "register", "url" or "cap" (the declared running cap)
    lane: Lane
    args: list[str]  # report: Pending.args' form; register: []
    waiters: list[Any]
    heartbeat: bool = False
    depth: int = 0  # a report's place among its engine's reports of this round


KINDS = ("register", "url", "cap", "report")  # the order of a round's calls on a cluster
MAX_REPORTS = 1024  # reports per lua/report_many.lua call (its MAX_REPORTS)


def group_calls(ops: list[Op], batch: bool) -> list[list[Op]]:
    """The calls a round makes, in order: one per op, or (``batch``) the reports of one
    deployment together, one report_many call each (an engine at most once per call,
    at most MAX_REPORTS reports)."""
    if not batch:
        return [[op] for op in ops]
    calls: list[list[Op]] = []
    open_calls: dict[str, tuple[list[Op], set[str]]] = {}
    for op in ops:
        if op.kind != "report":
            calls.append([op])
            continue
        key = op.lane.scripts.keys.deployment
        call, ids = open_calls.get(key, (None, None))
        if call is None or ids is None or len(call) >= MAX_REPORTS or op.lane.engine_id in ids:
            call, ids = [], set()
            open_calls[key] = (call, ids)
            calls.append(call)
        call.append(op)
        ids.add(op.lane.engine_id)
    return calls


def report_many_argv(call: list[Op]) -> list[str]:
    """ARGV of lua/report_many.lua after deployment and publish command, for a call of
    report ops: the epoch candidate ("r-" when one of the engines had state), the count
    and each engine's nine fields, ten (with the admitted total, "" when unset) when one
    of them reports a total."""
    lane = next((op.lane for op in call if op.lane.had_state), call[0].lane)
    argv = [lane.candidate(), str(len(call))]
    totals = any(len(op.args) == TOTAL_ARGS for op in call)
    for op in call:
        argv += _report_fields(op, totals)
    return argv


TOTAL_ARGS = 8  # a report's args with an admitted total (Counts.argv)


def _report_fields(op: Op, totals: bool) -> list[str]:
    """A report's fields from the engine id on (lua/report.lua's ARGV 4..12, and 13,
    the admitted total, when ``totals``): Counts.argv's, the incarnation before the
    progress flag."""
    args, lane = op.args, op.lane
    fields = [lane.engine_id, *args[:6], lane.incarnation, args[-1]]
    if totals:
        fields.append(args[6] if len(args) == TOTAL_ARGS else "")
    return fields


def _spread(call: list[Op], out: Any) -> list[tuple[Op, Any]]:
    """Each op of a call with its result: a report_many call's reply holds one per op."""
    if len(call) == 1 or isinstance(out, Exception):
        return [(op, out) for op in call]
    if not isinstance(out, list) or len(out) != len(call):
        bad = redis.exceptions.ResponseError(f"report_many: {len(call)} replies expected")
        return [(op, bad) for op in call]
    return list(zip(call, out, strict=True))


async def round_trip(
    client: Any, batch: list[Op], *, many: bool, cluster: bool, timeout_s: float
) -> list[tuple[Op, Any]]:
    """Each op with its result (or exception). The calls (group_calls) go in one
    pipeline once every lane's Scripts knows its mode; on a cluster, one at a time,
    concurrently."""
    calls = group_calls(batch, many)
    guard = timeout_s + 1.0  # a client without socket timeouts must not hang us
    try:
        if len(calls) > 1 and not cluster and all(op.lane.scripts.mode != "probe" for op in batch):
            outs = await asyncio.wait_for(_pipelined(client, calls), guard)
        else:
            outs = await asyncio.wait_for(_singly(client, calls), guard)
    except Exception as exc:  # an outage, or a failure of the round as a whole
        outs = [exc] * len(calls)
    return [pair for call, out in zip(calls, outs, strict=True) for pair in _spread(call, out)]


async def _pipelined(client: Any, calls: list[list[Op]]) -> list[Any]:
    # ``async with``: the pipeline gives its connection back on every path (a failed
    # SCRIPT EXISTS before EVALSHA, a cancel), or redis-py warns "Unclosed Pipeline"
    async with client.pipeline(transaction=False) as pipe:
        for call in calls:
            queued = _issue(client, call, pipe)
            if inspect.iscoroutine(queued):  # redis-py's asyncio Script queues when awaited
                await queued
        outs: list[Any] = list(await pipe.execute(raise_on_error=False))
    for i, (call, out) in enumerate(zip(calls, outs, strict=True)):
        if isinstance(out, Exception) and not isinstance(out, OUTAGE_ERRORS):
            outs[i] = await _one(client, call)  # e.g. the library was flushed: reload
    return outs


async def _singly(client: Any, calls: list[list[Op]]) -> list[Any]:
    """One call at a time, concurrently: every registration, then the reports in
    layers, an engine's next report after its previous one has its answer."""
    outs: list[Any] = [None] * len(calls)
    layers: dict[tuple[int, int], list[int]] = {}  # (kind, layer) -> calls
    seen: dict[int, int] = {}  # id(lane) -> layers holding one of its reports
    for i, call in enumerate(calls):
        layer = 0
        if call[0].kind == "report":
            layer = max(seen.get(id(op.lane), 0) for op in call)
            for op in call:
                seen[id(op.lane)] = layer + 1
        layers.setdefault((KINDS.index(call[0].kind), layer), []).append(i)
    for _, todo in sorted(layers.items()):
        done = await asyncio.gather(*(_one(client, calls[i]) for i in todo))
        for i, out in zip(todo, done, strict=True):
            outs[i] = out
    return outs


async def _one(client: Any, call: list[Op]) -> Any:
    try:
        return await _issue(client, call)
    except Exception as exc:  # handed to _settle: an outage, or an error to count
        return exc


def _issue(client: Any, call: list[Op], pipe: Any = None) -> Any:
    """Send (or queue on ``pipe``) one call: a URL or cap write, a registration, a report,
    or several engines' reports in one report_many."""
    op, lane = call[0], call[0].lane
    if op.kind == "url":
        target = pipe or client
        return target.hset(lane.scripts.keys.urls, lane.engine_id, lane.url)
    if op.kind == "cap":
        target = pipe or client
        return target.hset(lane.scripts.keys.running_caps, lane.engine_id, str(lane.running_cap))
    if len(call) > 1:
        return lane.scripts.call("report_many", *report_many_argv(call), client=pipe)
    return lane.scripts.call(op.kind, *_argv(op), client=pipe)


def _argv(op: Op) -> list[str]:
    """ARGV after deployment and publish command: a report's carries the counts, the
    incarnation and the progress flag (lua/report.lua); a registration's, the id."""
    lane = op.lane
    if op.kind == "report":
        return [lane.candidate(), *_report_fields(op, len(op.args) == TOTAL_ARGS)]
    return [lane.candidate(), lane.engine_id]
