"""What the other routers of a deployment have routed that the engines have not
admitted yet: told by each router over pub/sub as it routes, so that a router counts
everyone's pending routes as they are instead of scaling its own by 1 / its share.

Between an engine's report and the snapshot that holds it, a router sees its own
routes but not the others'. Each router therefore tells, a few milliseconds after it
routes (``COALESCE_S``), its cumulative routes to each engine's current process and
its requests still open there; every other router subtracts what the engine admitted
from that router (the snapshot's ``admitted`` list, by client index), which is
exactly that router's routes still on their way. A router tells at least every
``TELL_EVERY_S``, so the others know it is there while it is idle; they count on the
told routes only while every other client index has been heard from within
``FRESH_S``, and fall back to the share model otherwise (a router gone, a lost
message, a deployment whose snapshots carry no admitted counts, more routers than
``MAX_ROUTERS``: every message reaches every other router).

Message (JSON on the deployment's routes channel, ``redisbal.keys``):
``{"i": client index, "e": {engine id: [incarnation or null, routes, open]}}``, with
only the engines whose counts changed since the last message (none: a heartbeat).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import orjson

from redisbal.routing.views import EngineView

COALESCE_S = 0.002  # routes made within this of each other are told in one message
TELL_EVERY_S = 0.5  # a router tells at least this often, idle or not
FRESH_S = 1.5  # another router not heard from for this long is taken as gone
# Routers tell each other only while the deployment has at most this many: every message
# goes to every other router, N x (N - 1) deliveries; past it, the share model.
MAX_ROUTERS = 8
MAX_ENGINES = 65536  # at most this many engines in one message (more: malformed)

__all__ = [
    "COALESCE_S",
    "FRESH_S",
    "MAX_ROUTERS",
    "TELL_EVERY_S",
    "PeerRoutes",
    "encode",
    "telling",
]


def telling(count: int) -> bool:
    """Whether ``count`` routers tell each other their routes."""
    return 1 < count <= MAX_ROUTERS


def encode(index: int, counts: Mapping[str, tuple[str | None, int, int]]) -> bytes:
    """A message telling ``counts`` (engine id -> (incarnation, routes, open))."""
    return orjson.dumps({"i": index, "e": {k: list(v) for k, v in counts.items()}})


def _decode(data: bytes | str) -> tuple[int, dict[str, tuple[str | None, int, int]]]:
    """(client index, counts) of a message; ValueError when it is not one."""
    msg = orjson.loads(data)
    if not isinstance(msg, dict):
        raise ValueError("not an object")
    index, engines = msg.get("i"), msg.get("e", {})
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1 << 20:
        raise ValueError(f"bad client index {index!r}")
    if not isinstance(engines, dict) or len(engines) > MAX_ENGINES:
        raise ValueError("bad engines")
    counts: dict[str, tuple[str | None, int, int]] = {}
    for eid, c in engines.items():
        if not (isinstance(c, list) and len(c) == 3):
            raise ValueError(f"bad counts for {eid!r}")
        inc, routes, open_ = c
        if inc is not None and not isinstance(inc, str):
            raise ValueError(f"bad incarnation for {eid!r}")
        for n in (routes, open_):
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 1 << 62:
                raise ValueError(f"bad count for {eid!r}")
        counts[eid] = (inc, routes, open_)
    return index, counts


class PeerRoutes:
    """A router's side of the exchange: the other routers' told counts and when each
    was last heard from, and which of its own counts changed since it last told.

    ``told[engine][index] = (incarnation, routes, open)``; an entry with nothing left
    on its way is dropped when counted, so the table holds only routes in transit.
    ``live``: every other client index was heard from within FRESH_S, and the
    snapshots carry admitted counts to subtract (``exact``; without them nothing told
    could be counted): then a router's ``EngineView.others`` hold the count and its
    own routes count 1.
    """

    def __init__(self) -> None:
        self.told: dict[str, dict[int, tuple[str | None, int, int]]] = {}
        self.heard: dict[int, float] = {}
        self.live = False
        self.exact = True  # the latest snapshot's counts had admitted counts (the core's)
        self.changed: set[str] = set()  # own counts changed since the last message
        self.due = False  # a route is among them: the message is owed soon
        self.on_change: Callable[[], None] | None = None  # when a message becomes due
        self.messages = 0
        self.malformed = 0

    # -- telling ------------------------------------------------------------------------------

    def mark(self, engine_id: str, route: bool) -> None:
        """This router's counts for ``engine_id`` changed: a route (or one taken back)
        is told within COALESCE_S; an end only changes the cap on what is on its way
        (requests open), so it goes with the next message, a heartbeat at the latest:
        half the messages where requests last longer than the coalescing window."""
        self.changed.add(engine_id)
        if route and not self.due:
            self.due = True
            if self.on_change is not None:
                self.on_change()

    def message(self, views: Mapping[str, EngineView], index: int) -> bytes:
        """The message telling the counts that changed since the last one (a
        heartbeat when none did)."""
        counts = {}
        for eid in self.changed:
            e = views.get(eid)
            if e is not None:
                counts[eid] = (e.incarnation, max(0, e.routed - e.routed_before), e.inflight)
        self.changed.clear()
        self.due = False
        return encode(index, counts)

    # -- hearing ------------------------------------------------------------------------------

    def hear(
        self, data: bytes | str, own_index: int, now: float, known: Mapping[str, object]
    ) -> list[str] | None:
        """Take one message in; returns the engines it told about that are ``known``
        (the others are not kept: None of them can be routed to here), or None for a
        malformed message or this router's own."""
        try:
            index, counts = _decode(data)
        except ValueError:  # (orjson.JSONDecodeError is one)
            self.malformed += 1
            return None
        if index == own_index:
            return None
        self.messages += 1
        self.heard[index] = now
        ids = [eid for eid in counts if eid in known]
        for eid in ids:
            self.told.setdefault(eid, {})[index] = counts[eid]
        return ids

    def count(
        self,
        views: Iterable[EngineView] | None,
        known: Mapping[str, EngineView],
        own_index: int,
        count: int,
        now: float,
    ) -> list[EngineView]:
        """Set ``others`` of ``views`` (None: of the engines something was told about;
        every ``known`` one when ``live`` flips); returns the views changed. While not
        live every ``others`` is 0 already: nothing to count."""
        heard = self.heard
        live = (
            self.exact
            and telling(count)
            and all(i == own_index or now - heard.get(i, -math.inf) < FRESH_S for i in range(count))
        )
        if live != self.live:
            self.live, views = live, known.values()
        elif not live:
            return []
        elif views is None:  # (an engine with others > 0 has an entry in told)
            views = [known[eid] for eid in self.told if eid in known]
        changed = []
        for e in views:
            n = self._pending(e, count) if live and e.exact else 0.0
            if n != e.others:
                e.others = n
                changed.append(e)
        return changed

    def _pending(self, e: EngineView, count: int) -> float:
        """The other routers' routes to ``e`` (its current process) that its admitted
        counts (by client index) do not hold yet, each at most the requests that
        router still has open there. Entries with nothing left on its way, of another
        process or of an index no longer in use are dropped."""
        told = self.told.get(e.engine_id)
        if not told:
            return 0.0
        admitted = e.admitted or []
        total = 0
        for i, (inc, routes, open_) in list(told.items()):
            left = min(routes - (admitted[i] if i < len(admitted) else 0), open_)
            if left > 0 and inc == e.incarnation and i < count:
                total += left
            else:
                del told[i]
        if not told:
            del self.told[e.engine_id]
        return float(total)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what was told about engines not in ``keep`` (gone from the deployment)."""
        keep = set(keep)
        for eid in [e for e in self.told if e not in keep]:
            del self.told[eid]
