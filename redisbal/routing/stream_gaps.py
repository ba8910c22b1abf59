"""Streams that stop mid-way: the gaps between an engine's chunks, against its usual.

An engine whose streams stop after their first chunks (a hung detokenizer, a wedged
output loop, a network path dead mid-response) keeps its connections open and its
reports healthy, and the first-byte rule never fires: each new stream gets its first
chunks. What gives it away is the gap: its streams go silent far beyond the gaps it
usually leaves between chunks, none of its streams has had a chunk since, and the
other engines' streams flow meanwhile (so neither the caller's own event loop nor
the host stalled everything). That is evidence against the engine
(``RouterCore.stalled``, kind ``stall``), long before an idle-read timeout ends the
streams.

Pure logic on a clock the caller passes: the gateway's ``StreamWatch`` calls
``check`` a few times a second while streams are open; a library user relaying
streams itself does the same (``opened``, ``chunk``, ``closed``, ``check``). Not
thread-safe: one event loop or the caller's lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from redisbal.errors import InvalidArgument


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
    gap: float | None = None  # EWMA of the gap between two chunks of one stream, seconds
    last: float = -math.inf  # the latest chunk of any of its streams
    streams: set[Stream] = field(default_factory=set)


class StreamGaps:
    """Open streams per engine and each engine's usual gap between chunks (module doc).
    When every stream of an engine under way for its bound (``factor`` x its usual gap,
    at least ``min_s``, at most ``max_s``) has waited that long for its next chunk,
    and another engine's stream had a chunk within that time, ``check`` names it;
    once per stall: an engine named is named again only after one of its streams got a
    chunk."""

    alpha = 0.05  # weight of a new gap in the EWMA

    def __init__(self, factor: float = 10.0, min_s: float = 0.5, max_s: float = 5.0) -> None:
        if not 0 < factor < math.inf:
            raise InvalidArgument(f"factor must be finite and > 0, got {factor!r}")
        if not 0 < min_s <= max_s < math.inf:
            raise InvalidArgument(
                f"min_s and max_s must be finite, > 0 and in order, got {min_s!r} and {max_s!r}"
            )
        self.factor, self.min_s, self.max_s = factor, min_s, max_s
        self.engines: dict[str, _Engine] = {}
        self.named: set[str] = set()  # engines named since their last chunk
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
        gap = now - s.last
        if e.gap is not None:  # a stall is no usual gap: it counts as the bound at most
            gap = min(gap, min(self.max_s, max(self.min_s, self.factor * e.gap)))
        e.gap = gap if e.gap is None else e.gap + self.alpha * (gap - e.gap)
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

    def bound(self, engine: str) -> float | None:
        """How long a stream of ``engine`` may wait for its next chunk before it counts
        as stalled; None until a gap of it is known."""
        e = self.engines.get(engine)
        if e is None or e.gap is None:
            return None
        return min(self.max_s, max(self.min_s, self.factor * e.gap))

    def check(self, now: float) -> list[tuple[str, Stream, float]]:
        """The engines stalled at ``now``, not named before: (engine, its longest-waiting
        stream, the seconds it waited)."""
        out: list[tuple[str, Stream, float]] = []
        for eid, e in self.engines.items():
            if not e.streams or eid in self.named:
                continue
            bound = self.bound(eid)
            if bound is None:
                continue
            # its streams under way for the bound at least (a new one gets its first
            # chunks from an engine that stalls mid-way): all silent for the bound
            under_way = [s for s in e.streams if now - s.since >= bound]
            if not under_way or any(now - s.last < bound for s in under_way):
                continue
            flowing = any(
                o.streams and now - o.last < bound for oid, o in self.engines.items() if oid != eid
            )
            if not flowing:
                continue  # every engine quiet: the host or the caller stalled, not it
            oldest = min(under_way, key=lambda s: s.last)
            self.named.add(eid)
            out.append((eid, oldest, now - oldest.last))
        return out

    def forget(self, keep: set[str]) -> None:
        """Drop the engines not in ``keep`` that have no open stream."""
        for eid in [e for e, v in self.engines.items() if e not in keep and not v.streams]:
            del self.engines[eid]
            self.named.discard(eid)
