"""Engines that stopped answering, noticed before a request fails on them. Pure logic
for ``RouterCore``, which holds its lock around it (docs/DESIGN.md, "Silence,
lateness and no answer").

- ``Silence``: the engines the deployment calls silent: their reports stopped, so
  the latest forced snapshot names them laggards. A snapshot republished at the
  same cut (the publish of a suspect mark names no laggard) keeps them silent; a
  later cut, which needs a report from each member, ends it. It also keeps each
  engine's recent gaps between reports (``ReportGaps``): how long a report-less
  spell of that engine means it is stopped rather than slow.
- ``FirstByteWaits``: requests sent to an engine that wait for their first byte.
  An engine that left one waiting past its late bound (``OutcomeTracker.late_bound``)
  and answered nothing since is late: the router passes it over until it answers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from redisbal.barrier.snapshot import Snapshot
from redisbal.routing.outcomes import SILENT_AFTER_S

GAPS_KEPT = 16  # an engine's latest pauses between reports, for its silence bound
GAPS_FOR_MS = 60_000  # ... of the last minute
GAP_RANK = 0.9  # the bound scales with this rank of them (one odd gap is not the usual)
GAP_FACTOR = 3.0  # ... times this
SILENT_MAX_S = 10.0  # and never longer: a stopped process is still given up on
# an engine that answered none of the router's requests yet: its pace is unknown, and a
# fresh server's first steps (a first prefill, compiling, warming caches) are its longest
SILENT_UNANSWERED_S = 2.0
TTFB_FACTOR = 2.0  # ... nor below this x its usual time to a first byte (RouterCore)
# an engine whose latest counts, at most this old, say requests wait there queues
# (``RouterCore.queues``): a stream of it silent past the idle-read bound is waited for
# again, since vLLM sends nothing for a request it preempted until it runs it again
QUEUE_FRESH_S = 2.0


class Silence:
    """The latest forced snapshot's laggards, kept while its cut stays."""

    def __init__(self) -> None:
        self.reported_ms: dict[str, int] = {}  # engine -> Redis ms of its last report
        self._cut: tuple[str, int, int] | None = None  # (epoch, wave, step) they were named at

    def track(self, snap: Snapshot) -> None:
        """Take in the snapshot just adopted."""
        cut = (snap.epoch, snap.wave, snap.step)
        if snap.forced:
            self.reported_ms = {e: snap.time_ms - ms for e, ms in snap.laggards.items()}
            self._cut = cut
        elif cut != self._cut:  # the barrier moved: every member reported
            self.reported_ms = {}
            self._cut = None

    def ms(self, engine: str, snap: Snapshot | None) -> int:
        """How long ``engine``'s reports had stopped when ``snap`` (the latest) was
        published; 0 when it is not named. Only the snapshots' statements count, never
        the time since one came: with Redis out of reach no engine turns silent."""
        at = self.reported_ms.get(engine)
        return 0 if at is None or snap is None else max(0, snap.time_ms - at)


class ReportGaps:
    """Each engine's recent pauses between reports, as the forced snapshots show them.

    An engine reports at its step pace: a vLLM whose steps are long (a big prefill, a
    front end starved of CPU) pauses its reports and is alive; a stopped process does
    not report at all. A pause is what forced snapshots name: the engine a laggard,
    with the age of its last report. It is counted once it ends (a later snapshot no
    longer names it), so a stopped engine's ongoing silence never lengthens its own
    bound; and only while snapshots came without a pause of their own (a Redis
    outage stops everyone's reports at once: no engine's pace). Pauses older than
    ``GAPS_FOR_MS`` are forgotten: an engine back at its usual pace is soon held to
    the floor again."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}  # engine -> the longest age named in its pause
        self.gaps: dict[str, deque[tuple[int, int]]] = {}  # engine -> (ended at, ms)
        self._snap_ms = 0  # the previous snapshot's publication time
        self._cut: tuple[str, int, int] | None = None  # where the last laggards were named

    def track(self, snap: Snapshot) -> None:
        """Take in the snapshot just adopted."""
        now = snap.time_ms
        if not 0 <= now - self._snap_ms <= SILENT_AFTER_S * 1000:
            self.open.clear()  # the snapshots paused: what they say of pauses is unsure
        self._snap_ms = now
        cut = (snap.epoch, snap.wave, snap.step)
        lag = snap.laggards
        if self.open and (snap.forced or cut != self._cut):  # named again, or reported
            for eid in [e for e in self.open if e not in lag]:
                kept = self.gaps.get(eid)
                if kept is None:
                    kept = self.gaps[eid] = deque(maxlen=GAPS_KEPT)
                kept.append((now, self.open.pop(eid)))
        if snap.forced:
            self._cut = cut
            for eid, age in lag.items():
                if age > self.open.get(eid, -1):
                    self.open[eid] = age

    def silent_after_s(self, engine: str, now_ms: int) -> float:
        """How long ``engine`` may go without a report before it counts as stopped:
        ``GAP_FACTOR`` x a high rank of its pauses of the last ``GAPS_FOR_MS`` (at
        ``now_ms``, Redis time), at least ``SILENT_AFTER_S``, at most ``SILENT_MAX_S``."""
        kept = self.gaps.get(engine)
        if not kept:
            return SILENT_AFTER_S
        ranked = sorted(ms for at, ms in kept if now_ms - at <= GAPS_FOR_MS)
        if not ranked:
            return SILENT_AFTER_S
        usual = ranked[int(GAP_RANK * (len(ranked) - 1))] / 1000.0
        return min(SILENT_MAX_S, max(SILENT_AFTER_S, GAP_FACTOR * usual))

    def keep(self, engines: Collection[str]) -> None:
        """Forget the engines not in ``engines`` (a later engine of that id starts anew)."""
        for d in (self.open, self.gaps):
            for e in [e for e in d if e not in engines]:
                del d[e]


class FirstByteWaits:
    """Requests sent and not answered yet, per engine, and the engines found late."""

    def __init__(self) -> None:
        self.waiting: dict[str, dict[int, float]] = {}  # engine -> {decision seq: sent at}
        self.late: dict[str, None] = {}  # in the order they turned late: the first stay

    def __bool__(self) -> bool:
        return bool(self.waiting or self.late)

    def sent(self, engine: str, seq: int, now: float) -> None:
        self.waiting.setdefault(engine, {})[seq] = now

    def overdue(self, engine: str, now: float, bound: float | None) -> bool:
        """Whether ``engine`` left a request waiting longer than ``bound`` (None: no
        bound known) and answered none since it was sent."""
        waiting = self.waiting.get(engine)
        if not waiting or bound is None:
            return False
        return now - next(iter(waiting.values())) > bound

    def answered(self, engine: str) -> None:
        """``engine`` answered: what was sent to it before says nothing of a hang."""
        self.waiting.pop(engine, None)

    def ended(self, engine: str, seq: int) -> None:
        """The request ``seq`` waits for no first byte any more."""
        waiting = self.waiting.get(engine)
        if waiting is not None and waiting.pop(seq, None) is not None and not waiting:
            del self.waiting[engine]

    def keep(self, engines: Collection[str]) -> None:
        """Forget the engines not in ``engines`` (gone: their requests say nothing of
        a later engine of that id)."""
        for e in [e for e in self.waiting if e not in engines]:
            del self.waiting[e]
        self.late = {e: None for e in self.late if e in engines}
