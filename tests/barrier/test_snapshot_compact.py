"""The compact snapshot form, read and adopted: pure logic (the Lua side that
publishes it is tested against real servers in tests/barrier/test_compact.py)."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from redisbal.barrier.snapshot import EngineCounts, Rosters, RosterUnknown, Snapshot
from redisbal.routing.router_core import RouterCore
from redisbal.routing.state import Decision

HEADER: dict[str, Any] = {
    "deployment": "d",
    "epoch": "ep",
    "wave": 0,
    "forced": False,
    "laggards": {},
    "gone": {},
    "joining": [],
    "stalled": {},
    "suspect": {},
}


def forms(
    version: int,
    counts: dict[str, tuple[int, int, float | None, int]],
    incs: dict[str, str],
    roster: int,
    *,
    with_ids: bool = True,
    **fields: Any,
) -> tuple[bytes, bytes]:
    """The same cut as the barrier publishes it in both forms: (full, compact).
    counts: engine -> (waiting, running, kv, age ms)."""
    time_ms = 1_000_000 + 20 * version
    head = {**HEADER, "version": version, "step": version, "time_ms": time_ms, **fields}
    engines = {
        e: {"wave": 0, "step": version, "waiting": w, "running": r, "kv": kv, "t": time_ms - age}
        | ({"inc": incs[e]} if incs.get(e, "-") != "-" else {})
        for e, (w, r, kv, age) in counts.items()
    }
    full = orjson.dumps({**head, "engines": engines})
    compact: dict[str, Any] = {**head, "roster": roster}
    if with_ids:
        compact["ids"] = list(counts)
        compact["incs"] = [incs.get(e, "-") for e in counts]
    compact["counts"] = [x for c in counts.values() for x in c]
    return full, orjson.dumps(compact)


def test_compact_reads_as_the_full_form_less_what_it_does_not_carry() -> None:
    full, compact = forms(
        3, {"e0": (2, 5, 0.5, 0), "e1": (0, 1, None, 7)}, {"e0": "k1-ab", "e1": "-"}, roster=1
    )
    f, c = Snapshot.from_json(full), Snapshot.from_json(compact)
    assert (c.epoch, c.version, c.cut, c.time_ms, c.roster_version) == (
        "ep",
        3,
        (0, 3),
        f.time_ms,
        1,
    )
    assert list(c.engines) == ["e0", "e1"] and len(c.engines) == 2 and "e1" in c.engines
    assert "e2" not in c.engines and c.engines.get("e2") is None
    assert dict(c.engines) == dict(f.engines)
    assert c.engines["e1"] == EngineCounts(0, 1, None, 0, 3, f.time_ms - 7, None, None)
    assert c.counts == [2, 5, 0.5, 0, 0, 1, None, 7] and f.counts == []
    assert c.to_dict()["roster"] == 1


def test_a_message_without_its_roster_needs_one_seen_in_its_epoch() -> None:
    counts = {"e0": (1, 1, 0.1, 0)}
    _, with_ids = forms(1, counts, {}, roster=4)
    _, without = forms(2, counts, {}, roster=4, with_ids=False)
    with pytest.raises(RosterUnknown):
        Snapshot.from_json(without)
    rosters = Rosters()
    with pytest.raises(RosterUnknown):
        Snapshot.from_json(without, rosters)
    Snapshot.from_json(with_ids, rosters)
    assert list(Snapshot.from_json(without, rosters).engines) == ["e0"]
    other_epoch = orjson.loads(without) | {"epoch": "ep2"}
    with pytest.raises(RosterUnknown):
        Snapshot.from_json(orjson.dumps(other_epoch), rosters)


def test_rosters_keep_the_latest_few() -> None:
    rosters = Rosters(keep=2)
    for v in (1, 2, 3):
        Snapshot.from_json(forms(v, {f"e{v}": (0, 0, None, 0)}, {}, roster=v)[1], rosters)
    assert rosters.get("ep", 1) is None
    assert rosters.get("ep", 2) is not None and rosters.get("ep", 3) is not None


@pytest.mark.parametrize(
    "change",
    [
        {"counts": [1, 2, 0.5]},  # not 4 per engine
        {"counts": "1,2,3,4"},
        {"incs": []},  # not one per id
        {"ids": ["e0", "e0"], "incs": ["-", "-"], "counts": [0] * 8},
        {"ids": "e0"},
        {"roster": 0},
        {"roster": "1"},
    ],
)
def test_a_malformed_compact_snapshot_is_a_value_error(change: dict[str, Any]) -> None:
    _, compact = forms(1, {"e0": (1, 1, 0.1, 0)}, {}, roster=1)
    bad = orjson.dumps(orjson.loads(compact) | change)
    with pytest.raises(ValueError):
        Snapshot.from_json(bad, Rosters())


def test_a_router_adopts_both_forms_alike_and_routes_the_same() -> None:
    """Full snapshots without admitted counts and their compact twins: every engine
    view and every decision of two routers (same seed, same clock) stay equal through
    routes, finishes, ages, a restart, a stall, an engine leaving and one joining."""
    now = [100.0]
    routers = [
        RouterCore(1, 4, clock=lambda: now[0], rng=random.Random(7), transit_s=0.002)
        for _ in range(2)
    ]
    rng = random.Random(3)
    rosters = Rosters()
    engines = [f"e{i}" for i in range(6)]
    incs = dict.fromkeys(engines, "k1-aa")
    roster = 1
    opened: list[list[Decision]] = []  # each router's decision of a request still open
    for version in range(1, 40):
        fields: dict[str, Any] = {}
        if version == 12:
            incs["e2"] = "k2-bb"  # a restart
            roster += 1
        if version == 20:
            engines.remove("e4")  # it leaves
            fields["gone"] = {"e4": "left"}
            roster += 1
        if version == 25:
            engines.append("e9")  # it joins
            incs["e9"] = "-"
            roster += 1
        if 30 <= version < 33:
            fields["stalled"] = {"e1": 900}
        counts = {
            e: (
                rng.randint(0, 3),
                rng.randint(0, 8),
                rng.choice([None, 0.25, 0.5]),
                rng.randint(0, 60),  # ms: ends after some counts were made
            )
            for e in engines
        }
        full, compact = forms(
            version, counts, incs, roster, with_ids=version in (1, 12, 20, 25), **fields
        )
        snaps = [Snapshot.from_json(full), Snapshot.from_json(compact, rosters)]
        assert all(core.apply_snapshot(s) for core, s in zip(routers, snaps, strict=True))
        for _ in range(rng.randint(0, 6)):
            now[0] += rng.random() * 0.004
            decisions = [core.route() for core in routers]
            assert decisions[0].engine_id == decisions[1].engine_id
            opened.append(decisions)
            if rng.random() < 0.3:  # one open request ends: maybe one the counts hold
                for core, d in zip(routers, opened.pop(rng.randrange(len(opened))), strict=True):
                    core.finished(d)
        now[0] += 0.02
        views = [
            [
                (
                    e.engine_id,
                    e.waiting,
                    e.running,
                    e.kv_usage,
                    e.age_s,
                    e.pending,
                    e.aged,
                    e.incarnation,
                )
                for e in core.known
            ]
            for core in routers
        ]
        assert views[0] == views[1]
        assert routers[0].running_cap == routers[1].running_cap  # taught alike
        assert [e.engine_id for e in routers[0].engines] == [
            e.engine_id for e in routers[1].engines
        ]
    assert routers[0].counters == routers[1].counters
    assert routers[1].counters["restarts"] == 1
    assert routers[1].running_cap > 0  # (queues in reports in a row taught both a cap)


def test_a_full_snapshot_between_compact_ones_leaves_no_stale_incarnation() -> None:
    """Compact adoption takes incarnations from a roster once, when it first adopts it; a
    full snapshot sets them too, so after one the next compact snapshot compares them
    again even when its roster is one the router has already adopted."""
    rosters = Rosters()
    core = RouterCore(0, 1, "redisbal", rng=random.Random(1))
    counts = {"e0": (0, 1, None, 0), "e1": (0, 1, None, 0)}
    _, compact = forms(1, counts, {"e0": "k1-aa", "e1": "k1-bb"}, roster=1)
    core.apply_snapshot(Snapshot.from_json(compact, rosters))
    full, _ = forms(2, counts, {"e0": "k2-cc", "e1": "k1-bb"}, roster=1)  # e0 restarted
    core.apply_snapshot(Snapshot.from_json(full, rosters))
    assert core.by_id["e0"].incarnation == "k2-cc"
    restarts = core.counters["restarts"]
    # roster 1 again (the same Roster object, from the cache): e0's incarnation as it names it
    _, again = forms(3, counts, {"e0": "k1-aa", "e1": "k1-bb"}, roster=1, with_ids=False)
    snap = Snapshot.from_json(again, rosters)
    core.apply_snapshot(snap)
    assert core.by_id["e0"].incarnation == "k1-aa"
    assert core.counters["restarts"] == restarts + 1
