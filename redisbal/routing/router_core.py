"""``RouterCore``: what one router knows and its request path; pure logic, no I/O, so
route() costs microseconds.

``RouterCore`` holds what one API server knows: the latest snapshot's counts
per engine, and its own bookkeeping per engine (routed, in flight, and the
routes the snapshot does not contain yet: "pending"). Its ``Policy``
(``redisbal.routing.policies``) turns that into a choice. Here is the request
path (route, its end, its outcome) and the state it reads; how a snapshot is
taken in, pending reconciled with it and engines carried through a new epoch,
is in ``redisbal.routing.adoption``.

Engines the router should not choose are kept known but left out of
``engines``, the list policies pick from: those the snapshot names stalled
(work and no progress), silent (their reports stopped ``SILENT_AFTER_S``
ago: the process is stopped or gone) or suspect (ejected: requests failed on
them, some router told the deployment), and those this router ejected on the outcomes
of its own requests (``failed()``; ``redisbal.routing.outcomes``). Engines probing
(an ejection whose back-off ended, here or in the snapshot) are left out too,
but get one request at a time (``Decision.probe``) until one answers
(``answered()``); with ``shadow_probes`` (the gateway) that request is a copy of
one routed elsewhere (``Decision.shadow``), so that no client waits on an engine
that may still be stopped, and none is served twice by it. A pinned request may
still go to any of them; when every engine is excluded the router chooses among
all of them rather than fail, and its own evidence ejects at most half of the
engines: an exclusion is a preference, never a way to empty the deployment.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from redisbal.barrier.snapshot import Snapshot
from redisbal.errors import InvalidArgument
from redisbal.routing.admit_total import TotalReconciler
from redisbal.routing.adoption import Carrying, RosterViews, Versions, adopt_full
from redisbal.routing.cache_view import CacheView
from redisbal.routing.estimates import (
    HANDOVER_S,
    RouteCost,
    RunningCap,
    ShareEstimate,
    SpeedEstimate,
    ended,
    ended_held,
    held_ended,
    trim_costs,
)
from redisbal.routing.exclusions import Exclusions
from redisbal.routing.outcomes import QUEUE_WAITS, OutcomeTracker
from redisbal.routing.policies import DEFAULT_POLICY, NoEngines, Policy, UnknownEngine, make_policy
from redisbal.routing.state import Decision, EngineView, RequestInfo, request_info
from redisbal.routing.told_routes import ToldRoutes
from redisbal.routing.unanswered import (
    QUEUE_FRESH_S,
    SILENT_MAX_S,
    SILENT_UNANSWERED_S,
    TTFB_FACTOR,
)


class RouterCore:
    """One API server's routing state. Thread-safe; no I/O."""

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
        rejoin_grace_s: float = 1.0,
        suspect_s: float = 1.0,
        outcomes: OutcomeTracker | None = None,
        learn_routes: int = 0,
    ) -> None:
        if isinstance(client_count, bool) or not isinstance(client_count, int) or client_count < 1:
            raise InvalidArgument(f"client_count must be a whole number >= 1, got {client_count!r}")
        if (
            isinstance(client_index, bool)
            or not isinstance(client_index, int)
            or not 0 <= client_index < client_count
        ):
            raise InvalidArgument(
                f"client_index must be in 0..{client_count - 1}, got {client_index!r}"
            )
        g = rejoin_grace_s
        if isinstance(g, bool) or not (isinstance(g, int | float) and 0 <= g < math.inf):
            raise InvalidArgument(f"rejoin_grace_s must be finite and >= 0, got {rejoin_grace_s!r}")
        g = suspect_s
        if isinstance(g, bool) or not (isinstance(g, int | float) and 0 < g < math.inf):
            raise InvalidArgument(f"suspect_s must be finite and > 0, got {suspect_s!r}")
        self.client_index = client_index
        self.client_count = client_count
        self.policy = make_policy(policy)
        # whether a route counts by its size (the policy's use_cost; RedisbalPolicy)
        self._sized: bool = getattr(self.policy, "use_cost", False)
        self.stale_after_s = stale_after_s
        self.transit_s = transit_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.lock = threading.Lock()
        self.known: list[EngineView] = []  # every engine, in snapshot order
        self.engines: list[EngineView] = []  # the ones policies choose from (module doc)
        self.by_id: dict[str, EngineView] = {}
        self._ids: list[str] = []  # the ids known was made from (_set_engines)
        self.roster_views = RosterViews()  # by_id's views in the order of a compact roster
        self.suspect_s = suspect_s
        # this router's evidence: ejections back off from suspect_s / 8 to suspect_s
        self.outcomes = outcomes or OutcomeTracker(base_s=suspect_s / 8, max_s=suspect_s)
        self.excl = Exclusions(self.outcomes)  # engines not chosen now (routing.exclusions)
        self._knew_any = False
        self.snapshot: Snapshot | None = None
        self.snapshot_at = float("-inf")  # local clock when the snapshot was applied
        self.connected = False
        self.rejoin_grace_s = rejoin_grace_s
        self.carrying = Carrying()  # engines known before this epoch, not shown by it yet
        self.versions = Versions()  # the latest version adopted per epoch: never back in one
        self.seq = 0  # the last decision's
        # share of traffic (redisbal.routing.estimates); its weights set where it moves
        # (_weigh): policies read them per route
        self.share_estimate = ShareEstimate(client_count, share_halflife)
        # the other routers' routes on their way, as they tell them: while every other one
        # is heard from, they count instead of the share (routing.told_routes)
        self.told_routes = ToldRoutes()
        # engines that report an admitted total and no admitted counts: each one's drift
        # baseline (routing.admit_total), while every router's routes there are known
        self.totals: dict[str, TotalReconciler] = {}
        self._weigh()  # share_weight, pending_weight
        self.speeds = SpeedEstimate()  # engines' completion rates (speed and age terms)
        self.caps = RunningCap()  # the engines' running cap as far as seen
        self.declared: dict[str, int] = {}  # the caps engines declared (set_declared_caps)
        self.request: RequestInfo | None = None  # the request being routed (policies read it)
        # what the engines hold in their prefix caches: told by the router's reader
        # (AsyncRouter's cache_sync), or learned from the routes of requests with blocks,
        # this router's and, on the routes channel, the others' (``learn_routes`` anchors
        # per engine at most; 0: none); empty without either (policies route on load)
        self.cache_view = CacheView(learn=learn_routes)
        # called (outside the lock) when slots may have freed: a snapshot adopted, a route
        # told, a request ended or taken back (routing.admission wakes held requests)
        self.on_update: Callable[[], None] | None = None
        self.route_cost = RouteCost()  # a route's size against recent routes' (estimates)
        # probes go as copies of requests (Decision.shadow), the requests themselves to
        # choosable engines: set by a caller that sends the copies (the gateway)
        self.shadow_probes = False
        self.counters = {
            "routes": 0,
            "degraded_routes": 0,
            "pinned": 0,
            "snapshots": 0,
            "ignored_old": 0,
            "epochs": 0,
            "rejoin_dropped": 0,
            "failed": 0,  # failed() calls counted as evidence
            "queued_given_up": 0,  # failed() calls of waits on a queueing engine: no evidence
            "stalled": 0,  # stalled() calls: streams that stopped mid-way
            "restarts": 0,  # engines seen with a new incarnation
            "all_excluded_routes": 0,  # routes made while every engine was excluded
            "roster_fetches": 0,  # compact messages whose roster was read from the stored one
            "malformed": 0,  # snapshots ignored as malformed (Snapshot.from_json refused them)
            "probes": 0,  # requests (or their copies: shadow_probes) sent to a probing engine
            "recovered": 0,  # probing engines that answered
            "cache_routes": 0,  # routes that followed a match in cache_view (Decision.cached)
        }

    # -- state -------------------------------------------------------------------------------

    @property
    def running_cap(self) -> int:
        """The engines' running cap as far as seen (0 until known: ``RunningCap``); an
        engine that declared its own has that one (``estimates.engine_cap``)."""
        return self.caps.cap

    def set_declared_caps(self, caps: Mapping[str, int]) -> None:
        """The running caps the engines declared (engine id -> cap: redisbal.running_caps),
        all of them: an engine not named has none (it left, or never declared one)."""
        with self.lock:
            self.declared = dict(caps)
            for eid, e in self.by_id.items():
                e.declared_cap = self.declared.get(eid, 0)

    @property
    def degraded(self) -> bool:
        """True when routing without a fresh snapshot (none yet, stale, or feed down),
        or to engines a new epoch has not shown yet (``carried``)."""
        return (
            not self.connected
            or self.snapshot is None
            or bool(self.carrying.carried)
            or self.clock() - self.snapshot_at > self.stale_after_s
        )

    @property
    def carried(self) -> set[str]:
        """The engines known before this epoch that it does not show yet, still routed
        to (``redisbal.routing.adoption.Carrying``)."""
        return self.carrying.carried

    def set_engines(self, engine_ids: Iterable[str]) -> None:
        """Known engines before any snapshot (e.g. the members set): start balanced."""
        with self.lock:
            if self.snapshot is not None:
                return
            self._set_engines(list(engine_ids))
            self.policy.reset(self)

    def _set_engines(self, ids: list[str]) -> None:
        self._ids = ids
        self.roster_views.forget()
        old = self.by_id
        self._knew_any = self._knew_any or bool(ids)
        self.by_id = {i: old.get(i) or EngineView(i, first_seq=self.seq + 1) for i in ids}
        for i, e in self.by_id.items():
            e.declared_cap = self.declared.get(i, 0)
        self.known = list(self.by_id.values())
        self.excl.waits.keep(self.by_id)
        self.excl.gaps.keep(self.by_id)
        self.told_routes.forget(ids)
        self.totals = {i: t for i, t in self.totals.items() if i in self.by_id}
        self.cache_view.keep_learned(self.by_id)
        self._choosable(self.clock())

    def _choosable(self, now: float) -> None:
        """Set ``engines``: the known ones not excluded or probing at ``now`` (all of
        them when every one is). The caller resets the policy."""
        self.engines = self.excl.choosable(self.known, self.by_id, now)

    def excluded(self) -> dict[str, str]:
        """Known engines this router does not choose now -> why ("stalled", "silent":
        its reports stopped, "suspect": ejected here or in the deployment, "probing":
        one request at a time, "late": a request sent here waits too long for its
        first byte)."""
        with self.lock:
            return self.excl.why(self.clock(), self.snapshot)

    def accepts(self, snap: Snapshot) -> bool:
        """Whether snap is newer than any adopted in its epoch (``Versions.accepts``)."""
        return self.versions.accepts(snap, self.snapshot)

    def apply_snapshot(self, snap: Snapshot) -> bool:
        """Adopt snap unless it is older than ours within the same epoch (invariant 4)."""
        with self.lock:
            adopted = self._adopt(snap)
        if adopted:
            self._updated()
        return adopted

    def _updated(self) -> None:
        """Slots may have freed: call ``on_update`` (outside the lock)."""
        if self.on_update is not None:
            self.on_update()

    def _adopt(self, snap: Snapshot) -> bool:
        """apply_snapshot() under the lock."""
        cur = self.snapshot
        if not self.accepts(snap):
            self.counters["ignored_old"] += 1
            return False
        if cur is not None and snap.epoch != cur.epoch:
            self.counters["epochs"] += 1
        now = self.clock()
        self.snapshot, self.snapshot_at = snap, now
        self.counters["snapshots"] += 1
        self.versions.adopted(snap)
        # an engine this router knows that the cut cannot hold yet (it reported only
        # steps past it, e.g. re-registering after a state loss) stays routable
        # with its last counts instead of vanishing for a snapshot
        kept = [j for j in snap.joining if j in self.by_id and j not in snap.engines]
        carried, dropped = self.carrying.carry(snap, cur, self.by_id, self.rejoin_grace_s)
        self.counters["rejoin_dropped"] += dropped
        marked = self.excl.adopt(snap, now)
        # the speed estimate only feeds a policy that uses it (off by default)
        speed_on, age_on = (getattr(self.policy, a, False) for a in ("wants_speed", "use_age"))
        ids = [*snap.engines, *kept, *carried]
        if ids != self._ids or marked:
            self._set_engines(ids)
        # else the same engines, none excluded: known and engines stand as they are
        counters, transit, weight = self.counters, self.transit_s, self.share_weight
        if snap.roster is not None:
            self.roster_views.adopt(
                snap, now, self.by_id, self.known, transit, weight, counters, self.caps
            )
            mine = total = 0
            exact = False
        else:
            self.roster_views.forget()  # (incarnations change here too)
            speeds = self.speeds if speed_on or age_on else None
            ci = self.client_index
            # where the admitted totals retire routes (_by_totals), time waits for them
            late = HANDOVER_S if self.totals_retire else 0.0
            mine, total, exact = adopt_full(
                snap, self.known, ci, now, transit, weight, self.caps, speeds, counters, late
            )
        if exact:
            self._update_share(mine, total)
            if speed_on:
                self.speeds.update_speeds(self.known)
            if age_on:
                self.speeds.update_aged(self.known, snap)
        self._count_others(None, tell_policy=False)  # (reset just below)
        if snap.roster is None:  # (the compact form carries no totals)
            retired = self._by_totals(snap)
            if retired:
                self._count_others(retired, tell_policy=False)
        self.policy.reset(self)
        return True

    @property
    def totals_retire(self) -> bool:
        """Whether engines' admitted totals retire pending routes (``_by_totals``): only
        where every router's routes are known here, one router or routers that tell
        theirs (``told_routes.live``)."""
        return self.client_count <= 1 or self.told_routes.live

    def _by_totals(self, snap: Snapshot) -> list[EngineView]:
        """Retire the pending routes (own and told) that the admitted totals of snap's
        engines without admitted counts show are in: for each, at most the routes of all
        routers on their way (``TotalReconciler``) stay counted, the oldest going
        first. Only where ``totals_retire``; else by time alone. Returns the views
        that changed."""
        if not self.totals_retire:
            return []
        count = self.client_count
        changed = []
        told = self.told_routes
        for e in self.known:
            c = snap.engines.get(e.engine_id)
            if c is None or c.admitted is not None or e.exact:
                continue
            if c.admitted_total is None:
                continue
            rec = self.totals.get(e.engine_id)
            if rec is None:
                rec = self.totals[e.engine_id] = TotalReconciler()
            sent, open_ = told.sent(e, count) if count > 1 else (0, 0)
            sent += max(0, e.routed - e.routed_before)
            try:
                keep = rec.in_transit(e.incarnation, c.admitted_total, sent, open_ + e.inflight)
            except InvalidArgument:
                # a published snapshot's total is checked where it is decoded; one made
                # in-process with a bad total is skipped alike
                continue
            if told.retire(e, keep, count):
                # its retired routes that ended since its counts were made free their room
                e.done = ended_held(e)
                e.aged = held_ended(e, self.share_weight)
                changed.append(e)
        return changed

    @property
    def share(self) -> float:
        """This router's estimated share of all routes (``ShareEstimate``)."""
        return self.share_estimate.share

    def restart_share(self, client_count: int) -> None:
        """Start the share estimate over at 1 / client_count (the index or the router
        count changed: redisbal.routing.lease)."""
        self.share_estimate.restart(client_count)
        self._weigh()

    def _update_share(self, mine: int, total: int) -> None:
        """A snapshot's admitted totals, this router's and all routers', into the estimate."""
        self.share_estimate.update(mine, total)
        self._weigh()

    def _weigh(self) -> None:
        """What one own pending route counts: 1 / share, or 1 while the others' are told."""
        self.share_weight = self.share_estimate.weight
        self.pending_weight = 1.0 if self.told_routes.live else self.share_weight

    def _count_others(self, views: Iterable[EngineView] | None, tell_policy: bool = True) -> None:
        """``others`` of ``views`` (None: of every engine told about) counted again;
        when told_routes.live flips, every view's and the weights (the share comes back or
        goes). With ``tell_policy`` the policy hears of it: reset on a flip, else the
        views changed."""
        was = self.told_routes.live
        index, count = self.client_index, self.client_count
        changed = self.told_routes.count(
            views, self.by_id, index, count, self.clock(), self.connected
        )
        if self.told_routes.live != was:
            self._weigh()
            if tell_policy:
                self.policy.reset(self)
        elif tell_policy:
            for e in changed:
                self.policy.changed(self, e)

    def hear(self, data: bytes | str) -> None:
        """Another router's message on the routes channel (routing.told_routes)."""
        with self.lock:
            view = self.cache_view
            learn = view.learn_anchors if view.learn else None
            ids = self.told_routes.hear(data, self.client_index, self.clock(), self.by_id, learn)
            if ids is not None:
                self._count_others([self.by_id[i] for i in ids])
        if ids:
            self._updated()

    def check_told(self) -> None:
        """Whether every other router is still heard from (the feed asks every 0.5 s:
        a router gone stops counting without a message or a snapshot to say so)."""
        with self.lock:
            self._count_others(())

    def set_connected(self, connected: bool) -> None:
        """The feed connected or lost: told routes count only while it is connected
        (with it down nothing told can change, while the routes it counts end)."""
        self.connected = connected
        self.check_told()

    def told(self) -> bytes:
        """This router's message to the others: its counts that changed since the last one."""
        with self.lock:
            return self.told_routes.message(self.by_id, self.client_index)

    def silent_ms(self, engine_id: str) -> int:
        """How long ``engine_id``'s reports had stopped when the latest snapshot was
        published (0: not named a laggard; ``redisbal.routing.unanswered.Silence``)."""
        return self.excl.silence.ms(engine_id, self.snapshot)

    def stepped_s(self, engine_id: str) -> float | None:
        """Seconds since ``engine_id`` last stepped, as its reports say: the age of its
        counts in the latest snapshot (a heartbeat without progress keeps their time)
        plus the time since that snapshot came; None when it holds no report of it."""
        snap, e = self.snapshot, self.by_id.get(engine_id)
        if snap is None or e is None or engine_id not in snap.engines:
            return None
        return max(0.0, self.clock() - self.snapshot_at) + e.age_s

    def queues(self, engine_id: str) -> bool:
        """Whether requests wait for room at ``engine_id`` while it steps, as its latest
        counts say (at most ``QUEUE_FRESH_S`` old), and nothing marks it: a stream of it
        gone silent is then most likely one the engine preempted (its KV cache ran out)
        and will run again, not a hung one."""
        with self.lock:
            return self._queues(engine_id)

    def _queues(self, engine_id: str) -> bool:
        e, stepped = self.by_id.get(engine_id), self.stepped_s(engine_id)
        if e is None or stepped is None or stepped > QUEUE_FRESH_S or e.waiting <= 0:
            return False
        snap = self.snapshot
        marked = snap is not None and (engine_id in snap.suspect or engine_id in snap.stalled)
        return not marked and engine_id not in self.outcomes.marked

    def silent_after_s(self, engine_id: str) -> float:
        """How long ``engine_id``'s reports may stop before a request waiting on it is
        given up: from its own recent gaps between reports (``unanswered.ReportGaps``),
        and at least ``TTFB_FACTOR`` x its usual time to a first byte (within
        ``SILENT_MAX_S``): an engine slow to answer is slow, not stopped. Until it
        answered one request, at least ``SILENT_UNANSWERED_S``: nothing tells its pace
        yet, and a fresh server's first steps are its longest."""
        snap = self.snapshot
        bound = self.excl.gaps.silent_after_s(engine_id, snap.time_ms if snap else 0)
        h = self.outcomes.engines.get(engine_id)
        if h is None or h.ttfb is None:
            return max(bound, SILENT_UNANSWERED_S)
        return max(bound, min(SILENT_MAX_S, TTFB_FACTOR * h.ttfb))  # slow to answer is slow

    # -- hot path --------------------------------------------------------------------------------

    def route(
        self,
        engine_id: str | None = None,
        *,
        key: str | None = None,
        prompt_tokens: int | None = None,
        output_tokens: int | None = None,
        blocks: Iterable[int] | None = None,
        key_guessed: bool = False,
    ) -> Decision:
        """Pick an engine (or take the pinned one) and record the route. No I/O.

        The keywords describe the request (``RequestInfo``): a session or prefix
        ``key`` for affinity (``key_guessed``: taken from the request, not given),
        its size in tokens so that the route counts by its cost, and its prompt's
        block hashes, which the default policy matches with ``cache_view``."""
        info = None
        if key is not None or prompt_tokens is not None or output_tokens is not None or blocks:
            info = request_info(key, prompt_tokens, output_tokens, blocks, key_guessed)
        if engine_id is not None and not isinstance(engine_id, str):
            if isinstance(engine_id, int) and not isinstance(engine_id, bool):
                engine_id = str(engine_id)  # an engine id is text: 3 means "3"
            else:
                raise TypeError(f"engine_id must be a str, got {type(engine_id).__name__}")
        with self.lock:
            excl = self.excl
            if excl.recheck_at <= self.clock():  # an exclusion ran out
                self._choosable(self.clock())
                self.policy.reset(self)
            if not self.engines:
                if self.snapshot is not None and self.snapshot.engines == {} and self._knew_any:
                    raise NoEngines(
                        "no engine left: every engine this router knew left or expired, "
                        "and none has joined since"
                    )
                raise NoEngines(
                    "no engine known yet: no snapshot with engines has arrived; check that "
                    "engines report to this deployment"
                )
            self.request = info  # policies read it in pick() and routed()
            now = self.clock()
            policy = self.policy
            try:
                policy.matched = 0
                eng, pinned, probe = self._choose(engine_id, now)
                if excl.waits and not (pinned or probe) and self._overdue(eng.engine_id, now):
                    excl.waits.late[eng.engine_id] = None  # waiting on it: pick another
                    self._choosable(now)
                    policy.reset(self)
                    policy.matched = 0
                    eng, pinned, probe = self._choose(engine_id, now)
                cached = policy.matched
                cost = 1.0 if info is None or not self._sized else self.route_cost(info)
                self._book(eng, cost, now)
                if not probe and (not pinned or eng.engine_id not in excl.avoided):
                    self.policy.routed(self, eng)  # (only engines in self.engines)
                if info is not None and info.blocks:
                    chain = self.cache_view.learn_route(eng.engine_id, info.blocks)
                    self.told_routes.learned(eng.engine_id, chain)
            finally:
                self.request = None
            degraded = self.degraded
            counters = self.counters
            counters["routes"] += 1
            if degraded:
                counters["degraded_routes"] += 1
            if cached:
                counters["cache_routes"] += 1
            snap, self.seq = self.snapshot, self.seq + 1
            version = snap.version if snap else 0
            eid, ci = eng.engine_id, self.client_index
            d = Decision(eid, ci, self.seq, version, degraded, pinned, False, probe, now, cached)
            if self.shadow_probes and engine_id is None:
                d.shadow = self._shadow(cost, version, degraded, now)
            return d

    def _book(self, eng: EngineView, cost: float, now: float) -> None:
        """Count a route to ``eng``: routed, in flight, pending, its cost."""
        eng.routed += 1
        eng.inflight += 1
        self.told_routes.mark(eng.engine_id, True)
        eng.pending += 1
        eng.costs.append(cost)
        eng.pending_cost += cost
        if not eng.exact:
            eng.times.append(now)

    def _shadow(self, cost: float, version: int, degraded: bool, now: float) -> Decision | None:
        """The probe owed to a probing engine, as a copy of the request just routed
        (``shadow_probes``): a route of its own, counted as the request's (its cost), or
        None when no probe is due."""
        for eid in self.excl.probing:  # (a silent one is excluded: no probe)
            if self.outcomes.take_probe(eid, now):
                self.counters["probes"] += 1
                self._book(self.by_id[eid], cost, now)
                self.seq += 1
                ci = self.client_index
                return Decision(eid, ci, self.seq, version, degraded, False, False, True, now)
        return None

    def _choose(self, engine_id: str | None, now: float) -> tuple[EngineView, bool, bool]:
        """The policy's pick, a probe of a probing engine (one at a time), or the pinned
        engine; and whether it was pinned, whether a probe."""
        if engine_id is None:
            for eid in () if self.shadow_probes else self.excl.probing:  # (else: _shadow)
                if self.outcomes.take_probe(eid, now):  # (a silent one is excluded: no probe)
                    self.counters["probes"] += 1
                    return self.by_id[eid], False, True
            if self.excl.all_excluded:
                self.counters["all_excluded_routes"] += 1
            return self.policy.pick(self), False, False
        eng = self.by_id.get(engine_id)
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
        self.counters["pinned"] += 1
        return eng, True, False

    def finished(self, decision: Decision) -> None:
        """The request of ``decision`` ended (idempotent)."""
        with self.lock:
            self._finish(decision)
        self._updated()

    def _view(self, decision: Decision) -> EngineView | None:
        """The view decision was made on, if it is still known (not a later one's)."""
        eng = self.by_id.get(decision.engine_id)
        return eng if eng is not None and decision.seq >= eng.first_seq else None

    def sent(self, decision: Decision) -> None:
        """The request of ``decision`` went to its engine and its first byte should come
        soon (a stream). Until ``answered()`` or its end, the engine is passed over by
        the policy once the request waited past the engine's late bound
        (``OutcomeTracker.late_bound``: a few times its usual first-byte time): an
        engine stopped or hung gets no more requests from this router from then on,
        long before the request fails. Not evidence: nothing is ejected or told."""
        with self.lock:
            if not decision.done and self._view(decision) is not None:
                self.excl.waits.sent(decision.engine_id, decision.seq, self.clock())

    def _overdue(self, engine: str, now: float) -> bool:
        """Whether ``engine`` left a request sent() waiting past its late bound, and
        answered none since it was sent."""
        return self.excl.waits.overdue(engine, now, self.outcomes.late_bound(engine))

    def _settle(self, decision: Decision, now: float) -> None:
        """The request of ``decision`` waits for no first byte any more: the engine is no
        longer late unless another request still waits too long on it."""
        eid, waits = decision.engine_id, self.excl.waits
        waits.ended(eid, decision.seq)
        if eid in waits.late and not (eid in self.by_id and self._overdue(eid, now)):
            del waits.late[eid]
            self._choosable(now)
            self.policy.reset(self)

    def _finish(self, decision: Decision, reached: bool = True) -> None:
        """End decision's request (``reached``: it got to its engine)."""
        if decision.done:
            return
        decision.done = True
        self.told_routes.mark(decision.engine_id, False)
        if self.excl.waits:
            self._settle(decision, self.clock())
        if decision.probe:  # ended, answered or not: the next request may probe again
            self.outcomes.release_probe(decision.engine_id)
        eng = self._view(decision)
        if eng is not None and eng.inflight > 0:
            eng.inflight -= 1
            if reached and not eng.exact:  # counts without admitted ones: by time
                ended(eng, decision.routed_at, self.clock(), self.transit_s, self.share_weight)
                self.policy.changed(self, eng)
            self.policy.finished(self, eng)

    def unroute(self, decision: Decision) -> None:
        """The request of ``decision`` never reached its engine: take the route out of
        the bookkeeping (routed, pending: exact reconciliation compares them with the
        engine's admitted count) and end it."""
        with self.lock:
            eng = self._view(decision)
            if eng is not None and not decision.done:
                self.told_routes.mark(eng.engine_id, True)
                eng.routed = max(0, eng.routed - 1)
                eng.pending = max(0, eng.pending - 1)
                if eng.times:
                    eng.times.pop()
                if eng.costs:
                    eng.pending_cost -= eng.costs.pop()
                trim_costs(eng)
            self._finish(decision, reached=False)
        self._updated()

    def failed(self, decision: Decision, kind: str = "error") -> bool:
        """The engine of ``decision`` did not serve it (``kind``: one of
        ``redisbal.routing.outcomes.FAILURES``): the request ends, and this router ejects the
        engine with a back-off (unless half of the engines are ejected or probing
        already). Returns whether to tell the deployment (it was ejected now).

        A wait given up (``QUEUE_WAITS``: no first byte, a stream gone quiet) on an
        engine that ``queues()`` is no evidence: the request was most likely among
        those its counts say wait for room, and an engine that queues steps. Counting
        it would mark the engine, the one a last try then waits for in vain."""
        with self.lock:
            self._finish(decision)
            engine = decision.engine_id
            if engine not in self.by_id:
                return False
            if kind in QUEUE_WAITS and self._queues(engine):
                self.counters["queued_given_up"] += 1
                return False
            self.counters["failed"] += 1
            now = self.clock()
            tell = self.excl.failed(engine, kind, now, len(self.known), decision.probe)
            if tell:
                self._choosable(now)
                self.policy.reset(self)
        self._updated()
        return tell

    def stalled(self, decision: Decision) -> bool:
        """The stream of ``decision`` stopped mid-way (``redisbal.routing.stream_gaps``):
        evidence against its engine (kind ``stall``), as ``failed()``, but the request
        goes on (its stream may still end, or time out: ``finished()``/``failed()``).
        Returns whether to tell the deployment (it was ejected now)."""
        with self.lock:
            engine = decision.engine_id
            if engine not in self.by_id:
                return False
            self.counters["stalled"] += 1
            now = self.clock()
            # (the stream goes on: a probe named stalled is still the one in flight)
            tell = self.excl.failed(engine, "stall", now, len(self.known), False)
            if tell:
                self._choosable(now)
                self.policy.reset(self)
        self._updated()
        return tell

    def unproven(self, decision: Decision) -> None:
        """The probe of ``decision`` ended whole but before the point where its engine's
        streams stalled (``StreamGaps.flowed``): it proves nothing either way. The
        request ends, and the engine's next probe waits its back-off."""
        with self.lock:
            self._finish(decision)
            if decision.probe and decision.engine_id in self.by_id:
                self.outcomes.unproven(decision.engine_id, self.clock())
        self._updated()

    def answered(self, decision: Decision, first_byte_s: float | None = None) -> bool:
        """The engine of ``decision`` answered it (its first byte, after ``first_byte_s``;
        default: since the route). The request goes on (``finished()`` still ends it).
        Clears this router's ejection of a probing engine; returns whether to tell the
        deployment (the engine is probing there: ``lua/recovered.lua``)."""
        with self.lock:
            engine = decision.engine_id
            if engine not in self.by_id:
                return False
            now, excl = self.clock(), self.excl
            took = now - decision.routed_at if first_byte_s is None else first_byte_s
            if excl.waits:
                excl.waits.answered(engine)  # (what was sent before says nothing now)
                self._settle(decision, now)
            tell, changed = excl.answered(engine, now, took, decision.probe)
            if changed:
                self.counters["recovered"] += 1
                self._choosable(now)
                self.policy.reset(self)
            return tell

    def first_byte_bound(self, engine_id: str) -> float:
        """Seconds to wait for ``engine_id``'s first byte before calling it failed
        (``first_byte_timeout``): a multiple of what it usually takes, within bounds."""
        with self.lock:
            return self.outcomes.first_byte_bound(engine_id)

    def evidence(self, engine_id: str) -> str:
        """What this router's requests got from ``engine_id`` since it was last healthy
        (e.g. ``5xx x12 in 2.0s``; "" when nothing)."""
        with self.lock:
            return self.outcomes.why(engine_id, self.clock())

    def loads(self) -> dict[str, float]:
        """Each engine's estimated load as this router sees it (for status/debug)."""
        with self.lock:
            w = self.pending_weight
            return {e.engine_id: e.waiting + e.running + e.pending_cost * w for e in self.known}
