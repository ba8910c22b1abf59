"""The compact snapshot form, read and adopted, and the checks of every field of both
forms where a snapshot is decoded: pure logic (the Lua side that publishes it is
tested against real servers in tests/barrier/test_compact.py)."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from redisbal.barrier.snapshot import EngineCounts, Rosters, RosterUnknown, Snapshot
from redisbal.errors import MalformedData
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


# every field a reader of a snapshot uses, each with values of the wrong type or range:
# (field, where: "" the header, "e0" an engine's counts, "c" its compact counts)
NOT_NUMBERS = ["x", None, True, [1], {"n": 1}]
WRONG_FIELDS: list[tuple[str, str, Any]] = [
    *[("version", "", v) for v in ["9", -1, 1.5, *NOT_NUMBERS]],
    *[(f, "", v) for f in ("wave", "step", "time_ms") for v in ["0", -1, 2.5, None, False]],
    *[("forced", "", v) for v in [0, "no", None]],
    ("deployment", "", 5),
    ("epoch", "", None),
    ("epoch", "", ["ep"]),
    *[(f, "", v) for f in ("laggards", "stalled", "suspect") for v in [{"e0": "x"}, {"e0": 1.5}]],
    ("suspect", "", [1]),
    ("gone", "", {"e0": ["left"]}),
    ("laggards", "", {"a b": 5}),  # not an engine id
    ("gone", "", {"e0": 1}),
    ("gone", "", {"": "left"}),
    *[
        (f, "", v)
        for f in ("joining", "probing")
        for v in ["e0", [5], ["e0", None], ["a\nb"], [["e0"]]]
    ],
    ("engines", "", ["e0"]),
    ("engines", "", {"e0": 5}),
    ("engines", "", {"e0": None}),
    ("engines", "", {"{x}": {}}),
    *[(f, "e0", v) for f in ("waiting", "running") for v in [-1, 10**9 + 1, 2.0, *NOT_NUMBERS]],
    *[("kv", "e0", v) for v in [-0.1, 1.5, 2, "0.4", True, [0.4]]],
    *[(f, "e0", v) for f in ("wave", "step", "t") for v in [-1, "1", 1.5, None, True]],
    *[("adm", "e0", v) for v in ["12", 5, [1, "2"], [-1], [1.5], [True], [None], {"0": 1}]],
    *[("inc", "e0", v) for v in [5, ["k1-aa"], True]],
    *[("tot", "e0", v) for v in [-1, 10**15, "3", 1.5, True]],
    *[(f, "c", v) for f in ("waiting", "running") for v in [-1, 10**9 + 1, 2.0, *NOT_NUMBERS]],
    *[("kv", "c", v) for v in [-0.1, 1.5, "0.4", True]],
    *[("age", "c", v) for v in [-1, 1.5, "1", None, True]],
    ("ids", "", ["bad id"]),
    ("incs", "", [5]),
]


def wrong(field: str, where: str, value: Any) -> bytes:
    """A published snapshot (full form, or compact when where is "c" or the field is a
    roster's) with ``field`` set to ``value``."""
    counts = {"e0": (1, 2, 0.5, 3), "e1": (0, 1, None, 0)}
    full, compact = forms(3, counts, {"e0": "k1-aa"}, roster=1)
    if where == "c" or field in ("ids", "incs"):
        doc = orjson.loads(compact)
        if where == "c":
            doc["counts"][("waiting", "running", "kv", "age").index(field)] = value
        else:
            doc[field] = value
    else:
        doc = orjson.loads(full)
        (doc["engines"][where] if where else doc)[field] = value
    return orjson.dumps(doc)


@pytest.mark.parametrize(
    ("field", "where", "value"),
    WRONG_FIELDS,
    ids=[f"{f}{w and '@' + w}={v!r}"[:40] for f, w, v in WRONG_FIELDS],
)
def test_every_field_of_a_snapshot_is_checked_where_it_is_decoded(
    field: str, where: str, value: Any
) -> None:
    """A snapshot whose field has the wrong type or range is refused by the parse,
    with a one-line error naming the field: no reader gets a Snapshot that would fail
    later, in whichever routing path meets the field first."""
    with pytest.raises(MalformedData) as exc:
        Snapshot.from_json(wrong(field, where, value), Rosters())
    message = str(exc.value)
    assert "\n" not in message
    assert field in message, message


@pytest.mark.parametrize(
    "raw", [b"", b"[1]", b"5", b'"counts"', b"{", b"null", b'{"counts": []}', b"{}"]
)
def test_a_snapshot_that_is_no_json_object_of_one_is_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedData):
        Snapshot.from_json(raw, Rosters())


def test_a_missing_field_is_malformed_and_absent_optional_ones_are_not() -> None:
    full, compact = forms(3, {"e0": (1, 2, 0.5, 3)}, {"e0": "k1-aa"}, roster=1)
    for form in (full, compact):
        for name in ("version", "time_ms", "forced", "epoch"):
            doc = orjson.loads(form)
            del doc[name]
            with pytest.raises(MalformedData, match=name):
                Snapshot.from_json(orjson.dumps(doc), Rosters())
    doc = orjson.loads(full)
    del doc["engines"]["e0"]["waiting"]
    with pytest.raises(MalformedData, match="waiting"):
        Snapshot.from_json(orjson.dumps(doc))
    for name in ("stalled", "suspect", "probing"):  # optional header fields
        doc = orjson.loads(full)
        doc.pop(name, None)
        assert Snapshot.from_json(orjson.dumps(doc)).version == 3


def test_a_refused_compact_message_leaves_no_roster_behind() -> None:
    rosters = Rosters()
    with pytest.raises(MalformedData):
        Snapshot.from_json(wrong("waiting", "c", "x"), rosters)
    assert rosters.get("ep", 1) is None


def test_what_the_lua_script_lets_through_is_read_not_refused() -> None:
    """Values at the ends of every range parse; an admitted entry past 64 bits (the
    script does not count its digits: orjson reads it as a float) is no count, and the
    router reads its list as not reported, as one whose sum is past MAX_ADMITTED."""
    full, _ = forms(3, {"e0": (0, 10**9, 1, 0), "e1": (10**9, 0, 0, 0)}, {}, roster=1)
    doc = orjson.loads(full)
    doc["engines"]["e0"] |= {"adm": [0, 999999999999999], "tot": 999999999999999}
    doc["engines"]["e1"] |= {"adm": [1, 2], "tot": 0}
    doc["stalled"] = {"e0": -5}  # (ms since progress, on a server clock that went back)
    raw = orjson.dumps(doc).replace(b"[1,2]", b"[1,123456789012345678901234567890]")
    snap = Snapshot.from_json(raw)
    assert snap.engines["e0"].admitted == (0, 999999999999999)
    big = snap.engines["e1"].admitted
    assert big is not None and type(big[1]) is float
    core = RouterCore(0, 2)
    core.apply_snapshot(snap)
    assert core.by_id["e0"].exact and not core.by_id["e1"].exact
    assert core.by_id["e1"].waiting == 10**9 and core.by_id["e0"].kv_usage == 1


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
