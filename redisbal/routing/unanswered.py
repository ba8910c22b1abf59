"""Engines that stopped answering, noticed before a request fails on them. Pure logic
for ``RouterCore``, which holds its lock around it (docs/DESIGN.md, "Silence,
lateness and no answer").

- ``Silence``: the engines the deployment calls silent: their reports stopped, so
  the latest forced snapshot names them laggards. A snapshot republished at the
  same cut (the publish of a suspect mark names no laggard) keeps them silent; a
  later cut, which needs a report from each member, ends it.
- ``FirstByteWaits``: requests sent to an engine that wait for their first byte.
  An engine that left one waiting past its late bound (``OutcomeTracker.late_bound``)
  and answered nothing since is late: the router passes it over until it answers.
"""

from __future__ import annotations

from collections.abc import Collection

from redisbal.barrier.snapshot import Snapshot


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
