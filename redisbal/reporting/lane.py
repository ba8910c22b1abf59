"""One engine's slot in a report sender (``Lane``), one deployment's engines in it
(``Group``), what becomes of its reports (``ReportResult``, ``ReporterStats``), and
the operations of one round (``Op``), how they are grouped into calls and sent
(``round_trip``): the types the reporters and the sender share (reporter.py,
sender.py) and the sender's Redis I/O."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions

from redisbal.barrier.operations import Scripts
from redisbal.connection import OUTAGE_ERRORS

log = logging.getLogger("redisbal.reporting.reporter")
WARN_EVERY_S = 60.0

Tag = tuple[int, int]


@dataclass(frozen=True, slots=True)
class ReportResult:
    """What became of one report. ``status``: "queued" (handed to the sender, the
    default answer), "accepted", "stale" (older than the engine's latest: refused),
    "conflict" (a process started later reports under this engine id: refused),
    "unavailable" (Redis unreachable: the sender keeps the counts and retries) or
    "coalesced" (replaced by newer counts before it was sent)."""

    status: str
    version: int = 0  # version of the snapshot this report published, 0 if none
    wave: int = 0
    step: int = 0

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


@dataclass(frozen=True, slots=True)
class ReporterStats:
    """One engine's report counters (since its reporter was made)."""

    queued: int = 0  # reports handed to the sender
    sent: int = 0  # reports (and heartbeats) that reached Redis
    accepted: int = 0
    stale: int = 0  # refused as older than the engine's latest (locally or by Redis)
    conflict: int = 0  # refused: a later process reports under this engine id
    coalesced: int = 0  # replaced by newer counts before they were sent
    unavailable: int = 0  # sends that failed on an outage (then retried)
    errors: int = 0  # sends refused for another reason (not retried)
    heartbeats: int = 0  # re-sends of unchanged counts
    dropped: int = 0  # reports never sent: handed over after close, or left at close


@dataclass(eq=False, slots=True)
class Pending:
    """One report handed over and not sent yet: ARGV 5..10 of lua/report.lua with its
    progress flag, and the callers waiting for its outcome."""

    args: list[str]
    waiters: list[concurrent.futures.Future[ReportResult]] = field(default_factory=list)
    retry: bool = False  # put back after a failed send (an outage)


# reports of one engine held while Redis answers: beyond this (a Redis slower than the
# engine's steps) the newest replaces the last one held, counted as coalesced
MAX_QUEUED = 16


@dataclass(eq=False)
class Lane:
    """One engine's slot in a sender. Every field is guarded by the sender's lock."""

    engine_id: str
    scripts: Scripts
    heartbeat_s: float | None  # None: no heartbeat
    incarnation: str = "-"  # this reporting process (lua/includes/incarnation.lua)
    # reports not sent yet, oldest first: each lockstep step while Redis answers, the
    # newest only while it does not (an outage) or when MAX_QUEUED are held already
    queue: collections.deque[Pending] = field(default_factory=collections.deque)
    register: bool = False
    register_waiters: list[concurrent.futures.Future[bool]] = field(default_factory=list)
    newest: Tag | None = None  # newest lockstep tag handed over
    last_args: list[str] | None = None  # what a heartbeat re-sends
    last_sent: float = 0.0  # monotonic time of the last delivered report
    inflight: int = 0
    had_state: bool = False  # Redis knew this engine once: a lost state is a recovery
    url: str | None = None  # where gateways send this engine's requests (endpoints.py)
    url_due: float = 0.0  # monotonic time the URL is next written (after a loss too)
    attached: bool = True
    # heartbeats: none while paused (until the next report); with ``beat_for_s``, only
    # that long after the last report, or for ever while its counts are idle
    paused: bool = False
    beat_for_s: float | None = None
    beat_idle_forever: bool = False
    submitted: float = 0.0  # monotonic time of the last report handed over
    conflict_with: str | None = None  # the incarnation that replaced this one (logged once)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)

    def candidate(self) -> str:
        """Epoch to create if the deployment's state is missing. "r-" tells the script
        that state was lost (this engine had been in it), so the first snapshot of the
        new epoch waits join_grace_ms for the other engines to re-register."""
        return ("r-" if self.had_state else "") + secrets.token_hex(8)

    def beats(self, now: float) -> bool:
        """Whether this engine's last counts are re-sent as heartbeats now."""
        if self.heartbeat_s is None or self.last_args is None or self.paused:
            return False
        if self.beat_for_s is None or now - self.submitted <= self.beat_for_s:
            return True
        return self.beat_idle_forever and self.last_args[2] == self.last_args[3] == "0"

    def log_conflict(self, out: Any) -> None:
        """One error per replacing incarnation: two processes report under one engine id
        (or this one was replaced and keeps running)."""
        other = out[4].decode() if isinstance(out[4], bytes) else str(out[4])
        if self.conflict_with == other:
            return
        self.conflict_with = other
        log.error(
            "engine %s: reports refused: another process (incarnation %s, started later) "
            "reports under this engine id; this one is %s. Give each engine process its "
            "own engine_id, or stop the old process",
            self.engine_id,
            other,
            self.incarnation,
        )

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.register or self.inflight > 0


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


def tag_of(args: list[str]) -> Tag:
    """(wave, step) of a report's ARGV; (0, 0) in tick mode (the server assigns it)."""
    return (int(args[0]), int(args[1])) if args[1] != "tick" else (0, 0)


@dataclass(eq=False, slots=True)
class Op:
    """One thing a sender's round does for a lane."""

    kind: str  # "report", "register" or "url"
    lane: Lane
    args: list[str]  # report: Pending.args' form; register: []
    waiters: list[Any]
    heartbeat: bool = False
    depth: int = 0  # a report's place among its engine's reports of this round


KINDS = ("register", "url", "report")  # the order of a round's calls on a cluster
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
    and each engine's nine fields."""
    lane = next((op.lane for op in call if op.lane.had_state), call[0].lane)
    argv = [lane.candidate(), str(len(call))]
    for op in call:
        argv += [op.lane.engine_id, *op.args[:-1], op.lane.incarnation, op.args[-1]]
    return argv


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
    """Send (or queue on ``pipe``) one call: a URL write, a registration, a report,
    or several engines' reports in one report_many."""
    op, lane = call[0], call[0].lane
    if op.kind == "url":
        target = pipe or client
        return target.hset(lane.scripts.keys.urls, lane.engine_id, lane.url)
    if len(call) > 1:
        return lane.scripts.call("report_many", *report_many_argv(call), client=pipe)
    return lane.scripts.call(op.kind, *_argv(op), client=pipe)


def _argv(op: Op) -> list[str]:
    """ARGV after deployment and publish command: a report's carries the counts, the
    incarnation and the progress flag (lua/report.lua); a registration's, the id."""
    lane = op.lane
    if op.kind == "report":
        return [lane.candidate(), lane.engine_id, *op.args[:-1], lane.incarnation, op.args[-1]]
    return [lane.candidate(), lane.engine_id]
