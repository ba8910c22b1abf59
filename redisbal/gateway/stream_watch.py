"""Streams that stop mid-way, caught within about a second: one deployment's open
streams and its engines' usual gaps between chunks (redisbal.routing.stream_gaps),
checked every ``CHECK_EVERY_S`` by one timer while any stream is open.

An engine whose streams under way all went silent far beyond its usual gap, while
other engines' streams flow at their pace and its reports say it stepped since (an
engine in a long step is slow, not stalled: ``AsyncRouter.stepped_s``), is reported
to the router (``stalled()``: kind ``stall``, ejected here and marked suspect for
every router of the deployment) and said in the log (once a minute while it keeps
stalling). The streams themselves go on: one that stays silent still ends at the
idle-read bound (``--idle-timeout-s``) with an error event. A probe of it answers
only once its stream flows to its end past the point where its streams stalled
(``flowed``; the proxy's ``_relay``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redisbal.routing.router import AsyncRouter
from redisbal.routing.state import Decision
from redisbal.routing.stream_gaps import Stream, StreamGaps
from redisbal.routing.unanswered import GAP_FACTOR, SILENT_MAX_S

log = logging.getLogger("redisbal.gateway")

CHECK_EVERY_S = 0.1
WARN_EVERY_S = 60.0  # an engine that keeps stalling (each probe's stream) is said once a minute


class StreamWatch:
    """The open streams of one deployment (module doc). ``on_stall(engine, ejected)``
    is called for each engine named stalled (the gateway's metrics)."""

    def __init__(
        self,
        router: AsyncRouter,
        label: str = "",
        on_stall: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.router, self.label, self.on_stall = router, label, on_stall
        self.gaps = StreamGaps()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned: dict[str, float] = {}  # engine -> loop time of its last warning

    def opened(self, d: Decision) -> Stream:
        """The stream of ``d`` got its first chunk."""
        loop = self._loop = asyncio.get_running_loop()
        s = self.gaps.opened(d.engine_id, loop.time(), d)
        if self._timer is None:
            self._timer = loop.call_later(CHECK_EVERY_S, self._check, loop)
        return s

    def chunk(self, s: Stream) -> None:
        """Another chunk of ``s`` came."""
        assert self._loop is not None
        self.gaps.chunk(s, self._loop.time())

    def closed(self, s: Stream) -> None:
        self.gaps.closed(s)

    def flowed(self, s: Stream) -> bool:
        """``s`` ended whole: whether it flowed past the point where its engine's
        streams stalled (``StreamGaps.flowed``): only then does a probe answer."""
        return self.gaps.flowed(s)

    def silent_after_s(self, engine_id: str) -> float:
        """How long ``engine_id``'s reports may stop before a request waiting on it is
        given up (``SilenceWatch``): the router's bound (``AsyncRouter.silent_after_s``),
        and at least ``GAP_FACTOR`` x its usual gap between chunks (within
        ``SILENT_MAX_S``): each chunk is a step, so an engine that streams slowly steps
        slowly, and its reports pause as long while it is alive."""
        bound = self.router.silent_after_s(engine_id)
        usual = self.gaps.usual(engine_id)
        return bound if usual is None else max(bound, min(SILENT_MAX_S, GAP_FACTOR * usual))

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()

        def stepped(eid: str) -> float | None:
            ago = self.router.stepped_s(eid)
            return None if ago is None else now - ago

        for eid, s, waited in self.gaps.check(now, stepped):
            gap = self.gaps.usual(eid) or 0.0
            what = f"streams silent {waited:.1f}s mid-way (usually {gap:.3f}s between chunks)"
            assert isinstance(s.token, Decision)
            ejected = self.router.stalled(s.token, f"engine {eid}: {what}")
            said = now - self._warned.get(eid, -WARN_EVERY_S) < WARN_EVERY_S
            if not said:
                self._warned[eid] = now
            log.log(
                logging.DEBUG if said else logging.WARNING,
                "gateway: engine %s%s: %s while it steps and other engines' streams flow; %s",
                self.label,
                eid,
                what,
                "passed over until a probe's stream flows" if ejected else "noted",
            )
            if self.on_stall is not None:
                self.on_stall(eid, ejected)
        if self.gaps.open:  # the timer runs only while a stream is open
            self._timer = loop.call_later(CHECK_EVERY_S, self._check, loop)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
