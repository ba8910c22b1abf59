"""One engine's slot in a report sender (``Lane``), what becomes of its reports
(``ReportResult``, ``ReporterStats``), and the operations of one round (``Op``) and
how a batching sender groups them into calls: the types the reporters and the
sender share (redisbal.engine, redisbal.sender, redisbal.batch)."""

from __future__ import annotations

import collections
import concurrent.futures
import secrets
from dataclasses import dataclass, field
from typing import Any

from redisbal.scripts import Scripts

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
    conflict_with: str | None = None  # the incarnation that replaced this one (logged once)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)

    def candidate(self) -> str:
        """Epoch to create if the deployment's state is missing. "r-" tells the script
        that state was lost (this engine had been in it), so the first snapshot of the
        new epoch waits join_grace_ms for the other engines to re-register."""
        return ("r-" if self.had_state else "") + secrets.token_hex(8)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.register or self.inflight > 0


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
