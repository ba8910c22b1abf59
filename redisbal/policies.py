"""Routing state and policies: pure logic, no I/O, so route() costs microseconds.

``RouterCore`` holds what one API server knows: the latest snapshot's counts
per engine, and its own bookkeeping per engine (routed, in flight, and the
routes the snapshot does not contain yet: "pending"). A ``Policy`` turns that
into a choice.

Pending is reconciled with each snapshot, never simply wiped:
- exactly, when engines report ``admitted`` (cumulative requests received per
  API-server index): pending = routed - admitted[client_index];
- otherwise by time: routes made before the report's time (less a transit
  allowance) are taken to be in it.
So a snapshot that predates recent routes loses no bookkeeping, and one that
includes them does not count them twice.

Policies (``POLICIES``): ``redisbal`` (the default), and the baselines that the
benchmark compares it with: ``random``, ``round-robin``, ``vllm-pre``,
``vllm-21617``, ``vllm-latest``.

Writing a policy (the public extension point, exported from ``redisbal``): a
``Policy`` picks an ``EngineView`` from ``core.engines``; a ``ScoringPolicy`` only
scores one engine (lowest wins) and can be built from a plain function::

    def score(core: RouterCore, e: EngineView) -> float:
        return e.waiting + e.running + e.pending * core.pending_weight

    router = redisbal.AsyncRouter(url, "llama", 0, 4, policy=redisbal.ScoringPolicy(score))

What a policy may read: the public fields of ``EngineView`` (below) and, on the
router's core, ``engines``, ``client_index``, ``client_count``, ``pending_weight``
(how many routes of all routers one route of this one stands for), ``snapshot``
and ``rng`` (use it, not ``random``, so that a seeded router is reproducible).
A policy keeps any state of its own on itself; it must not write the views.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from redisbal.snapshot import MAX_ADMITTED, Snapshot


class NoEngines(RuntimeError):
    """No engine is known yet: nothing to route to."""


class UnknownEngine(ValueError):
    """A pinned engine that is not (or no longer) in the deployment."""


@dataclass(slots=True)
class Decision:
    """One routing decision; pass it back to ``finished()`` when the request ends."""

    engine_id: str
    client_index: int
    seq: int
    version: int  # snapshot version the decision was made on (0: none yet)
    degraded: bool  # made without a fresh snapshot (Redis gone or feed stale)
    pinned: bool = False
    done: bool = False


@dataclass(slots=True, eq=False)
class EngineView:
    """One engine as this router sees it.

    Public (what any policy may read): ``engine_id``; ``waiting``, ``running`` and
    ``kv_usage`` from the latest snapshot; ``age_s``, how old the engine's report
    was when the snapshot was made; this router's own ``routed`` (cumulative),
    ``inflight`` (routed, not finished) and ``pending`` (routed, not yet in the
    snapshot's counts). The other fields are the default policy's bookkeeping.
    """

    engine_id: str
    waiting: int = 0
    running: int = 0
    kv_usage: float | None = None
    routed: int = 0  # cumulative routes by this router
    inflight: int = 0  # routed and not finished
    pending: int = 0  # routed and not yet in the snapshot
    age_s: float = 0.0  # age of the engine's report at the snapshot
    exact: bool = False  # pending reconciled from admitted counts
    times: deque[float] = field(default_factory=deque)  # route times (time-based pending)
    gen: int = 0  # heap entry generation
    hid: int = -1  # crc32 of engine_id (for the shared dither)
    dither: float = 0.0  # this router's offset for the engine, redrawn per snapshot
    aged: float = 0.0  # expected completions since the engine's report (use_age only)
    # service-speed estimate from the engine's completions (exact reconciliation only)
    speed: float = 1.0  # relative to the median engine; 1.0 until known
    done_prev: int = -1  # completed requests (sum(admitted) - waiting - running) last time
    t_prev: int = -1  # reported_ms of that report
    run_prev: int = 0  # running count then
    done_acc: float = 0.0  # decayed completions
    exposure_acc: float = 0.0  # decayed running-request-seconds


class Policy:
    """Chooses an engine from a RouterCore (see the module docstring for what it may
    read). Subclasses keep any state of their own on themselves. Every method is
    called under the router's lock, on the request path: keep them in microseconds."""

    name = ""

    def reset(self, core: RouterCore) -> None:
        """Called after the engine set or the snapshot changed."""

    def pick(self, core: RouterCore) -> EngineView:
        """The engine for the next request; ``core.engines`` is never empty here."""
        raise NotImplementedError

    def routed(self, core: RouterCore, eng: EngineView) -> None:
        """Called after a route to eng (pinned or not) was recorded."""

    def finished(self, core: RouterCore, eng: EngineView) -> None:
        """Called after a request on eng finished."""


Scorer = Callable[["RouterCore", EngineView], float]


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

    def score(self, core: RouterCore, e: EngineView) -> float:
        """Lower is better."""
        if self._score_fn is None:
            raise NotImplementedError("give ScoringPolicy a score function or override score()")
        return self._score_fn(core, e)

    def start_index(self, core: RouterCore) -> int:
        return int(core.rng.random() * len(core.engines))

    def pick(self, core: RouterCore) -> EngineView:
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

    def pick(self, core: RouterCore) -> EngineView:
        return core.engines[int(core.rng.random() * len(core.engines))]


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self.next = -1

    def pick(self, core: RouterCore) -> EngineView:
        n = len(core.engines)
        if self.next < 0:  # staggered start so that routers do not move in step
            self.next = (core.client_index * n) // max(core.client_count, 1)
        eng = core.engines[self.next % n]
        self.next = (self.next + 1) % n
        return eng


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

    def reset(self, core: RouterCore) -> None:
        self.vw = {e.engine_id: float(e.waiting) for e in core.engines}
        self.vr = {e.engine_id: float(e.running) for e in core.engines}

    def start_index(self, core: RouterCore) -> int:
        return 0

    def score(self, core: RouterCore, e: EngineView) -> float:
        return self.vw[e.engine_id] * 4 + self.vr[e.engine_id]

    def routed(self, core: RouterCore, eng: EngineView) -> None:
        self.vw[eng.engine_id] += core.client_count if self.bump_by_client_count else 1


class Vllm21617Policy(VllmPrePolicy):
    """vLLM PR 21617: step-buffered snapshots (the transport's job), +client_count
    locally per route, scan starting at a per-client staggered index."""

    name = "vllm-21617"
    bump_by_client_count = True

    def start_index(self, core: RouterCore) -> int:
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

    def start_index(self, core: RouterCore) -> int:
        self.rotation += 1
        return super().start_index(core) + self.rotation

    def score(self, core: RouterCore, e: EngineView) -> float:
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

    Stratified dither: each router adds to engine e an offset in [0, 1/share)
    of frac(client_index / client_count + phi(version, e)), where phi is a hash
    of the snapshot version and the engine id that every router computes alike.
    Each own route counts 1/share in the router's view (it stands for everyone's
    routes), so without the offset all routers would fill the same lowest engines
    in lumps of 1/share and overshoot them; with it, the routers' offsets for one
    engine are evenly spread over a lump, and the number of routers that pick an
    engine is proportional to its deficit (water-filling in small steps). Over
    snapshots phi is uniform, so ties are broken without bias; remaining exact
    ties are broken at random.

    With ``use_age`` (on), each engine's snapshot load is lowered by the completions
    expected since its report was made (its running count x its completion rate per
    running request x the report's age), so an older report is read as the lighter
    load it has become. ``p2c_from`` (off) switches to the better of two random
    engines at large N.

    With ``use_speed`` (off by default), what is queued beyond an engine's free
    slots is divided by the engine's estimated speed (its completion rate per
    running request relative to the median engine; 1.0 inside a dead band or
    without admitted counts).
    """

    name = "redisbal"
    # Off by default: in the benchmark it cut straggler imbalance and p99 queue delay
    # but made per-burst assignments less even (docs/BENCHMARKS.md).
    use_speed = False
    # Weigh each engine's reported load by its age (Dahlin 2000): subtract the
    # completions expected since the report (running x the engine's completion rate
    # per running request x the report's age at the snapshot). On: it lowered straggler
    # imbalance on every seed; reports of one lockstep step have no age (BENCHMARKS.md).
    use_age = True
    # Power-of-two choices (Mitzenmacher 2000) from this many engines up; 0 = off.
    # Measured and left off: less even than the heap at 32 engines (BENCHMARKS.md).
    p2c_from = 0

    def __init__(self) -> None:
        super().__init__()
        self.heap: list[tuple[float, float, int, EngineView]] = []

    def score(self, core: RouterCore, e: EngineView) -> float:
        queued = e.waiting + e.pending * core.pending_weight
        if not self.use_speed or e.speed == 1.0:
            s = e.running + queued + e.dither
        else:
            # what is queued beyond the free slots waits on the engine's speed
            free = max(0, core.running_cap - e.running) if core.running_cap > 0 else queued
            direct = min(queued, free)
            s = e.running + direct + (queued - direct) / e.speed + e.dither
        return s - e.aged if self.use_age else s

    @staticmethod
    def _dither(core: RouterCore) -> None:
        snap = core.snapshot
        salt = (snap.version if snap is not None else 0).to_bytes(8, "little", signed=False)
        w = core.pending_weight
        base = core.client_index / core.client_count
        for e in core.engines:
            if e.hid < 0:
                e.hid = zlib.crc32(e.engine_id.encode())
            phi = zlib.crc32(salt, e.hid) / 4294967296.0
            e.dither = (base + phi) % 1.0 * w

    def _push(self, core: RouterCore, e: EngineView) -> None:
        e.gen += 1
        heapq.heappush(self.heap, (self.score(core, e), core.rng.random(), e.gen, e))

    def reset(self, core: RouterCore) -> None:
        self._dither(core)
        rnd = core.rng.random
        heap = []
        for e in core.engines:
            e.gen += 1
            heap.append((self.score(core, e), rnd(), e.gen, e))
        heapq.heapify(heap)
        self.heap = heap

    def pick(self, core: RouterCore) -> EngineView:
        if self.p2c_from and len(core.engines) >= self.p2c_from:
            engines = core.engines
            n = len(engines)
            rnd = core.rng.random
            a, b = engines[int(rnd() * n)], engines[int(rnd() * n)]
            return a if self.score(core, a) <= self.score(core, b) else b
        heap = self.heap
        while heap:
            _, _, gen, e = heap[0]
            if gen == e.gen:
                return e
            heapq.heappop(heap)
        self.reset(core)
        return self.heap[0][3]

    def routed(self, core: RouterCore, eng: EngineView) -> None:
        if self.heap and self.heap[0][3] is eng:
            eng.gen += 1
            heapq.heapreplace(self.heap, (self.score(core, eng), core.rng.random(), eng.gen, eng))
        else:
            self._push(core, eng)
        if len(self.heap) > 4 * len(core.engines) + 64:
            self.reset(core)


POLICIES: dict[str, Callable[[], Policy]] = {
    "redisbal": RedisbalPolicy,
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
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
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None


class RouterCore:
    """One API server's routing state. Thread-safe; no I/O."""

    # engine speed estimate (see _update_speeds): decay half-life, the least
    # running-request-seconds to trust, and the dead band around the median
    speed_halflife_s = 3.0
    speed_min_exposure = 10.0
    speed_band = (0.8, 1.25)

    def __init__(
        self,
        client_index: int = 0,
        client_count: int = 1,
        policy: str | Policy = DEFAULT_POLICY,
        *,
        stale_after_s: float = 5.0,
        transit_s: float = 0.005,
        share_halflife: int = 2000,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if isinstance(client_count, bool) or not isinstance(client_count, int) or client_count < 1:
            raise ValueError(f"client_count must be a whole number >= 1, got {client_count!r}")
        if (
            isinstance(client_index, bool)
            or not isinstance(client_index, int)
            or not 0 <= client_index < client_count
        ):
            raise ValueError(f"client_index must be in 0..{client_count - 1}, got {client_index!r}")
        self.client_index = client_index
        self.client_count = client_count
        self.policy = make_policy(policy)
        self.stale_after_s = stale_after_s
        self.transit_s = transit_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.lock = threading.Lock()
        self.engines: list[EngineView] = []
        self.by_id: dict[str, EngineView] = {}
        self.snapshot: Snapshot | None = None
        self.snapshot_at = float("-inf")  # local clock when the snapshot was applied
        self.connected = False
        self.seq = itertools.count(1)
        # share of traffic: EWMA of (mine, all) admitted deltas
        self.share = 1.0 / client_count
        self._adm_totals: tuple[int, int] | None = None
        self._share_halflife = share_halflife
        self.running_cap = 0  # largest running count seen on an engine with a queue
        self.pending_weight = float(client_count)
        self.counters = {
            "routes": 0,
            "degraded_routes": 0,
            "pinned": 0,
            "snapshots": 0,
            "ignored_old": 0,
            "epochs": 0,
        }

    # -- state -------------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        """True when routing without a fresh snapshot (none yet, stale, or feed down)."""
        return (
            not self.connected
            or self.snapshot is None
            or self.clock() - self.snapshot_at > self.stale_after_s
        )

    def set_engines(self, engine_ids: Iterable[str]) -> None:
        """Known engines before any snapshot (e.g. the members set): start balanced."""
        with self.lock:
            if self.snapshot is not None:
                return
            self._set_engines(list(engine_ids))
            self.policy.reset(self)

    def _set_engines(self, ids: list[str]) -> None:
        old = self.by_id
        self.by_id = {i: old.get(i) or EngineView(i) for i in ids}
        self.engines = list(self.by_id.values())

    def accepts(self, snap: Snapshot) -> bool:
        """Whether snap is newer than ours (or of a new epoch)."""
        cur = self.snapshot
        return cur is None or snap.epoch != cur.epoch or snap.version > cur.version

    def apply_snapshot(self, snap: Snapshot) -> bool:
        """Adopt snap unless it is older than ours within the same epoch (invariant 4)."""
        with self.lock:
            cur = self.snapshot
            if not self.accepts(snap):
                self.counters["ignored_old"] += 1
                return False
            if cur is not None and snap.epoch != cur.epoch:
                self.counters["epochs"] += 1
            now = self.clock()
            self.snapshot, self.snapshot_at = snap, now
            self.counters["snapshots"] += 1
            # an engine this router knows that the cut cannot hold yet (it reported only
            # steps past it, e.g. re-registering after a state loss) stays routable
            # with its last counts instead of vanishing for a snapshot
            kept = [j for j in snap.joining if j in self.by_id and j not in snap.engines]
            self._set_engines([*snap.engines, *kept])
            ci = self.client_index
            mine = total = 0
            exact = False
            # the speed estimate only feeds a policy that uses it (off by default)
            speed_on = getattr(self.policy, "use_speed", False)
            age_on = getattr(self.policy, "use_age", False)
            for e in self.engines:
                c = snap.engines.get(e.engine_id)
                if c is None:
                    continue
                e.waiting, e.running, e.kv_usage = c.waiting, c.running, c.kv_usage
                e.age_s = max(0.0, (snap.time_ms - c.reported_ms) / 1000.0)
                adm = c.admitted
                # (a sum past MAX_ADMITTED: counts none of our reporters sends, read as none)
                if adm is not None and (all_adm := sum(adm)) < MAX_ADMITTED:
                    got = adm[ci] if ci < len(adm) else 0
                    e.pending = max(0, e.routed - got)
                    e.exact = exact = True
                    e.times.clear()
                    mine += got
                    total += all_adm
                    if c.waiting > 0 and c.running > self.running_cap:
                        self.running_cap = c.running  # an engine with a queue is at its cap
                    if speed_on or age_on:
                        done = all_adm - c.waiting - c.running
                        self._observe_speed(e, done, c.reported_ms, c.running)
                else:
                    cutoff = now - (snap.time_ms - c.reported_ms) / 1000.0 - self.transit_s
                    times = e.times
                    while times and times[0] <= cutoff:
                        times.popleft()
                    e.pending = len(times)
                    e.exact = False
            if exact:
                self._update_share(mine, total)
                if speed_on:
                    self._update_speeds()
                if age_on:
                    self._update_aged(snap)
            self.policy.reset(self)
            return True

    def _observe_speed(self, e: EngineView, done: int, t_ms: int, running: int) -> None:
        """Accumulate an engine's completions and running-request-seconds (decayed)."""
        if e.t_prev >= 0 and t_ms > e.t_prev and done >= e.done_prev:
            dt = (t_ms - e.t_prev) / 1000.0
            decay = 0.5 ** (dt / self.speed_halflife_s)
            e.done_acc = e.done_acc * decay + (done - e.done_prev)
            e.exposure_acc = e.exposure_acc * decay + e.run_prev * dt
        elif e.t_prev >= 0 and done < e.done_prev:  # engine restarted: start over
            e.done_acc = e.exposure_acc = 0.0
        if t_ms >= e.t_prev:
            e.t_prev, e.done_prev, e.run_prev = t_ms, done, running

    def _update_speeds(self) -> None:
        """speed = completion rate per running request / the median engine's, clamped to
        [0.25, 4]; 1.0 inside the dead band or without enough observations."""
        rates = {}
        for e in self.engines:
            if e.exposure_acc >= self.speed_min_exposure and e.done_acc >= 20:
                rates[e.engine_id] = e.done_acc / e.exposure_acc
        if len(rates) < 3:
            for e in self.engines:
                e.speed = 1.0
            return
        mid = sorted(rates.values())[len(rates) // 2]
        lo, hi = self.speed_band
        for e in self.engines:
            r = rates.get(e.engine_id)
            sp = 1.0 if r is None or mid <= 0 else min(4.0, max(0.25, r / mid))
            e.speed = 1.0 if lo < sp < hi else sp

    def _update_aged(self, snap: Snapshot) -> None:
        """Expected completions on each engine since its report (use_age): running x
        its completion rate per running request (decayed, as for the speed estimate;
        the median engine's until known) x the report's age at the snapshot."""
        rates = {}
        for e in self.engines:
            if e.exposure_acc >= self.speed_min_exposure and e.done_acc >= 20:
                rates[e.engine_id] = e.done_acc / e.exposure_acc
        mid = sorted(rates.values())[len(rates) // 2] if rates else 0.0
        for e in self.engines:
            c = snap.engines.get(e.engine_id)
            if c is None:
                e.aged = 0.0
                continue
            e.aged = e.running * rates.get(e.engine_id, mid) * e.age_s

    def _update_share(self, mine: int, total: int) -> None:
        prev = self._adm_totals
        self._adm_totals = (mine, total)
        if prev is None or total < prev[1] or mine < prev[0]:
            return
        d_mine, d_total = mine - prev[0], total - prev[1]
        if d_total <= 0:
            return
        alpha = min(1.0, d_total / self._share_halflife)
        self.share += alpha * (d_mine / d_total - self.share)
        # never trust a share below a tenth of an equal one: bounds the estimate's error
        self.share = min(1.0, max(self.share, 0.1 / self.client_count))
        self.pending_weight = 1.0 / self.share

    # -- hot path --------------------------------------------------------------------------------

    def route(self, engine_id: str | None = None) -> Decision:
        """Pick an engine (or take the pinned one) and record the route. No I/O."""
        with self.lock:
            if not self.engines:
                raise NoEngines(
                    "no engine known yet: wait for the first snapshot (router.start(wait=...)) "
                    "or check that engines report to this deployment"
                )
            if engine_id is None:
                eng = self.policy.pick(self)
                pinned = False
            else:
                eng = self.by_id.get(engine_id)  # type: ignore[assignment]
                if eng is None:
                    snap = self.snapshot
                    why = (
                        f"it {snap.gone[engine_id]}"
                        if snap and engine_id in snap.gone
                        else "it is not in the current snapshot"
                    )
                    raise UnknownEngine(
                        f"cannot pin to engine {engine_id!r}: {why}; "
                        f"live engines: {', '.join(self.by_id) or 'none'}"
                    )
                pinned = True
                self.counters["pinned"] += 1
            eng.routed += 1
            eng.inflight += 1
            eng.pending += 1
            if not eng.exact:
                eng.times.append(self.clock())
            self.policy.routed(self, eng)
            degraded = self.degraded
            self.counters["routes"] += 1
            if degraded:
                self.counters["degraded_routes"] += 1
            snap = self.snapshot
            return Decision(
                eng.engine_id,
                self.client_index,
                next(self.seq),
                snap.version if snap else 0,
                degraded,
                pinned,
            )

    def finished(self, decision: Decision) -> None:
        """The request of ``decision`` ended (idempotent)."""
        with self.lock:
            if decision.done:
                return
            decision.done = True
            eng = self.by_id.get(decision.engine_id)
            if eng is not None and eng.inflight > 0:
                eng.inflight -= 1
                self.policy.finished(self, eng)

    def loads(self) -> dict[str, float]:
        """Each engine's estimated load as this router sees it (for status/debug)."""
        with self.lock:
            w = self.pending_weight
            return {e.engine_id: e.waiting + e.running + e.pending * w for e in self.engines}
