"""What requests actually got from each engine: one router's outcome state machine.

An engine's reports say what it thinks it is doing; this module keeps what the
requests sent to it got (invariant "Outcomes over self-reports" in
docs/DESIGN.md). Per engine:

- **healthy**: routed normally;
- **ejected** after a failure (connect refused or reset, 5xx, 429, no first
  byte within ``first_byte_bound()``, a stream that stopped): not chosen until
  a back-off ends. The back-off starts at ``base_s`` and doubles with every
  ejection that follows the previous one within ``forget_s`` (a probe that
  failed, or an engine that failed again soon after it came back), up to
  ``max_s``;
- **probing** (half-open) once the back-off ended: still not chosen by the
  policy, but one real request at a time goes to it (``take_probe``); an answer
  (``answered``) makes it healthy, a failure ejects it again for longer. Only the
  probe's own end frees the way for the next one: a probe whose stream was named
  stalled is still in flight (it ends at the idle-read bound, or flows again), and
  what other requests got says nothing of it, so a stalled engine never holds more
  than one probe of a router. A probe that proved nothing (a stream
  that ended before the point where the engine's streams stall: ``unproven``) is
  neither: the next one waits the back-off again.

An ejection never lapses into "healthy": only an answer clears it. Pure logic
on a clock the caller passes; ``RouterCore`` merges it with the deployment's
marks (the suspect operation, ``lua/suspect.lua``) and sends what it learns
there. Not thread-safe by itself: ``RouterCore`` holds its lock around it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from redisbal.errors import InvalidArgument

# failure kinds: evidence against an engine (``RouterCore.failed``)
FAILURES = frozenset(
    {
        "connect",  # connection refused / could not connect: the engine never got it
        "reset",  # connection reset or dropped before an answer
        "5xx",  # a 500, 502, 503 or 504 answer
        "429",  # too many requests
        "first_byte_timeout",  # no first byte within first_byte_bound()
        "idle_timeout",  # a stream stopped producing tokens
        # its streams under way went silent far beyond its usual gap between chunks while
        # other engines' streams flowed (redisbal.routing.stream_gaps); the streams go on
        "stall",
        "timeout",  # the whole response took too long
        "error",  # anything else the caller saw (failed() without a kind)
        # a 401, 403 or 404 for what another engine of the deployment accepted with the
        # same credentials and model: a wrong engine key, a missing model or LoRA there
        "401",
        "403",
        "404",
    }
)
# waits given up, no evidence against an engine whose counts say requests wait for room
# there (``RouterCore.queues``): the request was most likely one of them
QUEUE_WAITS = frozenset({"first_byte_timeout", "idle_timeout"})
# what a request can end with (``outcome()``): ok and rejected are no evidence
OUTCOMES = FAILURES | {"ok", "rejected"}
HEALTHY, EJECTED, PROBING = "healthy", "ejected", "probing"
# An engine whose reports stopped this long ago (a forced snapshot names it a laggard)
# is silent: its reporter heartbeats from a thread of its own, so its process is
# stopped or gone. A silent engine is neither chosen nor probed until it reports
# again (redisbal.routing.unanswered), and a request waiting on it is given up early.
SILENT_AFTER_S = 0.5
# How long a request waits for the first byte of an engine that answered none of the
# router's requests yet, before it is given up and sent elsewhere (within
# first_byte_max_s): its pace is unknown, and a fresh server's first answer (a first
# prefill, compiling, warming caches on a busy host) is its slowest. Giving up early
# doubles the work of an engine that is alive; the engine is passed over well before
# (``late_bound``), which costs nothing.
FIRST_BYTE_UNANSWERED_S = 10.0


@dataclass
class EngineHealth:
    """One engine's outcome state (times on the tracker's clock)."""

    state: str = HEALTHY
    level: int = 0  # back-off doublings of the current run of ejections
    until: float = 0.0  # ejected until
    ejected_at: float = -math.inf  # the last ejection
    probe_at: float | None = None  # a probe in flight since
    next_probe: float = -math.inf  # no probe before (a probe that proved nothing)
    failures: Counter[str] = field(default_factory=Counter)  # since it was last healthy
    first_failure: float = 0.0
    ttfb: float | None = None  # EWMA of the time to first byte, seconds


class OutcomeTracker:
    """Per-engine outcome states of one router (module doc)."""

    ttfb_alpha = 0.1  # weight of a new first-byte time in the EWMA
    # an engine that leaves a request waiting for its first byte this many times its
    # usual first-byte time (at least late_min_s) is passed over until it answers
    late_factor = 4.0
    late_min_s = 0.25

    def __init__(
        self,
        *,
        base_s: float = 0.125,
        max_s: float = 1.0,
        forget_s: float = 10.0,
        first_byte_factor: float = 8.0,
        first_byte_min_s: float = 3.0,
        first_byte_max_s: float = 30.0,
    ) -> None:
        for name, v in (("base_s", base_s), ("max_s", max_s), ("forget_s", forget_s)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
                raise InvalidArgument(f"{name} must be finite and > 0, got {v!r}")
        if base_s > max_s:
            raise InvalidArgument(f"base_s ({base_s}) must not exceed max_s ({max_s})")
        if not 0 <= first_byte_factor < math.inf:
            raise InvalidArgument(
                f"first_byte_factor must be finite and >= 0, got {first_byte_factor}"
            )
        if not 0 < first_byte_min_s <= first_byte_max_s < math.inf:
            raise InvalidArgument(
                "first_byte_min_s and first_byte_max_s must be finite, > 0 and in order, got "
                f"{first_byte_min_s!r} and {first_byte_max_s!r}"
            )
        self.base_s, self.max_s, self.forget_s = base_s, max_s, forget_s
        self.first_byte_factor = first_byte_factor
        self.first_byte_min_s, self.first_byte_max_s = first_byte_min_s, first_byte_max_s
        self.engines: dict[str, EngineHealth] = {}
        self.marked: set[str] = set()  # engines not healthy (ejected or probing)
        self.counters: Counter[str] = Counter()  # ejections, recoveries, capped, probes

    def health(self, engine: str) -> EngineHealth:
        h = self.engines.get(engine)
        if h is None:
            h = self.engines[engine] = EngineHealth()
        return h

    def state(self, engine: str, now: float) -> str:
        """healthy, ejected or probing (an ejection whose back-off ended)."""
        h = self.engines.get(engine)
        if h is None:
            return HEALTHY
        if h.state == EJECTED and now >= h.until:
            h.state = PROBING
        return h.state

    def failure(
        self, engine: str, kind: str, now: float, *, may_eject: bool = True, probe: bool = True
    ) -> bool:
        """A request to ``engine`` failed with ``kind`` (``FAILURES``). Returns True
        when this ejected it (the caller tells the deployment). ``may_eject`` False
        (too many engines ejected already) records the evidence only. ``probe``: the
        request may be the probe in flight, which ends with it; the caller that knows
        says False for any other request and for a stalled stream (it goes on), so
        that a new probe waits for the one in flight."""
        if kind not in FAILURES:
            raise InvalidArgument(f"kind must be one of {sorted(FAILURES)}, got {kind!r}")
        h = self.health(engine)
        state = self.state(engine, now)
        if not h.failures:
            h.first_failure = now
        h.failures[kind] += 1
        if probe:
            h.probe_at = None
        if state == EJECTED:
            return False  # (a request sent before the ejection: no new evidence of time)
        if not may_eject:
            self.counters["capped"] += 1
            return False
        recent = now - h.ejected_at < self.forget_s
        h.level = h.level + 1 if state == PROBING or recent else 0
        h.state, h.ejected_at = EJECTED, now
        self.marked.add(engine)
        h.until = now + self.backoff(h.level)
        self.counters["ejections"] += 1
        return True

    def backoff(self, level: int) -> float:
        """The ejection time after ``level`` doublings."""
        return float(min(self.max_s, self.base_s * 2.0 ** min(level, 60)))

    def answered(
        self, engine: str, now: float, first_byte_s: float | None = None, probe: bool = True
    ) -> bool:
        """``engine`` answered a request (its first byte, within the bound). Returns True
        when that ended an ejection (it was probing: healthy again). An answer while
        ejected is to a request sent before: it clears nothing. ``probe``: as for
        ``failure``."""
        h = self.health(engine)
        if first_byte_s is not None and first_byte_s >= 0:
            a = self.ttfb_alpha
            h.ttfb = first_byte_s if h.ttfb is None else h.ttfb + a * (first_byte_s - h.ttfb)
        state = self.state(engine, now)
        if probe:
            h.probe_at = None
        if state == EJECTED:
            return False
        h.next_probe = -math.inf
        recovered = state == PROBING
        if recovered:
            self.counters["recoveries"] += 1
        h.state = HEALTHY
        h.failures.clear()
        self.marked.discard(engine)
        return recovered

    def take_probe(self, engine: str, now: float) -> bool:
        """Whether the next request may go to ``engine`` as a probe: none is in flight
        (or the one in flight is older than the longest first-byte bound: lost)."""
        h = self.health(engine)
        if h.probe_at is not None and now - h.probe_at < self.first_byte_max_s:
            return False
        if now < h.next_probe:
            return False
        h.probe_at = now
        self.counters["probes"] += 1
        return True

    def unproven(self, engine: str, now: float) -> None:
        """A probe of ``engine`` ended without proving it (its stream ended before the
        point where the engine's streams stalled: a short answer passes a stall that
        holds longer ones). No answer and no failure: the next probe waits the
        current back-off, so that short answers do not probe it back to back."""
        h = self.health(engine)
        h.probe_at = None
        h.next_probe = now + self.backoff(h.level)

    def release_probe(self, engine: str) -> None:
        """The probe in flight to ``engine`` ended without an answer or a failure (never
        sent, the client left): the next request may probe."""
        h = self.engines.get(engine)
        if h is not None:
            h.probe_at = None

    def first_byte_bound(self, engine: str) -> float:
        """How long to wait for ``engine``'s first byte: ``first_byte_factor`` times what
        it usually takes, within [first_byte_min_s, first_byte_max_s]; until it answered
        one, ``FIRST_BYTE_UNANSWERED_S`` (at least the floor, at most the ceiling)."""
        h = self.engines.get(engine)
        if self.first_byte_factor == 0:
            return self.first_byte_max_s
        if h is None or h.ttfb is None:  # answered none yet (FIRST_BYTE_UNANSWERED_S)
            bound = max(self.first_byte_min_s, FIRST_BYTE_UNANSWERED_S)
            return min(self.first_byte_max_s, bound)
        bound = self.first_byte_factor * h.ttfb
        return min(self.first_byte_max_s, max(self.first_byte_min_s, bound))

    def late_bound(self, engine: str) -> float | None:
        """How long a request may wait for ``engine``'s first byte before the engine is
        passed over (not failed: ``RouterCore.sent``): ``late_factor`` times what it
        usually takes, within [late_min_s, first_byte_bound()]. Until it answered one,
        ``first_byte_min_s``: passed over where a known engine would be given up."""
        h = self.engines.get(engine)
        if h is None or h.ttfb is None:
            return min(self.first_byte_min_s, self.first_byte_bound(engine))
        late = max(self.late_min_s, self.late_factor * h.ttfb)
        return min(late, self.first_byte_bound(engine))

    def why(self, engine: str, now: float) -> str:
        """The evidence against ``engine`` since it was last healthy, e.g.
        ``5xx x12 in 2.0s`` ("" when none)."""
        h = self.engines.get(engine)
        if h is None or not h.failures:
            return ""
        kinds = ", ".join(f"{k} x{n}" for k, n in h.failures.most_common(3))
        return f"{kinds} in {max(0.0, now - h.first_failure):.1f}s"

    def forget(self, keep: set[str]) -> None:
        """Drop the engines not in ``keep`` (gone from the deployment)."""
        for e in [e for e in self.engines if e not in keep]:
            del self.engines[e]
            self.marked.discard(e)
