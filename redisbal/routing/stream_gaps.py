"""Streams that stop mid-way: the gaps between an engine's chunks, against its usual.

An engine whose streams stop after their first chunks (a hung detokenizer, a wedged
output loop, a network path dead mid-response) keeps its connections open and its
reports healthy, and the first-byte rule never fires: each new stream gets its first
chunks. What gives it away, all together:

- its streams under way went silent far beyond the gaps it usually leaves between
  chunks (a high rank of its recent gaps, known once it left enough of them: the role
  chunk and the first token come together, and one stream's first gaps are no usual)
  and beyond its very latest gaps (an engine turning slow is slow before its usual
  says so);
- other engines' streams flow at their own usual pace meanwhile (a host or a caller's
  loop starved of CPU slows every engine's streams at once: no evidence against one);
- where the caller knows when the engine last stepped (its reports' progress, through
  the deployment's snapshots), it stepped well after its streams' latest chunk: an
  engine in a long step (a big prefill, a front end starved of CPU) has no token to
  send and is slow, and one whose reports stopped is stopped (the silence rule's).

That is evidence against the engine (``RouterCore.stalled``, kind ``stall``), long
before an idle-read timeout ends the streams. Only a stream that flows past the point
where its streams stalled proves it again (``flowed``): a short answer that ends within
the chunks a stall lets through proves nothing (``RouterCore.unproven``).

Pure logic on a clock the caller passes: the gateway's ``StreamWatch`` calls
``check`` a few times a second while streams are open; a library user relaying
streams itself does the same (``opened``, ``chunk``, ``closed``, ``check``). Not
thread-safe: one event loop or the caller's lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from redisbal.errors import InvalidArgument

GAPS_KEPT = 32  # an engine's latest gaps between chunks, for its usual
GAP_RANK = 0.9  # its usual gap is this rank of them (bursts of chunks read at once are 0)
RECENT = 4  # ... or, for its own bound, the longest of its latest gaps, if longer


@dataclass(eq=False)
class Stream:
    """One open stream: its engine, when its latest chunk came, how many came."""

    engine: str
    since: float  # its first chunk
    last: float
    chunks: int = 0
    token: object = None  # the caller's (the gateway keeps the Decision here)


@dataclass
class _Engine:
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=GAPS_KEPT))
    usual: float | None = None  # GAP_RANK of ``gaps``, once ``known`` of them came
    recent: float = 0.0  # the longest of its latest RECENT gaps
    latest: float = 0.0  # the latest gap of any of its streams
    last: float = -math.inf  # the latest chunk of any of its streams
    streams: set[Stream] = field(default_factory=set)


class StreamGaps:
    """Open streams per engine and each engine's usual gap between chunks (module doc).
    An engine's bound is ``factor`` x its usual gap (or its longest of the latest
    ``RECENT``, if longer: an engine turning slow raises its own bound at once), at
    least ``min_s``, at most ``max_s``; its pace bound ``pace`` x its usual gap (at
    least a fifth of ``min_s``). ``check`` names an engine when every stream of it
    under way for its bound has waited that long for its next chunk, another engine's
    streams flow at their pace (neither their latest gap nor their silence now past
    their pace bound), and the engine stepped, as far as the caller knows, half its
    bound after that latest chunk; once per stall: an engine named is named again
    only after one of its streams got a chunk. An engine is judged once ``known`` gaps
    of it came."""

    def __init__(
        self,
        factor: float = 10.0,
        min_s: float = 0.5,
        max_s: float = 5.0,
        pace: float = 5.0,
        known: int = 8,
    ) -> None:
        if not 0 < factor < math.inf:
            raise InvalidArgument(f"factor must be finite and > 0, got {factor!r}")
        if not 0 < min_s <= max_s < math.inf:
            raise InvalidArgument(
                f"min_s and max_s must be finite, > 0 and in order, got {min_s!r} and {max_s!r}"
            )
        if not 1 <= pace < math.inf:
            raise InvalidArgument(f"pace must be finite and >= 1, got {pace!r}")
        if isinstance(known, bool) or not isinstance(known, int) or not 1 <= known <= GAPS_KEPT:
            raise InvalidArgument(f"known must be a whole number in 1..{GAPS_KEPT}, got {known!r}")
        self.factor, self.min_s, self.max_s = factor, min_s, max_s
        self.pace, self.known = pace, known
        self.engines: dict[str, _Engine] = {}
        self.named: set[str] = set()  # engines named since their last chunk
        # engine -> the fewest chunks its streams got before they stalled (at its
        # namings), until one of its streams ends past it (``flowed``)
        self.stalled_at: dict[str, int] = {}
        self.open = 0  # streams open now

    def opened(self, engine: str, now: float, token: object = None) -> Stream:
        """A stream of ``engine`` got its first chunk at ``now``."""
        e = self.engines.get(engine)
        if e is None:
            e = self.engines[engine] = _Engine()
        s = Stream(engine, now, now, 1, token)
        e.streams.add(s)
        e.last = max(e.last, now)
        self.open += 1
        return s

    def chunk(self, s: Stream, now: float) -> None:
        """Another chunk of ``s`` came at ``now``."""
        e = self.engines[s.engine]
        gap = e.latest = now - s.last
        # a stall is no usual gap: it counts as the bound at most
        e.gaps.append(gap if e.usual is None else min(gap, self._bound(max(e.usual, e.recent))))
        if e.usual is None and len(e.gaps) >= self.known:
            self._refresh(e)
        s.last, e.last = now, now
        s.chunks += 1
        if self.named:
            self.named.discard(s.engine)

    def closed(self, s: Stream) -> None:
        """``s`` ended (done, failed, or its client left)."""
        e = self.engines.get(s.engine)
        if e is not None and s in e.streams:
            e.streams.discard(s)
            self.open -= 1

    def flowed(self, s: Stream) -> bool:
        """``s`` ended whole: whether it got more chunks than its engine's streams got
        before they stalled (True when none was named stalled since one last did). A
        stream that did forgets the point: the engine streams whole answers again."""
        point = self.stalled_at.get(s.engine)
        if point is not None and s.chunks <= point:
            return False
        self.stalled_at.pop(s.engine, None)
        return True

    def _refresh(self, e: _Engine) -> None:
        """Its usual and recent gaps from the gaps kept (in ``check``, not per chunk)."""
        ranked = sorted(e.gaps)
        e.usual = ranked[int(GAP_RANK * (len(ranked) - 1))]
        e.recent = max(e.gaps[-i] for i in range(1, min(RECENT, len(e.gaps)) + 1))

    def _bound(self, usual: float) -> float:
        return min(self.max_s, max(self.min_s, self.factor * usual))

    def usual(self, engine: str) -> float | None:
        """``engine``'s usual gap between two chunks of a stream; None until known."""
        e = self.engines.get(engine)
        return None if e is None else e.usual

    def bound(self, engine: str) -> float | None:
        """How long a stream of ``engine`` may wait for its next chunk before it counts
        as stalled (from its usual gap, or its latest ones if longer); None until its
        usual gap is known."""
        e = self.engines.get(engine)
        if e is None or e.usual is None:
            return None
        self._refresh(e)
        return self._bound(max(e.usual, e.recent))

    def _flowing(self, o: _Engine, now: float) -> bool:
        """Whether ``o``'s streams flow at its usual pace now: neither its latest gap
        nor its silence since past its pace bound."""
        if not o.streams or o.usual is None:
            return False
        return max(now - o.last, o.latest) <= max(self.pace * o.usual, self.min_s / 5)

    def check(
        self, now: float, stepped: Callable[[str], float | None] | None = None
    ) -> list[tuple[str, Stream, float]]:
        """The engines stalled at ``now``, not named before: (engine, its longest-waiting
        stream, the seconds it waited). ``stepped(engine)``: when the engine last
        stepped, on this clock, as its reports say (None: not known)."""
        out: list[tuple[str, Stream, float]] = []
        for eid, e in self.engines.items():
            if not e.streams or eid in self.named or e.usual is None:
                continue
            self._refresh(e)
            assert e.usual is not None
            bound = self._bound(max(e.usual, e.recent))
            # its streams under way for the bound at least (a new one gets its first
            # chunks from an engine that stalls mid-way): all silent for the bound
            under_way = [s for s in e.streams if now - s.since >= bound]
            if not under_way or any(now - s.last < bound for s in under_way):
                continue
            if stepped is not None:
                at = stepped(eid)
                if at is not None and at < max(s.last for s in under_way) + bound / 2:
                    continue  # no step since its streams' last chunk: slow, or stopped
            if not any(self._flowing(o, now) for oid, o in self.engines.items() if oid != eid):
                continue  # no other engine at its pace: the host or the caller is slow
            oldest = min(under_way, key=lambda s: s.last)
            self.named.add(eid)
            point = min(s.chunks for s in under_way)
            self.stalled_at[eid] = min(point, self.stalled_at.get(eid, point))
            out.append((eid, oldest, now - oldest.last))
        return out

    def forget(self, keep: set[str]) -> None:
        """Drop the engines not in ``keep`` that have no open stream."""
        for eid in [e for e, v in self.engines.items() if e not in keep and not v.streams]:
            del self.engines[eid]
            self.named.discard(eid)
            self.stalled_at.pop(eid, None)
