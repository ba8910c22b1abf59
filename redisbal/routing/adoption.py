"""Snapshot adoption: which snapshots a router takes, and their counts into its views.
Pure logic for ``RouterCore``, which holds its lock around it; apart from the request
path (route, ends, outcomes) so that each module has one role.

Pending is reconciled with each snapshot, never simply wiped:
- exactly, when engines report ``admitted`` (cumulative requests received per
  API-server index): pending = routed - admitted[client_index] (``adopt_full``);
- otherwise by time: routes made before the report's time (less a transit
  allowance) are taken to be in it (``RosterViews.adopt``, and ``adopt_full`` for
  engines without admitted counts); where engines report only an admitted total,
  ``RouterCore`` then retires the routes it shows are in (routing.admit_total).
So a snapshot that predates recent routes loses no bookkeeping, and one that
includes them does not count them twice.

A snapshot belongs to an epoch (one Redis state: a new one after Redis lost its
state) and has a version within it. A router never goes back to an older version of
an epoch it adopted (``Versions``), and after an epoch change it keeps routing to the
engines it knew until the new epoch shows them (``Carrying``).
"""

from __future__ import annotations

from collections.abc import Collection

from redisbal.barrier.snapshot import MAX_ADMITTED, Roster, Snapshot
from redisbal.routing.estimates import RunningCap, SpeedEstimate, by_report, no_report, trim_costs
from redisbal.routing.state import EngineView

EPOCHS_KEPT = 8  # epochs whose latest adopted version a router remembers


class Versions:
    """The highest version adopted in each of the latest epochs: never back within
    one, even by way of another (invariant 4)."""

    def __init__(self) -> None:
        # epoch -> the highest version adopted in it, the latest adopted epoch last
        self.latest: dict[str, int] = {}

    def accepts(self, snap: Snapshot, cur: Snapshot | None) -> bool:
        """Whether snap is newer than any adopted in its epoch (or of a new epoch); one of
        an epoch the router left must also have been published after ``cur``, the
        snapshot it holds (a message of the old epoch may be read after a GET got the
        new one)."""
        seen = self.latest.get(snap.epoch, -1)
        if cur is not None and snap.epoch != cur.epoch and seen >= 0:
            return snap.version > seen and snap.time_ms > cur.time_ms
        return snap.version > seen

    def adopted(self, snap: Snapshot) -> None:
        """snap was adopted: its version is its epoch's, and its epoch the latest."""
        latest = self.latest
        latest.pop(snap.epoch, None)
        latest[snap.epoch] = snap.version
        if len(latest) > EPOCHS_KEPT:
            del latest[next(iter(latest))]


class Carrying:
    """The engines known before a new epoch that it does not hold yet, kept routable.

    A new epoch means Redis lost its state: the engines re-register one by one, so
    a snapshot of it that lacks an engine says nothing about it yet. Every engine
    known then is carried until the epoch holds it (engines, joining), reports it
    gone, or publishes a snapshot with engines ``grace_s`` (Redis time; the router's
    ``rejoin_grace_s``) after the first of its snapshots adopted here. Engines known
    before any snapshot (``RouterCore.set_engines``) go at the first snapshot with
    engines (it waits for them).
    """

    def __init__(self) -> None:
        self.carried: set[str] = set()  # known before this epoch, not shown by it yet
        self.settle_ms = 0  # Redis time from which a snapshot with engines ends carrying
        self.rejoin = False  # the carried engines were seen (not given before any snapshot)

    def carry(
        self, snap: Snapshot, cur: Snapshot | None, known: Collection[str], grace_s: float
    ) -> tuple[list[str], int]:
        """The ``known`` engines snap does not hold that stay routable (in known order),
        and how many seen engines were dropped now for not coming back in time (the
        router counts them: ``rejoin_dropped``). ``cur``: the snapshot held before."""
        if cur is None or snap.epoch != cur.epoch:
            self.carried.update(known)
            self.rejoin = cur is not None  # (else the engines were given, not seen)
            grace_ms = int(grace_s * 1000) if self.rejoin else 0
            self.settle_ms = snap.time_ms + grace_ms
        carried = self.carried
        if not carried:
            return [], 0
        carried.difference_update(snap.engines)
        carried.difference_update(snap.joining)
        carried.difference_update(snap.gone)
        dropped = 0
        if carried and snap.engines and snap.time_ms >= self.settle_ms:
            dropped = len(carried) if self.rejoin else 0
            carried.clear()
        return [e for e in known if e in carried], dropped


def new_incarnation(e: EngineView, inc: str | None, got: int, counters: dict[str, int]) -> None:
    """e now reports from process ``inc``; after another (a restart, counted in
    ``counters``) this router's routes but the ``got`` the new one admitted went to the
    old process and are gone."""
    if e.incarnation is not None:
        counters["restarts"] += 1
        e.routed_before = e.routed - got
        e.t_prev = -1
        e.total_cut = -1e18  # (routes to the old process: held by no count of the new one)
    e.incarnation = inc


def adopt_full(
    snap: Snapshot,
    known: list[EngineView],
    client_index: int,
    now: float,
    transit_s: float,
    weight: float,
    caps: RunningCap,
    speeds: SpeedEstimate | None,
    counters: dict[str, int],
    handover_s: float = 0.0,
) -> tuple[int, int, bool]:
    """A full snapshot's counts into the ``known`` views (``now``: the router's clock;
    ``transit_s``, ``weight``: reconciling by time, ``by_report``); returns this
    router's (``client_index``) and all routers' admitted totals, and whether any
    engine reported admitted counts. The reports feed the running cap (``caps``), and
    the completions ``speeds`` unless None; restarts are counted in ``counters``.
    ``handover_s``: how long past the time rule the routes to an engine that reports
    an admitted total stay counted (``estimates.HANDOVER_S``; 0 where the total
    retires none)."""
    ci = client_index
    mine = total = 0
    exact = False
    for e in known:
        c = snap.engines.get(e.engine_id)
        if c is None:  # kept or carried
            no_report(e)
            continue
        e.waiting, e.running, e.kv_usage = c.waiting, c.running, c.kv_usage
        e.age_s = max(0.0, (snap.time_ms - c.reported_ms) / 1000.0)
        adm = c.admitted
        if c.incarnation != e.incarnation:
            got = adm[ci] if adm is not None and ci < len(adm) else 0
            new_incarnation(e, c.incarnation, got, counters)
        # (a sum past MAX_ADMITTED: counts none of our reporters sends, read as none)
        if adm is not None and (all_adm := sum(adm)) < MAX_ADMITTED:
            got = adm[ci] if ci < len(adm) else 0
            # routes it never admitted that ended (refused, failed) are no load: at
            # most the requests still open here are (no phantom load after errors)
            e.pending = max(0, min(e.routed - e.routed_before - got, e.inflight))
            e.exact = exact = True
            e.admitted = adm
            e.times.clear()
            trim_costs(e)
            mine += got
            total += all_adm
            if c.reported_ms != e.cap_ms:
                caps.observe(e, c.waiting, c.running, c.reported_ms, all_adm, c.kv_usage)
            if speeds is not None:
                done = all_adm - c.waiting - c.running
                speeds.observe(e, done, c.reported_ms, c.running)
        else:
            at = now - (snap.time_ms - c.reported_ms) / 1000.0
            # (only where the total retires routes: not where a list read as none)
            late = handover_s if adm is None and c.admitted_total is not None else 0.0
            by_report(e, c.reported_ms, at, transit_s, weight, late)
            if c.reported_ms != e.cap_ms:
                caps.observe(e, c.waiting, c.running, c.reported_ms, None, c.kv_usage)
    return mine, total, exact


class RosterViews:
    """The engine views in the order of a compact roster, a compact snapshot's counts
    going to them by position. Made again, and the roster's incarnations adopted, only
    when the roster is not the last one adopted (a restart, a new incarnation, makes a
    new roster)."""

    def __init__(self) -> None:
        self.views: list[EngineView] = []
        self.roster: Roster | None = None  # the roster views was made from

    def forget(self) -> None:
        """The views are to be made again at the next compact snapshot: the known
        engines changed, or a full snapshot adopted incarnations."""
        self.roster = None

    def adopt(
        self,
        snap: Snapshot,
        now: float,
        by_id: dict[str, EngineView],
        known: list[EngineView],
        transit_s: float,
        weight: float,
        counters: dict[str, int],
        caps: RunningCap,
    ) -> None:
        """A compact snapshot's counts into the views of ``by_id`` (no admitted counts:
        pending is reconciled by time, ``by_report``); views with no routes to reconcile
        are only overwritten. ``known`` past the roster's engines are kept or carried
        (``RouterCore.apply_snapshot``); restarts are counted in ``counters``, queues
        that may teach the running cap go to ``caps``."""
        roster = snap.roster
        assert roster is not None
        if self.roster is not roster:
            self.views = [by_id[i] for i in roster.ids]
            self.roster = roster
            for e, inc in zip(self.views, roster.incs, strict=True):
                if inc != e.incarnation:
                    new_incarnation(e, inc, 0, counters)
        it = iter(snap.counts)  # four per engine (their number is checked by the parse)
        for e, w, r, kv, age in zip(self.views, it, it, it, it, strict=False):
            e.waiting = w  # (one assignment each: a tuple of four cost a sixth of this loop)
            e.running = r
            e.kv_usage = kv
            e.age_s = age_s = age / 1000.0
            # (a view with nothing to reconcile keeps no report time: the first route
            # after a quiet spell stays pending a report longer)
            if e.pending or e.exact or e.costs or e.ends or e.others:
                by_report(e, snap.time_ms - age, now - age_s, transit_s, weight)
            if w or e.cap_wait or r > caps.most_running:  # (else nothing for caps to see)
                t_ms = snap.time_ms - age
                if t_ms != e.cap_ms:
                    caps.observe(e, w, r, t_ms, None, kv)
        for e in known[len(roster.ids) :]:  # kept or carried
            no_report(e)
