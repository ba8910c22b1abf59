"""One background sender for the engines an integration speaks for.

``submit()`` validates the counts and stores them (the latest per engine wins); a
daemon thread sends them through the public ``EngineReporter`` API on one shared
Redis client, so the caller (vLLM's output loop, the sidecar's event loop) never
waits on Redis. The thread also keeps engines alive between submissions by
re-sending their last counts every heartbeat (tick mode needs a report every tick,
or the barrier waits for the engine), marked "no progress": an engine with work
whose counts are only re-sent for ``stall_after_ms`` is stalled (not routed to)
until new counts come. How long counts are re-sent:

- ``max_age_s`` None (the vLLM plugin): for as long as the process lives; a
  process that dies falls silent and expires;
- ``max_age_s`` seconds (the sidecar, whose counts are only worth one scrape):
  counts submitted within this long, and with ``idle_forever`` idle counts
  (nothing waiting, nothing running) indefinitely: an idle engine produces no
  steps, yet must stay routable.

``pause()`` silences an engine at once (a failed scrape), and ``suspect()`` tells
the deployment's routers to avoid it (the mark lasts the deployment's
``suspect_ms``; at most one a second per engine).

Each flush hands the engines' reports to one ``BatchReporter`` (``redisbal.batch``):
the reports of all the engines of a flush reach Redis together, in one report_many
call, and outages are retried there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis.exceptions

from redisbal.batch import BatchReporter
from redisbal.connection import is_cluster, make_client, redact
from redisbal.engine import validate_report
from redisbal.keys import DeploymentKeys, check_name
from redisbal.scripts import Scripts, suspect_reason

log = logging.getLogger("redisbal.integrations")

WARN_EVERY_S = 10.0
SUSPECT_EVERY_S = 1.0
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def sanitise(value: object) -> str:
    """A value for an engine-id template, of name characters only (':' '/' ... -> '-')."""
    return _UNSAFE.sub("-", str(value)) or "-"


@dataclass
class _Engine:
    pending: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    submitted: float = 0.0  # monotonic time of the latest submit()
    sent: float = 0.0  # monotonic time of the latest send attempt
    paused: bool = False


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
    """Non-blocking reports for several engines of one deployment, sent by one thread."""

    def __init__(
        self,
        redis_url: str,
        deployment: str,
        *,
        mode: str = "tick",
        heartbeat_s: float | None = None,
        max_age_s: float | None = 1.0,
        idle_forever: bool = True,
        name: str = "redisbal-relay",
        incarnation: str | None = None,
    ) -> None:
        self.deployment = check_name(deployment, "deployment")
        self.mode = mode
        self.redis_url = redis_url
        self.url = redact(redis_url)
        default_hb = 0.02 if mode == "tick" else 0.25
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else default_hb
        self.max_age_s = max_age_s
        self.idle_forever = idle_forever
        self.incarnation = incarnation  # shared by processes that speak for one engine
        # the engines' reports, one report_many call per round; heartbeats are ours
        self._batch = BatchReporter(
            redis_url, self.deployment, mode=mode, heartbeat=False, incarnation=incarnation
        )
        self._engines: dict[str, _Engine] = {}
        self._suspects: dict[str, str] = {}  # engine id -> reason, to mark in Redis
        self._suspect_after: dict[str, float] = {}  # engine id -> next mark allowed
        self._scripts: Scripts | None = None  # on a blocking client of its own, for the marks
        self._mark_client: Any = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.warn = RateLimitedLog(log)
        self.flushes = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    # -- caller side: no I/O -------------------------------------------------------------

    def add(self, engine_id: str, url: str | None = None) -> None:
        """Speak for ``engine_id`` (checked now); ``url`` is where gateways send requests."""
        check_name(engine_id, "engine id")
        with self._lock:
            if engine_id in self._engines:
                return
            # registers at once: the sender sends registrations before reports; the url
            # (where gateways send the engine's requests) goes to the urls hash
            self._batch.add(engine_id, url or None)
            self._engines[engine_id] = _Engine()
        self._wake.set()

    def ready(self, engine_id: str) -> None:
        """``engine_id`` can take requests: report it idle now, unless counts of its own
        came first. The heartbeat keeps an idle engine alive, so a server that nobody has
        sent a request to yet (it has no steps, so no counts) is routable as soon as it
        is ready, instead of expiring as a registration that never reported."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None:
                raise KeyError(f"unknown engine {engine_id!r}: add() it first")
            if eng.pending is not None or eng.last is not None:
                return
            step = None if self.mode == "tick" else 0  # lockstep: before the first step
            eng.pending = {"step": step, "waiting": 0, "running": 0, "wave": 0}
            eng.pending.update(kv_usage=None, progress=True)
            eng.submitted = time.monotonic()
            eng.paused = False
        self._wake.set()

    def engines(self) -> list[str]:
        with self._lock:
            return list(self._engines)

    def submit(
        self,
        engine_id: str,
        *,
        step: int | None = None,
        waiting: int = 0,
        running: int = 0,
        wave: int = 0,
        kv_usage: float | None = None,
        progress: bool = True,
    ) -> None:
        """Queue one engine's counts (validated now; raises InvalidReport); latest wins.
        ``progress=False``: the engine did not move since its last counts (a stalled
        engine with work is not routed to: EngineReporter.report)."""
        validate_report(
            mode=self.mode,
            step=step,
            waiting=waiting,
            running=running,
            wave=wave,
            kv_usage=kv_usage,
            admitted=None,
        )
        counts: dict[str, Any] = {"step": step, "waiting": waiting, "running": running}
        counts.update(wave=wave, kv_usage=kv_usage, progress=progress)
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None:
                raise KeyError(f"unknown engine {engine_id!r}: add() it first")
            eng.pending = counts
            eng.submitted = time.monotonic()
            eng.paused = False
        self._wake.set()

    def pause(self, engine_id: str) -> None:
        """Stop reporting ``engine_id`` until its next submit(): it stalls, then expires."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is not None:
                eng.paused = True
                eng.pending = None

    def suspect(self, engine_id: str, reason: str) -> None:
        """Have routers avoid ``engine_id`` (it did not answer); sent by the thread."""
        now = time.monotonic()
        with self._lock:
            if engine_id not in self._engines or now < self._suspect_after.get(engine_id, 0.0):
                return
            self._suspect_after[engine_id] = now + SUSPECT_EVERY_S
            self._suspects[engine_id] = suspect_reason(reason)
        self._wake.set()

    def _mark_suspects(self) -> None:
        with self._lock:
            marks, self._suspects = self._suspects, {}
        if not marks:
            return
        if self._scripts is None:
            client = make_client(self.redis_url, socket_timeout=1.0, socket_connect_timeout=0.5)
            pubcmd = "SPUBLISH" if is_cluster(client) else "PUBLISH"
            self._scripts = Scripts(client, DeploymentKeys(self.deployment), pubcmd)
            self._mark_client = client
        for eid, reason in marks.items():
            try:
                self._scripts.call("suspect", eid, "-", reason)
            except redis.exceptions.RedisError as exc:
                self.warn.warning(
                    "suspect", "redisbal: suspect mark refused (%s): %s", self.url, exc
                )

    def stats(self, engine_id: str) -> dict[str, int]:
        """The engine's reporter counters (queued, sent, accepted, unavailable, ...)."""
        if engine_id not in self._engines:
            raise KeyError(f"unknown engine {engine_id!r}")
        return dataclasses.asdict(self._batch.stats[engine_id])

    # -- the sender thread ---------------------------------------------------------------

    def _due(self, now: float) -> list[tuple[str, _Engine, dict[str, Any]]]:
        """What to send now: new counts, and re-sends of the last ones (no progress)."""
        out = []
        with self._lock:
            for eid, eng in self._engines.items():
                if eng.pending is not None:
                    out.append((eid, eng, eng.pending))
                    eng.last, eng.pending = eng.pending, None
                elif (
                    not eng.paused
                    and eng.last is not None
                    and now - eng.sent >= self.heartbeat_s
                    and (
                        self.max_age_s is None
                        or now - eng.submitted <= self.max_age_s
                        or (
                            self.idle_forever
                            and eng.last["waiting"] == 0
                            and eng.last["running"] == 0
                        )
                    )
                ):
                    out.append((eid, eng, {**eng.last, "progress": False}))
        return out

    def _flush(self, batch: list[tuple[str, _Engine, dict[str, Any]]]) -> None:
        self.flushes += 1
        now = time.monotonic()
        for _, eng, _ in batch:
            eng.sent = now
        try:  # a hand-off: the batch reporter's sender delivers and retries
            self._batch.report_many({eid: counts for eid, _, counts in batch})
        except redis.exceptions.RedisError as exc:
            self.warn.warning("send", "redisbal: report failed (%s): %s", self.url, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.heartbeat_s / 2)
            self._wake.clear()
            if self._stop.is_set():
                break
            batch = self._due(time.monotonic())
            try:
                if batch:
                    self._flush(batch)
                self._mark_suspects()
            except Exception as exc:  # never let the thread die on one bad reply
                self.warn.warning("flush", "redisbal: sender error: %r", exc)

    def close(self, leave: bool = True) -> None:
        """Send what is pending, stop the thread and (by default) leave gracefully."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2)
        with self._lock:
            pending = [(k, e, e.pending) for k, e in self._engines.items() if e.pending is not None]
        with contextlib.suppress(Exception):
            if pending:
                self._flush(pending)  # type: ignore[arg-type]
        with contextlib.suppress(Exception):
            self._batch.close(leave=leave)
        if self._mark_client is not None:
            with contextlib.suppress(Exception):
                self._mark_client.close()
