"""The compact snapshot (lua/includes/publish.lua, docs/DESIGN.md "Snapshot format") on
real servers.

From ``compact_from`` engines with counts on, a publish carries per engine waiting,
running, kv and the report's age, positionally, with the engines' ids and incarnations
in the key always and in the channel message only when the roster (the ids and
incarnations) changed. These tests read the raw JSON: the counts must be those the full
format shows for the same reports, and the message must name the roster exactly when it
changed (a join, a leave, an expiry, a restart, a new epoch or generation).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis
from support.helpers import Barrier, wait_until

from redisbal.keys import DeploymentKeys
from redisbal.reporting.reporter import new_incarnation

pytestmark = pytest.mark.servers

INC = {e: new_incarnation(1_700_000_000_000 + i) for i, e in enumerate(("e0", "e1", "e2", "e3"))}
FULL = 1_000_000  # compact_from above any deployment here: the full format


@pytest.fixture
def bar(r: redis.Redis, keys: DeploymentKeys) -> Barrier:
    b = Barrier(r, keys)
    b.configure(compact_from=0)
    return b


class Feed:
    """The deployment's channel, message by message (parsed)."""

    def __init__(self, r: redis.Redis, keys: DeploymentKeys) -> None:
        self.r, self.channel = r, keys.channel
        self.sub = r.pubsub()
        self.sub.subscribe(keys.channel)
        wait_until(lambda: self.sub.get_message(timeout=0.1), what="subscribed")

    def all(self) -> list[dict[str, Any]]:
        """Every message published since the last call, in order: up to a marker this
        publishes now (the channel keeps the order, so nothing is left behind)."""
        self.r.publish(self.channel, b"end")
        out = []
        while True:
            m = wait_until(lambda: self.sub.get_message(timeout=0.1), what="a message")
            if m["data"] == b"end":
                return out
            out.append(orjson.loads(m["data"]))

    def one(self) -> dict[str, Any]:
        got = self.all()
        assert len(got) == 1, f"expected one message, got {len(got)}"
        return got[0]

    def close(self) -> None:
        self.sub.close()


@pytest.fixture
def feed(r: redis.Redis, keys: DeploymentKeys) -> Any:
    f = Feed(r, keys)
    yield f
    f.close()


def key(bar: Barrier) -> dict[str, Any]:
    raw = bar.snapshot_raw()
    assert raw is not None
    return orjson.loads(raw)  # type: ignore[no-any-return]


def rows(snap: dict[str, Any]) -> dict[str, tuple[str, list[Any]]]:
    """A compact snapshot (with ids) as engine -> (incarnation, [waiting, running, kv, age])."""
    ids, incs, counts = snap["ids"], snap["incs"], snap["counts"]
    assert len(ids) == len(incs) == len(counts) // 4 and len(counts) % 4 == 0
    return {e: (incs[i], counts[4 * i : 4 * i + 4]) for i, e in enumerate(ids)}


def rnd(bar: Barrier, step: int, engines: tuple[str, ...] = ("e0", "e1", "e2")) -> None:
    """One lockstep round: every engine reports step with counts made from it."""
    for i, e in enumerate(engines):
        bar.report(e, step, waiting=step + i, running=i, kv="0.25", adm="3,4", inc=INC[e])


def test_the_compact_key_holds_what_the_full_format_shows(bar: Barrier) -> None:
    """Engines with and without an incarnation, kv and adm; one ahead of the cut (its
    counts come from its report at or before it), one registered without a report
    (joining): republished at the same cut in the full format (a new epoch), every
    engine's counts, incarnation and age match."""
    bar.register("e0", "e1", "e2", "e3")
    bar.report("e0", 1, waiting=3, running=17, kv="0.4", adm="40,38", inc=INC["e0"])
    bar.report("e1", 1, waiting=0, running=2)  # no incarnation, no kv, no adm
    bar.report("e2", 1, waiting=9, running=1, kv="1", inc=INC["e2"])
    bar.report("e2", 2, waiting=99, running=99, kv="0", inc=INC["e2"])  # ahead of the cut
    bar.report("e3", 1, waiting=5, running=5, kv="0.1234", adm="1", inc=INC["e3"])
    bar.register("e9")  # a member without a report: joining
    bar.scripts.call("new_epoch", "e1st")  # (republish: register does not)
    compact = key(bar)
    assert "engines" not in compact and compact["step"] == 1 and compact["joining"] == ["e9"]
    bar.configure(compact_from=FULL)
    bar.scripts.call("new_epoch", "e2nd")  # the same cut, republished in full
    full = key(bar)
    assert "ids" not in full and "counts" not in full and "roster" not in full
    assert (full["wave"], full["step"], full["version"]) == (0, 1, compact["version"] + 1)
    for field in ("forced", "laggards", "joining", "stalled", "suspect", "deployment"):
        assert compact[field] == full[field], field
    got = rows(compact)
    assert sorted(got) == sorted(full["engines"]) == ["e0", "e1", "e2", "e3"]
    for e, c in full["engines"].items():
        age = compact["time_ms"] - c["t"]
        assert got[e] == (c.get("inc", "-"), [c["waiting"], c["running"], c["kv"], age]), e
        assert age >= 0
    assert got["e2"][1][:3] == [9, 1, 1]  # its step-1 report, not step 2's
    assert got["e1"] == ("-", [0, 2, None, compact["time_ms"] - full["engines"]["e1"]["t"]])


def test_the_message_names_the_roster_only_when_it_changed(
    bar: Barrier, feed: Feed, r: redis.Redis
) -> None:
    """ids and incs go out with roster + 1 after a join, a leave, an expiry and a
    restart, and are left out of the messages in between; the key always has them."""
    bar.register("e0", "e1", "e2")
    rnd(bar, 1)
    first = feed.one()
    assert first["roster"] == 1 and set(rows(first)) == {"e0", "e1", "e2"}
    assert first == key(bar)  # a new roster: the message is the key
    order = first["ids"]

    def quiet(step: int, engines: tuple[str, ...], roster: int) -> None:
        """Two rounds without a roster change: counts only, in the key's order."""
        for s in (step, step + 1):
            rnd(bar, s, engines)
            msg, snap = feed.one(), key(bar)
            assert msg["roster"] == snap["roster"] == roster
            assert "ids" not in msg and "incs" not in msg
            assert msg == {k: v for k, v in snap.items() if k not in ("ids", "incs")}
            for i, e in enumerate(snap["ids"]):  # positional: the counts of ids[i]
                n = engines.index(e)
                assert msg["counts"][4 * i : 4 * i + 3] == [s + n, n, 0.25]

    def changed(roster: int, engines: set[str]) -> dict[str, Any]:
        msgs = feed.all()
        assert msgs, "a roster change publishes"
        named = [m for m in msgs if "ids" in m]
        assert [m["roster"] for m in named] == [roster], "one message names the new roster"
        assert all(m["roster"] == roster - 1 for m in msgs if "ids" not in m)
        assert set(named[-1]["ids"]) == engines and named[-1]["roster"] == key(bar)["roster"]
        assert bar.meta()["roster"] == str(roster)
        return named[-1]

    quiet(2, ("e0", "e1", "e2"), 1)
    assert key(bar)["ids"] == order  # the roster's order holds while it does
    # a join: e3 reports the next step first, then the others
    bar.report("e3", 4, waiting=7, running=3, kv="0.25", inc=INC["e3"])
    assert feed.all() == []
    rnd(bar, 4)
    changed(2, {"e0", "e1", "e2", "e3"})
    quiet(5, ("e0", "e1", "e2", "e3"), 2)
    # a leave
    bar.leave("e3", INC["e3"])
    changed(3, {"e0", "e1", "e2"})
    quiet(7, ("e0", "e1", "e2"), 3)
    # an expiry
    bar.expire_now("e2")
    assert bar.reap()[1] == ["e2"]
    changed(4, {"e0", "e1"})
    quiet(9, ("e0", "e1"), 4)
    # a restart: e1's new process, the same id, starts at step 0: a new step sequence
    # past the cut, so it is joining until e0 reaches its step (11)
    later = new_incarnation(1_800_000_000_000)
    bar.report("e1", 0, inc=later)
    assert changed(5, {"e0"})["joining"] == ["e1"]
    bar.report("e0", 11, inc=INC["e0"])
    msg = changed(6, {"e0", "e1"})
    assert rows(msg)["e1"][0] == later and rows(msg)["e0"][0] == INC["e0"]


def test_a_new_order_of_the_reports_hash_is_no_roster_change(
    bar: Barrier, feed: Feed, r: redis.Redis, keys: DeploymentKeys
) -> None:
    """HGETALL gives the hash's order, which a rehash changes (here: fields added until
    the hash grows); the same engines in a new order keep the roster and its order."""
    engines = [f"n{i}" for i in range(40)]
    bar.register(*engines)

    def round_(step: int) -> None:
        for i, e in enumerate(engines):
            bar.report(e, step, waiting=i, running=step)

    def hash_order() -> list[str]:
        return [k.decode() for k in r.hkeys(keys.reports) if not k.startswith(b".")]

    round_(1)
    first = feed.one()
    before = hash_order()
    r.hset(keys.reports, mapping={f".pad{i}": "x" for i in range(1000)})
    r.hdel(keys.reports, *[f".pad{i}" for i in range(1000)])
    assert hash_order() != before, "the hash kept its order: this test shows nothing"
    round_(2)
    msg = feed.one()
    assert "ids" not in msg and msg["roster"] == 1 and key(bar)["ids"] == first["ids"]
    for i, e in enumerate(first["ids"]):  # the counts follow the roster's order
        assert msg["counts"][4 * i : 4 * i + 2] == [engines.index(e), 2]


def test_below_compact_from_the_full_format_is_published(
    bar: Barrier, feed: Feed, r: redis.Redis, keys: DeploymentKeys
) -> None:
    """compact_from counts engines with counts: 3 of 4 publish in full; the 4th
    makes it compact; a leave makes it full again, and the next compact snapshot names
    its roster again (a full publish clears it)."""
    bar.configure(compact_from=4)
    bar.register("e0", "e1", "e2", "e3")
    rnd(bar, 1)  # e3 registered, no report: it holds the barrier
    assert feed.all() == []
    bar.report("e3", 1, inc=INC["e3"])
    msg = feed.one()
    assert "roster" in msg and set(msg["ids"]) == {"e0", "e1", "e2", "e3"} and msg["roster"] == 1
    bar.leave("e3", INC["e3"])
    msg = feed.one()
    assert "roster" not in msg and sorted(msg["engines"]) == ["e0", "e1", "e2"]
    assert msg == key(bar) and r.hget(keys.reports, ".roster") is None
    rnd(bar, 2)
    assert "engines" in feed.one()
    bar.configure(compact_from=3)
    rnd(bar, 3)
    msg = feed.one()
    assert msg["roster"] == 2 and set(msg["ids"]) == {"e0", "e1", "e2"}


def test_forced_stalled_suspect_and_joining_lists_in_compact(bar: Barrier) -> None:
    """The header lists are the full format's: a forced cut names its laggard (whose
    counts come from its report at or before the cut), a stalled and a suspect engine
    are listed and still counted, a registered engine without a report is joining."""
    bar.register("e0", "e1", "e2", "e3")
    for e in ("e0", "e1", "e2", "e3"):
        bar.report(e, 1, waiting=1, inc=INC[e])
    bar.report("e0", 2, waiting=2, inc=INC["e0"])
    bar.report("e1", 2, waiting=2, inc=INC["e1"])
    bar.report("e3", 2, waiting=2, inc=INC["e3"])
    version, laggards = bar.force(stall_ms="0")
    assert version > 0 and laggards == ["e2"]
    snap = key(bar)
    assert snap["forced"] is True and set(snap["laggards"]) == {"e2"} and snap["step"] == 2
    got = rows(snap)
    assert {e: c[0] for e, (_, c) in got.items()} == {"e0": 2, "e1": 2, "e2": 1, "e3": 2}
    # e2 hangs with work queued: its next heartbeat finds it stalled
    bar.age_progress("e2")
    bar.report("e2", 1, waiting=7, inc=INC["e2"], progress=False)
    snap = key(bar)
    assert set(snap["stalled"]) == {"e2"} and rows(snap)["e2"][1][0] == 7
    assert bar.suspect("e1")[0] == "suspect"
    snap = key(bar)
    assert set(snap["suspect"]) == {"e1"} and "e1" in rows(snap)
    bar.register("e9")
    bar.report("e9", 5, inc=new_incarnation(1_700_000_000_009))  # past the cut: joining
    bar.scripts.call("new_epoch", "e2nd")  # republish the same cut
    snap = key(bar)
    assert snap["joining"] == ["e9"] and "e9" not in rows(snap) and snap["forced"] is False


def test_a_new_epoch_or_generation_names_the_roster_again(
    bar: Barrier, feed: Feed, r: redis.Redis, keys: DeploymentKeys
) -> None:
    bar.register("e0", "e1", "e2")
    rnd(bar, 1)
    assert feed.one()["roster"] == 1
    rnd(bar, 2)
    assert "ids" not in feed.one()
    bar.scripts.call("new_epoch", "e2nd")
    msg = feed.one()
    assert msg["epoch"] == "e2nd" and msg["roster"] == 2 and len(msg["ids"]) == 3
    # the state is lost: a new generation counts rosters from 1 again
    r.delete(*keys.all_keys())
    bar.configure(compact_from=0)
    bar.register("e0", "e1", "e2")
    rnd(bar, 1)
    msg = feed.one()
    assert msg["roster"] == 1 and msg["version"] == 1 and len(msg["ids"]) == 3


def test_nothing_takes_the_roster_field_for_an_engine(
    bar: Barrier, r: redis.Redis, keys: DeploymentKeys
) -> None:
    """.roster sits among the records: reports, suspect, force, reap and leave keep
    treating only engine ids as engines."""
    rnd(bar, 1)
    assert r.hget(keys.reports, ".roster") is not None
    assert set(bar.records()) == {"e0", "e1", "e2"}
    with pytest.raises(redis.ResponseError, match="bad engine_id"):
        bar.suspect(".roster")
    rnd(bar, 2, ("e0", "e1"))
    assert bar.force(stall_ms="0")[1] == ["e2"]
    assert set(rows(key(bar))) == {"e0", "e1", "e2"}
    bar.leave("e2", INC["e2"])
    assert set(rows(key(bar))) == {"e0", "e1"} and ".roster" not in bar.members()
    assert bar.reap() == (0, [])
