"""lua/report_many.lua and reporters of several engines on real servers.

The same reports sent one by one (lua/report.lua) and in batches must leave the same
stored state and publish the same snapshots when each batch ends where the barrier
completes (server times, which differ between the two runs, are masked); a batch
publishes at most once; a bad report refuses the whole call and stores nothing.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
import redis
from support.helpers import Barrier, Blocking, contents, text, wait_until

from redisbal import AsyncReporter, Counts, InvalidReport, Reporter
from redisbal.barrier.operations import report_reply
from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation

pytestmark = pytest.mark.servers

ENGINES = ["e0", "e1", "e2", "e3"]
TIME = re.compile(rb"(?<!\d)1\d{12}(?!\d)")  # a server ms (13 digits, this century)


def report_many(bar: Barrier, entries: list[list[Any]]) -> list[tuple[str, int, int, int]]:
    """One report_many call; entries: [engine, wave, step, waiting, running, kv, adm, inc,
    progress] each."""
    argv = [a for e in entries for a in e]
    return [
        report_reply(x) for x in bar.scripts.call("report_many", bar.epoch, len(entries), *argv)
    ]


def one_by_one(bar: Barrier, entries: list[list[Any]]) -> list[tuple[str, int, int, int]]:
    return [report_reply(bar.scripts.call("report", bar.epoch, *e)) for e in entries]


def masked(r: redis.Redis, keys: DeploymentKeys) -> dict[str, object]:
    """The deployment's contents, with its name and every server time masked."""
    name = keys.deployment.encode()

    def mask(v: Any) -> Any:
        if isinstance(v, bytes):
            return TIME.sub(b"0", v.replace(name, b"D"))
        if isinstance(v, float):
            return 0.0 if v > 1e12 else v
        if isinstance(v, dict):
            return {mask(k): mask(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [mask(x) for x in v]
        return v

    out = {
        k.replace(keys.deployment, "D"): mask(v) for k, v in contents(r, keys.all_keys()).items()
    }
    kind, members = out.pop(keys.members.replace(keys.deployment, "D"))  # type: ignore[misc]
    out["members"] = (kind, sorted(members or []))  # (ordered by the masked times)
    kind, snap = out.pop(keys.snapshot.replace(keys.deployment, "D"))  # type: ignore[misc]
    # its engines come in the order of the reports hash: compare it as JSON
    out["snapshot"] = (kind, snap and orjson.loads(snap))
    return out


def entry(engine: str, step: int, inc: str, waiting: int = 1, progress: str = "1") -> list[Any]:
    return [engine, 0, step, waiting, step, "0.5", "1,2", inc, progress]


@pytest.fixture
def pair(r: redis.Redis, deployment: str) -> tuple[Barrier, Barrier]:
    """Two deployments with the same engines registered: one gets reports one by one,
    the other the same reports in batches."""
    bars = []
    for name in (deployment + ".one", deployment + ".many"):
        bar = Barrier(r, DeploymentKeys(name))
        bar.configure()
        bar.register(*ENGINES)
        bars.append(bar)
    return bars[0], bars[1]


def test_batches_leave_the_state_one_by_one_reports_leave(
    r: redis.Redis, pair: tuple[Barrier, Barrier]
) -> None:
    """Rounds of lockstep reports, with a stale report, a conflict, a heartbeat and a
    restart (last in its round, where one-by-one republishes too): same state, same
    snapshots, same replies (a batch gives its version to each accepted report)."""
    one, many = pair
    inc = {e: new_incarnation(1_700_000_000_000 + i) for i, e in enumerate(ENGINES)}
    later = new_incarnation(1_800_000_000_000)
    older = new_incarnation(1_600_000_000_000)
    rounds: list[list[list[Any]]] = [[entry(e, 1, inc[e]) for e in ENGINES]]
    rounds.append([entry(e, 2, inc[e], waiting=3) for e in reversed(ENGINES)])
    rounds.append([entry("e0", 3, inc["e0"]), entry("e1", 1, inc["e1"]), entry("e2", 3, inc["e2"])])
    rounds.append(
        # e0's heartbeat (a same-step refresh) first: the barrier completes at the end
        [entry("e0", 3, inc["e0"], 5, "0"), entry("e1", 3, inc["e1"]), entry("e3", 3, inc["e3"])]
    )
    rounds.append([entry("e2", 9, older), entry("e0", 4, inc["e0"]), entry("e3", 4, inc["e3"])])
    rounds.append([entry("e1", 4, inc["e1"]), entry("e2", 0, later)])  # a restart, last
    rounds.append([entry(e, 5, inc[e]) for e in ("e0", "e1", "e3")] + [entry("e2", 1, later)])
    statuses = set()
    for batch in rounds:
        want = one_by_one(one, batch)
        got = report_many(many, batch)
        assert [(s, w, st) for s, _, w, st in got] == [(s, w, st) for s, _, w, st in want]
        version = max(v for _, v, _, _ in want)
        assert [v for _, v, _, _ in got] == [version if s == "accepted" else 0 for s, *_ in want]
        assert masked(r, many.keys) == masked(r, one.keys)
        statuses |= {s for s, *_ in want}
    assert statuses == {"accepted", "stale", "conflict"}
    snap = many.snapshot()
    assert snap is not None and snap.cut == (0, 5) and snap.version == one.snapshot().version  # type: ignore[union-attr]


def test_a_batch_with_mixed_results_publishes_once(
    r: redis.Redis, pair: tuple[Barrier, Barrier]
) -> None:
    _, bar = pair
    inc = {e: new_incarnation(1_700_000_000_000 + i) for i, e in enumerate(ENGINES)}
    assert [s for s, *_ in report_many(bar, [entry(e, 1, inc[e]) for e in ENGINES])] == [
        "accepted"
    ] * 4
    assert bar.counter("published") == 1
    older = new_incarnation(1_600_000_000_000)
    sub = r.pubsub()
    sub.subscribe(bar.keys.channel)
    wait_until(lambda: sub.get_message(timeout=0.1), what="subscribed")
    replies = report_many(
        bar,
        [
            *(entry("e0", 2, inc["e0"]), entry("e1", 0, inc["e1"])),
            *(entry("e2", 2, older), entry("e3", 2, inc["e3"])),
        ],
    )
    # e1 is stale (older than its step 1), e2 a conflict: the barrier waits for e1
    assert [s for s, *_ in replies] == ["accepted", "stale", "conflict", "accepted"]
    assert [v for _, v, *_ in replies] == [0, 0, 0, 0]
    replies = report_many(bar, [entry("e1", 2, inc["e1"]), entry("e2", 2, inc["e2"])])
    assert [(s, v) for s, v, *_ in replies] == [("accepted", 2), ("accepted", 2)]
    assert bar.counter("published") == 2 and bar.counter("stale") == 1
    assert bar.counter("conflicts") == 1
    messages = []
    wait_until(lambda: (m := sub.get_message(timeout=0.1)) and messages.append(m) is None)
    assert sub.get_message(timeout=0.2) is None, "a batch published twice"
    assert b'"version":2' in messages[0]["data"]
    sub.close()


def test_a_batch_of_one_is_a_report(r: redis.Redis, pair: tuple[Barrier, Barrier]) -> None:
    one, many = pair
    inc = new_incarnation()
    for step in (1, 2, 0):
        for e in ENGINES:
            got = report_many(many, [entry(e, step, inc)])
            assert got == one_by_one(one, [entry(e, step, inc)])
            assert masked(r, many.keys) == masked(r, one.keys)


@pytest.mark.parametrize(
    ("index", "value", "message"),
    [
        (0, "e 1", "report 2 of 3: bad engine_id: e 1"),
        (0, "e0", "report 2 of 3 (engine e0): bad engine_id: given twice"),
        (3, "-4", "report 2 of 3 (engine e1): bad waiting: -4"),
        (5, "2", "report 2 of 3 (engine e1): bad kv_usage: 2"),
        (8, "x", "report 2 of 3 (engine e1): bad progress: x"),
    ],
)
def test_a_bad_report_refuses_the_batch_and_stores_nothing(
    r: redis.Redis, pair: tuple[Barrier, Barrier], index: int, value: str, message: str
) -> None:
    _, bar = pair
    inc = new_incarnation()
    report_many(bar, [entry(e, 1, inc) for e in ENGINES])
    before = contents(r, bar.keys.all_keys())
    batch = [entry("e0", 2, inc), entry("e1", 2, inc), entry("e2", 2, inc)]
    batch[1][index] = value
    with pytest.raises(redis.ResponseError) as exc:
        report_many(bar, batch)
    assert str(exc.value) == f"redisbal: {message}"
    assert contents(r, bar.keys.all_keys()) == before


def test_report_many_refuses_a_count_that_does_not_match(pair: tuple[Barrier, Barrier]) -> None:
    _, bar = pair
    args = entry("e0", 1, "-") + entry("e1", 1, "-")
    for count, msg in (
        ("3", "bad arguments: expected 31 or 34 for 3 reports, got 22"),
        ("0", "bad report count: 0 (1..1024)"),
    ):
        with pytest.raises(redis.ResponseError, match=re.escape(msg)):
            bar.scripts.call("report_many", bar.epoch, count, *args)


# -- reporters of several engines ----------------------------------------------------------


@pytest.mark.parametrize("twin", [Reporter, AsyncReporter])
def test_batch_reporter_reports_every_engine_in_one_call(
    redis_url: str, r: redis.Redis, deployment: str, twin: type
) -> None:
    bar = Barrier(r, DeploymentKeys(deployment))
    bar.configure()
    kw: dict[str, Any] = {"register": True} if twin is Reporter else {}
    rep = Blocking(twin(redis_url, deployment, ENGINES, heartbeat=False, **kw))
    try:
        if twin is AsyncReporter:
            rep.register()
        for step in (1, 2, 3):
            out = rep.report_many(
                {e: {"step": step, "waiting": i, "running": 1} for i, e in enumerate(ENGINES)},
                wait=True,
            )
            assert {e: o.status for e, o in out.items()} == dict.fromkeys(ENGINES, "accepted")
            snap = bar.snapshot()
            assert snap is not None and snap.cut == (0, step)
            assert {e: c.waiting for e, c in snap.engines.items()} == {
                e: i for i, e in enumerate(ENGINES)
            }
        assert rep.report(Counts(1), engine="e2", wait=True).status == "stale"
        assert rep.stats("e2").stale == 1 and rep.stats("e0").accepted == 3
        # a bad engine or count: one line naming it, nothing handed over
        with pytest.raises(InvalidReport, match="engine e1: waiting must be in"):
            rep.report_many({"e0": {"step": 4}, "e1": {"step": 4, "waiting": -1}})
        with pytest.raises(InvalidReport, match="unknown engine 'x9'"):
            rep.report(Counts(4), engine="x9")
        assert rep.stats("e0").queued == 3
        assert rep.flush()
    finally:
        rep.close()
    assert bar.members() == {}, "closing leaves"
    assert text(r.hget(bar.keys.meta, "left")) == "4"


def test_admitted_totals_travel_in_batches_and_alone(
    redis_url: str, r: redis.Redis, deployment: str
) -> None:
    """A batch where some engines send an admitted total and others none (ten fields
    each, "" for none), and a report alone with one: each engine's total is in the
    snapshot, or None; the same reports one by one leave the same state."""
    bar = Barrier(r, DeploymentKeys(deployment))
    bar.configure()
    rep = Reporter(redis_url, deployment, ENGINES, heartbeat=False, register=True)
    try:
        totals = {"e0": 7, "e2": 0}
        out = rep.report_many(
            {e: Counts(1, i, 1, admitted_total=totals.get(e)) for i, e in enumerate(ENGINES)},
            wait=True,
        )
        assert {o.status for o in out.values()} == {"accepted"}
        snap = bar.snapshot()
        assert snap is not None and snap.cut == (0, 1)
        assert {e: c.admitted_total for e, c in snap.engines.items()} == {
            "e0": 7,
            "e1": None,
            "e2": 0,
            "e3": None,
        }
        assert rep.report(Counts(2, admitted_total=12), engine="e1", wait=True).accepted
        for e in ("e0", "e2", "e3"):
            assert rep.report(Counts(2), engine=e, wait=True).accepted
        snap = bar.snapshot()
        assert snap is not None and snap.cut == (0, 2)
        assert {e: c.admitted_total for e, c in snap.engines.items()} == {
            "e0": None,
            "e1": 12,
            "e2": None,
            "e3": None,
        }
    finally:
        rep.close()


def test_a_batch_with_totals_leaves_the_state_one_by_one_reports_leave(
    r: redis.Redis, pair: tuple[Barrier, Barrier]
) -> None:
    one, many = pair
    inc = new_incarnation()
    batch = [[*entry(e, 1, inc), str(i) if i % 2 else ""] for i, e in enumerate(ENGINES)]
    want, got = one_by_one(one, batch), report_many(many, batch)
    assert [(s, st) for s, _, _, st in got] == [(s, st) for s, _, _, st in want]
    assert masked(r, many.keys) == masked(r, one.keys)
    snap = many.snapshot()
    assert snap is not None
    assert [snap.engines[e].admitted_total for e in ENGINES] == [None, 1, None, 3]
    with pytest.raises(redis.ResponseError, match=r"engine e1\): bad admitted_total: 01"):
        report_many(many, [[*entry("e0", 2, inc), ""], [*entry("e1", 2, inc), "01"]])


def test_batch_reporter_checks_its_engine_ids(redis_url: str) -> None:
    for ids, msg in (
        (["e0", "e0"], "engine id 'e0' given twice"),
        (["e0", "a b"], "engine_id"),
        ([f"e{i}" for i in range(1025)], "at most 1024 engines"),
    ):
        with pytest.raises(ValueError, match=msg):
            Reporter(redis_url, "d", ids)
    one = Reporter(redis_url, "d", "e0", register=False)  # one id: one engine
    try:
        assert one.engines == ["e0"]
    finally:
        one.close(leave=False)
