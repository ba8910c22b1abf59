"""What the other routers of a deployment have routed that the engines have not
counted yet: told by each router over pub/sub as it routes, so that a router counts
everyone's pending routes as they are instead of scaling its own by 1 / its share.

Between an engine's report and the snapshot that holds it, a router sees its own
routes but not the others'. Each router therefore tells, a few milliseconds after it
routes (``COALESCE_S``), its cumulative routes to each engine's current process and
its requests still open there. Every other router counts them as its own:

- with admitted counts, exactly: it subtracts what the engine admitted from that
  router (the snapshot's ``admitted`` list, by client index), which is exactly that
  router's routes still on their way;
- without them (vLLM's plugin, the sidecar), by time: it notes when it heard of each
  route, and counts the ones heard after the engine's cut (``EngineView.cut``, as its
  own pending routes: ``estimates.by_report``). A route is heard a few milliseconds
  after it is made, so this errs towards counting one a report longer.

Either way a router's count from another is at most the requests that router still
has open there. A router tells at least every ``TELL_EVERY_S``, so the others know it
is there while it is idle; they count on the told routes only while every other
client index has been heard from within ``FRESH_S``, and fall back to the share model
otherwise (a router gone, a lost message, more routers than ``MAX_ROUTERS``: every
message reaches every other router).

Routers that learn what they send each engine (``CacheView(learn=...)``, for engines
without KV events) tell each other the anchors of those routes too, so that every
router's learned view holds every router's routes, as a view from KV events would:
otherwise a prefix one router sent an engine is unknown to the others, which send it
elsewhere by load and compute it again. A chain is told whole (the receivers refresh its
recency, as the teller did), as JSON integers (any hashes of 64 bits, signed or not, as
callers of ``route(blocks=...)`` make them; a message whose chains hold a larger one
goes without its chains): a new 4,096-token prompt costs about 1.3 kB on the channel,
and each hearer about 40 us to learn it.

Message (JSON on the deployment's routes channel, ``redisbal.keys``):
``{"i": client index, "e": {engine id: [incarnation or null, routes, open]}}``, with
only the engines whose counts changed since the last message (none: a heartbeat), and,
when routes were learned meanwhile, ``"l": {engine id: [chain, ...]}``, each chain a
route's anchors, root first: a list of integers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping

import orjson

from redisbal.errors import MalformedData
from redisbal.routing.estimates import trim_costs
from redisbal.routing.state import EngineView

COALESCE_S = 0.002  # routes made within this of each other are told in one message
TELL_EVERY_S = 0.5  # a router tells at least this often, idle or not
FRESH_S = 1.5  # another router not heard from for this long is taken as gone
# Routers tell each other only while the deployment has at most this many: every message
# goes to every other router, N x (N - 1) deliveries; past it, the share model.
MAX_ROUTERS = 8
MAX_ENGINES = 65536  # at most this many engines in one message (more: malformed)
# Learned chains told per engine in one message (more made meanwhile: the oldest are not
# told), and anchors told of one chain, its first ones (more in a message: malformed; the
# gateway hashes 8,192 tokens of a prompt by default, 128 anchors).
MAX_CHAINS = 256
MAX_CHAIN = 8192

__all__ = [
    "COALESCE_S",
    "FRESH_S",
    "MAX_ROUTERS",
    "TELL_EVERY_S",
    "ToldRoutes",
    "encode",
    "telling",
]


def telling(count: int) -> bool:
    """Whether ``count`` routers tell each other their routes."""
    return 1 < count <= MAX_ROUTERS


Counts = dict[str, tuple[str | None, int, int]]
Chains = dict[str, list[list[int]]]


def encode(
    index: int,
    counts: Mapping[str, tuple[str | None, int, int]],
    chains: Chains | None = None,
) -> bytes:
    """A message telling ``counts`` (engine id -> (incarnation, routes, open)) and the
    ``chains`` learned (engine id -> anchors of each route, root first)."""
    msg: dict[str, object] = {"i": index, "e": {k: list(v) for k, v in counts.items()}}
    if chains:
        msg["l"] = chains
        try:
            return orjson.dumps(msg)
        except TypeError:  # a hash past 64 bits: the counts go without the chains
            del msg["l"]
    return orjson.dumps(msg)


def _decode_chains(learned: object) -> Chains:
    """The learned chains of a message's ``"l"``; ValueError when they are not."""
    if not isinstance(learned, dict) or len(learned) > MAX_ENGINES:
        raise MalformedData("bad learned routes")
    for eid, told in learned.items():
        if not isinstance(told, list) or len(told) > MAX_CHAINS:
            raise MalformedData(f"bad learned routes for {eid!r}")
        for chain in told:
            if not (
                isinstance(chain, list)
                and len(chain) <= MAX_CHAIN
                and all(type(a) is int for a in chain)
            ):
                raise MalformedData(f"bad learned route for {eid!r}")
    return learned


def _decode(data: bytes | str) -> tuple[int, Counts, Chains]:
    """(client index, counts, learned chains) of a message; ValueError when it is not one."""
    msg = orjson.loads(data)
    if not isinstance(msg, dict):
        raise MalformedData("not an object")
    index, engines = msg.get("i"), msg.get("e", {})
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1 << 20:
        raise MalformedData(f"bad client index {index!r}")
    if not isinstance(engines, dict) or len(engines) > MAX_ENGINES:
        raise MalformedData("bad engines")
    counts: Counts = {}
    for eid, c in engines.items():
        if not (isinstance(c, list) and len(c) == 3):
            raise MalformedData(f"bad counts for {eid!r}")
        inc, routes, open_ = c
        if inc is not None and not isinstance(inc, str):
            raise MalformedData(f"bad incarnation for {eid!r}")
        for n in (routes, open_):
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 1 << 62:
                raise MalformedData(f"bad count for {eid!r}")
        counts[eid] = (inc, routes, open_)
    learned = msg.get("l")
    return index, counts, ({} if learned is None else _decode_chains(learned))


class ToldRoutes:
    """A router's side of the exchange: the other routers' told counts and when each
    was last heard from, and which of its own counts changed since it last told.

    Engines with admitted counts (``EngineView.exact``): ``told[engine][index] =
    (incarnation, routes, open)``; an entry with nothing left on its way is dropped
    when counted, so the table holds only routes in transit. Engines without:
    ``last[engine][index]``, the latest counts told (each message's routes less the
    last's are the new ones), and ``times[engine][index]``, when each route not yet
    under the engine's cut was heard (emptied entries dropped when counted).
    ``live``: the router's feed is connected and every other client index was heard
    from within FRESH_S: then its ``EngineView.others`` hold the count and its own
    routes count 1. With the feed down nothing told can change, while the routes it
    counts end: what was told is not counted until the feed is back. ``chains``: the
    routes learned since the last message, kept only while live (no one to tell else).
    """

    def __init__(self) -> None:
        self.told: dict[str, dict[int, tuple[str | None, int, int]]] = {}
        self.last: dict[str, dict[int, tuple[str | None, int, int]]] = {}
        self.times: dict[str, dict[int, deque[float]]] = {}
        self.heard: dict[int, float] = {}
        self.live = False
        self.changed: set[str] = set()  # own counts changed since the last message
        self.chains: Chains = {}  # own learned routes since the last message, per engine
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

    def learned(self, engine_id: str, chain: list[int]) -> None:
        """This router learned a route to ``engine_id`` (its anchors, root first): told
        with the route's counts, while the others are heard from."""
        if not (self.live and chain):
            return
        chains = self.chains.setdefault(engine_id, [])
        chains.append(chain[:MAX_CHAIN])
        if len(chains) > MAX_CHAINS:
            del chains[0]

    def message(self, views: Mapping[str, EngineView], index: int) -> bytes:
        """The message telling the counts that changed since the last one (a
        heartbeat when none did) and the routes learned meanwhile."""
        counts = {}
        for eid in self.changed:
            e = views.get(eid)
            if e is not None:
                counts[eid] = (e.incarnation, max(0, e.routed - e.routed_before), e.inflight)
        self.changed.clear()
        self.due = False
        chains, self.chains = self.chains, {}
        return encode(index, counts, chains)

    # -- hearing ------------------------------------------------------------------------------

    def hear(
        self,
        data: bytes | str,
        own_index: int,
        now: float,
        known: Mapping[str, EngineView],
        learn: Callable[[str, list[int]], None] | None = None,
    ) -> list[str] | None:
        """Take one message in; returns the engines it told about that are ``known``
        (the others are not kept: None of them can be routed to here), or None for a
        malformed message or this router's own. ``learn(engine id, chain)`` is given each
        learned route told to a ``known`` engine."""
        try:
            index, counts, chains = _decode(data)
        except ValueError:  # (orjson.JSONDecodeError is one)
            self.malformed += 1
            return None
        if index == own_index:
            return None
        self.messages += 1
        self.heard[index] = now
        ids = [eid for eid in counts if eid in known]
        for eid in ids:
            if known[eid].exact:
                self.told.setdefault(eid, {})[index] = counts[eid]
            else:
                self._heard_by_time(eid, index, counts[eid], now)
        if learn is not None:
            for eid, told in chains.items():
                if eid in known:
                    for chain in told:
                        learn(eid, chain)
        return ids

    def _heard_by_time(
        self, eid: str, index: int, c: tuple[str | None, int, int], now: float
    ) -> None:
        """Note ``now`` for each route told since ``index``'s last message about ``eid``
        (the first one about a process: none, its routes are of unknown times); a
        route taken back drops the newest."""
        inc, routes, open_ = c
        last = self.last.setdefault(eid, {})
        prev = last.get(index)
        last[index] = c
        if prev is None or prev[0] != inc:
            self._drop_times(eid, index)
            return
        new = routes - prev[1]
        if new == 0:
            return
        times = self.times.setdefault(eid, {}).setdefault(index, deque())
        if new > 0:
            times.extend([now] * min(new, open_))
        else:
            for _ in range(min(-new, len(times))):
                times.pop()
        while len(times) > open_:  # more than it has open: the oldest are not on their way
            times.popleft()

    def _drop_times(self, eid: str, index: int) -> None:
        by_index = self.times.get(eid)
        if by_index is not None:
            by_index.pop(index, None)
            if not by_index:
                del self.times[eid]

    def count(
        self,
        views: Iterable[EngineView] | None,
        known: Mapping[str, EngineView],
        own_index: int,
        count: int,
        now: float,
        connected: bool = True,
    ) -> list[EngineView]:
        """Set ``others`` of ``views`` (None: of the engines something was told about;
        every ``known`` one when ``live`` flips); returns the views changed. While not
        live every ``others`` is 0 already: nothing to count."""
        heard = self.heard
        live = (
            connected
            and telling(count)
            and all(i == own_index or now - heard.get(i, -math.inf) < FRESH_S for i in range(count))
        )
        if live != self.live:
            self.live, views = live, known.values()
            self.chains.clear()
        elif not live:
            return []
        elif views is None:  # (an engine with others > 0 has an entry in told or times)
            views = [known[eid] for eid in (*self.told, *self.times) if eid in known]
        changed = []
        for e in views:
            if not live:
                n = 0.0
            elif e.exact:
                n = self._pending(e, count)
            else:
                n = self._pending_by_time(e, count)
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

    def _pending_by_time(self, e: EngineView, count: int) -> float:
        """The other routers' routes to ``e`` heard after its cut (its counts do not
        hold them yet), each at most the requests that router still has open there.
        Times under the cut, of another process or of an index no longer in use are
        dropped."""
        eid = e.engine_id
        by_index = self.times.get(eid)
        if not by_index:
            return 0.0
        last = self.last.get(eid, {})
        cut, total = e.cut, 0
        for i, times in list(by_index.items()):
            while times and times[0] <= cut:
                times.popleft()
            inc, _, open_ = last.get(i, (None, 0, 0))
            if times and inc == e.incarnation and i < count:
                total += min(len(times), open_)
            else:
                del by_index[i]
        if not by_index:
            del self.times[eid]
        return float(total)

    def sent(self, e: EngineView, count: int) -> tuple[int, int]:
        """The other routers' routes to ``e``'s current process and their requests still
        open there, as last told (the sum over the client indices below ``count``): what
        reconciling with the engine's admitted total needs (routing.admit_total)."""
        routes = open_ = 0
        for i, (inc, r, o) in self.last.get(e.engine_id, {}).items():
            if inc == e.incarnation and i < count:
                routes += r
                open_ += o
        return routes, open_

    def retire(self, e: EngineView, keep: int, count: int) -> bool:
        """Leave at most ``keep`` routes counted on their way to ``e``: its own pending
        ones (``e.times``) and the others' heard after its cut, the oldest going first
        (an engine takes requests in the order they reach it). Returns whether any
        went; the caller counts ``others`` again."""
        eid = e.engine_id
        last = self.last.get(eid, {})
        queues = [e.times]
        for i, times in self.times.get(eid, {}).items():
            inc, _, open_ = last.get(i, (None, 0, 0))
            if inc == e.incarnation and i < count:
                while len(times) > open_:  # (past its open requests: not counted anyway)
                    times.popleft()
                queues.append(times)
        over = sum(len(q) for q in queues) - max(0, keep)
        if over <= 0:
            return False
        own = e.times
        for _ in range(over):
            q = min(filter(None, queues), key=lambda q: q[0])
            t = q.popleft()
            if q is own and t > e.total_cut:  # its own routes made by then are held
                e.total_cut = t
        e.pending = len(own)
        trim_costs(e)
        return True

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what was told about engines not in ``keep`` (gone from the deployment)."""
        keep = set(keep)
        for table in (self.told, self.last, self.times, self.chains):
            for eid in [e for e in table if e not in keep]:
                del table[eid]
