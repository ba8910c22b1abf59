"""Engine side: hand step-tagged counts of one engine or many to a sender that reports
them into the barrier.

``report()`` never waits on Redis, whatever Redis does (down, frozen, paused,
failing over): it checks the counts (bad input raises InvalidReport before
anything is handed over), gives them to the engine's slot in a ``ReportSender``
and returns ``ReportResult("queued")``. The sender coalesces per engine, sends in
the background (one round trip for every engine it holds), retries through
outages with a back-off and re-sends the latest counts as a heartbeat;
``redisbal.reporting.sender`` says how it orders and coalesces. A caller that wants one
report's outcome passes ``wait=True``; ``flush()`` waits for everything.

One reporter speaks for one engine or many (``engines``, ``add()``): a process
that reports several engines (a vLLM front-end with several DP engines, a sidecar
scraping several engines, ``redisbal engine-sim``) hands each engine's counts over
the same way, and its sender carries the newest counts of all of them in one
lua/report_many.lua call per round (the call's entry, the barrier's fields and the
publish check are paid once; a snapshot is published at most once per call).
``report_many()`` checks every engine's counts before it hands any over.

One implementation, written with asyncio: ``AsyncReporter`` runs its sender on the
caller's event loop; ``Reporter`` is its blocking twin, the same code with its
sender on a private loop in a daemon thread (``redisbal.background``), as ``Router``
runs ``AsyncRouter``. Both hand counts over from the caller's thread, without
waiting for any loop.

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
import math
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from redisbal.endpoints import check_url
from redisbal.errors import InvalidArgument
from redisbal.keys import DeploymentKeys, check_name
from redisbal.reporting.counts import MODES, Counts, InvalidReport
from redisbal.reporting.lane import Lane, ReporterStats, ReportResult, tag_of
from redisbal.reporting.sender import MAX_REPORTS, ReportSender
from redisbal.running_caps import check_running_cap

__all__ = [
    "MAX_ENGINES",
    "AsyncReporter",
    "Counts",
    "InvalidReport",
    "ReportResult",
    "Reporter",
    "ReporterStats",
    "new_incarnation",
]

MAX_ENGINES = MAX_REPORTS  # engines of one reporter: one report_many call holds them
CountsLike = Counts | Mapping[str, Any]

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
        raise InvalidArgument(f"heartbeat_s must be a number of seconds, got {heartbeat_s!r}")
    if not (math.isfinite(heartbeat_s) and heartbeat_s > 0):
        raise InvalidArgument(f"heartbeat_s must be finite and > 0, got {heartbeat_s!r}")
    return float(heartbeat_s)


def _engine_ids(engines: str | Iterable[str]) -> list[str]:
    """The engine ids, checked: names, each once, at most MAX_ENGINES."""
    if isinstance(engines, str | bytes) or not isinstance(engines, Iterable):
        engines = [engines]  # one engine (a bad one: check_name says why)
    ids = [check_name(e, "engine_id") for e in engines]
    if len(ids) > MAX_ENGINES:
        raise InvalidArgument(f"a reporter reports at most {MAX_ENGINES} engines, got {len(ids)}")
    twice = sorted({e for e in ids if ids.count(e) > 1}) if len(set(ids)) < len(ids) else []
    if twice:
        raise InvalidArgument(f"engine id {twice[0]!r} given twice")
    return ids


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


def _blocking(out: ReportResult | _Wait) -> ReportResult:
    return out if isinstance(out, ReportResult) else out.block()


async def _awaited(out: ReportResult | _Wait) -> ReportResult:
    return out if isinstance(out, ReportResult) else await out.wait()


Registering = list[concurrent.futures.Future[bool]] | None  # None: nothing to wait for


class _Reporting:
    """What both reporters are: names, the engines' slots (``Lane``) in a sender, the
    hand-over (any thread, never waits), stats, and flushing and closing (coroutines,
    run on the sender's loop)."""

    _threaded = False  # the blocking twin runs its sender on a private loop thread

    def __init__(
        self,
        redis_url: str | None = None,
        deployment: str = "default",
        engines: str | Iterable[str] = (),
        *,
        mode: str = "lockstep",
        sender: ReportSender | None = None,
        client: Any = None,
        heartbeat: bool = True,
        heartbeat_s: float | None = None,
        backoff_s: float = 0.2,
        register: bool | None = None,
        url: str | None = None,
        urls: Mapping[str, str] | None = None,
        incarnation: str | None = None,
        running_cap: int | None = None,
    ) -> None:
        # names, URLs and mode first: bad input raises before any client, thread or key
        ids = _engine_ids(engines)
        given = dict(urls or {})
        if url is not None:
            if len(ids) != 1:
                raise InvalidArgument(
                    "url= is for a reporter of one engine: pass urls={engine: url}"
                )
            given[ids[0]] = url
        unknown = sorted(set(given) - set(ids))
        if unknown:
            raise InvalidArgument(f"urls names engine {unknown[0]!r}, which is not in engines")
        # where gateways send each engine's requests: written to the deployment's urls
        # hash by the sender (and again every few seconds, so it survives a state loss)
        engine_urls = {eid: check_url(u) for eid, u in given.items()}
        # how many requests each engine runs at once, declared to routers once per engine
        # (redisbal.running_caps): the same for all of them, as a server's DP ranks share it
        self.running_cap = None if running_cap is None else check_running_cap(running_cap)
        if incarnation is not None and (
            not isinstance(incarnation, str) or not INCARNATION_RE.fullmatch(incarnation)
        ):
            raise InvalidArgument(
                "incarnation must look like new_incarnation() makes it, "
                f"'<start ms base 36>-<hex>', got {incarnation!r}"
            )
        self.keys = DeploymentKeys(check_name(deployment, "deployment"))
        if mode not in MODES:
            raise InvalidReport(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.heartbeat_s = _heartbeat_s(mode, heartbeat_s)
        self._heartbeat = heartbeat
        self._register = register if register is not None else self._threaded
        self._closed = False
        self._owns_sender = sender is None and client is None
        if self._threaded and client is not None:
            raise InvalidArgument(
                "Reporter sends from its own event loop: pass redis_url, or "
                "sender=ReportSender(redis_url, threaded=True) to share one"
            )
        if self._threaded and sender is not None and sender.background is None:
            raise InvalidArgument("a Reporter's sender must be ReportSender(..., threaded=True)")
        if sender is None:
            if client is not None:  # reporters made with one client share its sender
                sender = ReportSender.for_client(client, batch=True, backoff_s=backoff_s)
            elif self._threaded:  # one sender thread per process and Redis URL
                sender = ReportSender.for_url(
                    redis_url, threaded=True, batch=True, backoff_s=backoff_s
                )
            else:
                sender = ReportSender(redis_url, batch=True, backoff_s=backoff_s)
        self.sender = sender
        self.client = sender.client_for(self.keys.deployment)
        self.url = sender.url
        self.scripts = sender.scripts_for(self.keys)
        # this process's name in the barrier: a later reporter of the same engine id
        # replaces this one's record (a restart); this one's reports are then refused.
        # One process: one incarnation for all its engines; processes that report one
        # engine together pass one shared incarnation.
        self.incarnation = incarnation or new_incarnation()
        self._lanes: dict[str, Lane] = {}
        for eid in ids:
            self._attach(eid, engine_urls.get(eid), self.running_cap)

    def add(self, engine_id: str, url: str | None = None, running_cap: int | None = None) -> None:
        """Report for one more engine (registered as the constructor's engines are);
        ``url``: where gateways send its requests; ``running_cap``: how many it runs at
        once [default: the reporter's]. An engine added before is kept."""
        check_name(engine_id, "engine_id")
        cap = self.running_cap if running_cap is None else check_running_cap(running_cap)
        if engine_id not in self._lanes:
            self._attach(engine_id, check_url(url) if url is not None else None, cap)

    def _attach(self, engine_id: str, url: str | None, running_cap: int | None = None) -> None:
        if len(self._lanes) >= MAX_ENGINES:
            raise InvalidArgument(f"a reporter reports at most {MAX_ENGINES} engines")
        lane = Lane(
            engine_id,
            self.scripts,
            self.heartbeat_s if self._heartbeat else None,
            incarnation=self.incarnation,
        )
        lane.url = url
        lane.running_cap = running_cap
        self.sender.attach(lane)
        self._lanes[engine_id] = lane
        if self._register:
            self.sender.submit_register(lane, False)

    @property
    def engines(self) -> list[str]:
        """The ids of the engines this reporter speaks for, in the order they were added."""
        return list(self._lanes)

    def lane(self, engine: str | None = None) -> Lane:
        """The engine's slot in the sender (for integrations that tune its heartbeat or
        pause it). ``engine`` may be omitted when the reporter has one engine."""
        if engine is None:
            if len(self._lanes) != 1:
                raise InvalidReport(
                    f"name the engine (engine=...): this reporter has {len(self._lanes)} engines"
                )
            return next(iter(self._lanes.values()))
        lane = self._lanes.get(engine)
        if lane is None:
            raise InvalidReport(f"unknown engine {engine!r}: not one of this reporter's engines")
        return lane

    def stats(self, engine: str | None = None) -> ReporterStats:
        """The engine's report counters: queued, sent, coalesced, unavailable, ...
        (``engine`` may be omitted when the reporter has one engine)."""
        lane = self.lane(engine)
        with self.sender._lock:
            counts = dict(lane.counts)
        return ReporterStats(**{f.name: counts.get(f.name, 0) for f in fields(ReporterStats)})

    def _hand_over(
        self, counts: CountsLike, engine: str | None, wait: bool, timeout: float | None
    ) -> ReportResult | _Wait:
        lane = self.lane(engine)
        return self._submit(lane, Counts.of(counts).argv(self.mode), wait, timeout)

    def _hand_over_many(
        self, reports: Mapping[str, CountsLike], wait: bool, timeout: float | None
    ) -> dict[str, ReportResult | _Wait]:
        """Check every engine's counts, then hand them all over (none on a bad one)."""
        if not isinstance(reports, Mapping):
            raise InvalidReport("reports must map engine ids to their counts")
        checked = []
        for eid, counts in reports.items():
            lane = self.lane(eid)
            try:
                checked.append((lane, Counts.of(counts).argv(self.mode)))
            except InvalidReport as exc:
                raise InvalidReport(f"engine {eid}: {exc}") from None
        return {lane.engine_id: self._submit(lane, args, wait, timeout) for lane, args in checked}

    def _submit(
        self, lane: Lane, args: list[str], wait: bool, timeout: float | None
    ) -> ReportResult | _Wait:
        """Hand a checked report to the sender."""
        tag = tag_of(args) if self.mode == "lockstep" else None
        out = self.sender.submit(lane, args, tag, wait)
        if isinstance(out, ReportResult):
            return out
        return _Wait(out, timeout, ReportResult("queued", 0, *tag_of(args)))

    def _hand_over_register(self, engine: str | None, wait: bool) -> Registering:
        """Registrations of ``engine`` (every engine when None); the futures when waited for."""
        lanes = list(self._lanes.values()) if engine is None else [self.lane(engine)]
        futs = [self.sender.submit_register(lane, wait) for lane in lanes]
        return [f for f in futs if f is not None] if wait and None not in futs else None

    async def _flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for lane in list(self._lanes.values()):
            if not await self.sender.flush(lane, max(0.0, deadline - time.monotonic())):
                return False
        return True

    async def _close(self, leave: bool, timeout: float) -> None:
        """Deliver what is queued (up to ``timeout``), then leave or just detach."""
        if self._closed:
            return
        self._closed = True
        await self._flush(timeout)
        lanes = list(self._lanes.values())
        if not leave:
            for lane in lanes:
                self.sender.detach(lane)
            return
        # every engine leaves (detached first); a refusal (not an outage) is raised
        left = await asyncio.gather(*map(self.sender.leave, lanes), return_exceptions=True)
        refused = next((out for out in left if isinstance(out, BaseException)), None)
        if refused is not None:
            raise refused


class AsyncReporter(_Reporting):
    """Reports the counts of one engine or many (asyncio); ``report()`` never waits on Redis.

    ``engines``: one engine id or several (``add()`` adds more). The sender runs on the
    caller's event loop: a private one per reporter on ``redis_url``, one per
    ``client=`` (reporters sharing a client share a sender: one round trip for all
    their engines), or ``sender=``. With ``heartbeat=True`` the sender re-sends an
    engine's latest counts when it has not reported for ``heartbeat_s`` (0.25 s
    lockstep, one tick in tick mode). ``url=`` (one engine) or ``urls=`` (per engine):
    where gateways send the engines' requests. ``running_cap=``: how many requests each
    engine runs at once (vLLM's ``max_num_seqs``), declared to routers once per engine
    (``redisbal.running_caps``). ``register=True`` hands over the
    registrations at once (inside a running loop); by default ``await register()``.
    """

    async def report(
        self,
        counts: CountsLike,
        *,
        engine: str | None = None,
        wait: bool = False,
        timeout: float | None = 10.0,
    ) -> ReportResult:
        """Hand ``engine``'s counts (a ``Counts``, or a mapping of its fields) over; returns
        at once. ``engine`` may be omitted when the reporter has one engine.

        Returns ReportResult("queued"), or "stale" at once when (wave, step) is older than
        this engine's newest report. ``wait=True`` waits (up to ``timeout``) for this
        report's outcome: "accepted", "stale", "conflict" (a process started later reports
        under this engine id), "unavailable" (Redis unreachable: the sender keeps the
        counts and retries; answered at once while an outage lasts) or "coalesced" (newer
        counts replaced it).

        ``Counts(progress=False)`` says the engine's loop did not move since its last
        report (a re-send of unchanged counts, as the heartbeat is): an engine with work
        queued or running that makes no progress for ``stall_after_ms`` is stalled (not
        routed to)."""
        return await _awaited(self._hand_over(counts, engine, wait, timeout))

    def report_nowait(self, counts: CountsLike, *, engine: str | None = None) -> ReportResult:
        """``report()`` without await (and without waiting for the outcome)."""
        return _blocking(self._hand_over(counts, engine, False, None))  # (nothing to wait for)

    async def report_many(
        self,
        reports: Mapping[str, CountsLike],
        *,
        wait: bool = False,
        timeout: float | None = 10.0,
    ) -> dict[str, ReportResult]:
        """Hand several engines' counts over: ``{engine_id: Counts(...)}`` (or mappings of
        Counts' fields). Every engine's counts are checked first (InvalidReport names the
        engine and the field; nothing is handed over); returns each engine's ReportResult
        (as ``report()``)."""
        outs = self._hand_over_many(reports, wait, timeout)
        return {eid: await _awaited(out) for eid, out in outs.items()}

    async def register(
        self, engine: str | None = None, *, wait: bool = False, timeout: float = 10.0
    ) -> bool | None:
        """Announce ``engine`` (every engine when None) before its first report (the first
        snapshot waits for it); with ``wait=True`` whether all were added (False: known
        already, or Redis unreachable; None after ``timeout``), else None at once."""
        futs = self._hand_over_register(engine, wait)
        if futs is None:
            return None
        try:
            added = await asyncio.wait_for(asyncio.gather(*map(asyncio.wrap_future, futs)), timeout)
        except asyncio.TimeoutError:
            return None
        return all(added)

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every report handed over is delivered; False after ``timeout``."""
        return await self._flush(timeout)

    async def aclose(self, leave: bool = True, timeout: float = 2.0) -> None:
        """Deliver what is queued (up to ``timeout``) and (by default) leave gracefully."""
        closing = not self._closed
        try:
            await self._close(leave, timeout)
        finally:
            if closing and self._owns_sender:
                await self.sender.aclose()

    async def __aenter__(self) -> AsyncReporter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Reporter(_Reporting):
    """Blocking twin of AsyncReporter: the same reporter, its sender on its own event loop
    in a daemon thread, so ``report()`` never waits on Redis (``wait=True`` to wait).

    Constructing it hands the registrations over (``register=False`` to skip), so the
    deployment's first snapshot waits for its engines. The blocking reporters of a
    process on one Redis URL share one sender thread (or pass ``sender=
    ReportSender(redis_url, threaded=True)``); their reports travel together.
    """

    _threaded = True

    def _run(self, coro: Any, timeout: float) -> Any:
        assert self.sender.background is not None
        return self.sender.background.run(coro, timeout)

    def report(
        self,
        counts: CountsLike,
        *,
        engine: str | None = None,
        wait: bool = False,
        timeout: float | None = 10.0,
    ) -> ReportResult:
        """See AsyncReporter.report: hands the counts over from this thread."""
        return _blocking(self._hand_over(counts, engine, wait, timeout))

    def report_many(
        self,
        reports: Mapping[str, CountsLike],
        *,
        wait: bool = False,
        timeout: float | None = 10.0,
    ) -> dict[str, ReportResult]:
        """See AsyncReporter.report_many."""
        return {e: _blocking(o) for e, o in self._hand_over_many(reports, wait, timeout).items()}

    def register(
        self, engine: str | None = None, *, wait: bool = False, timeout: float = 10.0
    ) -> bool | None:
        """See AsyncReporter.register."""
        futs = self._hand_over_register(engine, wait)
        if futs is None or concurrent.futures.wait(futs, timeout).not_done:
            return None
        return all(f.result() for f in futs)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every report handed over is delivered; False after ``timeout``."""
        return bool(self._run(self._flush(timeout), timeout + 5))

    def close(self, leave: bool = True, timeout: float = 2.0) -> None:
        """Deliver what is queued (up to ``timeout``) and (by default) leave gracefully."""
        bg = self.sender.background
        if self._closed or bg is None or not bg.running:
            return
        try:
            with contextlib.suppress(TimeoutError):
                self._run(self._close(leave, timeout), timeout + 10)
        finally:
            if self._owns_sender and self.sender.release():
                self.sender.close()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
