"""Invariants 1-3, 5 and 6 of docs/DESIGN.md on the real Lua barrier scripts.

Every test drives the scripts exactly as the library does (EVALSHA through
``Scripts``) on a real redis-server, then reads the stored keys back. Counts
are chosen so that each report is recognisable (waiting encodes the engine and
step, running the step), so a cut that took a later report, or mixed two
reports of one engine, shows up as a wrong tuple.
"""

from __future__ import annotations

import time

import orjson
import pytest
import redis
from support.helpers import Barrier, counts, score, wait_until

from redisbal.barrier.record import parse_record
from redisbal.barrier.snapshot import Snapshot
from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import Counts, Reporter
from redisbal.sim.embedded import RedisServer

pytestmark = pytest.mark.servers


@pytest.fixture
def bar(r: redis.Redis, keys: DeploymentKeys) -> Barrier:
    b = Barrier(r, keys)
    b.configure()
    return b


def tag(engine: str, wave: int, step: int) -> tuple[int, int, int, int]:
    """The (wave, step, waiting, running) an engine reports for (wave, step) in these tests."""
    return (wave, step, 1000 * int(engine[1:]) + 10 * wave + step, step)


def rep(bar: Barrier, engine: str, step: int, wave: int = 0) -> tuple[str, int, int, int]:
    _, _, w, r = tag(engine, wave, step)
    return bar.report(engine, step, w, r, wave)


# -- invariant 2: all engines report ------------------------------------------------------------


def test_no_snapshot_until_every_registered_engine_reported(bar: Barrier) -> None:
    """Registered engines hold the first snapshot until each has reported."""
    assert bar.register("e0", "e1", "e2") == 3
    assert rep(bar, "e0", 1) == ("accepted", 0, 0, 1)
    assert rep(bar, "e1", 1)[1] == 0
    assert bar.snapshot_raw() is None
    # the stall guard never forces over an engine that has not reported at all
    assert bar.force(stall_ms="0") == (0, [])
    assert bar.reap() == (0, [])
    assert bar.snapshot_raw() is None
    status, version, _, _ = rep(bar, "e2", 1)
    assert (status, version) == ("accepted", 1)
    snap = bar.snapshot()
    assert snap is not None and snap.version == 1 and snap.cut == (0, 1)
    assert counts(snap) == {e: tag(e, 0, 1) for e in ("e0", "e1", "e2")}
    assert not snap.forced and snap.laggards == {}


def test_barrier_waits_for_the_slowest_member_at_every_step(bar: Barrier) -> None:
    """After the first snapshot each step publishes only once the last member reached it."""
    bar.register("e0", "e1")
    for e in ("e0", "e1"):
        rep(bar, e, 1)
    assert bar.snapshot().cut == (0, 1)  # type: ignore[union-attr]
    for step in range(2, 6):
        assert rep(bar, "e0", step)[1] == 0, "published before e1 reported"
        assert bar.snapshot().cut == (0, step - 1)  # type: ignore[union-attr]
        assert rep(bar, "e1", step)[1] > 0
        assert bar.snapshot().cut == (0, step)  # type: ignore[union-attr]


def test_forced_snapshot_after_stall_names_laggards_with_age(r: redis.Redis, bar: Barrier) -> None:
    """The stall guard publishes the cut at the lowest step reached, marked forced."""
    bar.register("e0", "e1", "e2")
    rep(bar, "e0", 1)
    rep(bar, "e1", 1)
    rep(bar, "e2", 1)
    rep(bar, "e0", 3)
    rep(bar, "e1", 2)
    # not stalled long enough: nothing forced
    assert bar.force(stall_ms="60000") == (0, [])
    e2_reported = bar.reported_ms("e2")
    version, laggards = bar.force(stall_ms="0")
    assert version == 2 and laggards == ["e2"]
    snap = bar.snapshot()
    assert snap is not None and snap.forced and snap.version == 2
    assert snap.cut == (0, 2), "forced cut must be the lowest step an engine moved to"
    assert counts(snap) == {"e0": tag("e0", 0, 1), "e1": tag("e1", 0, 2), "e2": tag("e2", 0, 1)}
    assert set(snap.laggards) == {"e2"}
    # its age: from its last report to the snapshot, by the server's clock
    assert snap.laggards["e2"] == snap.time_ms - e2_reported
    assert bar.counter("forced") == 1
    # nothing ahead of the forced cut except e0: forcing again goes to step 3
    version, laggards = bar.force(stall_ms="0")
    assert version == 3 and sorted(laggards) == ["e1", "e2"]
    assert bar.snapshot().cut == (0, 3)  # type: ignore[union-attr]
    # nobody ahead of the published step: nothing to force
    assert bar.force(stall_ms="0") == (0, [])


def test_forced_snapshot_honours_the_configured_stall_ms(bar: Barrier) -> None:
    """Without an override the config's stall_ms decides when the guard may force."""
    bar.register("e0", "e1")
    bar.configure(stall_ms=600_000)  # longer than any pause of a busy machine
    rep(bar, "e0", 1)
    rep(bar, "e1", 1)
    rep(bar, "e0", 2)
    assert bar.force() == (0, [])
    bar.stall_for(599_000)  # still short of it
    assert bar.force() == (0, [])
    bar.stall_for(1_000)  # stall_ms waited
    _, laggards = bar.force()
    assert laggards == ["e1"] and bar.snapshot().forced  # type: ignore[union-attr]


# -- invariant 1: consistent cut ----------------------------------------------------------------


def test_engine_ahead_contributes_its_newest_report_at_or_before_the_cut(bar: Barrier) -> None:
    """An engine several steps ahead is cut at the snapshot's step, not at its newest."""
    bar.register("e0", "e1")
    for step in (1, 2, 3, 5):
        rep(bar, "e0", step)
    assert bar.snapshot_raw() is None or bar.snapshot() is None
    rep(bar, "e1", 2)
    snap = bar.snapshot()
    assert snap is not None and snap.cut == (0, 2)
    assert counts(snap) == {"e0": tag("e0", 0, 2), "e1": tag("e1", 0, 2)}
    rep(bar, "e1", 4)  # e0 has no step 4: its newest <= 4 is step 3
    snap = bar.snapshot()
    assert snap is not None and snap.cut == (0, 4)
    assert counts(snap) == {"e0": tag("e0", 0, 3), "e1": tag("e1", 0, 4)}
    rep(bar, "e1", 9)  # cut at 5, e0's newest; e1 has nothing between 4 and 9
    assert counts(bar.snapshot()) == {"e0": tag("e0", 0, 5), "e1": tag("e1", 0, 4)}  # type: ignore[arg-type]


def test_cut_orders_by_wave_then_step(bar: Barrier) -> None:
    """Lockstep engines reset the step at a new wave: (1, 0) is after (0, 99)."""
    bar.register("e0", "e1")
    rep(bar, "e0", 99, wave=0)
    rep(bar, "e0", 0, wave=1)
    rep(bar, "e1", 99, wave=0)
    snap = bar.snapshot()
    assert snap is not None and snap.cut == (0, 99)
    assert counts(snap) == {"e0": tag("e0", 0, 99), "e1": tag("e1", 0, 99)}
    rep(bar, "e1", 0, wave=1)
    snap = bar.snapshot()
    assert snap is not None and snap.cut == (1, 0)
    assert counts(snap) == {"e0": tag("e0", 1, 0), "e1": tag("e1", 1, 0)}
    assert bar.barrier() == {"e0": score(1, 0), "e1": score(1, 0)}


def test_snapshot_counts_come_whole_from_one_report(bar: Barrier) -> None:
    """kv_usage and admitted travel with their report: never one report's counts with
    another's kv or admitted."""
    bar.register("e0", "e1")
    bar.report("e0", 1, 3, 4, kv="0.25", adm="5,6")
    bar.report("e0", 2, 30, 40, kv="0.75", adm="50,60")
    bar.report("e1", 1, 7, 8)
    snap = bar.snapshot()
    assert snap is not None
    c = snap.engines["e0"]
    assert (c.step, c.waiting, c.running, c.kv_usage, c.admitted) == (1, 3, 4, 0.25, (5, 6))
    c1 = snap.engines["e1"]
    assert (c1.kv_usage, c1.admitted) == (None, None)


def test_an_admitted_total_travels_with_its_report_and_is_checked(bar: Barrier) -> None:
    """The admitted total is in the snapshot only when sent (older reports parse as
    None), with its own report's counts; a bad one is refused before anything is
    written; a heartbeat re-sending it keeps its counts' time, a changed one does not."""
    bar.register("e0", "e1")
    bar.report("e0", 1, 3, 4, adm="5", total="12")
    bar.report("e0", 2, 30, 40, total="99")
    bar.report("e1", 1, 7, 8)
    snap = bar.snapshot()
    assert snap is not None
    c, c1 = snap.engines["e0"], snap.engines["e1"]
    assert (c.step, c.waiting, c.admitted, c.admitted_total) == (1, 3, (5,), 12)
    assert c1.admitted_total is None
    assert b'"tot"' not in bar.r.hget(bar.keys.reports, "e1")
    before = bar.dump()
    for bad in ("-1", "01", "1.5", "x", "1" * 16, " 1"):
        with pytest.raises(redis.ResponseError, match="bad admitted_total"):
            bar.report("e0", 3, 1, 1, total=bad)
    assert bar.dump() == before
    assert bar.report("e0", 3, 1, 1, total="9" * 15)[0] == "accepted"
    line = parse_record(bar.r.hget(bar.keys.reports, "e0").decode()).latest
    assert line is not None and line.counts()["tot"] == 10**15 - 1

    def made(step: int, total: str) -> int:
        time.sleep(0.01)  # (each report at a later server ms)
        bar.report("e0", step, 1, 1, total=total, progress=False)
        newest = parse_record(bar.r.hget(bar.keys.reports, "e0").decode()).latest
        assert newest is not None
        return int(newest.counts()["t"])

    first = line.counts()["t"]
    assert made(4, "9" * 15) == first  # a heartbeat: the same counts and total
    assert made(5, "7") > first  # the total moved: counts made anew


def test_a_heartbeat_keeps_the_time_its_counts_were_made(bar: Barrier) -> None:
    """A report's time in a snapshot is when its counts were made: a heartbeat (no
    progress, the newest report's counts re-sent under a later step) keeps it, and
    any report with new counts or progress is made anew. Routers reconcile their
    routes by it: a re-sent count stamped anew would claim routes it never saw."""
    bar.register("e0", "e1")
    kv, adm = "0.5000", "3,4"

    def made(step: int, waiting: int, running: int, progress: bool, adm: str = adm) -> int:
        time.sleep(0.01)  # (each report at a later server ms)
        bar.report("e0", step, waiting, running, kv=kv, adm=adm, progress=progress)
        bar.report("e1", step, 0, 0)
        snap = bar.snapshot()
        assert snap is not None and snap.cut == (0, step)
        return snap.engines["e0"].reported_ms

    first = made(1, 2, 5, True)
    assert made(2, 2, 5, False) == first  # a heartbeat
    assert made(3, 2, 5, False) == first
    moved = made(4, 2, 5, True)  # progress with the same counts: made now
    assert moved > first
    assert made(5, 3, 5, False) > moved  # new counts without progress: made now
    waited = made(6, 3, 5, False)
    assert made(7, 3, 5, False, adm="3,5") > waited  # new admitted counts
    assert made(8, 3, 5, False, adm="3,5") > waited


# -- invariant 3: ordering per engine -----------------------------------------------------------


def test_stale_report_is_rejected_counted_and_changes_nothing(bar: Barrier) -> None:
    bar.register("e0", "e1")
    rep(bar, "e0", 5)
    rep(bar, "e1", 5)
    before = bar.dump()
    status, version, wave, step = bar.report("e0", 3, 999, 999)
    assert (status, version, wave, step) == ("stale", 0, 0, 3)
    after = bar.dump()
    meta = bar.meta()
    assert meta["stale"] == "1" and meta["stale:e0"] == "1" and "stale:e1" not in meta
    # only the counters in meta changed: snapshot, reports, barrier, members byte-identical
    for k in before:
        if k != bar.keys.meta:
            assert before[k] == after[k], f"{k} changed on a stale report"
    bar.report("e0", 4, 0, 0, wave=0)
    assert bar.meta()["stale:e0"] == "2"
    # an older wave is stale too, whatever its step
    assert bar.report("e1", 2**32 - 1, 0, 0, wave=0)[0] == "accepted"  # newer step, same wave
    bar.report("e1", 0, 0, 0, wave=1)
    assert bar.report("e1", 7, 0, 0, wave=0)[0] == "stale"
    assert bar.meta()["stale:e1"] == "1" and bar.counter("stale") == 3


def test_report_for_a_published_step_updates_latest_counts_without_republishing(
    bar: Barrier,
) -> None:
    """A laggard catching up to a step that was force-published is accepted ('late')
    but publishes nothing; its new counts are what the next cut uses."""
    bar.register("e0", "e1")
    rep(bar, "e0", 1)
    rep(bar, "e1", 1)
    rep(bar, "e0", 2)
    assert bar.force(stall_ms="0")[0] == 2  # forced at step 2, e1 still at 1
    snap_before = bar.snapshot_raw()
    assert bar.report("e1", 2, 77, 7) == ("accepted", 0, 0, 2)
    assert bar.snapshot_raw() == snap_before, "a late report must not republish"
    assert bar.counter("late") == 1
    assert bar.counter("published") + bar.counter("forced") == 2
    # same-step refresh of a published step: also accepted, also no republish
    assert bar.report("e1", 2, 78, 8) == ("accepted", 0, 0, 2)
    assert bar.snapshot_raw() == snap_before
    # the next cut carries e1's refreshed step-2 counts while e0 moves on
    rep(bar, "e0", 3)
    assert bar.force(stall_ms="0")[0] == 3
    assert counts(bar.snapshot())["e1"] == (0, 2, 78, 8)  # type: ignore[arg-type]


def test_same_step_refresh_is_accepted_and_the_newest_wins(bar: Barrier) -> None:
    """Engines may publish before and after a step under the same tag."""
    bar.register("e0", "e1")
    assert bar.report("e0", 4, 10, 1) == ("accepted", 0, 0, 4)
    assert bar.report("e0", 4, 2, 9) == ("accepted", 0, 0, 4)
    assert bar.report("e1", 4, 0, 0)[1] == 1
    assert counts(bar.snapshot())["e0"] == (0, 4, 2, 9)  # type: ignore[arg-type]
    assert bar.counter("stale") == 0


# -- invariant 5: membership --------------------------------------------------------------------


def _assert_engine_gone(bar: Barrier, engine: str) -> None:
    assert engine not in bar.members()
    assert engine not in bar.barrier()
    assert not bar.r.hexists(bar.keys.reports, engine)
    assert f"stale:{engine}" not in bar.meta()


def test_graceful_leave_completes_the_barrier_atomically(bar: Barrier) -> None:
    bar.register("e0", "e1", "e2")
    for e in ("e0", "e1", "e2"):
        rep(bar, e, 1)
    rep(bar, "e2", 0)  # a stale report, so that e2 has a stale counter to drop
    rep(bar, "e0", 2)
    rep(bar, "e1", 2)
    assert bar.snapshot().cut == (0, 1)  # type: ignore[union-attr]
    removed, version = bar.leave("e2")
    assert (removed, version) == (1, 2), "the leave should complete step 2 at once"
    _assert_engine_gone(bar, "e2")
    snap = bar.snapshot()
    assert snap is not None and snap.cut == (0, 2) and set(snap.engines) == {"e0", "e1"}
    assert snap.gone == {"e2": "left"}
    assert bar.counter("left") == 1
    # retrying the leave is harmless: nothing removed, nothing published
    raw = bar.snapshot_raw()
    assert bar.leave("e2") == (0, 0)
    assert bar.snapshot_raw() == raw and bar.counter("left") == 1


def test_leave_without_completing_republishes_the_current_step(bar: Barrier) -> None:
    """Routers learn of a departure within one snapshot even when the step is unchanged."""
    bar.register("e0", "e1", "e2")
    for e in ("e0", "e1", "e2"):
        rep(bar, e, 1)
    rep(bar, "e0", 2)
    removed, version = bar.leave("e1")
    assert (removed, version) == (1, 2)
    snap = bar.snapshot()
    assert snap is not None and snap.cut == (0, 1) and set(snap.engines) == {"e0", "e2"}
    assert snap.gone == {"e1": "left"}
    # the next snapshot no longer reports e1 as gone
    rep(bar, "e2", 2)
    assert bar.snapshot().gone == {}  # type: ignore[union-attr]


def test_a_silence_of_the_whole_deployment_expires_nobody_at_once(bar: Barrier) -> None:
    """When nothing reached the deployment for longer than dead_after_ms (Redis down,
    paused or failed over), silence says nothing about the engines: the first reap
    after it holds expiry for dead_after_ms, so engines that report again in that
    time stay; one that stays silent expires after the hold."""
    bar.configure(dead_after_ms=600_000)  # longer than any pause of a busy machine
    bar.register("e0", "e1", "e2")
    for e in ("e0", "e1", "e2"):
        rep(bar, e, 1)
    assert bar.reap() == (0, [])
    bar.silence(600_001)  # no call at all for longer: the deployment was unreachable
    assert bar.reap()[1] == [], "engines expired for a silence they could not break"
    # e0 and e1 are alive and report on (as live engines do); e2 stays silent: dead
    rep(bar, "e0", 2)
    rep(bar, "e1", 2)
    assert bar.reap()[1] == [], "expired within the hold"
    assert "e2" in bar.members()
    bar.end_hold()  # dead_after_ms after the silence
    assert bar.reap()[1] == ["e2"]
    assert set(bar.snapshot().engines) == {"e0", "e1"}  # type: ignore[union-attr]
    assert bar.counter("expired") == 1


def test_expired_engine_is_absent_from_the_next_snapshot(bar: Barrier) -> None:
    """Expiry (last report older than dead_after_ms) removes the engine and resumes
    the barrier it was holding, in one reap call."""
    bar.register("e0", "e1", "e2")
    for e in ("e0", "e1", "e2"):
        rep(bar, e, 1)
    rep(bar, "e0", 2)
    rep(bar, "e1", 2)
    bar.expire_now("e2")
    version, expired = bar.reap()
    assert expired == ["e2"] and version == 2
    _assert_engine_gone(bar, "e2")
    snap = bar.snapshot()
    assert snap is not None and snap.cut == (0, 2) and set(snap.engines) == {"e0", "e1"}
    assert snap.gone == {"e2": "expired"} and bar.counter("expired") == 1
    assert bar.reap() == (0, []), "a second reap finds nobody"


def test_dead_after_ms_expires_by_the_clock_and_reports_reap_opportunistically(
    bar: Barrier,
) -> None:
    """With a short dead_after_ms a silent engine expires through another engine's report
    (no coordinator needed)."""
    bar.register("e0", "e1")
    bar.configure(dead_after_ms=150)
    for e in ("e0", "e1"):
        rep(bar, e, 1)
    steps = [1]

    def e0_steps_on() -> bool:
        steps.append(steps[-1] + 1)
        rep(bar, "e0", steps[-1])
        return "e1" not in bar.members()

    wait_until(e0_steps_on, 30, "e1 to expire", interval=0.03)  # 150 ms after its report
    snap = bar.snapshot()
    assert snap is not None and set(snap.engines) == {"e0"} and snap.cut == (0, steps[-1])
    assert bar.counter("expired") == 1


def test_registered_engine_that_never_reports_expires_and_releases_the_first_snapshot(
    bar: Barrier,
) -> None:
    assert bar.register("e0", "e1") == 2
    rep(bar, "e0", 1)
    assert bar.snapshot_raw() is None
    bar.expire_now("e1")
    version, expired = bar.reap()
    assert expired == ["e1"] and version == 1
    snap = bar.snapshot()
    assert snap is not None and set(snap.engines) == {"e0"}
    assert snap.gone == {"e1": "expired"}


def test_joiner_behind_the_published_step_is_provisional(bar: Barrier) -> None:
    """A joiner whose step counter is behind does not hold the barrier, but routers see it."""
    bar.register("e0", "e1")
    for step in range(1, 11):
        rep(bar, "e0", step)
        rep(bar, "e1", step)
    assert bar.snapshot().cut == (0, 10)  # type: ignore[union-attr]
    assert rep(bar, "e2", 3) == ("accepted", 0, 0, 3)
    assert "e2" not in bar.barrier() and "e2" in bar.members()
    rep(bar, "e0", 11)
    assert rep(bar, "e1", 11)[1] > 0, "the behind joiner held the barrier"
    snap = bar.snapshot()
    assert snap is not None and snap.cut == (0, 11)
    assert counts(snap)["e2"] == tag("e2", 0, 3)
    # once past the published step it is a full member and holds the barrier
    rep(bar, "e2", 12)
    assert bar.barrier()["e2"] == score(0, 12)
    rep(bar, "e0", 12)
    rep(bar, "e0", 13)
    rep(bar, "e1", 13)
    assert bar.snapshot().cut == (0, 12)  # type: ignore[union-attr]
    rep(bar, "e2", 13)
    assert bar.snapshot().cut == (0, 13)  # type: ignore[union-attr]


def test_joiner_ahead_of_the_cut_is_listed_as_joining(bar: Barrier) -> None:
    bar.register("e0", "e1")
    rep(bar, "e0", 1)
    rep(bar, "e1", 1)
    rep(bar, "e2", 20)  # joins the barrier; has nothing at or before the next cuts
    rep(bar, "e0", 2)
    rep(bar, "e1", 2)
    snap = bar.snapshot()
    assert snap is not None and snap.cut == (0, 2)
    assert set(snap.engines) == {"e0", "e1"} and snap.joining == ("e2",)
    assert bar.counter("joined") == 3


def test_first_snapshot_waits_for_join_grace(r: redis.Redis, keys: DeploymentKeys) -> None:
    """After a state loss, the first snapshot of the epoch waits join_grace_ms, so
    engines that re-register a little later are all in it. A recovering caller
    creates the new generation with an "r-" epoch candidate (reporters and the
    coordinator do once they had state); a fresh deployment has no grace."""
    bar = Barrier(r, keys)
    bar.epoch = "r-lost"
    bar.configure(join_grace_ms=600_000)  # longer than any pause of a busy machine
    assert bar.meta()["grace"] == "1"
    rep(bar, "e0", 1)
    assert bar.snapshot_raw() is None
    rep(bar, "e1", 1)  # a late re-registration within the grace
    assert bar.snapshot_raw() is None
    assert bar.reap() == (0, []) and bar.force(stall_ms="0") == (0, [])
    bar.end_join_grace(600_000)
    assert bar.reap()[0] > 0, "the end of the grace publishes"
    snap = bar.snapshot()
    assert snap is not None and set(snap.engines) == {"e0", "e1"}


def test_fresh_deployment_has_no_join_grace(r: redis.Redis, keys: DeploymentKeys) -> None:
    """Nothing was lost: the first snapshot waits for the registered engines only."""
    bar = Barrier(r, keys)
    bar.configure(join_grace_ms=60_000)
    bar.register("e0", "e1")
    rep(bar, "e0", 1)
    assert bar.snapshot_raw() is None, "published before a registered engine reported"
    assert rep(bar, "e1", 1)[1] == 1, "a fresh deployment waited for a grace"


def test_register_after_first_snapshot_only_starts_heartbeat(bar: Barrier) -> None:
    rep(bar, "e0", 1)
    assert bar.snapshot() is not None
    assert bar.register("e1") == 1
    assert "e1" in bar.members() and "e1" not in bar.barrier()
    assert rep(bar, "e0", 2)[1] > 0, "a registration after the first snapshot held the barrier"
    assert set(bar.snapshot().engines) == {"e0"}  # type: ignore[union-attr]


def test_rejoin_after_leave_starts_a_fresh_history(bar: Barrier) -> None:
    bar.register("e0", "e1")
    rep(bar, "e0", 5)
    rep(bar, "e1", 5)
    bar.leave("e1")
    assert rep(bar, "e1", 1)[0] == "accepted", "a rejoiner is not stale against its old self"
    assert "e1" not in bar.barrier()  # behind the published step: provisional
    assert counts(bar.snapshot()) == {"e0": tag("e0", 0, 5)}  # type: ignore[arg-type]


# -- invariant 6: idempotency -------------------------------------------------------------------


def test_retrying_a_report_is_harmless(bar: Barrier) -> None:
    bar.register("e0", "e1")
    rep(bar, "e0", 1)
    rep(bar, "e1", 1)
    rep(bar, "e0", 2)
    snap_before = bar.snapshot_raw()
    first = rep(bar, "e0", 2)
    again = rep(bar, "e0", 2)
    assert first == again == ("accepted", 0, 0, 2)
    assert bar.snapshot_raw() == snap_before
    assert bar.barrier() == {"e0": score(0, 2), "e1": score(0, 1)}
    assert bar.history("e0") == [score(0, 2), score(0, 1)], "a retry added a history entry"
    # and the retried step publishes exactly once when e1 arrives
    assert rep(bar, "e1", 2)[1] == 2
    assert rep(bar, "e1", 2)[1] == 0
    assert bar.snapshot().version == 2  # type: ignore[union-attr]


def test_retrying_a_registration_is_harmless(bar: Barrier) -> None:
    assert bar.register("e0", "e1") == 2
    members = bar.members()
    time.sleep(0.01)
    assert bar.register("e0", "e1") == 0
    assert bar.members() == members, "a retried registration refreshed liveness"
    assert bar.barrier() == {"e0": -1.0, "e1": -1.0}
    rep(bar, "e0", 1)
    assert bar.register("e0") == 0 and bar.barrier()["e0"] == score(0, 1)


def test_scripts_reject_bad_arguments_before_writing(bar: Barrier) -> None:
    """The Lua side validates too (a client that bypasses the Python checks)."""
    rep(bar, "e0", 1)
    before = bar.dump()
    bad = [
        ("engine_id", ("e{x}", 1, 1, 1)),
        ("waiting", ("e0", 2, -1, 1)),
        ("running", ("e0", 2, 1, "1.5")),
        ("step", ("e0", "x", 1, 1)),
        ("step", ("e0", 2**32, 1, 1)),
    ]
    for field, (engine, step, w, r_) in bad:
        with pytest.raises(redis.ResponseError, match=f"bad {field}"):
            bar.report(engine, step, w, r_)  # type: ignore[arg-type]
    with pytest.raises(redis.ResponseError, match="bad kv_usage"):
        bar.report("e0", 2, 1, 1, kv="nan")
    with pytest.raises(redis.ResponseError, match="bad kv_usage"):
        bar.report("e0", 2, 1, 1, kv="1.5")
    with pytest.raises(redis.ResponseError, match="bad admitted"):
        bar.report("e0", 2, 1, 1, adm="1,,2")
    with pytest.raises(redis.ResponseError, match="bad wave"):
        bar.report("e0", 2, 1, 1, wave=2**20)
    with pytest.raises(redis.ResponseError, match="bad engine_id"):
        bar.register("ok", "not ok")
    with pytest.raises(redis.ResponseError, match="bad engine_id"):
        bar.leave("a:b")
    assert bar.dump() == before


# -- invariant 4: monotonic versions, epochs ------------------------------------------------------


def test_versions_strictly_increase_over_every_kind_of_publication(
    r: redis.Redis, bar: Barrier
) -> None:
    """Barrier completion, forced cut, leave republish, expiry, idle republish and a new
    epoch all take the next version; the channel carries them in order."""
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(bar.keys.channel)
    wait_until(lambda: pubsub.get_message(timeout=0.1) is None and pubsub.subscribed)
    bar.register("e0", "e1", "e2")
    for e in ("e0", "e1", "e2"):
        rep(bar, e, 1)
    rep(bar, "e0", 2)
    bar.force(stall_ms="0")
    bar.leave("e2")
    bar.expire_now("e1")
    bar.reap()
    bar.configure(idle_publish_ms=10)
    time.sleep(0.02)
    bar.reap()
    bar.scripts.call("new_epoch", "e2nd")
    stored = bar.snapshot()
    assert stored is not None and stored.epoch == "e2nd"
    got: list[tuple[str, int]] = []
    deadline = time.monotonic() + 30  # a hang guard: the messages are already sent
    while len(got) < 6 and time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=0.1)
        if msg:
            d = orjson.loads(msg["data"])
            got.append((d["epoch"], d["version"]))
    pubsub.close()
    assert got == [("e1", v) for v in range(1, 6)] + [("e2nd", 6)]
    assert stored.version == 6


def test_lost_state_starts_a_new_epoch(r: redis.Redis, bar: Barrier) -> None:
    bar.register("e0")
    rep(bar, "e0", 1)
    rep(bar, "e0", 2)
    assert bar.snapshot().version == 2  # type: ignore[union-attr]
    r.delete(*bar.keys.all_keys())
    bar.epoch = "after-loss"
    bar.configure()
    assert rep(bar, "e0", 1)[1] == 1
    snap = bar.snapshot()
    assert snap is not None and snap.epoch == "after-loss" and snap.version == 1
    # the epoch candidate of a report only counts when there is no epoch
    bar.epoch = "ignored"
    rep(bar, "e0", 2)
    assert bar.snapshot().epoch == "after-loss"  # type: ignore[union-attr]


def test_flushall_starts_a_new_epoch(fresh_server: RedisServer) -> None:
    """With no epoch key (FLUSHALL, restart without persistence) the next write of any
    engine creates a new one, from that engine's own random candidate."""
    c = fresh_server.client()
    keys = DeploymentKeys("dep")
    rep1 = Reporter(fresh_server.url, "dep", "e0", heartbeat=False)
    try:
        rep1.report(Counts(step=1, waiting=0, running=0), wait=True)
        first = c.get(keys.epoch)
        c.flushall()
        rep1.report(Counts(step=1, waiting=0, running=0), wait=True)
        second = c.get(keys.epoch)
        assert first and second and first != second
        # default config again (it was flushed too): the first snapshot waits join_grace_ms
        steps = iter(range(2, 10_000))
        raw = wait_until(
            lambda: (
                rep1.report(Counts(step=next(steps), waiting=0, running=0), wait=True).version
                and c.get(keys.snapshot)
            ),
            timeout=5,
            interval=0.05,
        )
        snap = Snapshot.from_json(raw)
        assert snap.epoch == second.decode() and snap.version == 1
        assert c.hget(keys.meta, "grace") == b"1", "a recovering generation waits the grace"
    finally:
        rep1.close()
        c.close()
