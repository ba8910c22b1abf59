"""Holding requests at the router while every engine is at its running cap, and
sending each to the first engine that frees a slot.

A request sent to an engine whose slots are all taken waits in that engine's own
queue for one of *its* slots, however soon another engine frees one: behind a slow
engine, or a few long answers, it waits longest of all. Held at the router it waits
in one queue for the first slot freed anywhere (a central queue, late binding). The
router learns that a slot freed from what it already hears: snapshots, the other
routers' told routes and its own requests' ends (``RouterCore.on_update``).

The routers of a deployment see a slot free at the same snapshot. So that they do
not all fill it, they take turns while they tell each other their routes: each
releases ``STAGGER_S`` after the one before it, in an order that turns with each
snapshot, and so hears what the ones before it routed (a told route comes within
about ``COALESCE_S`` and a publish). Without told routes (more than ``MAX_ROUTERS``,
a router that does not tell, snapshots without admitted counts to count them by) each
releases its share of the free slots.

Over capacity the queue stands. A slot an engine frees is then filled a step late: the
router hears of the end after the engine began its next step. So once the oldest held
request has waited the policy's ``stand_s``, each engine may queue one request past
its running cap (``ahead_of``), and fills a freed slot from that at its next step.
Below that, nothing waits at an engine that could go to the first slot freed.

An engine is full when its own word says so: its running cap reached (declared, or
``estimates.RunningCap``, learned from queues), less what is on its way. A request is
held only while every engine is full, and routed at once while any engine's room is
unknown, or bounded by its KV cache rather than its cap (``estimates.kv_binds``: what
vLLM's plugin, its /metrics and SGLang's report carry). A KV-bound engine admits by
request size, not a slot count, so whether it would queue a request is a guess; held
on that guess, requests were no better off in real time than routed at once, and at
four replicas worse (docs/BENCHMARKS.md, engines as users run them).

The default policy holds (``Policy.holds``); the baselines route at once, as the
routers they stand for do. Nothing is held while the router routes without a fresh
snapshot, and no request is held longer than ``max_s``: then it is routed as it
would have been without holding.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

from redisbal.errors import InvalidArgument
from redisbal.routing.estimates import kv_binds, room
from redisbal.routing.router_core import RouterCore

DEFAULT_MAX_S = 2.0  # hold a request at most this long (the gateway's --hold-s)
STAGGER_S = 0.008  # between two routers' turns to release (simulated: 4-12 ms alike)
RECHECK_S = 0.25  # while requests are held, look again this often (a lost feed)

__all__ = [
    "DEFAULT_MAX_S",
    "STAGGER_S",
    "Admission",
    "ahead_of",
    "free_slots",
    "releasable",
    "release_delay",
]


def free_slots(core: RouterCore, enough: int | None = None, ahead: int = 0) -> int | None:
    """Requests the engines ``core`` chooses from would run now without queueing one,
    as it sees them: each engine's ``room`` (its free slots under the running cap and
    its KV room, less what is on its way to it), plus ``ahead`` each while the queue
    stands (``ahead_of``); once past ``enough``, that count (the request path needs
    no more). None when nothing should be held: no fresh snapshot, an engine whose
    room nothing bounds (neither the running cap nor its KV usage known), or one whose
    KV cache bounds it (``kv_binds``): unsure, so route at once."""
    with core.lock:
        if not core.engines or core.degraded:
            return None
        cap = core.running_cap
        w = core.pending_weight
        free = 0
        for e in core.engines:
            if kv_binds(e, cap):
                return None  # it admits by request size: whether it would queue is a guess
            r = room(e, cap, w) + ahead
            if r == math.inf:
                return None
            if r > 0:
                free += math.ceil(r)
                if enough is not None and free > enough:
                    break
        return free


def ahead_of(core: RouterCore, oldest_wait_s: float | None) -> int:
    """Requests each engine may queue past its running cap: 1 once the oldest held
    request has waited the policy's ``stand_s`` (a standing queue), else 0."""
    stand = core.policy.stand_s
    if stand is None or oldest_wait_s is None or oldest_wait_s < stand:
        return 0
    return 1


def release_delay(core: RouterCore) -> float:
    """How long after a change ``core``'s router releases what it holds: its turn
    among the deployment's routers at the current snapshot, while they tell each
    other their routes (else there is nothing to hear from the ones before it)."""
    n = core.client_count
    if n <= 1 or not core.told_routes.live:
        return 0.0
    snap = core.snapshot
    version = snap.version if snap is not None else 0
    return ((core.client_index + version) % n) * STAGGER_S


def releasable(core: RouterCore, free: int) -> int:
    """How many held requests ``core``'s router may release into ``free`` slots: all
    of them while the routers tell each other their routes (they take turns); else its
    share of them, rounded at random, since every router sees the same free slots and
    none hears what the others send there."""
    if core.client_count <= 1 or core.told_routes.live or free <= 0:
        return free
    x = free * core.share
    k = int(x)
    return k + (1 if core.rng.random() < x - k else 0)


class Admission:
    """The requests one router holds, first in first out (asyncio; one loop).

    ``enter()`` returns at once while a slot is free, else when a release finds one
    for it (``wake()``, at the router's turn) or after ``max_s``. A released request
    holds a ticket until it routes, so that one free slot releases one request, not
    every one held."""

    def __init__(self, core: RouterCore, max_s: float) -> None:
        if isinstance(max_s, bool) or not isinstance(max_s, int | float):
            raise InvalidArgument(f"max_s must be a number of seconds, got {max_s!r}")
        if not 0 < max_s < math.inf:
            raise InvalidArgument(f"max_s must be finite and > 0, got {max_s!r}")
        self.core = core
        self.max_s = float(max_s)
        # each held request: when it came (loop time) and what it waits on
        self._queue: deque[tuple[float, asyncio.Future[bool]]] = deque()
        self._released = 0  # released, not routed yet
        self._turn: asyncio.TimerHandle | None = None  # a release due at this router's turn
        self._recheck: asyncio.TimerHandle | None = None
        self.held_total = 0  # requests that were held
        self.timed_out = 0  # of those, routed at max_s without a free slot

    @property
    def held(self) -> int:
        """Requests held now."""
        return sum(1 for _, f in self._queue if not f.done())

    async def enter(self) -> float:
        """Wait for a free slot, at most ``max_s``; returns the seconds held (0.0: a
        slot was free). Route right after it returns (no await in between): a released
        request's ticket is the route's until then."""
        q = self._queue
        self._drop_done()
        if not q:
            free = free_slots(self.core, self._released)
            if free is None or free > self._released:
                return 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        fut: asyncio.Future[bool] = loop.create_future()
        self._queue.append((t0, fut))
        self.held_total += 1
        expire = loop.call_later(self.max_s, _expire, fut)
        if self._recheck is None:
            self._recheck = loop.call_later(RECHECK_S, self._on_recheck)
        try:
            released = await fut
        except asyncio.CancelledError:  # the client left
            if fut.done() and not fut.cancelled() and fut.result():
                self._released -= 1  # released meanwhile: its slot goes to the next one
                self.release()
            raise
        finally:
            expire.cancel()
        if released:
            self._released -= 1
        else:
            self.timed_out += 1
        return max(1e-9, loop.time() - t0)

    def wake(self) -> None:
        """The router's view changed: release at its turn (``release_delay``)."""
        if not self._queue or self._turn is not None:
            return
        delay = release_delay(self.core)
        if delay <= 0:
            self.release()
        else:
            self._turn = asyncio.get_running_loop().call_later(delay, self._on_turn)

    def release(self) -> None:
        """Release as many held requests as there are free slots not yet promised
        (every one when nothing should be held any more)."""
        q = self._queue
        self._drop_done()
        if not q:
            return
        wait = asyncio.get_running_loop().time() - q[0][0]
        free = free_slots(self.core, ahead=ahead_of(self.core, wait))
        n = len(q) if free is None else releasable(self.core, free - self._released)
        while n > 0 and q:
            _, fut = q.popleft()
            if not fut.done():
                fut.set_result(True)
                self._released += 1
                n -= 1

    def _drop_done(self) -> None:
        q = self._queue
        while q and q[0][1].done():
            q.popleft()  # timed out, or the client left: nobody waits there

    def _on_turn(self) -> None:
        self._turn = None
        self.release()

    def _on_recheck(self) -> None:
        self._recheck = None
        self.release()
        if self._queue:
            loop = asyncio.get_running_loop()
            self._recheck = loop.call_later(RECHECK_S, self._on_recheck)

    def close(self) -> None:
        """Let every held request go (the router is closing)."""
        for handle in (self._turn, self._recheck):
            if handle is not None:
                handle.cancel()
        self._turn = self._recheck = None
        while self._queue:
            _, fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(False)


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)
