"""Reports for several engines of one deployment from one process, one call per round.

A process that speaks for several engines (a vLLM front-end with several DP engines,
a sidecar scraping a page that lists several engines, ``redisbal engine-sim``) hands
each engine's counts over as an engine reporter does, and one sender carries the
newest counts of all of them in one lua/report_many.lua call per round: the call's
entry, the barrier's fields and the publish check are paid once for all the engines,
and a snapshot is published at most once per call.

Per engine it is an engine reporter (``redisbal.reporting.reporter``): ``report()`` never waits
on Redis, bad counts raise InvalidReport before anything is handed over, the newest
report of each engine is coalesced into the next call, at most one call is in
flight, outages are retried, idle engines heartbeat, results and stats are per
engine. ``report_many()`` checks every engine's counts before it hands any over.

One implementation (``_Batch``): ``AsyncBatchReporter`` runs its sender on the
caller's event loop, ``BatchReporter`` on the sender's private loop in a daemon
thread, as the engine reporters do.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from redisbal.keys import check_name
from redisbal.reporting.lane import MAX_REPORTS, ReporterStats, ReportResult
from redisbal.reporting.reporter import (
    AsyncEngineReporter,
    Counts,
    EngineReporter,
    InvalidReport,
    _awaited,
    _blocking,
    _expose,
    _queued,
    _Reporter,
    _Wait,
    new_incarnation,
)
from redisbal.reporting.sender import ReportSender

__all__ = ["MAX_ENGINES", "AsyncBatchReporter", "BatchReporter"]

MAX_ENGINES = MAX_REPORTS  # engines of one batch reporter: one report_many call holds them


def check_engine_ids(engine_ids: Iterable[str]) -> list[str]:
    """The engine ids, checked: names, each once, at most MAX_ENGINES."""
    if isinstance(engine_ids, str | bytes):
        raise ValueError(f"engine_ids must be a list of engine ids, got {engine_ids!r}")
    ids = [check_name(e, "engine_id") for e in engine_ids]
    if len(ids) > MAX_ENGINES:
        raise ValueError(f"a batch reporter reports at most {MAX_ENGINES} engines, got {len(ids)}")
    twice = sorted({e for e in ids if ids.count(e) > 1}) if len(set(ids)) < len(ids) else []
    if twice:
        raise ValueError(f"engine id {twice[0]!r} given twice")
    return ids


class _Batch:
    """The one implementation both batch reporters run: one engine reporter per engine
    (``_engine_class``), all on one sender made with ``batch=True``."""

    _engine_class: type[_Reporter] = AsyncEngineReporter
    _threaded = False

    def __init__(
        self,
        redis_url: str | None = None,
        deployment: str = "default",
        engine_ids: Iterable[str] = (),
        *,
        mode: str = "lockstep",
        sender: ReportSender | None = None,
        client: Any = None,
        heartbeat: bool = True,
        heartbeat_s: float | None = None,
        backoff_s: float = 0.2,
        register: bool | None = None,
        urls: Mapping[str, str] | None = None,
        incarnation: str | None = None,
    ) -> None:
        ids = check_engine_ids(engine_ids)
        self.urls = dict(urls or {})
        unknown = sorted(set(self.urls) - set(ids))
        if unknown:
            raise ValueError(f"urls names engine {unknown[0]!r}, which is not in engine_ids")
        check_name(deployment, "deployment")
        if sender is not None and not sender.batch:
            raise ValueError("a batch reporter's sender must be ReportSender(..., batch=True)")
        if self._threaded and client is not None:
            raise ValueError("BatchReporter sends from its own event loop: pass redis_url")
        self._owns_sender = sender is None
        if sender is None:
            sender = ReportSender(
                redis_url, client=client, threaded=self._threaded, batch=True, backoff_s=backoff_s
            )
        self.sender = sender
        self.deployment = deployment
        # one process: one incarnation for all its engines (lua/includes/incarnation.lua)
        self.incarnation = incarnation or new_incarnation()
        self._options: dict[str, Any] = dict(
            mode=mode, heartbeat=heartbeat, heartbeat_s=heartbeat_s, register=register
        )
        self._reporters: dict[str, _Reporter] = {}
        self._closed = False
        for eid in ids:
            self.add(eid, self.urls.get(eid))

    def add(self, engine_id: str, url: str | None = None) -> None:
        """Report for one more engine (registered as the constructor's engines are)."""
        check_name(engine_id, "engine_id")
        if engine_id in self._reporters:
            return
        if len(self._reporters) >= MAX_ENGINES:
            raise ValueError(f"a batch reporter reports at most {MAX_ENGINES} engines")
        self._reporters[engine_id] = self._engine_class(
            deployment=self.deployment,
            engine_id=engine_id,
            sender=self.sender,
            url=url,
            incarnation=self.incarnation,
            **self._options,
        )

    @property
    def engine_ids(self) -> list[str]:
        return list(self._reporters)

    def _reporter(self, engine_id: str) -> _Reporter:
        rep = self._reporters.get(engine_id)
        if rep is None:
            raise InvalidReport(f"unknown engine {engine_id!r}: not one of this batch's engines")
        return rep

    def _hand_over(
        self,
        engine_id: str,
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
        rep = self._reporter(engine_id)
        counts = Counts(step, waiting, running, wave, kv_usage, admitted, progress)
        return rep._submit(counts.argv(rep.mode), wait, timeout)

    def _hand_over_many(
        self, reports: Mapping[str, Counts | Mapping[str, Any]], wait: bool, timeout: float | None
    ) -> dict[str, ReportResult | _Wait]:
        """Check every engine's counts, then hand them all over (none on a bad one)."""
        if not isinstance(reports, Mapping):
            raise InvalidReport("reports must map engine ids to their counts")
        checked = []
        for eid, counts in reports.items():
            rep = self._reporter(eid)
            try:
                checked.append((rep, Counts.of(counts).argv(rep.mode)))
            except InvalidReport as exc:
                raise InvalidReport(f"engine {eid}: {exc}") from None
        return {rep.engine_id: rep._submit(args, wait, timeout) for rep, args in checked}

    @property
    def stats(self) -> dict[str, ReporterStats]:
        """Each engine's report counters (queued, sent, accepted, stale, coalesced, ...)."""
        return {eid: rep.stats for eid, rep in self._reporters.items()}

    async def _flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for rep in self._reporters.values():
            if not await self.sender.flush(rep._lane, max(0.0, deadline - time.monotonic())):
                return False
        return True

    async def _close_all(self, leave: bool, timeout: float) -> None:
        """Deliver what is queued (up to ``timeout``), then leave or just detach."""
        if self._closed:
            return
        self._closed = True
        await self._flush(timeout)
        await asyncio.gather(
            *(rep._close(leave, 0.0) for rep in self._reporters.values()), return_exceptions=True
        )


_REPORT_DOC = """Hand engine ``engine_id``'s counts to the sender; returns at once (see
AsyncEngineReporter.report: "queued", or with ``wait=True`` this report's outcome)."""
_MANY_DOC = """Hand several engines' counts over: ``{engine_id: Counts(...)}`` (or a mapping
of Counts' fields: ``{"step": ..., "waiting": ..., "running": ...}``). Every engine's counts are
checked first (InvalidReport names the engine and the field; nothing is handed over);
returns each engine's ReportResult."""


class AsyncBatchReporter(_Batch):
    """Reports several engines' counts (asyncio), one report_many call per round.

    The sender runs on the caller's event loop (a private one per batch reporter, on
    ``redis_url`` or ``client=``, or ``sender=ReportSender(..., batch=True)``).
    ``register=True`` registers the engines at once (inside a running loop); by
    default call ``await register()``.
    """

    report = _expose(_awaited, _REPORT_DOC)(_Batch._hand_over)
    report_nowait = _expose(_queued, _REPORT_DOC)(_Batch._hand_over)

    async def report_many(
        self,
        reports: Mapping[str, Counts | Mapping[str, Any]],
        *,
        wait: bool = False,
        timeout: float | None = 10.0,
    ) -> dict[str, ReportResult]:
        outs = self._hand_over_many(reports, wait, timeout)
        return {
            eid: out if isinstance(out, ReportResult) else await out.wait()
            for eid, out in outs.items()
        }

    report_many.__doc__ = _MANY_DOC

    async def register(self) -> None:
        """Announce every engine before its first report (the first snapshot waits)."""
        for rep in self._reporters.values():
            self.sender.submit_register(rep._lane, False)

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every report handed over is delivered; False after ``timeout``."""
        return await self._flush(timeout)

    async def aclose(self, leave: bool = True, timeout: float = 2.0) -> None:
        """Deliver what is queued (up to ``timeout``) and (by default) leave gracefully."""
        closing = not self._closed
        await self._close_all(leave, timeout)
        if closing and self._owns_sender:
            await self.sender.aclose()

    async def __aenter__(self) -> AsyncBatchReporter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class BatchReporter(_Batch):
    """Blocking facade of the same batch reporter: its sender runs on its own event loop
    in a daemon thread, so ``report()`` never waits on Redis (``wait=True`` to wait).
    Constructing it registers the engines (``register=False`` to skip)."""

    _engine_class = EngineReporter
    _threaded = True

    def _run(self, coro: Any, timeout: float) -> Any:
        assert self.sender.background is not None
        return self.sender.background.run(coro, timeout)

    report = _expose(_blocking, _REPORT_DOC)(_Batch._hand_over)

    def report_many(
        self,
        reports: Mapping[str, Counts | Mapping[str, Any]],
        *,
        wait: bool = False,
        timeout: float | None = 10.0,
    ) -> dict[str, ReportResult]:
        outs = self._hand_over_many(reports, wait, timeout)
        return {eid: o if isinstance(o, ReportResult) else o.block() for eid, o in outs.items()}

    report_many.__doc__ = _MANY_DOC

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every report handed over is delivered; False after ``timeout``."""
        return bool(self._run(self._flush(timeout), timeout + 5))

    def close(self, leave: bool = True, timeout: float = 2.0) -> None:
        """Deliver what is queued (up to ``timeout``) and (by default) leave gracefully."""
        bg = self.sender.background
        if self._closed or bg is None or not bg.running:
            return
        with contextlib.suppress(TimeoutError):
            self._run(self._close_all(leave, timeout), timeout + 10)
        if self._owns_sender:
            self.sender.close()

    def __enter__(self) -> BatchReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
