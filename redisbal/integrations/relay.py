"""The reports of the engines an integration speaks for, on one batch reporter.

``submit()`` checks the counts and hands them to a ``Reporter`` of all the engines
(``redisbal.reporting.reporter``), whose sender delivers them: the caller (vLLM's output loop,
the sidecar's event loop) never waits on Redis, the reports of all the engines
reach Redis together, in one report_many call per round, and outages are retried
there. The sender also keeps engines alive between submissions by re-sending
their last counts every heartbeat (tick mode needs a report every tick, or the
barrier waits for the engine), marked "no progress": an engine with work whose
counts are only re-sent for ``stall_after_ms`` is stalled (not routed to) until
new counts come. How long counts are re-sent:

- ``max_age_s`` None (the vLLM plugin): for as long as the process lives; a
  process that dies falls silent and expires;
- ``max_age_s`` seconds (the sidecar, whose counts are only worth one scrape):
  counts submitted within this long, and with ``idle_forever`` idle counts
  (nothing waiting, nothing running) indefinitely: an idle engine produces no
  steps, yet must stay routable.

``pause()`` silences an engine at once (a failed scrape), and ``suspect()`` tells
the deployment's routers to avoid it (the mark lasts the deployment's
``suspect_ms``; at most one a second per engine), through the same sender's
client. No thread of its own: everything runs on the reporter's sender.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import redis.exceptions

from redisbal.barrier.operations import suspect_reason
from redisbal.connection import redact
from redisbal.keys import check_name
from redisbal.reporting.lane import Lane
from redisbal.reporting.reporter import Counts, InvalidReport, Reporter

log = logging.getLogger("redisbal.integrations")

WARN_EVERY_S = 10.0
SUSPECT_EVERY_S = 1.0
T = TypeVar("T")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def sanitise(value: object) -> str:
    """A value for an engine-id template, of name characters only (':' '/' ... -> '-')."""
    return _UNSAFE.sub("-", str(value)) or "-"


class RateLimitedLog:
    """At most one warning per key every ``every_s``; says how many were held back."""

    def __init__(self, logger: logging.Logger, every_s: float = WARN_EVERY_S) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -1e18) < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        held = self._held.pop(key, 0)
        self._last[key] = now
        suffix = f" ({held} more like this since the last warning)" if held else ""
        self.logger.warning(msg + suffix, *args)
        return True


class CountsRelay:
    """Non-blocking reports for several engines of one deployment."""

    def __init__(
        self,
        redis_url: str,
        deployment: str,
        *,
        mode: str = "tick",
        heartbeat_s: float | None = None,
        max_age_s: float | None = 1.0,
        idle_forever: bool = True,
        incarnation: str | None = None,
    ) -> None:
        self.deployment = check_name(deployment, "deployment")
        self.mode = mode
        self.url = redact(redis_url)
        self.max_age_s = max_age_s
        self.idle_forever = idle_forever
        self.incarnation = incarnation  # shared by processes that speak for one engine
        self._reporter = Reporter(
            redis_url, self.deployment, mode=mode, heartbeat_s=heartbeat_s, incarnation=incarnation
        )
        self._lock = threading.Lock()
        self._suspect_after: dict[str, float] = {}  # engine id -> next mark allowed
        self.warn = RateLimitedLog(log)

    def add(self, engine_id: str, url: str | None = None, running_cap: int | None = None) -> None:
        """Speak for ``engine_id`` (checked now); ``url`` is where gateways send requests,
        ``running_cap`` how many it runs at once (declared to routers: redisbal.running_caps).
        It registers at once: the sender sends registrations before reports."""
        check_name(engine_id, "engine id")
        with self._lock:
            if engine_id in self._reporter.engines:
                return
            self._reporter.add(engine_id, url or None, running_cap)
            lane = self._reporter.lane(engine_id)
            lane.beat_for_s, lane.beat_idle_forever = self.max_age_s, self.idle_forever

    def ready(self, engine_id: str) -> None:
        """``engine_id`` can take requests: report it idle now, unless counts of its own
        came first. The heartbeat keeps an idle engine alive, so a server that nobody has
        sent a request to yet (it has no steps, so no counts) is routable as soon as it
        is ready, instead of expiring as a registration that never reported."""
        lane = self._lane(engine_id)
        step = None if self.mode == "tick" else 0  # lockstep: before the first step
        args = Counts(step).argv(self.mode)
        tag = None if step is None else (0, 0)
        self._reporter.sender.submit(lane, args, tag, False, first=True)

    def _lane(self, engine_id: str) -> Lane:
        try:
            return self._reporter.lane(engine_id)
        except InvalidReport:
            raise KeyError(f"unknown engine {engine_id!r}: add() it first") from None

    def engines(self) -> list[str]:
        return self._reporter.engines

    def submit(self, engine_id: str, counts: Counts | Mapping[str, Any]) -> None:
        """Hand one engine's counts over (checked now: InvalidReport). ``Counts(progress=
        False)``: the engine did not move since its last counts (a stalled engine with
        work is not routed to: Reporter.report)."""
        self._lane(engine_id)  # KeyError for an engine not added
        self._reporter.report(counts, engine=engine_id)  # a stale step is counted there

    def pause(self, engine_id: str) -> None:
        """Stop reporting ``engine_id`` until its next submit(): it stalls, then expires."""
        if engine_id in self._reporter.engines:
            self._reporter.sender.pause(self._reporter.lane(engine_id))

    def suspect(self, engine_id: str, reason: str) -> None:
        """Have routers avoid ``engine_id`` (it did not answer); sent by the sender."""
        now = time.monotonic()
        with self._lock:
            if engine_id not in self._reporter.engines:
                return
            if now < self._suspect_after.get(engine_id, 0.0):
                return
            self._suspect_after[engine_id] = now + SUSPECT_EVERY_S
        bg = self._reporter.sender.background
        if bg is not None and bg.running:
            bg.submit(self._mark(engine_id, suspect_reason(reason)))

    async def _mark(self, engine_id: str, reason: str) -> None:
        call = self._reporter.scripts.call("suspect", engine_id, "-", reason)
        try:
            await asyncio.wait_for(call, 2.0)
        except (redis.exceptions.RedisError, asyncio.TimeoutError) as exc:
            self.warn.warning("suspect", "redisbal: suspect mark refused (%s): %r", self.url, exc)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the sender's event loop (cancelled when the relay closes)."""
        bg = self._reporter.sender.background
        assert bg is not None  # a Reporter's sender runs on its own loop
        return bg.submit(coro)

    def stats(self, engine_id: str) -> dict[str, int]:
        """The engine's reporter counters (queued, sent, accepted, unavailable, ...)."""
        self._lane(engine_id)  # KeyError for an engine not added
        return dataclasses.asdict(self._reporter.stats(engine_id))

    def close(self, leave: bool = True) -> None:
        """Deliver what is queued and (by default) leave gracefully."""
        self._reporter.close(leave=leave)
