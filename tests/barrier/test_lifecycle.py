"""Engine lifecycle in the barrier, on a real Redis: incarnations (restart, zombie,
conflict), progress (stalls), suspect marks (router.failed) and the record of
removed engines. Process-level scenarios are in test_lifecycle_procs.py."""

from __future__ import annotations

import time

import pytest
import redis
from support.helpers import Barrier, text

from redisbal.barrier.record import parse_record
from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation

pytestmark = pytest.mark.servers

OLD = new_incarnation(1_700_000_000_000)  # a process started earlier ...
NEW = new_incarnation(1_700_000_060_000)  # ... and one started a minute later
NEWER = new_incarnation(1_700_000_120_000)


@pytest.fixture
def bar(r: redis.Redis, keys: DeploymentKeys) -> Barrier:
    b = Barrier(r, keys)
    b.configure()
    return b


def step_all(bar: Barrier, engines: dict[str, str], step: int, **kw: int) -> list[int]:
    """Every engine reports ``step`` (engine -> its incarnation); the versions published."""
    return [bar.report(e, step, inc=inc, **kw)[1] for e, inc in engines.items()]


def record(bar: Barrier, engine: str):  # type: ignore[no-untyped-def]
    return parse_record(text(bar.r.hget(bar.keys.reports, engine)))


def test_incarnations_order_by_start_time() -> None:
    assert OLD < NEW or OLD.split("-")[0] != NEW.split("-")[0]
    a, b = new_incarnation(35), new_incarnation(36)
    assert a.startswith("z-") and b.startswith("10-")  # base 36


def test_restart_replaces_the_record_and_publishes_unforced_within_one_step(
    bar: Barrier,
) -> None:
    engines = {"e0": OLD, "e1": OLD, "e2": OLD}
    bar.register(*engines)  # as reporters do: the first snapshot waits for all three
    for s in range(1, 11):
        step_all(bar, engines, s)
    assert bar.hot()["pub"] == "10"
    # the whole lockstep group restarts: each new process counts from step 0
    restarted = {"e0": NEW, "e1": NEW, "e2": NEW}
    published = step_all(bar, restarted, 0)
    assert published[-1] > 0  # the last one completes the barrier: unforced
    snap = bar.snapshot()
    assert snap is not None and not snap.forced
    assert {e: (c.step, c.incarnation) for e, c in snap.engines.items()} == {
        e: (0, NEW) for e in engines
    }
    assert bar.counter("restarted") == 3 and bar.counter("stale") == 0
    # the new sequence goes on after the old one, one snapshot per step
    for s in range(1, 4):
        versions = step_all(bar, restarted, s)
        assert versions[:2] == [0, 0] and versions[2] > 0
        snap = bar.snapshot()
        assert snap is not None and not snap.forced
        assert {c.step for c in snap.engines.values()} == {s}
    assert {e: record(bar, e).offset for e in engines} == dict.fromkeys(engines, 11)


def test_a_restart_leaves_no_old_step_in_a_snapshot(bar: Barrier) -> None:
    bar.register("e0", "e1")
    step_all(bar, {"e0": OLD, "e1": OLD}, 5)
    bar.report("e0", 0, waiting=7, inc=NEW)  # restarted, e1 still at 5
    snap = bar.snapshot()
    assert snap is not None
    # the republish names e0 joining (its new sequence is past the cut), never its
    # old incarnation's counts
    assert "e0" not in snap.engines and "e0" in snap.joining
    bar.report("e1", 6)
    snap = bar.snapshot()
    assert snap is not None and not snap.forced
    assert snap.engines["e0"].waiting == 7 and snap.engines["e0"].incarnation == NEW


def test_a_zombie_of_the_replaced_process_is_refused_as_a_conflict(bar: Barrier) -> None:
    bar.report("e0", 3, waiting=1, inc=OLD)
    bar.report("e0", 0, waiting=2, inc=NEW)
    before = bar.dump()
    status = bar.scripts.call("report", bar.epoch, "e0", 0, 4, 9, 9, "", "", OLD, "1")
    assert text(status[0]) == "conflict" and text(status[4]) == NEW
    assert bar.counter("conflicts") == 1
    when, refused, current = bar.meta()["conflict:e0"].split(" ")
    assert (refused, current) == (OLD, NEW) and int(when) > 0
    after = bar.dump()
    assert after[bar.keys.reports] == before[bar.keys.reports]  # nothing else changed
    assert record(bar, "e0").incarnation == NEW
    # its late leave takes nothing with it either
    assert bar.leave("e0", OLD) == (0, 0)
    assert record(bar, "e0").incarnation == NEW
    assert bar.leave("e0", NEW)[0] == 1


def test_reports_without_an_incarnation_keep_the_old_rules(bar: Barrier) -> None:
    bar.report("e0", 5, inc=NEW)
    assert bar.report("e0", 6)[0] == "accepted"  # "-": the current incarnation
    assert record(bar, "e0").incarnation == NEW
    assert bar.report("e0", 2)[0] == "stale"
    bar.report("e1", 3)  # a joiner without an incarnation: no new sequence
    assert record(bar, "e1").offset == 0


def test_tick_mode_restart_holds_nothing_back(bar: Barrier) -> None:
    bar.configure(tick_ms="20")
    for _ in range(3):
        bar.report("t0", "tick", inc=OLD)
        bar.report("t1", "tick", inc=OLD)
        time.sleep(0.025)
    v = bar.counter("published")
    bar.report("t0", "tick", inc=NEW)
    time.sleep(0.025)
    bar.report("t0", "tick", inc=NEW)
    bar.report("t1", "tick", inc=OLD)
    assert record(bar, "t0").offset == 0 and record(bar, "t0").flag == "b"
    assert bar.counter("published") > v and bar.counter("forced") == 0


def test_joiners_in_one_restart_window_share_one_new_sequence(bar: Barrier) -> None:
    bar.register("e0", "e1")
    step_all(bar, {"e0": OLD, "e1": OLD}, 20)
    bar.report("e0", 0, inc=NEW)
    bar.report("e0", 1, inc=NEW)
    bar.force(stall_ms="0")  # the stall guard publishes e0's step while e1 restarts
    bar.report("e1", 0, inc=NEW)  # joins the same sequence: behind the cut, provisional
    assert record(bar, "e1").offset == record(bar, "e0").offset
    assert record(bar, "e1").flag == "p"
    bar.report("e1", 1, inc=NEW)  # it reached the cut: a member, aligned with e0's steps
    assert record(bar, "e1").flag == "b"
    bar.report("e0", 2, inc=NEW)
    snap = bar.snapshot()  # the barrier waits for e1: still the cut of step 1
    assert snap is not None and snap.engines["e0"].step == 1
    bar.report("e1", 2, inc=NEW)
    snap = bar.snapshot()
    assert snap is not None and not snap.forced
    assert {e: c.step for e, c in snap.engines.items()} == {"e0": 2, "e1": 2}


def test_a_busy_engine_without_progress_stalls_and_comes_back(bar: Barrier) -> None:
    bar.configure(stall_after_ms="200")
    bar.report("e0", 1, waiting=6, inc=NEW)
    bar.report("e1", 1, inc=NEW)
    bar.report("e0", 1, waiting=6, inc=NEW, progress=False)  # a heartbeat: still live
    assert record(bar, "e0").flag == "b"
    time.sleep(0.25)
    bar.report("e0", 1, waiting=6, inc=NEW, progress=False)  # 200 ms without progress
    assert record(bar, "e0").flag == "s" and bar.counter("stalled") == 1
    snap = bar.snapshot()
    assert snap is not None and set(snap.stalled) == {"e0"} and snap.stalled["e0"] >= 200
    # the barrier no longer waits for it: e1 alone publishes unforced snapshots
    v = bar.report("e1", 2, inc=NEW)[1]
    assert v > 0 and bar.snapshot().step == 2 and not bar.snapshot().forced  # type: ignore[union-attr]
    assert bar.counter("forced") == 0
    # it steps again: back in the barrier and out of the stalled list
    bar.report("e0", 3, waiting=5, inc=NEW)
    assert record(bar, "e0").flag == "b"
    assert bar.snapshot().stalled == {}  # type: ignore[union-attr]


def test_an_idle_engine_that_does_not_step_is_healthy(bar: Barrier) -> None:
    bar.configure(stall_after_ms="100")
    bar.report("e0", 1, inc=NEW)
    time.sleep(0.15)
    bar.report("e0", 1, inc=NEW, progress=False)
    assert record(bar, "e0").flag == "b" and bar.counter("stalled") == 0


def test_suspect_marks_are_published_capped_and_kept_through_progress(bar: Barrier) -> None:
    for e in ("e0", "e1", "e2", "e3"):
        bar.report(e, 1, inc=NEW)
    status, version = bar.suspect("e0", 3, "connect refused")
    assert status == "suspect" and version > 0
    snap = bar.snapshot()
    assert snap is not None and set(snap.suspect) == {"e0"}
    assert 0 < snap.suspect["e0"] <= 2000 // 8  # the first back-off: suspect_ms / 8
    _, client, level, reason = bar.meta()["suspect:e0"].split(" ", 3)
    assert (client, level, reason) == ("3", "0", "connect refused")
    assert bar.suspect("e0", 1, "500 x3") == ("held", 0)  # ejected already: reason only
    assert bar.meta()["suspect:e0"].split(" ", 3)[3] == "500 x3"
    assert bar.suspect("e1")[0] == "suspect"
    assert bar.suspect("e2") == ("capped", 0)  # never more than half of the engines
    assert bar.counter("suspect_capped") == 1
    assert bar.suspect("nope") == ("unknown", 0)
    # neither a heartbeat nor progress clears it: outcomes over self-reports
    bar.report("e0", 1, inc=NEW, progress=False)
    bar.report("e0", 2, inc=NEW)
    assert record(bar, "e0").suspect_until_ms > 0 and "suspect:e0" in bar.meta()


def test_a_lapsed_mark_is_probing_until_an_answer_clears_it(bar: Barrier) -> None:
    bar.configure(suspect_ms="800")  # back-offs 100, 200, 400, 800 ms
    for e in ("e0", "e1", "e2", "e3"):
        bar.report(e, 1, inc=NEW)
    assert bar.recovered("e0") == ("healthy", 0)
    assert bar.recovered("nope") == ("unknown", 0)
    bar.suspect("e0")
    assert bar.recovered("e0") == ("ejected", 0)  # a newer failure than the answer
    time.sleep(0.25)  # past the first back-off (100 ms)
    for e in ("e0", "e1", "e2", "e3"):  # its own progress among them
        bar.report(e, 2, inc=NEW)
    snap = bar.snapshot()
    assert snap is not None and "e0" not in snap.suspect and snap.probing == ("e0",)
    # a failed probe backs off longer (level 1: 200 ms)
    status, _ = bar.suspect("e0", 0, "probe failed")
    assert status == "suspect"
    assert 100 < bar.snapshot().suspect["e0"] <= 200  # type: ignore[union-attr]
    assert bar.meta()["suspect:e0"].split(" ", 3)[2] == "1"
    time.sleep(0.35)
    for e in ("e0", "e1", "e2", "e3"):
        bar.report(e, 3, inc=NEW)
    assert bar.snapshot().probing == ("e0",)  # type: ignore[union-attr]
    status, version = bar.recovered("e0", 2)
    assert status == "recovered" and version > 0
    snap = bar.snapshot()
    assert snap is not None and "e0" not in snap.probing and "e0" not in snap.suspect
    assert record(bar, "e0").suspect_until_ms == 0 and bar.counter("recovered") == 1
    # a relapse soon after backs off longer than a first failure (level 2: 400 ms)
    bar.suspect("e0")
    assert 200 < bar.snapshot().suspect["e0"] <= 400  # type: ignore[union-attr]


def test_a_single_engine_is_never_marked_suspect(bar: Barrier) -> None:
    bar.report("e0", 1, inc=NEW)
    assert bar.suspect("e0") == ("capped", 0)


@pytest.mark.parametrize(
    ("engine", "client", "reason", "field"),
    [
        ("bad id", "0", "x", "engine_id"),
        ("e0", "-1", "x", "client index"),
        ("e0", "4096", "x", "client index"),
        ("e0", "0", "a\nb", "reason"),
        ("e0", "0", "x" * 201, "reason"),
    ],
)
def test_suspect_refuses_bad_arguments(
    bar: Barrier, engine: str, client: str, reason: str, field: str
) -> None:
    bar.report("e0", 1, inc=NEW)
    bar.report("e1", 1, inc=NEW)
    before = bar.dump()
    with pytest.raises(redis.ResponseError, match=f"redisbal: bad {field}"):
        bar.scripts.call("suspect", engine, client, reason)
    assert bar.dump() == before


BAD_INCARNATIONS = ["", "x", "zz-", "-abc", "abcdefghijklm-12", "1-xyz", "1-" + "a" * 40]


@pytest.mark.parametrize("inc", BAD_INCARNATIONS)
def test_report_refuses_a_bad_incarnation(bar: Barrier, inc: str) -> None:
    before = bar.dump()
    with pytest.raises(redis.ResponseError, match="redisbal: bad incarnation"):
        bar.scripts.call("report", bar.epoch, "e0", 0, 1, 0, 0, "", "", inc, "1")
    with pytest.raises(redis.ResponseError, match="redisbal: bad progress"):
        bar.scripts.call("report", bar.epoch, "e0", 0, 1, 0, 0, "", "", NEW, "yes")
    assert bar.dump() == before


def test_removed_engines_are_remembered_for_status(bar: Barrier) -> None:
    bar.report("e0", 1, inc=NEW)
    bar.report("e1", 1, inc=OLD)
    bar.leave("e0")
    bar.expire_now("e1")
    bar.reap()
    lines = bar.meta()["recent"].split("\n")
    assert [ln.split(" ")[:2] for ln in lines] == [["e1", "expired"], ["e0", "left"]]
    assert lines[0].split(" ")[3] == OLD and lines[1].split(" ")[3] == NEW
    for i in range(70):
        bar.register(f"x{i}")
        bar.leave(f"x{i}")
    assert len(bar.meta()["recent"].split("\n")) == 64


def test_stall_after_and_suspect_settings_are_checked(bar: Barrier) -> None:
    with pytest.raises(redis.ResponseError, match="bad stall_after_ms"):
        bar.configure(stall_after_ms="5")
    with pytest.raises(redis.ResponseError, match="bad suspect_ms"):
        bar.configure(suspect_ms="0")


def test_a_group_restarting_long_after_a_new_sequence_starts_its_own(bar: Barrier) -> None:
    """A new sequence set up earlier (here, a joiner started after the first snapshot)
    is not shared by a later restart whose steps it would put far behind the cut: those
    processes would be provisional until they caught up, and a clock that keeps pace
    with the cut never does."""
    bar.register("e0", "e1")
    step_all(bar, {"e0": OLD, "e1": OLD}, 0)
    now_ms = bar.r.time()[0] * 1000
    joiner = new_incarnation(now_ms + 1_000)  # started after the first snapshot
    bar.report("e2", 0, inc=joiner)  # a new sequence: its step 0 on the cut's next
    shared = record(bar, "e2").offset
    assert shared == 1
    for s in range(1, 31):
        step_all(bar, {"e0": OLD, "e1": OLD}, s)
        bar.report("e2", s - 1, inc=joiner)
    pub = bar.snapshot()
    assert pub is not None and not pub.forced and pub.step == 30
    again = {e: new_incarnation(now_ms + 2_000) for e in ("e0", "e1", "e2")}
    step_all(bar, again, 0)  # the whole group restarts: steps from 0 again
    assert {record(bar, e).offset for e in again} == {31}
    assert {record(bar, e).flag for e in again} == {"b"}
    step_all(bar, again, 1)
    snap = bar.snapshot()
    assert snap is not None and not snap.forced and snap.step == 32
    assert {e: (c.step, c.incarnation) for e, c in snap.engines.items()} == {
        e: (1, inc) for e, inc in again.items()
    }
