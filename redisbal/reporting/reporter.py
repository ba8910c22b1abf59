"""Engine side: hand step-tagged counts to a sender that reports them into the barrier.

``report()`` never waits on Redis, whatever Redis does (down, frozen, paused,
failing over): it checks the counts (bad input raises InvalidReport before
anything is handed over), gives them to the engine's ``ReportSender`` and
returns ``ReportResult("queued")``. The sender coalesces per engine, sends in
the background (one round trip for every engine it holds), retries through
outages with a back-off and re-sends the latest counts as a heartbeat;
``redisbal.reporting.sender`` says how it orders and coalesces. A caller that wants one
report's outcome passes ``wait=True``; ``flush()`` waits for everything.

One implementation, written with asyncio (``_Reporter`` and the sender):
``AsyncEngineReporter`` runs it on the caller's event loop, ``EngineReporter``
is a thin blocking facade running it on the sender's private loop in a daemon
thread (``redisbal.background``), as ``Router`` runs ``AsyncRouter``.

Two step-tag modes:
- ``lockstep``: the engine's own (wave, step) (MoE / expert-parallel engines
  that step together);
- ``tick``: independent engines; the barrier script tags every report with the
  server's tick floor(server_ms / tick_ms), so the barrier completes without
  clock skew, and a heartbeat reports every tick so idle engines never hold it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypeVar

from redisbal.background import BackgroundLoop
from redisbal.connection import OUTAGE_ERRORS
from redisbal.endpoints import check_url
from redisbal.errors import InvalidReport as InvalidReport
from redisbal.keys import DeploymentKeys, check_name
from redisbal.reporting.lane import Lane, ReporterStats, ReportResult, tag_of
from redisbal.reporting.sender import ReportSender

__all__ = [
    "OUTAGE_ERRORS",
    "AsyncEngineReporter",
    "Counts",
    "EngineReporter",
    "InvalidReport",
    "ReportResult",
    "ReportSender",
    "ReporterStats",
    "new_incarnation",
]

MAX_COUNT = 1_000_000_000
MAX_STEP = 2**32 - 1
MAX_WAVE = 2**20 - 1
MAX_CLIENTS = 4096
MODES = ("lockstep", "tick")


def _count(name: str, value: object, hi: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidReport(f"{name} must be a whole number, got {value!r}")
    if not 0 <= value <= hi:
        raise InvalidReport(f"{name} must be in 0..{hi}, got {value}")
    return value


class _CountsFields(NamedTuple):
    step: int | None = None
    waiting: int = 0
    running: int = 0
    wave: int = 0
    kv_usage: float | None = None
    admitted: Sequence[int] | None = None  # kept as a tuple
    progress: bool = True


_new_counts = _CountsFields.__new__


class Counts(_CountsFields):
    """One engine's counts at one step, checked when made (InvalidReport names the
    field): what a reporter hands to its sender. ``step`` and ``wave`` tag a lockstep
    report (None in tick mode: the server assigns the tick); ``admitted`` holds, per
    router client index, how many routed requests the engine has taken in;
    ``progress=False`` says the engine's loop did not move since its last report.
    Immutable (a named tuple: ``_replace`` makes a changed copy, checked again)."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Counts:
        self = _new_counts(cls, *args, **kwargs)
        step, waiting, running, wave, kv, adm, progress = self
        # the usual case in one expression; the checks one by one name a bad field
        if not (
            type(waiting) is int
            and type(running) is int
            and type(wave) is int
            and 0 <= waiting <= MAX_COUNT
            and 0 <= running <= MAX_COUNT
            and 0 <= wave <= MAX_WAVE
            and (step is None or (type(step) is int and 0 <= step <= MAX_STEP))
        ):
            if step is not None:
                _count("step", step, MAX_STEP)
            _count("wave", wave, MAX_WAVE)
            _count("waiting", waiting)
            _count("running", running)
        if kv is not None and not (type(kv) is float and 0.0 <= kv <= 1.0):
            if isinstance(kv, bool) or not isinstance(kv, int | float):
                raise InvalidReport(f"kv_usage must be a number in [0, 1], got {kv!r}")
            if not (math.isfinite(kv) and 0.0 <= kv <= 1.0):
                raise InvalidReport(f"kv_usage must be in [0, 1], got {kv!r}")
        if adm is not None:
            if (
                isinstance(adm, str | bytes)
                or not isinstance(adm, Sequence)
                or len(adm) > MAX_CLIENTS
            ):
                raise InvalidReport(f"admitted must be a list of at most {MAX_CLIENTS} counts")
            for i, a in enumerate(adm):
                _count(f"admitted[{i}]", a, 10**15 - 1)
            if not isinstance(adm, tuple):
                return _new_counts(cls, step, waiting, running, wave, kv, tuple(adm), progress)
        return self

    @classmethod
    def _make(cls, iterable: Any) -> Counts:  # type: ignore[override]  # _replace: checked
        return cls(*iterable)

    @classmethod
    def of(cls, counts: Counts | Mapping[str, Any]) -> Counts:
        """``counts`` as Counts: a mapping of its fields is checked (InvalidReport)."""
        if isinstance(counts, Counts):
            return counts
        if not isinstance(counts, Mapping) or set(counts) - set(cls._fields):
            raise InvalidReport(f"counts must be Counts or a mapping of {', '.join(cls._fields)}")
        return cls(**counts)

    def argv(self, mode: str) -> list[str]:
        """ARGV 5..10 of lua/report.lua and the progress flag, for ``mode``."""
        step, waiting, running, wave, kv, adm, progress = self
        if mode == "lockstep":
            if step is None:
                raise InvalidReport("step is required in lockstep mode (or use mode='tick')")
            wave_s, step_s = str(wave), str(step)
        elif step is not None:
            raise InvalidReport("step must not be given in tick mode: the server assigns the tick")
        else:
            wave_s, step_s = "0", "tick"
        return [
            wave_s,
            step_s,
            str(waiting),
            str(running),
            "" if kv is None else f"{kv:.4f}",
            "" if adm is None else ",".join(map(str, adm)),
            "1" if progress else "0",
        ]


INCARNATION_RE = re.compile(r"[A-Za-z0-9]{1,12}-[0-9a-fA-F]{1,27}")


def new_incarnation(now_ms: int | None = None) -> str:
    """A name for one reporting process: its start time (ms, base 36) and a random
    part, so that the barrier orders a restarted process after the one it replaces
    (lua/includes/incarnation.lua). Clocks of the hosts must agree to within the
    time a restart takes; a process whose clock is behind is refused as a conflict
    until the record it would replace expires."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        ms, d = divmod(ms, 36)
        text = digits[d] + text
        if ms == 0:
            return f"{text}-{secrets.token_hex(4)}"


def _heartbeat_s(mode: str, heartbeat_s: float | None) -> float:
    if heartbeat_s is None:
        return 0.02 if mode == "tick" else 0.25
    if isinstance(heartbeat_s, bool) or not isinstance(heartbeat_s, int | float):
        raise ValueError(f"heartbeat_s must be a number of seconds, got {heartbeat_s!r}")
    if not (math.isfinite(heartbeat_s) and heartbeat_s > 0):
        raise ValueError(f"heartbeat_s must be finite and > 0, got {heartbeat_s!r}")
    return float(heartbeat_s)


@dataclass(frozen=True, slots=True)
class _Wait:
    """A report handed over with ``wait=True``: its outcome, once the sender has it."""

    fut: concurrent.futures.Future[ReportResult]
    timeout: float | None
    queued: ReportResult  # the answer when the wait times out

    def block(self) -> ReportResult:
        try:
            return self.fut.result(self.timeout)
        except concurrent.futures.TimeoutError:
            return self.queued

    async def wait(self) -> ReportResult:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.fut), self.timeout)
        except asyncio.TimeoutError:
            return self.queued


class _Reporter:
    """The one implementation both reporters run: names, the engine's lane in a
    sender, the hand-over, stats, and the closing sequence (a coroutine)."""

    _threaded = False  # the blocking facade runs its sender on a private loop thread

    def __init__(
        self,
        redis_url: str | None = None,
        deployment: str = "default",
        engine_id: str = "0",
        *,
        mode: str = "lockstep",
        sender: ReportSender | None = None,
        client: Any = None,
        heartbeat: bool = True,
        heartbeat_s: float | None = None,
        backoff_s: float = 0.2,
        register: bool | None = None,
        url: str | None = None,
        incarnation: str | None = None,
    ) -> None:
        # names and mode first: bad input raises before any client, thread or key exists
        self.engine_id = check_name(engine_id, "engine_id")
        if incarnation is not None and (
            not isinstance(incarnation, str) or not INCARNATION_RE.fullmatch(incarnation)
        ):
            raise ValueError(
                "incarnation must look like new_incarnation() makes it, "
                f"'<start ms base 36>-<hex>', got {incarnation!r}"
            )
        # where gateways send this engine's requests: written to the deployment's urls
        # hash by the sender (and again every few seconds, so it survives a state loss)
        self.engine_url = check_url(url) if url is not None else None
        self.keys = DeploymentKeys(check_name(deployment, "deployment"))
        if mode not in MODES:
            raise InvalidReport(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.heartbeat_s = _heartbeat_s(mode, heartbeat_s)
        self._closed = False
        self._owns_sender = sender is None and client is None
        if self._threaded and client is not None:
            raise ValueError(
                "EngineReporter sends from its own event loop: pass redis_url, or "
                "sender=ReportSender(redis_url, threaded=True) to share one"
            )
        if self._threaded and sender is not None and sender.background is None:
            raise ValueError("an EngineReporter's sender must be ReportSender(..., threaded=True)")
        if sender is None:
            if client is not None:
                sender = ReportSender.for_client(client, backoff_s=backoff_s)
            elif self._threaded:  # one sender thread per process and Redis URL
                sender = ReportSender.for_url(redis_url, threaded=True, backoff_s=backoff_s)
            else:
                sender = ReportSender(redis_url, backoff_s=backoff_s)
        self.sender = sender
        self.client = sender.client_for(self.keys.deployment)
        self.url = sender.url
        self.scripts = sender.scripts_for(self.keys)
        # this process's name in the barrier: a later reporter of the same engine id
        # replaces this one's record (a restart); this one's reports are then refused.
        # Processes that report one engine together pass one shared incarnation.
        self.incarnation = incarnation or new_incarnation()
        self._lane = Lane(
            self.engine_id,
            self.scripts,
            self.heartbeat_s if heartbeat else None,
            incarnation=self.incarnation,
        )
        self._lane.url = self.engine_url
        sender.attach(self._lane)
        if register if register is not None else self._threaded:
            sender.submit_register(self._lane, False)

    def _hand_over(
        self,
        step: int | None = None,
        waiting: int = 0,
        running: int = 0,
        wave: int = 0,
        *,
        kv_usage: float | None = None,
        admitted: Sequence[int] | None = None,
        progress: bool = True,
        wait: bool = False,
        timeout: float | None = 10.0,
    ) -> ReportResult | _Wait:
        counts = Counts(step, waiting, running, wave, kv_usage, admitted, progress)
        return self._submit(counts.argv(self.mode), wait, timeout)

    def _submit(self, args: list[str], wait: bool, timeout: float | None) -> ReportResult | _Wait:
        """Hand a checked report to the sender."""
        tag = tag_of(args) if self.mode == "lockstep" else None
        out = self.sender.submit(self._lane, args, tag, wait)
        if isinstance(out, ReportResult):
            return out
        return _Wait(out, timeout, ReportResult("queued", 0, *tag_of(args)))

    async def _close(self, leave: bool, timeout: float) -> None:
        """Deliver what is queued (up to ``timeout``), then leave or just detach."""
        if self._closed:
            return
        self._closed = True
        await self.sender.flush(self._lane, timeout)
        if leave:
            await self.sender.leave(self._lane)
        else:
            self.sender.detach(self._lane)

    @property
    def stats(self) -> ReporterStats:
        """This engine's report counters: queued, sent, coalesced, unavailable, ..."""
        with self.sender._lock:
            counts = dict(self._lane.counts)
        return ReporterStats(**{f.name: counts.get(f.name, 0) for f in fields(ReporterStats)})

    @property
    def stale_count(self) -> int:
        return self.stats.stale

    @property
    def unavailable_count(self) -> int:
        return self.stats.unavailable

    @property
    def coalesced_count(self) -> int:
        return self.stats.coalesced


S = TypeVar("S")  # the reporter a report method is made for
P = ParamSpec("P")
R = TypeVar("R")
_HandOver = Callable[Concatenate[S, P], ReportResult | _Wait]


def _expose(
    finish: Callable[[ReportResult | _Wait], R], doc: str
) -> Callable[[_HandOver[S, P]], Callable[Concatenate[S, P], R]]:
    """A public report method made from ``_Reporter._hand_over`` (its one signature)
    and what the caller gets: a result, a blocking wait, or an awaitable."""

    def make(
        fn: Callable[Concatenate[S, P], ReportResult | _Wait],
    ) -> Callable[Concatenate[S, P], R]:
        @functools.wraps(fn)
        def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            return finish(fn(self, *args, **kwargs))

        method.__doc__ = doc
        return method

    return make


def _blocking(out: ReportResult | _Wait) -> ReportResult:
    return out if isinstance(out, ReportResult) else out.block()


async def _awaited(out: ReportResult | _Wait) -> ReportResult:
    return out if isinstance(out, ReportResult) else await out.wait()


def _queued(out: ReportResult | _Wait) -> ReportResult:
    return out if isinstance(out, ReportResult) else out.queued


_REPORT_DOC = """Hand counts for (wave, step) to the sender; returns at once.

Returns ReportResult("queued"), or "stale" at once when (wave, step) is older than
this engine's newest report. ``wait=True`` waits (up to ``timeout``) for this
report's outcome: "accepted", "stale", "conflict" (a process started later reports
under this engine id), "unavailable" (Redis unreachable: the sender keeps the
counts and retries) or "coalesced" (newer counts replaced it).

``progress=False`` says the engine's loop did not move since its last report (a
re-send of unchanged counts, as the heartbeat is): an engine with work queued or
running that makes no progress for ``stall_after_ms`` is stalled (not routed to)."""


class AsyncEngineReporter(_Reporter):
    """Reports one engine's counts (asyncio); ``report()`` never waits on Redis.

    The sender runs on the caller's event loop: a private one per reporter, one per
    ``client=`` (reporters sharing a client share a sender: one round trip for all
    their engines), or ``sender=``. ``report_nowait()`` is ``report()`` without await.
    With ``heartbeat=True`` the sender re-sends the latest counts when the engine has
    not reported for ``heartbeat_s`` (0.25 s lockstep, one tick in tick mode).
    ``register=True`` hands over a registration at once (inside a running loop);
    by default call ``await register()``.
    """

    report = _expose(_awaited, _REPORT_DOC)(_Reporter._hand_over)
    report_nowait = _expose(_queued, _REPORT_DOC)(_Reporter._hand_over)

    async def register(self, *, wait: bool = False, timeout: float = 10.0) -> bool | None:
        """Announce this engine before its first report (the first snapshot waits for
        it); with ``wait=True`` whether it was added (False: known already, or Redis
        unreachable), else None at once."""
        fut = self.sender.submit_register(self._lane, wait)
        if fut is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            return None

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every report handed over is delivered; False after ``timeout``."""
        return await self.sender.flush(self._lane, timeout)

    async def aclose(self, leave: bool = True, timeout: float = 2.0) -> None:
        """Deliver what is queued (up to ``timeout``) and (by default) leave gracefully."""
        closing = not self._closed
        await self._close(leave, timeout)
        if closing and self._owns_sender:
            await self.sender.aclose()

    async def __aenter__(self) -> AsyncEngineReporter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class EngineReporter(_Reporter):
    """Blocking facade of the same reporter: the sender runs on its own event loop in
    a daemon thread, so ``report()`` never waits on Redis (``wait=True`` to wait).

    Constructing it hands over a registration (``register=False`` to skip), so the
    deployment's first snapshot waits for this engine. Share ``sender=
    ReportSender(redis_url, threaded=True)`` between the reporters of a process and
    their reports travel together.
    """

    _threaded = True

    @property
    def _bg(self) -> BackgroundLoop:
        assert self.sender.background is not None
        return self.sender.background

    report = _expose(_blocking, _REPORT_DOC)(_Reporter._hand_over)

    def register(self, *, wait: bool = False, timeout: float = 10.0) -> bool | None:
        """Announce this engine (see AsyncEngineReporter.register)."""
        fut = self.sender.submit_register(self._lane, wait)
        if fut is None:
            return None
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return None

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every report handed over is delivered; False after ``timeout``."""
        return self._bg.run(self.sender.flush(self._lane, timeout), timeout + 5)

    def close(self, leave: bool = True, timeout: float = 2.0) -> None:
        """Deliver what is queued (up to ``timeout``) and (by default) leave gracefully."""
        if self._closed or not self._bg.running:
            return
        with contextlib.suppress(TimeoutError):
            self._bg.run(self._close(leave, timeout), timeout + 5)
        if self._owns_sender and self.sender.release():
            self.sender.close()

    def __enter__(self) -> EngineReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
