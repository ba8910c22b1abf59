"""Routes on their way from an engine's admitted total (routing/admit_total.py): the
reconciliation on its own, through drift, restarts and several routers."""

from __future__ import annotations

import pytest

from redisbal.errors import InvalidArgument
from redisbal.routing.admit_total import TotalReconciler, check_total


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
