"""Engines that stopped answering are passed over before any request fails on them.
Pure logic.

- silent: its reports stopped (forced snapshots name it a laggard); it stays silent
  over snapshots republished at the same cut (the publish of a suspect mark names no
  laggard) until the barrier moves past it;
- late: a request sent to it (``sent()``) waits for its first byte a few times its
  usual first-byte time, and it answered nothing since."""

from __future__ import annotations

import random
from collections import Counter

from support.helpers import make_snapshot

from redisbal.barrier.snapshot import Snapshot
from redisbal.routing.outcomes import FIRST_BYTE_UNANSWERED_S
from redisbal.routing.router_core import RouterCore

T0 = 5_000_000
FOUR = {f"e{i}": (0, 0) for i in range(4)}


def snap(version: int, step: int, t_ms: int, **fields: object) -> Snapshot:
    return make_snapshot(FOUR, version=version, step=step, time_ms=t_ms, **fields)


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def core_with(*snaps: Snapshot, clock: Clock | None = None) -> RouterCore:
    core = RouterCore(0, 1, "redisbal", rng=random.Random(3), clock=clock or Clock())
    core.connected = True
    for s in snaps:
        assert core.apply_snapshot(s)
    return core


def routed(core: RouterCore, n: int = 200) -> Counter[str]:
    """n requests routed while all are in flight, then finished."""
    decisions = [core.route() for _ in range(n)]
    for d in decisions:
        core.finished(d)
    return Counter(d.engine_id for d in decisions)


def test_a_silent_engine_gets_no_decision_and_status_says_silent() -> None:
    core = core_with(snap(1, 1, T0), snap(2, 1, T0 + 600, forced=True, laggards={"e0": 600}))
    assert core.silent_ms("e0") == 600 and core.silent_ms("e1") == 0
    assert core.excluded() == {"e0": "silent"}
    got = routed(core)
    assert got["e0"] == 0 and sum(got.values()) == 200


def test_a_laggard_not_silent_yet_is_still_chosen() -> None:
    core = core_with(snap(1, 1, T0), snap(2, 1, T0 + 300, forced=True, laggards={"e0": 300}))
    assert core.silent_ms("e0") == 300
    assert core.excluded() == {}
    assert routed(core)["e0"] > 0


def test_silence_holds_over_a_republish_at_the_same_cut_and_grows_with_its_time() -> None:
    # the publish after a suspect mark: same cut, not forced, no laggards named
    republish = snap(3, 1, T0 + 700, suspect={"e1": 125})
    core = core_with(
        snap(1, 1, T0), snap(2, 1, T0 + 300, forced=True, laggards={"e0": 300}), republish
    )
    assert core.silent_ms("e0") == 700
    assert core.excluded() == {"e0": "silent", "e1": "suspect"}
    got = routed(core)
    assert got["e0"] == 0 and got["e1"] == 0
    # silent and suspect: silent outlasts the mark
    core.apply_snapshot(snap(4, 1, T0 + 800, suspect={"e0": 50}))
    core.clock.t += 1.0  # type: ignore[attr-defined]
    assert core.excluded() == {"e0": "silent"}


def test_a_later_cut_ends_the_silence() -> None:
    core = core_with(snap(1, 1, T0), snap(2, 1, T0 + 600, forced=True, laggards={"e0": 600}))
    core.apply_snapshot(snap(3, 2, T0 + 650))  # every member reported past the cut
    assert core.silent_ms("e0") == 0
    assert core.excluded() == {}
    assert routed(core)["e0"] > 0


def test_a_new_forced_snapshot_replaces_the_laggards() -> None:
    core = core_with(
        snap(1, 1, T0),
        snap(2, 1, T0 + 600, forced=True, laggards={"e0": 600}),
        snap(3, 2, T0 + 900, forced=True, laggards={"e1": 550}),
    )
    assert (core.silent_ms("e0"), core.silent_ms("e1")) == (0, 550)
    assert core.excluded() == {"e1": "silent"}


def test_a_new_epoch_at_the_same_step_ends_the_silence() -> None:
    core = core_with(snap(1, 1, T0), snap(2, 1, T0 + 600, forced=True, laggards={"e0": 600}))
    core.apply_snapshot(make_snapshot(FOUR, version=1, step=1, time_ms=T0 + 700, epoch="e2"))
    assert core.silent_ms("e0") == 0


def test_every_engine_silent_still_routes_among_all() -> None:
    lag = {e: 800 for e in FOUR}
    core = core_with(snap(1, 1, T0), snap(2, 1, T0 + 800, forced=True, laggards=lag))
    assert sum(routed(core, 40).values()) == 40


# -- late: a request waits for its first byte -------------------------------------------------


def answering(clock: Clock) -> RouterCore:
    """Four engines, each with a usual first-byte time of 20 ms (late bound: 0.25 s)."""
    core = core_with(snap(1, 1, T0), clock=clock)
    for e in FOUR:
        d = core.route(e)
        core.sent(d)
        core.answered(d, 0.02)
        core.finished(d)
    return core


def test_an_engine_that_leaves_a_request_waiting_is_passed_over_until_it_answers() -> None:
    clock = Clock()
    core = answering(clock)
    waiting = core.route("e0")
    core.sent(waiting)
    clock.t += 0.2  # within the bound: still chosen
    assert routed(core)["e0"] > 0
    clock.t += 0.1
    got = routed(core)
    assert got["e0"] == 0 and sum(got.values()) == 200
    assert core.excluded() == {"e0": "late"}
    core.answered(waiting, 0.3)
    assert core.excluded() == {}
    assert routed(core)["e0"] > 0


def test_a_waiting_request_that_ends_unanswered_ends_the_lateness() -> None:
    clock = Clock()
    core = answering(clock)
    waiting = core.route("e0")
    core.sent(waiting)
    clock.t += 0.3
    assert routed(core)["e0"] == 0
    core.failed(waiting, "first_byte_timeout")  # ejected now: the ejection takes over
    assert core.excluded() == {"e0": "suspect"}
    clock.t += core.suspect_s
    core.answered(core.route(), 0.02)  # the probe answers
    assert routed(core)["e0"] > 0


def test_requests_sent_before_its_last_answer_do_not_make_it_late() -> None:
    clock = Clock()
    core = answering(clock)
    first, second = core.route("e0"), core.route("e0")
    core.sent(first)
    core.sent(second)
    core.answered(second, 0.02)  # (the first one may be a long prefill)
    clock.t += 1.0
    assert routed(core)["e0"] > 0
    assert core.excluded() == {}


def test_an_engine_that_answered_none_is_passed_over_at_the_floor_given_up_later() -> None:
    clock = Clock()
    core = core_with(snap(1, 1, T0), clock=clock)  # answered() never called
    floor = core.outcomes.first_byte_min_s
    core.sent(core.route("e0"))
    clock.t += floor - 0.1
    assert routed(core)["e0"] > 0  # its pace is unknown: not late yet
    clock.t += 0.2
    assert routed(core)["e0"] == 0
    assert core.excluded() == {"e0": "late"}
    # a fresh server's first answer is its slowest: the request is not given up there
    assert core.first_byte_bound("e0") == FIRST_BYTE_UNANSWERED_S > floor


def test_at_most_half_of_the_engines_are_passed_over_as_late() -> None:
    clock = Clock()
    core = answering(clock)
    for e in ("e0", "e1", "e2"):
        core.sent(core.route(e))
    clock.t += 0.3
    got = routed(core, 400)
    assert sum(got.values()) == 400
    assert sum(1 for e in FOUR if got[e] == 0) == 2
    assert list(core.excluded().values()) == ["late", "late"]


def test_a_probe_answered_here_does_not_outlast_a_newer_mark() -> None:
    """A probe answered here lets this router choose the engine while the deployment
    clears its mark; a newer mark (another router saw it fail since) ends that: once
    its back-off ends, the engine gets probes again, not the policy's requests."""
    core = core_with(snap(1, 1, T0), snap(2, 1, T0 + 100, probing=["e0"]))
    probe = core.route()
    assert probe.engine_id == "e0" and probe.probe
    assert core.answered(probe)  # told to the deployment; chosen here meanwhile
    core.finished(probe)
    assert "e0" not in core.excluded()
    core.apply_snapshot(snap(3, 1, T0 + 200, suspect={"e0": 100}))  # marked again
    core.clock.t += 0.2  # type: ignore[attr-defined]
    core.apply_snapshot(snap(4, 1, T0 + 400, probing=["e0"]))  # its back-off ended
    assert core.excluded() == {"e0": "probing"}
    decisions = [core.route() for _ in range(20)]
    assert [d.probe for d in decisions if d.engine_id == "e0"] == [True]


def test_an_engine_queues_while_its_fresh_counts_say_requests_wait_and_nothing_marks_it() -> None:
    clock = Clock()
    counts = {"e0": (2, 8), "e1": (0, 8), "e2": (0, 0), "e3": (1, 8)}
    s = make_snapshot(counts, version=1, step=1, time_ms=T0, suspect={"e3": 125})
    core = core_with(s, clock=clock)
    assert [core.queues(e) for e in ("e0", "e1", "e2", "e3", "nope")] == [
        True,  # requests wait there (a preempted stream waits for room)
        False,  # nothing waits
        False,
        False,  # marked suspect in the deployment
        False,  # unknown
    ]
    core.failed(core.route("e0"), kind="5xx")  # marked by this router
    assert not core.queues("e0")
    core = core_with(s, clock=clock)
    clock.t += 5.0  # its counts grew old: it may have stopped
    assert not core.queues("e0")


def test_a_wait_given_up_on_a_queueing_engine_is_no_evidence_against_it() -> None:
    """A request given up for its first byte (or a quiet stream) on an engine whose
    fresh counts say requests wait there was most likely one of them: the engine is
    not ejected, and still queues (a last try waits for it); another kind of failure
    there, or the same wait on an engine that queues nothing, is evidence."""
    clock = Clock()
    counts = {"e0": (3, 8), "e1": (0, 8), "e2": (0, 8), "e3": (0, 8)}
    core = core_with(make_snapshot(counts, version=1, step=1, time_ms=T0), clock=clock)
    for kind in ("first_byte_timeout", "idle_timeout"):
        assert not core.failed(core.route("e0"), kind=kind)
    assert core.queues("e0") and "e0" not in core.excluded()
    assert core.counters["queued_given_up"] == 2 and core.counters["failed"] == 0
    assert core.failed(core.route("e1"), kind="first_byte_timeout")  # nothing waits there
    assert core.failed(core.route("e0"), kind="5xx")  # an answer, not a wait
    assert not core.queues("e0")
    assert core.excluded() == {"e0": "suspect", "e1": "suspect"}
