"""Routing policies: pure logic, no I/O, so route() costs microseconds.

A router's state (``redisbal.routing.router_core.RouterCore``) holds what one API server
knows; a ``Policy`` turns that into a choice of engine.

Policies (``POLICIES``): ``redisbal`` (the default), and the baselines that the
benchmark compares it with: ``random``, ``round-robin``, ``least-inflight``,
``vllm-pre``, ``vllm-21617``, ``vllm-latest``.

Writing a policy (the public extension point, exported from ``redisbal``): a
``Policy`` picks an ``EngineView`` from ``core.engines``; a ``ScoringPolicy`` only
scores one engine (lowest wins) and can be built from a plain function::

    def score(core: RoutingState, e: EngineView) -> float:
        return e.waiting + e.running + e.pending * core.pending_weight

    router = redisbal.AsyncRouter(url, "llama", 0, 4, policy=redisbal.ScoringPolicy(score))

What a policy may read: the public fields of ``EngineView`` and the router's
``RoutingState`` (``redisbal.routing.state``). A policy keeps any state of its own on
itself; it must not write either.
"""

from __future__ import annotations

import bisect
import heapq
import zlib
from collections.abc import Callable

from redisbal.barrier.snapshot import Snapshot
from redisbal.errors import InvalidArgument
from redisbal.errors import NoEngines as NoEngines
from redisbal.errors import UnknownEngine as UnknownEngine
from redisbal.routing.cache_view import BLOCK_TOKENS, anchors
from redisbal.routing.estimates import engine_cap, kv_binds
from redisbal.routing.state import EngineView, RoutingState


class Policy:
    """Chooses an engine from a router's RoutingState. Subclasses keep any state of
    their own on themselves. Every method is called under the router's lock, on the
    request path: keep them in microseconds."""

    name = ""
    # hold requests at the router while every engine is at its running cap
    # (routing.admission); the baselines route at once, as the routers they stand for
    holds = False
    # while the oldest held request has waited this long (a standing queue: over
    # capacity), let each engine queue one request past its running cap, so that a slot
    # freed is filled at the engine's next step, not a step later (None: never)
    stand_s: float | None = None
    # set by pick() when it followed a match in ``core.cache_view``: the leading blocks
    # of the prompt the engine picked holds (the router reports it: Decision.cached);
    # the router sets it to 0 before each pick
    matched = 0

    def reset(self, core: RoutingState) -> None:
        """Called after the engine set or the snapshot changed."""

    def pick(self, core: RoutingState) -> EngineView:
        """The engine for the next request; ``core.engines`` is never empty here."""
        raise NotImplementedError

    def routed(self, core: RoutingState, eng: EngineView) -> None:
        """Called after a route to eng (pinned or not) was recorded; eng is one of
        ``core.engines`` (a pinned route to an engine left out of them is not told)."""

    def finished(self, core: RoutingState, eng: EngineView) -> None:
        """Called after a request on eng finished."""

    def changed(self, core: RoutingState, eng: EngineView) -> None:
        """Called after eng's load changed between snapshots: what the other routers
        told (``eng.others``), or a request of this router ended (``eng.aged``)."""


Scorer = Callable[[RoutingState, EngineView], float]


class ScoringPolicy(Policy):
    """Route to the engine with the lowest ``score(core, engine)``.

    Give the scorer as a function (``ScoringPolicy(fn)``) or override ``score`` in a
    subclass. Engines are scanned from ``start_index(core)`` (a random engine unless
    overridden) and the first lowest score wins, so ties do not all go to one engine.
    """

    def __init__(self, score: Scorer | None = None, *, name: str = "custom") -> None:
        if score is not None:
            if not callable(score):
                raise TypeError(f"score must be callable, got {type(score).__name__}")
            self._score_fn: Scorer | None = score
            self.name = name
        else:
            self._score_fn = None

    def score(self, core: RoutingState, e: EngineView) -> float:
        """Lower is better."""
        if self._score_fn is None:
            raise NotImplementedError("give ScoringPolicy a score function or override score()")
        return self._score_fn(core, e)

    def start_index(self, core: RoutingState) -> int:
        return int(core.rng.random() * len(core.engines))

    def pick(self, core: RoutingState) -> EngineView:
        engines = core.engines
        n = len(engines)
        start = self.start_index(core)
        best, best_score = engines[start % n], float("inf")
        for i in range(n):
            e = engines[(start + i) % n]
            s = self.score(core, e)
            if s < best_score:
                best, best_score = e, s
        return best


class RandomPolicy(Policy):
    name = "random"

    def pick(self, core: RoutingState) -> EngineView:
        return core.engines[int(core.rng.random() * len(core.engines))]


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self.next = -1

    def pick(self, core: RoutingState) -> EngineView:
        n = len(core.engines)
        if self.next < 0:  # staggered start so that routers do not move in step
            self.next = (core.client_index * n) // max(core.client_count, 1)
        eng = core.engines[self.next % n]
        self.next = (self.next + 1) % n
        return eng


class LeastInflightPolicy(ScoringPolicy):
    """Each API server counts only its own unfinished requests per engine and sends to
    the engine with the fewest (ties at random): what a gateway without shared state does
    (a plain least-connections proxy). Blind to other servers' traffic and to the
    engines' queues."""

    name = "least-inflight"

    def score(self, core: RoutingState, e: EngineView) -> float:
        return e.inflight


class VllmPrePolicy(ScoringPolicy):
    """vLLM before PR 21617: latest counts replace the view at every push; score
    waiting*4 + running; lowest index wins ties; +1 waiting locally per route.

    Like vLLM's API server, it keeps its own copy of each engine's (waiting,
    running), ``vw`` / ``vr``, replaced at every push and bumped by its routes."""

    name = "vllm-pre"
    bump_by_client_count = False

    def __init__(self) -> None:
        super().__init__()
        self.vw: dict[str, float] = {}
        self.vr: dict[str, float] = {}

    def reset(self, core: RoutingState) -> None:
        self.vw = {e.engine_id: float(e.waiting) for e in core.engines}
        self.vr = {e.engine_id: float(e.running) for e in core.engines}

    def start_index(self, core: RoutingState) -> int:
        return 0

    def score(self, core: RoutingState, e: EngineView) -> float:
        return self.vw[e.engine_id] * 4 + self.vr[e.engine_id]

    def routed(self, core: RoutingState, eng: EngineView) -> None:
        self.vw[eng.engine_id] += core.client_count if self.bump_by_client_count else 1


class Vllm21617Policy(VllmPrePolicy):
    """vLLM PR 21617: step-buffered snapshots (the transport's job), +client_count
    locally per route, scan starting at a per-client staggered index."""

    name = "vllm-21617"
    bump_by_client_count = True

    def start_index(self, core: RoutingState) -> int:
        return (len(core.engines) * core.client_index) // max(core.client_count, 1)


class VllmLatestPolicy(Vllm21617Policy):
    """vLLM after PRs 22910, 41626, 47420, 49204, 52936, scored as vLLM's
    DPLBAsyncMPClient does today: score = max(client_count * inflight, waiting +
    running), plus waiting * 6 * max(0, kv - 0.5) when waiting; the floor uses this
    router's unfinished requests, so a snapshot cannot erase them; +client_count
    waiting locally per route; a start index that rotates at every call."""

    name = "vllm-latest"

    def __init__(self) -> None:
        super().__init__()
        self.rotation = 0

    def start_index(self, core: RoutingState) -> int:
        self.rotation += 1
        return super().start_index(core) + self.rotation

    def score(self, core: RoutingState, e: EngineView) -> float:
        # as vLLM's DPLBAsyncMPClient scores today: no x4 on waiting any more
        vw = self.vw[e.engine_id]
        s = max(core.client_count * e.inflight, vw + self.vr[e.engine_id])
        if vw and e.kv_usage is not None:
            s += vw * 6.0 * max(0.0, e.kv_usage - 0.5)
        return s


class RedisbalPolicy(ScoringPolicy):
    """The default: join-the-shortest-queue on the snapshot's load plus this
    router's pending routes scaled by its estimated share of all traffic.

    score = waiting + running + pending / share

    share is estimated from the engines' admitted counts (this router's part of
    all requests admitted lately), falling back to 1 / client_count. A heap
    keeps route() O(log N).

    Stratified dither: each router adds to engine e an offset in [0, A) of
    frac(client_index / client_count + phi(version, e)), where phi is a hash
    of the snapshot version and the engine id that every router computes alike.
    Each own route counts 1/share in the router's view (it stands for everyone's
    routes), so without the offset all routers would fill the same lowest engines
    in lumps of 1/share and overshoot them; with it, the routers' offsets for one
    engine are evenly spread over a lump, and the number of routers that pick an
    engine is proportional to its deficit (water-filling in small steps). Over
    snapshots phi is uniform, so ties are broken without bias; remaining exact
    ties are broken at random. The amplitude A is what all routers route per
    snapshot (this router's routes per snapshot x 1/share), between 1 and one
    lump (1/share): under a burst every router routes between snapshots and the
    offsets spread a whole lump; under light traffic few do, and a wide offset
    would only blur which engine is shortest.

    With ``use_age`` (on), each engine's snapshot load is lowered by the completions
    expected since its report was made (``SpeedEstimate.update_aged``: about its running
    count x its completion rate per running request x the report's age, never more
    than its running count), so an older report is read as the lighter load it has
    become. ``p2c_from`` (off) switches to the better of two random engines at large N.

    With ``use_kv_load`` (on), where the KV cache binds any engine (``kv_binds``: the
    rule that turns holding off) an engine's running requests count by the share of
    its KV cache they hold times the number of requests of the size the engines run
    that a whole cache holds (all engines' running requests over their KV usage), not
    1 each: a KV-bound engine admits by size, and one running a few long requests has
    no more room than one running many short ones. Where slots bind, a running request
    counts 1 whatever its size. Where KV binds this count replaces the slot and speed
    terms (``use_slots``, ``use_speed``; ``use_sed`` still takes precedence over it): a
    slot count is not a KV-bound engine's room.

    With ``use_speed`` (off by default), what is queued beyond an engine's free
    slots is divided by the engine's estimated speed (its completion rate per
    running request relative to the median engine; 1.0 inside a dead band or
    without admitted counts).

    Each pending route counts 1: it will hold one slot, whatever its size. With
    ``use_cost`` (off) a route that said its size in tokens counts as that size over
    the typical route's (``EngineView.pending_cost``); through the gateway the size is
    the prompt's, short prompts counted a tenth, and routers piled them onto one engine.

    A request with a ``key`` (``route(key=...)``) goes to the first of the key's
    engines on a consistent-hash ring of the choosable engines (clockwise from the
    key's point, at most ``affinity_probes``) that can take it about as soon as the
    least-loaded engine: room now (no queue, KV usage below ``affinity_kv`` and,
    once the running cap is known, a free slot for its pending routes) or a score within
    ``affinity_slack`` of the least-loaded engine's; else to the least-loaded
    engine. The ring and the snapshot are shared, so every router puts a key on
    the same engine while it has room, and on its second engine, not a random one,
    when it has not.

    A request with ``blocks`` (its prompt's block hashes) and no key followed (none
    given, and a guessed one while guessed keys do not come back) is matched with
    what the engines cache (``core.cache_view``, the same for every router): the
    engine holding its deepest match takes it while it takes the request about as
    soon as the least-loaded engine (as a key's engine does: room now, or a score
    within the slack), the slack being ``cache_slack`` times the share of the
    prompt the match saves (``keyed_cache_slack`` times it with a key not followed);
    among holders of an equally deep match the least loaded is tried first, then
    holders of shallower matches, ``affinity_probes`` engines in all. Else the
    least-loaded engine takes it, and caches it too: a popular prefix spreads over
    more engines as its traffic outgrows its holders.
    """

    name = "redisbal"
    holds = True  # measured: docs/BENCHMARKS.md, the straggler at two replicas
    stand_s = 0.5  # measured: docs/BENCHMARKS.md, two speeds (over capacity)
    # Off by default: on the quality benchmark it moves nothing beyond the seed spread
    # (docs/BENCHMARKS.md, "Policy experiments": redisbal+speed).
    use_speed = False
    # Weigh each engine's reported load by its age (Dahlin 2000; the class docstring).
    # On; reports of one lockstep step have no age, and on the quality benchmark
    # turning it off moves nothing beyond the seed spread (BENCHMARKS.md: redisbal-age).
    use_age = True
    # Power-of-two choices (Mitzenmacher 2000) from this many engines up; 0 = off.
    # Measured and left off: a higher TTFT p99 wherever queues form (BENCHMARKS.md:
    # redisbal+p2c).
    p2c_from = 0
    # Measured for the real-time straggler and left as they are (docs/DESIGN.md): use_sed,
    # shortest expected delay, (score + 1) / speed; use_dither; use_slots, an engine
    # where the request would queue scores above every one with a free slot, and among
    # those by its queue over its speed; use_share, own pending routes count 1 / share.
    use_sed, use_dither, use_slots, use_share = False, True, False, True
    # Pending routes count by their size (routing.estimates.RouteCost), not 1 each; off
    # (the class docstring; measured: docs/BENCHMARKS.md, real-time Poisson)
    use_cost = False
    # Where the KV cache binds, running requests count by the KV cache they hold, in
    # requests of the size all engines run (``_kv_full``), not 1 each: an engine running
    # a few long requests is as full as one running many short ones (the class
    # docstring; measured: docs/BENCHMARKS.md, where the KV cache binds)
    use_kv_load = True
    # Where running requests count by their KV, an engine with a queue counts a full
    # cache (``_kv_load``): its queue's head does not fit, whatever the running hold
    use_kv_queue = True
    # a key's engine takes it while its score is within this of the least-loaded
    # engine's (in requests: one queued request costs about what a cached prefix saves)
    affinity_slack = 1.0
    # a cache holder takes a request while its score is within this x the share of the
    # prompt its match covers of the least-loaded engine's: a whole prompt saved is
    # worth a few queued requests, not one (measured: docs/BENCHMARKS.md, the prefixes
    # trace: at 1, holders gave up a prefix to engines that had to compute it and evict
    # another, and the hit rate fell well below vllm-router kv_aware's)
    cache_slack = 4.0
    # a cache holder of a request with a key that is not followed (a client sending a
    # new user with each request) takes it within this x the share saved instead (None:
    # cache_slack): on long prompts over a few shared prefixes, each with a new user, 4
    # was 11 % higher (se 10, one run; docs/BENCHMARKS.md, long prompts on the views)
    keyed_cache_slack: float | None = 1.0
    affinity_probes = 4  # engines of a key tried, clockwise on the ring
    affinity_room = True  # a key's engine with no queue and room now takes it, whatever its load
    affinity_kv = 0.9  # an engine has room only below this KV usage
    # Guessed keys (``RequestInfo.key_guessed``: the gateway's body user) earn affinity
    # by coming back: while fewer than this share of them bring one seen lately
    # (``key_repeats``), such a key routes as if there were none (a client that sends a
    # new user with every request: its key's engine holds no cache for it, and following
    # the key would place requests by hash, not by load). Given keys are always followed.
    affinity_repeats = 0.1
    follow_guessed = False  # True: a guessed key is followed as a given one (as before)
    recent_keys = 65536  # guessed keys remembered by this router, the oldest forgotten first
    # dither amplitude: this x own routes per snapshot x pending_weight (1-4 measured)
    dither_gain = 1.0
    ring_points = 40  # points per engine on the hash ring

    def __init__(self) -> None:
        super().__init__()
        self.heap: list[tuple[float, float, int, EngineView]] = []
        self.ring_ids: tuple[str, ...] = ()
        self.ring: list[int] = []  # sorted point hashes
        self.ring_owner: list[int] = []  # index into ring_engines, per point
        self.ring_engines: list[EngineView] = []
        self.routes_per_snapshot = 1.0  # EWMA of own routes between snapshots
        self._routes_since = 0
        self._dither_snap: Snapshot | None = None
        self._heaped: set[int] = set()  # id() of the engines the heap was built from
        self._by_id: dict[str, EngineView] = {}  # the same engines by id (cache matches)
        # hash() of each guessed key routed lately -> the engine it went to, oldest first
        self._keys: dict[int, EngineView] = {}
        # over routes with a guessed key, 1 when the key was among _keys, else 0: their
        # mean over the first 256, then an EWMA (a router that has seen no key come back
        # has no cache to send one to; sessions' keys are followed once turns return)
        self.repeats = 0.0
        self._keyed = 0
        self._kv_full = 0.0  # requests a whole KV cache holds, over all engines (use_kv_load)

    def key_repeats(self, core: RoutingState) -> float:
        """The estimated share of guessed keys that came lately, to any router:
        this router's share times the number of routers (a key's requests spread over
        them, so each sees about 1 / client_count of its returns), at most 1."""
        return min(1.0, self.repeats * core.client_count)

    def _saw_key(self, key: str, eng: EngineView) -> None:
        keys, h = self._keys, hash(key)
        seen = h in keys
        if seen:
            del keys[h]  # to the newest end
        elif len(keys) >= self.recent_keys:
            del keys[next(iter(keys))]
        keys[h] = eng
        self._keyed = n = min(self._keyed + 1, 256)
        self.repeats += ((1.0 if seen else 0.0) - self.repeats) / n

    @property
    def wants_speed(self) -> bool:
        """Whether the router must estimate the engines' speeds for this policy."""
        return self.use_speed or self.use_sed or self.use_slots

    def score(self, core: RoutingState, e: EngineView) -> float:
        # (reset() inlines this for the default settings: change both, tests compare them)
        w = core.pending_weight if self.use_share else 1.0
        queued = e.waiting + e.others + e.pending_cost * w
        if self.use_sed:
            ahead = e.running + queued + 1.0 - (e.aged if self.use_age else 0.0)
            return ahead / e.speed + e.dither
        if self._kv_full and e.kv_usage is not None:  # (use_kv_load, where KV binds)
            return self._kv_load(e) + queued + e.dither
        cap = engine_cap(e, core.running_cap)
        if self.use_slots and cap > 0:
            load = e.running + queued - (e.aged if self.use_age else 0.0)
            over = load + 1.0 - cap
            return load + e.dither + (over * cap / e.speed if over > 0 else 0.0)
        if not self.use_speed or e.speed == 1.0:
            s = e.running + queued + e.dither
        else:
            # what is queued beyond the free slots waits on the engine's speed
            free = max(0, cap - e.running) if cap > 0 else queued
            direct = min(queued, free)
            s = e.running + direct + (queued - direct) / e.speed + e.dither
        return s - e.aged if self.use_age else s

    def _kv_load(self, e: EngineView) -> float:
        """e's running requests by the KV cache they hold (``use_kv_load``), less its
        completions since its counts were made (``aged``, with ``use_age``), each
        running one freeing its share of that KV (the part of ``aged`` past the
        running count ended waiting, counted 1 each as ``score`` counts them): counted
        1 each, an engine of many short requests was read empty after a few ends, the
        more so the more routers (each end stands for 1 / share of them). With
        ``use_kv_queue`` an engine with a queue reads as a full cache: a KV-bound engine
        queues when its queue's head does not fit (vLLM admits in order), so a request
        sent there waits for that head, however little the running requests hold (an
        engine draining for a long prompt read light and took requests that waited
        behind it)."""
        kv = e.kv_usage or 0.0
        if e.waiting > 0 and self.use_kv_queue:
            kv = 1.0  # its queue's head does not fit: full, whatever the running hold
        load = kv * self._kv_full
        if not self.use_age or not e.aged:
            return load
        if e.running <= 0:
            return load - e.aged
        ran = min(e.aged, float(e.running))
        return load * (1.0 - ran / e.running) - (e.aged - ran)

    def _dither(self, core: RoutingState) -> None:
        snap = core.snapshot
        salt = (snap.version if snap is not None else 0).to_bytes(8, "little", signed=False)
        prev = self._dither_snap
        if snap is not prev and snap is not None:  # own routes per snapshot published
            versions = 1
            if prev is not None and prev.epoch == snap.epoch and snap.version > prev.version:
                versions = snap.version - prev.version
            self._dither_snap = snap
            sample = self._routes_since / versions
            self.routes_per_snapshot += (sample - self.routes_per_snapshot) / 8.0
            self._routes_since = 0
        # the offsets spread over what all routers route before the next snapshot (about
        # this router's routes per snapshot / its share), at most one lump; by the share
        # even while routes are told: in a burst the routers still act within the time
        # a message takes (simulated, 8 routers: bursts' p99 +2 % with pending_weight)
        w = core.share_weight
        w = min(w, max(1.0, self.dither_gain * self.routes_per_snapshot * w))
        if not self.use_dither:
            w = 0.0
        base = core.client_index / core.client_count
        crc32 = zlib.crc32
        for e in core.engines:
            phi = crc32(salt, e.hid) / 4294967296.0
            e.dither = (base + phi) % 1.0 * w

    def _push(self, core: RoutingState, e: EngineView) -> None:
        e.gen += 1
        heapq.heappush(self.heap, (self.score(core, e), core.rng.random(), e.gen, e))
        if len(self.heap) > 4 * len(core.engines) + 64:  # mostly entries made invalid
            self.reset(core)

    def reset(self, core: RoutingState) -> None:
        self._dither(core)
        self._kv_full = _kv_full(core.engines, core.running_cap) if self.use_kv_load else 0.0
        self.heap = self._heap(core)
        self._heaped = {id(e) for e in core.engines}
        self._by_id = {e.engine_id: e for e in core.engines}
        if core.engines is not self.ring_engines:
            self.ring_engines = core.engines
            if tuple(e.engine_id for e in core.engines) != self.ring_ids:
                self.ring = []  # built again on the next keyed route

    def _heap(self, core: RoutingState) -> list[tuple[float, float, int, EngineView]]:
        """A new heap of every engine's entry (its old entries are gone with the old
        heap, so e.gen need not move)."""
        rnd, engines = core.rng.random, core.engines
        default = self.use_share and not (self.use_speed or self.use_sed or self.use_slots)
        if (
            self.use_age
            and default
            and not self._kv_full
            and type(self).score is RedisbalPolicy.score
        ):
            # the default settings' score() where slots bind, inlined: a call per engine
            # cost a third of this
            w = core.pending_weight
            heap = [
                (
                    e.running + (e.waiting + e.others + e.pending_cost * w) + e.dither - e.aged,
                    rnd(),
                    e.gen,
                    e,
                )
                for e in engines
            ]
        else:
            score = self.score
            heap = [(score(core, e), rnd(), e.gen, e) for e in engines]
        heapq.heapify(heap)
        return heap

    def _build_ring(self) -> None:
        points = []
        for i, e in enumerate(self.ring_engines):
            name = e.engine_id.encode()
            for v in range(self.ring_points):
                points.append((zlib.crc32(b"%d#" % v + name), i))
        points.sort()
        self.ring = [h for h, _ in points]
        self.ring_owner = [i for _, i in points]
        self.ring_ids = tuple(e.engine_id for e in self.ring_engines)

    def pick_for_key(self, core: RoutingState, key: str) -> EngineView:
        """The first of the key's engines (clockwise on the ring from the key's point,
        at most ``affinity_probes`` of them) that can take the request about as soon as
        the least-loaded engine can: no queue and room now (``_has_room``), or a score
        within ``affinity_slack`` of the least-loaded engine's. Else the least-loaded
        engine."""
        top, ref = self._affinity_ref(core)
        if not self.ring:
            self._build_ring()
        engines, ring, owner = self.ring_engines, self.ring, self.ring_owner
        at = bisect.bisect_left(ring, zlib.crc32(key.encode()))
        seen: list[int] = []
        for k in range(len(ring)):
            i = owner[(at + k) % len(ring)]
            if i in seen:
                continue
            e = engines[i]
            if e is top or self._takes(core, e, ref):
                return e
            seen.append(i)
            if len(seen) >= self.affinity_probes:
                break
        return top

    def _affinity_ref(self, core: RoutingState) -> tuple[EngineView, float]:
        """The least-loaded engine, and the score a keyed request's engine may have to
        take it about as soon: the least-loaded one's less its dither, plus
        ``affinity_slack``."""
        top = self._top(core)
        return top, self.score(core, top) - top.dither + self.affinity_slack

    def _takes(self, core: RoutingState, e: EngineView, ref: float) -> bool:
        """Whether ``e`` takes a keyed request about as soon as the least-loaded engine
        (``ref``: ``_affinity_ref``): a score within that, or no queue and room now (the
        key's cache saves its prefill)."""
        if self.score(core, e) - e.dither <= ref:
            return True
        return (
            self.affinity_room
            and e.waiting == 0
            and self._has_room(e, core.running_cap, core.pending_weight)
        )

    def _follow_key(self, core: RoutingState, key: str, guessed: bool) -> EngineView | None:
        """The engine a key sends the request to, None when the key is not followed: a
        given key always is (``pick_for_key``); a guessed one (the body's user) once
        guessed keys come back (``key_repeats``), first to the engine this router sent
        it to last (``_went``). A followed key is not weighed against the cache views:
        its match there is mostly its own history, on the engines the key chose, and
        following the views instead put a session's turns where its history was
        however loaded (docs/BENCHMARKS.md, sessions with keys on the cache views)."""
        if not guessed or self.follow_guessed:
            return self.pick_for_key(core, key)
        e = self._went(core, key)
        if e is not None:
            return e
        if self.key_repeats(core) >= self.affinity_repeats:
            return self.pick_for_key(core, key)
        return None

    def _went(self, core: RoutingState, key: str) -> EngineView | None:
        """The engine this router sent a guessed key to last, while it is choosable
        and takes the request about as soon as the least-loaded one (``_takes``)."""
        e = self._keys.get(hash(key))
        if e is None:
            return None
        top, ref = self._affinity_ref(core)  # (resets the heap and _heaped if stale)
        if id(e) not in self._heaped:
            return None
        return e if e is top or self._takes(core, e, ref) else None

    def _has_room(self, e: EngineView, cap: int, w: float) -> bool:
        """Room for one more request: KV usage below ``affinity_kv`` and, once the
        running cap is known, a free slot for this router's pending routes too; at
        least one of the two must be known."""
        kv_ok = e.kv_usage is not None and e.kv_usage < self.affinity_kv
        cap = engine_cap(e, cap)
        if not cap:
            return kv_ok
        slot = e.running + e.others + e.pending_cost * w < cap
        return slot and (e.kv_usage is None or kv_ok)

    def pick_cached(
        self, core: RoutingState, blocks: tuple[int, ...], size: int, slack: float | None = None
    ) -> EngineView | None:
        """The engine holding the deepest match of ``blocks`` in ``core.cache_view`` that
        takes the request about as soon as the least-loaded engine (``_takes``, with a
        slack of ``cache_slack`` x the share of the ``size``-token prompt it saves);
        holders of one depth least loaded first, deepest first, ``affinity_probes`` at
        most; None when none does, or nothing matches (sets ``matched``). ``slack``:
        instead of ``cache_slack``."""
        view = core.cache_view
        holders, stride = view.holders, view.stride
        req = anchors(blocks, stride)  # shallowest first
        if not req or req[0] not in holders:  # (a chain is cached from its root)
            return None
        top, base = self._affinity_ref(core)
        base -= self.affinity_slack
        by_id, score = self._by_id, self.score
        per_anchor = stride * BLOCK_TOKENS / max(size, len(blocks) * BLOCK_TOKENS, 1)
        slack = self.cache_slack if slack is None else slack
        tried: set[str] = set()
        for i in range(len(req) - 1, -1, -1):
            held = holders.get(req[i])
            if not held:
                continue
            ids = tuple(held)  # (one C call: a reader may change the set meanwhile)
            if top.engine_id in ids:  # the least loaded holds it: nothing to weigh
                self.matched = (i + 1) * stride
                return top
            cands = []
            for eid in ids:
                if eid not in tried:
                    e = by_id.get(eid)
                    if e is not None:
                        cands.append((score(core, e), eid, e))
            if not cands:
                continue
            cands.sort(key=_first)
            ref = base + slack * min(1.0, (i + 1) * per_anchor)
            for _, eid, e in cands:
                if self._takes(core, e, ref):
                    self.matched = (i + 1) * stride
                    return e
                tried.add(eid)
                if len(tried) >= self.affinity_probes:
                    return None
        return None

    def pick(self, core: RoutingState) -> EngineView:
        req = core.request
        if req is not None and req.key is not None:
            e = self._follow_key(core, req.key, req.key_guessed)
            if e is not None:
                return e
        if req is not None and req.blocks and core.cache_view.holders:
            slack = self.keyed_cache_slack if req.key is not None else None
            e = self.pick_cached(core, req.blocks, req.prompt_tokens or 0, slack)
            if e is not None:
                return e
        if self.p2c_from and len(core.engines) >= self.p2c_from:
            engines = core.engines
            n = len(engines)
            rnd = core.rng.random
            a, b = engines[int(rnd() * n)], engines[int(rnd() * n)]
            return a if self.score(core, a) <= self.score(core, b) else b
        return self._top(core)

    def _top(self, core: RoutingState) -> EngineView:
        """The engine with the lowest score (the heap's valid top)."""
        heap = self.heap
        while heap:
            _, _, gen, e = heap[0]
            if gen == e.gen:
                return e
            heapq.heappop(heap)
        self.reset(core)
        return self.heap[0][3]

    def changed(self, core: RoutingState, eng: EngineView) -> None:
        if id(eng) in self._heaped:  # (an engine left out of core.engines stays out)
            self._push(core, eng)

    def routed(self, core: RoutingState, eng: EngineView) -> None:
        self._routes_since += 1
        req = core.request
        if req is not None and req.key is not None and req.key_guessed:
            self._saw_key(req.key, eng)
        if self.heap and self.heap[0][3] is eng:
            eng.gen += 1
            heapq.heapreplace(self.heap, (self.score(core, eng), core.rng.random(), eng.gen, eng))
        else:
            self._push(core, eng)


def _kv_full(engines: list[EngineView], cap: int) -> float:
    """How many requests of the size the engines run a whole KV cache holds (all
    running requests over all KV usage) while the KV cache binds any engine
    (``kv_binds``, the rule that turns holding off); else 0: where slots bind, a
    running request is a slot whatever its size."""
    running, usage, binds = 0, 0.0, False
    for e in engines:
        if e.kv_usage is not None and e.kv_usage > 0.0:
            running += e.running
            usage += e.kv_usage
            binds = binds or kv_binds(e, cap)
    return running / usage if binds and usage > 0.0 else 0.0


def _first(c: tuple[float, str, EngineView]) -> float:
    return c[0]


POLICIES: dict[str, Callable[[], Policy]] = {
    "redisbal": RedisbalPolicy,
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "least-inflight": LeastInflightPolicy,
    "vllm-pre": VllmPrePolicy,
    "vllm-21617": Vllm21617Policy,
    "vllm-latest": VllmLatestPolicy,
}
DEFAULT_POLICY = "redisbal"


def make_policy(name: str | Policy) -> Policy:
    if isinstance(name, Policy):
        return name
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument(
            f"unknown policy {name!r}; choose from {', '.join(POLICIES)}"
        ) from None
