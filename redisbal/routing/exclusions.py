"""The engines one router passes over now, and why. Pure logic for ``RouterCore``,
which holds its lock around it (its module docstring says which engines and why).

Four sources, merged into one choosable list whenever any of them changes:
- the snapshot: engines it names stalled (until the next snapshot), suspect (a
  router's ejection, until its back-off ends) or probing;
- silence: engines whose reports stopped ``SILENT_AFTER_S`` ago (``Silence``);
- this router's own evidence: engines ejected or probing on the outcomes of its
  requests (``OutcomeTracker``);
- lateness: engines that left a request waiting past its late bound for a first
  byte (``FirstByteWaits``), at most half of the engines.
"""

from __future__ import annotations

import math

from redisbal.barrier.snapshot import Snapshot
from redisbal.routing.outcomes import EJECTED, PROBING, SILENT_AFTER_S, OutcomeTracker
from redisbal.routing.state import EngineView
from redisbal.routing.unanswered import FirstByteWaits, ReportGaps, Silence


class Exclusions:
    """Which known engines a router does not choose, and the probes it owes."""

    def __init__(self, outcomes: OutcomeTracker) -> None:
        self.outcomes = outcomes  # this router's evidence (shared with RouterCore)
        # engine -> local clock until which it is not chosen (inf: until the next snapshot)
        self.by_snapshot: dict[str, float] = {}
        self.probing_by_snapshot: set[str] = set()  # the snapshot's probing and suspect ones
        self.answered_here: set[str] = set()  # of those, the ones a probe here answered
        self.probing: list[str] = []  # probing now (here or in the snapshot): probes go there
        self.silence = Silence()  # engines whose reports stopped
        self.gaps = ReportGaps()  # each engine's recent gaps between reports
        self.waits = FirstByteWaits()  # requests waiting for a first byte, late engines
        self.recheck_at = math.inf  # when the next exclusion runs out
        self.all_excluded = False  # every known engine is excluded: choose among all
        self.avoided: set[str] = set()  # excluded, while some engine is not

    def choosable(
        self, known: list[EngineView], by_id: dict[str, EngineView], now: float
    ) -> list[EngineView]:
        """The known engines not excluded or probing at ``now`` (all of them when every
        one is); sets the probing ones and when to look again."""
        out = self.outcomes
        excluded = {e for e, until in self.by_snapshot.items() if until > now}
        untils = [t for t in self.by_snapshot.values() if t > now]
        probing = self.probing_by_snapshot - self.answered_here - excluded
        for e in out.marked:
            state = out.state(e, now)
            if state == EJECTED:
                excluded.add(e)
                untils.append(out.engines[e].until)
            elif state == PROBING and e not in excluded:
                probing.add(e)
        probing -= excluded  # ejected here: no probe, whatever the snapshot says
        avoid = excluded | probing
        # late engines (no first byte yet): a preference, so at most half of them all
        room = len(known) // 2 - len(avoid)
        for e in self.waits.late:
            if room > 0 and e not in avoid and e in by_id:
                avoid.add(e)
                room -= 1
        choosable = [e for e in known if e.engine_id not in avoid]
        self.all_excluded = not choosable and bool(known)
        self.avoided = avoid if choosable else set()
        self.probing = [e for e in by_id if e in probing] if choosable else []
        self.recheck_at = min(untils, default=math.inf)
        return choosable or known

    def adopt(self, snap: Snapshot, now: float) -> bool:
        """Take in the snapshot just adopted; returns whether any engine is or was excluded
        or probing (then the choosable engines must be made again)."""
        self.silence.track(snap)
        self.gaps.track(snap)
        excluded = dict.fromkeys(snap.stalled, math.inf)  # until the next snapshot
        for eid, ms_left in snap.suspect.items():
            excluded[eid] = now + ms_left / 1000.0
        for eid in self.silence.reported_ms:  # stopped or gone: until it reports again
            if self.silence.ms(eid, snap) >= SILENT_AFTER_S * 1000:
                excluded[eid] = math.inf
        # marked in the snapshot: probing once its ejection ends, even with no newer
        # snapshot saying so (a mark never lapses into routable)
        was_probing = self.probing_by_snapshot
        self.probing_by_snapshot = {*snap.probing, *snap.suspect}
        # a mark in its back-off is newer than any probe answered here: probe it again
        self.answered_here &= self.probing_by_snapshot - snap.suspect.keys()
        for e in was_probing - self.probing_by_snapshot:  # cleared: some router's probe
            if self.outcomes.state(e, now) == PROBING:  # was answered (not fresh evidence)
                self.outcomes.answered(e, now, probe=False)
        prev, self.by_snapshot = self.by_snapshot, excluded
        return bool(excluded or prev or self.outcomes.marked or was_probing or snap.probing)

    def why(self, now: float, snap: Snapshot | None) -> dict[str, str]:
        """Engine -> why it is not chosen now (``RouterCore.excluded``)."""
        out = {e: "probing" for e in self.probing_by_snapshot - self.answered_here}
        for e in self.outcomes.marked:
            state = self.outcomes.state(e, now)
            out[e] = "suspect" if state == EJECTED else "probing"
        for e, t in self.by_snapshot.items():
            if t > now:
                if snap is not None and e in snap.stalled:
                    out[e] = "stalled"
                elif t == math.inf:
                    out[e] = "silent"
                else:
                    out[e] = "suspect"
        for e in self.waits.late:
            if e in self.avoided:
                out.setdefault(e, "late")
        return out

    def failed(self, engine: str, kind: str, now: float, known: int, ends_probe: bool) -> bool:
        """A request failed on ``engine``: eject it with a back-off unless half of the
        ``known`` engines are ejected or probing already; whether it was ejected now.
        ``ends_probe``: the request was the probe in flight and ends now."""
        self.answered_here.discard(engine)
        marked = self.outcomes.marked | self.probing_by_snapshot
        marked.update(e for e, t in self.by_snapshot.items() if t > now)
        may_eject = engine in marked or len(marked) + 1 <= known // 2
        return self.outcomes.failure(engine, kind, now, may_eject=may_eject, probe=ends_probe)

    def answered(self, engine: str, now: float, took: float, probe: bool) -> tuple[bool, bool]:
        """A request on ``engine`` got its first byte after ``took`` s: whether to tell the
        deployment (a probing engine answered), and whether the choosable engines change."""
        out = self.outcomes
        if not out.marked and engine not in self.probing_by_snapshot:
            out.answered(engine, now, took, probe)  # (the steady case: no state changes)
            return False, False
        recovered = out.answered(engine, now, took, probe)
        tell = (probe or recovered) and engine in self.probing_by_snapshot - self.answered_here
        if tell:
            self.answered_here.add(engine)
        return tell, recovered or tell
