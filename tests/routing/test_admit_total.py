"""Routes on their way from an engine's admitted total (routing/admit_total.py): the
reconciliation on its own, through drift, restarts and several routers."""

from __future__ import annotations

import pytest
import redis
from support.helpers import Barrier, await_until, make_snapshot

from redisbal import AsyncReporter, AsyncRouter, Counts
from redisbal.barrier.snapshot import MAX_ADMITTED
from redisbal.errors import InvalidArgument
from redisbal.keys import DeploymentKeys
from redisbal.routing.admit_total import TotalReconciler, check_total
from redisbal.routing.estimates import HANDOVER_S
from redisbal.routing.router_core import RouterCore


class Engine:
    """An engine with a total admitted count fed by several routers: routes sent are
    on their way until admitted; admitted ones finish or are aborted (an abort never
    reaches the finished count, as in vLLM)."""

    def __init__(self, routers: int) -> None:
        self.sent = [0] * routers
        self.transit: list[int] = []  # router of each route on its way, oldest first
        self.inside: list[int] = []  # router of each admitted request not ended
        self.finished = 0
        self.outside = 0  # requests from no router

    def route(self, r: int, n: int = 1) -> None:
        self.sent[r] += n
        self.transit += [r] * n

    def admit(self, n: int) -> None:
        self.inside += self.transit[:n]
        del self.transit[:n]

    def finish(self, n: int) -> None:
        del self.inside[:n]
        self.finished += n

    def abort(self, n: int) -> None:
        del self.inside[:n]  # ends (the router sees it end) but is not finished

    @property
    def total(self) -> int:
        return self.finished + len(self.inside) + self.outside  # finished + waiting + running

    @property
    def open(self) -> int:
        return len(self.transit) + len(self.inside)

    def estimate(self, rec: TotalReconciler, inc: str = "a") -> int:
        return rec.in_transit(inc, self.total, sum(self.sent), self.open)


def test_exact_without_drift() -> None:
    eng, rec = Engine(1), TotalReconciler()
    eng.route(0, 5)
    assert eng.estimate(rec) == 5
    eng.admit(3)
    assert eng.estimate(rec) == 2
    eng.finish(2)
    eng.route(0, 4)
    assert eng.estimate(rec) == 6
    eng.admit(6)
    assert eng.estimate(rec) == 0


def test_aborts_do_not_accumulate() -> None:
    """Every abort leaves the total one low for good; the estimate still comes back to
    what is on its way, and is never above the open requests."""
    eng, rec = Engine(1), TotalReconciler()
    for _ in range(50):
        eng.route(0, 4)
        assert eng.estimate(rec) <= eng.open
        eng.admit(4)
        eng.abort(2)
        eng.finish(1)
        assert eng.estimate(rec) <= len(eng.transit) + len(eng.inside)
    eng.finish(len(eng.inside))
    assert eng.estimate(rec) == 0  # 100 aborts, all absorbed
    eng.route(0, 3)
    assert eng.estimate(rec) == 3  # and the next routes count exactly


def test_a_recent_bound_clears_abort_drift_under_load() -> None:
    """With only ``open`` as the bound, aborts are counted as on their way while other
    requests run; bounding by the routes that may still be in transit (recent ones)
    clears them at once."""
    eng, rec = Engine(1), TotalReconciler()
    eng.route(0, 10)
    eng.admit(10)
    assert eng.estimate(rec) == 0
    eng.abort(3)
    assert eng.estimate(rec) == 3  # loose: 7 still running bound nothing
    eng.route(0, 2)  # the only recent routes
    assert rec.in_transit("a", eng.total, sum(eng.sent), 2) == 2
    eng.admit(2)
    assert rec.in_transit("a", eng.total, sum(eng.sent), 2) == 0


def test_outside_requests_never_go_negative() -> None:
    eng, rec = Engine(1), TotalReconciler()
    eng.outside = 7  # requests no router sent
    eng.route(0, 2)
    assert eng.estimate(rec) == 0  # errs to routing at once
    eng.admit(2)
    eng.finish(2)
    assert eng.estimate(rec) == 0
    eng.route(0, 2)
    assert eng.estimate(rec) == 2


def test_restart_starts_anew() -> None:
    eng, rec = Engine(1), TotalReconciler()
    eng.route(0, 10)
    eng.admit(10)
    eng.abort(6)  # a drift of 6
    eng.finish(4)
    assert eng.estimate(rec) == 0
    new = Engine(1)  # a new process: counts and routes to it start at 0
    new.route(0, 2)
    assert new.estimate(rec, "b") == 2
    new.admit(2)
    assert new.estimate(rec, "b") == 0


def test_reset_under_the_same_name_is_absorbed() -> None:
    eng, rec = Engine(1), TotalReconciler()
    eng.route(0, 20)
    eng.admit(20)
    eng.finish(18)
    assert eng.estimate(rec) == 0
    eng.finished = 0  # the counter reset; the process is named the same
    assert 0 <= eng.estimate(rec) <= eng.open


def test_several_routers_sum_their_sent_counts() -> None:
    eng, rec = Engine(3), TotalReconciler()
    eng.route(0, 2)
    eng.route(1, 3)
    eng.route(2, 1)
    assert eng.estimate(rec) == 6
    eng.admit(4)
    assert eng.estimate(rec) == 2
    eng.abort(1)
    eng.finish(3)
    eng.route(1, 2)
    assert eng.estimate(rec) == 4


def test_a_router_that_leaves_the_sum() -> None:
    """A router no longer counted takes its routes out of ``sent``: the estimate
    drops to what the bounds allow, never below 0."""
    eng, rec = Engine(2), TotalReconciler()
    eng.route(0, 5)
    eng.route(1, 5)
    eng.admit(8)
    assert eng.estimate(rec) == 2
    left = rec.in_transit("a", eng.total, eng.sent[0], eng.open)
    assert left == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", 10**15])
def test_bad_totals_are_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="admitted_total"):
        check_total(bad)


# -- in RouterCore: pending routes retired by the engines' totals -------------------------


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


T0_MS = 1_000_000


def publish(
    cores: list[RouterCore], clock: FakeClock, at_s: float, version: int, **totals: int
) -> None:
    """Engines e0 and e1 report at ``at_s`` (e0 with ``totals``: its admitted total),
    published and adopted by every router 10 ms later."""
    clock.t = at_s + 0.01
    ms = T0_MS + round((at_s - 100.0) * 1000)
    s = make_snapshot(
        {"e0": (0, 0), "e1": (0, 0)}, version=version, time_ms=ms + 10, reported_ms=ms,
        total=totals,
    )  # fmt: skip
    for c in cores:
        c.apply_snapshot(s)


def test_a_total_retires_the_routes_it_holds_a_report_before_time_would() -> None:
    """By time alone a route stays pending until a report made after the engine's next
    step; a report whose total holds it retires it at once, and one that does not keeps
    it (one router: every route to the engine is its own)."""
    for with_total in (False, True):
        clock = FakeClock()
        core = RouterCore(0, 1, clock=clock)
        publish([core], clock, 100.0, 1, **({"e0": 0} if with_total else {}))
        clock.t = 100.02
        for _ in range(3):
            core.route(engine_id="e0")
        e0 = core.by_id["e0"]
        totals = {"e0": 2} if with_total else {}
        publish([core], clock, 100.05, 2, **totals)  # two of the three admitted
        assert e0.pending == (1 if with_total else 3)
        publish([core], clock, 100.09, 3, **({"e0": 3} if with_total else {}))
        assert e0.pending == 0  # (by time too: made after the step that followed)


def test_a_total_keeps_the_routes_it_does_not_hold_past_the_time_rule() -> None:
    """A route the engine has not taken by its next step (vLLM's API server hands a
    request on late on a busy host) stays counted while the total says so: by time
    alone it left the count before the engine's did, and a held request went ahead.
    Past HANDOVER_S time retires it anyway (a total can drift low)."""
    clock = FakeClock()
    core = RouterCore(0, 1, clock=clock)
    publish([core], clock, 100.0, 1, e0=0)
    clock.t = 100.02
    for _ in range(2):
        core.route(engine_id="e0")
    e0 = core.by_id["e0"]
    publish([core], clock, 100.05, 2, e0=0)
    publish([core], clock, 100.09, 3, e0=0)  # by time: both in its counts by now
    assert e0.pending == 2
    publish([core], clock, 100.13, 4, e0=1)  # the engine took one
    assert e0.pending == 1
    publish([core], clock, 100.1 + HANDOVER_S, 5, e0=1)
    assert e0.pending == 1  # (its previous report was not late enough)
    publish([core], clock, 100.14 + HANDOVER_S, 6, e0=1)
    assert e0.pending == 0


def test_a_list_read_as_none_keeps_no_route_past_the_time_rule() -> None:
    """An admitted list whose sum is past MAX_ADMITTED reads as none; its total does not
    retire routes there (the list was sent), so time alone does, with no handover."""
    clock = FakeClock()
    core = RouterCore(0, 1, clock=clock)
    big = {"e0": (MAX_ADMITTED, 0)}

    def report(at_s: float, version: int) -> None:
        clock.t = at_s + 0.01
        ms = T0_MS + round((at_s - 100.0) * 1000)
        s = make_snapshot(
            {"e0": (0, 0), "e1": (0, 0)}, version=version, time_ms=ms + 10,
            reported_ms=ms, admitted=big, total={"e0": 0},
        )  # fmt: skip
        core.apply_snapshot(s)

    report(100.0, 1)
    clock.t = 100.02
    core.route(engine_id="e0")
    e0 = core.by_id["e0"]
    report(100.05, 2)
    assert e0.pending == 1
    report(100.09, 3)  # by time: in its counts by now, though the total says not
    assert e0.pending == 0 and not e0.exact


def test_told_routes_and_own_ones_are_retired_oldest_first() -> None:
    """Two routers that tell each other their routes: the total counts everyone's, and
    what it holds goes oldest first, another's routes heard before one's own."""
    clock = FakeClock()
    a, b = (RouterCore(i, 2, clock=clock) for i in range(2))
    for c in (a, b):
        c.connected = True
    publish([a, b], clock, 100.0, 1, e0=0)
    b.hear(a.told())
    a.hear(b.told())
    # a first message about e0 sets its teller's base (routes of unknown times)
    for teller, hearer in ((a, b), (b, a)):
        teller.finished(teller.route(engine_id="e0"))
        hearer.hear(teller.told())
    publish([a, b], clock, 100.015, 2, e0=2)
    clock.t = 100.02
    a.route(engine_id="e0")
    a.route(engine_id="e0")
    b.hear(a.told())
    clock.t = 100.03
    b.route(engine_id="e0")
    b.route(engine_id="e0")
    a.hear(b.told())
    e0 = b.by_id["e0"]
    assert b.told_routes.live and (e0.pending, e0.others) == (2, 2.0)
    publish([a, b], clock, 100.04, 3, e0=5)  # three of the four admitted
    assert (e0.pending, e0.others) == (1, 0.0)  # b's newest is on its way
    a0 = a.by_id["e0"]
    assert (a0.pending, a0.others) == (0, 1.0)  # the same at a: b's newest
    publish([a, b], clock, 100.05, 4, e0=6)
    assert (e0.pending, e0.others, a0.pending, a0.others) == (0, 0.0, 0, 0.0)


def test_without_every_routers_routes_the_total_is_not_used() -> None:
    """Two routers that do not hear each other: a total says nothing of whose routes it
    holds, so pending goes by time alone."""
    clock = FakeClock()
    a, b = (RouterCore(i, 2, clock=clock) for i in range(2))
    publish([a, b], clock, 100.0, 1, e0=0)
    clock.t = 100.02
    b.route(engine_id="e0")
    publish([a, b], clock, 100.05, 2, e0=1)
    assert not b.told_routes.live and b.by_id["e0"].pending == 1 and not b.totals


def test_aborted_requests_never_keep_a_route_pending() -> None:
    """Aborted requests leave the total low for good; the routes still count exactly
    once the router has nothing open there, and never more than it has open."""
    clock = FakeClock()
    core = RouterCore(0, 1, clock=clock)
    publish([core], clock, 100.0, 1, e0=0)
    e0 = core.by_id["e0"]
    t, total, version = 100.0, 0, 1
    for _ in range(20):
        t += 0.1
        clock.t = t
        ds = [core.route(engine_id="e0") for _ in range(3)]
        total += 2  # admitted; the third is aborted before the engine counts it
        version += 1
        publish([core], clock, t + 0.01, version, e0=total)
        assert e0.pending <= e0.inflight
        for d in ds:
            core.finished(d)
    clock.t = t + 1
    version += 1
    publish([core], clock, t + 1, version, e0=total)
    clock.t = t + 1.1
    core.route(engine_id="e0")
    core.route(engine_id="e0")
    version += 1
    publish([core], clock, t + 1.1, version, e0=total + 1)
    assert e0.pending == 1  # 20 aborts absorbed: one of the two new routes is on its way


async def test_a_router_retires_routes_by_the_totals_a_reporter_sends(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys
) -> None:
    """Real Redis: a reporter sends admitted totals, as vLLM's plugin does; a router's
    routes to an engine stop counting as soon as a report's total holds them, where
    by time they would wait for the report after it."""
    Barrier(r, keys).configure()
    rep = AsyncReporter(redis_url, keys.deployment, ["e0", "e1"], heartbeat=False)
    router = AsyncRouter(redis_url, keys.deployment, poll_s=30)
    try:
        await rep.register()
        await rep.report_many({e: Counts(1, admitted_total=0) for e in ("e0", "e1")})
        await router.start(wait=5.0)
        core = router.core
        await await_until(lambda: len(core.by_id) == 2, 5.0, "the engines known")
        for _ in range(3):
            router.route(engine_id="e0")
        e0 = core.by_id["e0"]
        assert e0.pending == 3
        version = core.snapshot.version if core.snapshot else 0
        # e0 took two in; e1's report, with no total, keeps its routes by time
        await rep.report_many({"e0": Counts(2, 1, 1, admitted_total=2), "e1": Counts(2)})
        await await_until(
            lambda: core.snapshot is not None and core.snapshot.version > version, 5.0, "step 2"
        )
        assert core.snapshot is not None and core.snapshot.engines["e0"].admitted_total == 2
        assert e0.pending == 1
    finally:
        await router.aclose()
        await rep.aclose()


def test_a_retired_route_that_ends_frees_its_room_at_once() -> None:
    """A route the total retired is in the engine's counts: when it ends before the next
    report, the router counts it as done (its slot free), as it would have taken it out
    of pending by time; one still on its way leaves pending."""
    clock = FakeClock()
    core = RouterCore(0, 1, clock=clock)
    publish([core], clock, 100.0, 1, e0=0)
    ds = []
    for i in range(3):
        clock.t = 100.02 + i * 0.001
        ds.append(core.route(engine_id="e0"))
    e0 = core.by_id["e0"]
    publish([core], clock, 100.05, 2, e0=2)
    assert (e0.pending, e0.done) == (1, 0)
    clock.t = 100.07
    core.finished(ds[0])  # retired: the counts hold it
    assert (e0.pending, e0.done) == (1, 1)
    core.finished(ds[2])  # still on its way: out of pending
    assert (e0.pending, e0.done) == (0, 1)
    clock.t = 100.08  # the same report again, in a later snapshot: still done
    again = make_snapshot(
        {"e0": (0, 0), "e1": (0, 0)}, version=3, time_ms=T0_MS + 80, reported_ms=T0_MS + 50,
        total={"e0": 2},
    )  # fmt: skip
    core.apply_snapshot(again)
    assert (e0.pending, e0.done) == (0, 1)
    publish([core], clock, 100.09, 4, e0=2)  # counts made after it ended: it left them
    assert e0.done == 0
