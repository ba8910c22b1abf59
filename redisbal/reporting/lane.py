"""One engine's slot in a report sender (``Lane``), its reports not sent yet
(``Pending``) and what becomes of them (``ReportResult``, ``ReporterStats``): the types
the reporters and the sender share (reporter.py, sender.py)."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from redisbal.barrier.operations import Scripts

log = logging.getLogger("redisbal.reporting.reporter")  # (its errors are the reporter's)

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
    running_cap: int | None = None  # the cap it declares to routers (redisbal.running_caps)
    cap_due: float = 0.0  # monotonic time the cap is next written (as url_due)
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


def tag_of(args: list[str]) -> Tag:
    """(wave, step) of a report's ARGV; (0, 0) in tick mode (the server assigns it)."""
    return (int(args[0]), int(args[1])) if args[1] != "tick" else (0, 0)
