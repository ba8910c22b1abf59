"""Engine side: report step-tagged counts into the deployment's barrier.

One report is one FCALL (Redis 7) or EVALSHA (6.2) of ``lua/report_7.lua``: one
round trip, atomic.
The reporter never stalls the engine loop on a Redis outage: a failed call
returns status "unavailable" and the reporter stays quiet for a short back-off
(a heartbeat re-sends the latest counts once Redis is back, which re-registers
the engine in a fresh epoch). Bad input raises InvalidReport before any I/O.

Two step-tag modes:
- ``lockstep``: the engine's own (wave, step) (MoE / expert-parallel engines
  that step together);
- ``tick``: independent engines; the barrier script tags every report with the
  server's tick floor(server_ms / tick_ms), so the barrier completes without
  clock skew, and a heartbeat reports every tick so idle engines never hold it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions

from redisbal.connection import OUTAGE_ERRORS, is_cluster, make_client, redact
from redisbal.keys import DeploymentKeys, check_name
from redisbal.scripts import Scripts, report_reply

log = logging.getLogger("redisbal.engine")

MAX_COUNT = 1_000_000_000
MAX_STEP = 2**32 - 1
MAX_WAVE = 2**20 - 1
MAX_CLIENTS = 4096
MODES = ("lockstep", "tick")


class InvalidReport(ValueError):
    """A report argument that is not acceptable; names the field."""


@dataclass(frozen=True, slots=True)
class ReportResult:
    status: str  # "accepted", "stale" (older than the latest, rejected) or "unavailable"
    version: int = 0  # version of the snapshot this report published, 0 if none
    wave: int = 0
    step: int = 0

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


def _count(name: str, value: object, hi: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidReport(f"{name} must be a whole number, got {value!r}")
    if not 0 <= value <= hi:
        raise InvalidReport(f"{name} must be in 0..{hi}, got {value}")
    return value


def validate_report(
    *,
    mode: str,
    step: int | None,
    waiting: int,
    running: int,
    wave: int,
    kv_usage: float | None,
    admitted: Sequence[int] | None,
) -> list[str]:
    """Check one report and return ARGV[5..10] for report_7.lua."""
    if mode == "lockstep":
        if step is None:
            raise InvalidReport("step is required in lockstep mode (or use mode='tick')")
        wave_s, step_s = str(_count("wave", wave, MAX_WAVE)), str(_count("step", step, MAX_STEP))
    else:
        if step is not None:
            raise InvalidReport("step must not be given in tick mode: the server assigns the tick")
        wave_s, step_s = "0", "tick"
    w = str(_count("waiting", waiting))
    r = str(_count("running", running))
    kv = ""
    if kv_usage is not None:
        if isinstance(kv_usage, bool) or not isinstance(kv_usage, int | float):
            raise InvalidReport(f"kv_usage must be a number in [0, 1], got {kv_usage!r}")
        if not (math.isfinite(kv_usage) and 0.0 <= kv_usage <= 1.0):
            raise InvalidReport(f"kv_usage must be in [0, 1], got {kv_usage!r}")
        kv = f"{float(kv_usage):.4f}"
    adm = ""
    if admitted is not None:
        if (
            isinstance(admitted, str | bytes)
            or not isinstance(admitted, Sequence)
            or len(admitted) > MAX_CLIENTS
        ):
            raise InvalidReport(f"admitted must be a list of at most {MAX_CLIENTS} counts")
        adm = ",".join(str(_count(f"admitted[{i}]", a, 10**15 - 1)) for i, a in enumerate(admitted))
    return [wave_s, step_s, w, r, kv, adm]


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _ReporterBase:
    """What both reporters share: names, validation, arguments, back-off, heartbeat state."""

    def __init__(
        self,
        redis_url: str | None,
        deployment: str,
        engine_id: str,
        *,
        mode: str = "lockstep",
        client: Any = None,
        heartbeat_s: float | None = None,
        backoff_s: float = 0.2,
        asyncio: bool,
    ) -> None:
        self.engine_id = check_name(engine_id, "engine_id")
        self.keys = DeploymentKeys(check_name(deployment, "deployment"))
        if mode not in MODES:
            raise InvalidReport(f"mode must be one of {MODES}, got {mode!r}")
        if client is None:
            if not redis_url:
                raise ValueError("give a redis_url (or client=)")
            client = make_client(
                redis_url, asyncio=asyncio, socket_connect_timeout=0.25, socket_timeout=1.0
            )
            self._owns_client = True
        else:
            self._owns_client = False
        self.mode = mode
        self.client = client
        self.url = redact(redis_url or "")
        self.scripts = Scripts(client, self.keys, "SPUBLISH" if is_cluster(client) else "PUBLISH")
        self.heartbeat_s = (
            heartbeat_s if heartbeat_s is not None else (0.02 if mode == "tick" else 0.25)
        )
        self.backoff_s = backoff_s
        self._down_until = 0.0
        self._last_args: list[str] | None = None
        self._last_sent = 0.0
        self.stale_count = 0
        self.unavailable_count = 0
        self._had_state = False  # Redis knew this engine once: a lost state is a recovery

    def _candidate(self) -> str:
        """Epoch to create if the deployment's state is missing. "r-" tells the script
        that state was lost (this engine had been in it), so the first snapshot of the
        new epoch waits join_grace_ms for the other engines to re-register."""
        return ("r-" if self._had_state else "") + secrets.token_hex(8)

    def _argv(self, args: list[str]) -> list[str]:
        return [self._candidate(), self.engine_id, *args]

    def _parse(self, raw: Any, args: list[str]) -> ReportResult:
        self._had_state = True
        status, version, wave, step = report_reply(raw, args[0], args[1])
        if status == "stale":
            self.stale_count += 1
        return ReportResult(status, version, wave, step)

    def _backing_off(self) -> ReportResult | None:
        """During the back-off after an outage: the "unavailable" result, without I/O."""
        if time.monotonic() < self._down_until:
            self.unavailable_count += 1
            return ReportResult("unavailable")
        return None

    def _outage(self, exc: BaseException) -> ReportResult:
        if self.unavailable_count == 0 or time.monotonic() >= self._down_until:
            log.warning(
                "engine %s: Redis unavailable (%s): %s; will retry",
                self.engine_id,
                self.url,
                type(exc).__name__,
            )
        self.unavailable_count += 1
        self._down_until = time.monotonic() + self.backoff_s
        return ReportResult("unavailable")

    def _prepare(
        self,
        step: int | None,
        waiting: int,
        running: int,
        wave: int,
        kv_usage: float | None,
        admitted: Sequence[int] | None,
    ) -> list[str]:
        args = validate_report(
            mode=self.mode,
            step=step,
            waiting=waiting,
            running=running,
            wave=wave,
            kv_usage=kv_usage,
            admitted=admitted,
        )
        self._last_args = args
        return args


class EngineReporter(_ReporterBase):
    """Blocking reporter for one engine. ``report()`` is one round trip.

    Constructing it registers the engine (one round trip; ``register=False`` to
    skip), so that the deployment's first snapshot waits for its first report.

    With ``heartbeat=True`` a daemon thread re-sends the latest counts when the
    engine has not reported for ``heartbeat_s`` (0.25 s in lockstep mode, one
    tick in tick mode), so an idle engine stays alive and never holds the barrier.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        deployment: str = "default",
        engine_id: str = "0",
        *,
        mode: str = "lockstep",
        client: Any = None,
        heartbeat: bool = True,
        heartbeat_s: float | None = None,
        backoff_s: float = 0.2,
        register: bool = True,
    ) -> None:
        super().__init__(
            redis_url,
            deployment,
            engine_id,
            mode=mode,
            client=client,
            heartbeat_s=heartbeat_s,
            backoff_s=backoff_s,
            asyncio=False,
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if register:  # the first snapshot waits for an engine that exists
            self.register()
        if heartbeat:
            self._thread = threading.Thread(
                target=self._heartbeat, daemon=True, name=f"redisbal-heartbeat-{engine_id}"
            )
            self._thread.start()

    def register(self) -> bool:
        """Announce this engine before its first report (the first snapshot waits for it)."""
        try:
            added = int(self.scripts.call("register", self._candidate(), self.engine_id)) == 1
        except OUTAGE_ERRORS as exc:
            self._outage(exc)
            return False
        self._had_state = True
        return added

    def report(
        self,
        step: int | None = None,
        waiting: int = 0,
        running: int = 0,
        wave: int = 0,
        *,
        kv_usage: float | None = None,
        admitted: Sequence[int] | None = None,
    ) -> ReportResult:
        """Record counts for (wave, step); returns whether it was accepted or stale."""
        args = self._prepare(step, waiting, running, wave, kv_usage, admitted)
        return self._send(args)

    def _send(self, args: list[str]) -> ReportResult:
        if (skipped := self._backing_off()) is not None:
            return skipped
        try:
            with self._lock:
                raw = self.scripts.call("report", *self._argv(args))
                self._last_sent = time.monotonic()
        except OUTAGE_ERRORS as exc:
            return self._outage(exc)
        return self._parse(raw, args)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 2):
            args = self._last_args
            if args is not None and time.monotonic() - self._last_sent >= self.heartbeat_s:
                try:
                    self._send(args)
                except redis.exceptions.RedisError as exc:  # keep beating
                    log.warning("engine %s heartbeat failed: %s", self.engine_id, exc)

    def close(self, leave: bool = True) -> None:
        """Stop the heartbeat and (by default) leave the deployment gracefully."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if leave:
            with contextlib.suppress(*OUTAGE_ERRORS):
                self.scripts.call("leave", self.engine_id)
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> EngineReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEngineReporter(_ReporterBase):
    """asyncio twin of EngineReporter.

    ``await report(...)`` sends now. ``report_nowait(...)`` never waits: it
    stores the counts and a background task sends them, coalescing (the latest
    counts win), which is what an engine loop that must not wait wants.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        deployment: str = "default",
        engine_id: str = "0",
        *,
        mode: str = "lockstep",
        client: Any = None,
        heartbeat: bool = True,
        heartbeat_s: float | None = None,
        backoff_s: float = 0.2,
    ) -> None:
        super().__init__(
            redis_url,
            deployment,
            engine_id,
            mode=mode,
            client=client,
            heartbeat_s=heartbeat_s,
            backoff_s=backoff_s,
            asyncio=True,
        )
        self._heartbeat_enabled = heartbeat
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._pending: list[str] | None = None
        self._closed = False

    async def register(self) -> bool:
        try:
            added = int(await self.scripts.call("register", self._candidate(), self.engine_id))
        except OUTAGE_ERRORS as exc:
            self._outage(exc)
            return False
        self._had_state = True
        return added == 1

    async def report(
        self,
        step: int | None = None,
        waiting: int = 0,
        running: int = 0,
        wave: int = 0,
        *,
        kv_usage: float | None = None,
        admitted: Sequence[int] | None = None,
    ) -> ReportResult:
        args = self._prepare(step, waiting, running, wave, kv_usage, admitted)
        self._ensure_task()
        return await self._send(args)

    def report_nowait(
        self,
        step: int | None = None,
        waiting: int = 0,
        running: int = 0,
        wave: int = 0,
        *,
        kv_usage: float | None = None,
        admitted: Sequence[int] | None = None,
    ) -> None:
        """Queue counts for sending (latest wins); validates now, sends in the background."""
        self._pending = self._prepare(step, waiting, running, wave, kv_usage, admitted)
        self._ensure_task()
        self._wake.set()

    async def _send(self, args: list[str]) -> ReportResult:
        if (skipped := self._backing_off()) is not None:
            return skipped
        try:
            raw = await self.scripts.call("report", *self._argv(args))
            self._last_sent = time.monotonic()
        except OUTAGE_ERRORS as exc:
            return self._outage(exc)
        return self._parse(raw, args)

    def _ensure_task(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._sender())

    async def _sender(self) -> None:
        while not self._closed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.heartbeat_s / 2)
            self._wake.clear()
            args, self._pending = self._pending, None
            if (
                args is None
                and self._heartbeat_enabled
                and self._last_args is not None
                and time.monotonic() - self._last_sent >= self.heartbeat_s
            ):
                args = self._last_args
            if args is not None:
                try:
                    await self._send(args)
                except redis.exceptions.RedisError as exc:
                    log.warning("engine %s: report failed: %s", self.engine_id, exc)

    async def aclose(self, leave: bool = True) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._pending is not None:
            with contextlib.suppress(*OUTAGE_ERRORS):
                await self._send(self._pending)
        if leave:
            with contextlib.suppress(*OUTAGE_ERRORS):
                await self.scripts.call("leave", self.engine_id)
        if self._owns_client:
            await self.client.aclose()

    async def __aenter__(self) -> AsyncEngineReporter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
