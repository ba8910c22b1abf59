"""Routers telling each other their routes (redisbal.routing.told_routes): each counts the
others' routes still on their way, exactly, instead of its own times 1 / its share.
On RouterCores fed hand-built snapshots and each other's messages (no Redis, a fake
clock); the feed's side runs against a real Redis at the end."""

from __future__ import annotations

import orjson
import pytest
from support.helpers import await_until, make_snapshot

from redisbal.routing.cache_view import anchors, chain_hashes
from redisbal.routing.router import AsyncRouter
from redisbal.routing.router_core import RouterCore
from redisbal.routing.state import EngineView
from redisbal.routing.told_routes import FRESH_S, MAX_CHAIN, ToldRoutes


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def pair(clock: FakeClock, count: int = 2, learn_routes: int = 0) -> list[RouterCore]:
    """Routers whose feeds are connected (told routes count only then)."""
    cores = [RouterCore(i, count, clock=clock, learn_routes=learn_routes) for i in range(count)]
    for core in cores:
        core.connected = True
    return cores


def snap(version: int, admitted: dict[str, tuple[int, ...]], **kw: object) -> object:
    return make_snapshot({e: (0, 0) for e in admitted}, version=version, admitted=admitted, **kw)


def test_a_router_counts_the_routes_another_told_until_the_engine_admitted_them() -> None:
    clock = FakeClock()
    a, b = pair(clock)
    for c in (a, b):
        c.apply_snapshot(snap(1, {"e0": (0, 0), "e1": (0, 0)}))
    assert not b.told_routes.live and b.pending_weight == pytest.approx(2.0)  # the share model
    for _ in range(3):
        a.route(engine_id="e0")
    b.hear(a.told())
    e0 = b.by_id["e0"]
    assert b.told_routes.live and b.pending_weight == 1.0  # everyone's heard: own routes count 1
    assert e0.others == 3.0
    # the engine admitted two of them: one is still on its way
    b.apply_snapshot(snap(2, {"e0": (2, 0), "e1": (0, 0)}))
    assert e0.others == 1.0
    b.apply_snapshot(snap(3, {"e0": (3, 0), "e1": (0, 0)}))
    assert e0.others == 0.0 and "e0" not in b.told_routes.told  # nothing left on its way
    # what a told: only what changed since its last message
    assert orjson.loads(a.told()) == {"i": 0, "e": {}}


def test_the_others_routes_steer_the_default_policy() -> None:
    clock = FakeClock()
    a, b = pair(clock)
    for c in (a, b):
        c.apply_snapshot(snap(1, {"e0": (0, 0), "e1": (0, 0)}))
    a.route(engine_id="e0")
    a.route(engine_id="e0")
    b.hear(a.told())
    # e0 has two routes on their way from a: b sends its next two to e1
    assert [b.route().engine_id for _ in range(2)] == ["e1", "e1"]


def test_without_admitted_counts_told_routes_count_until_a_report_made_after_them() -> None:
    """Without admitted counts (vLLM's plugin, the sidecar) a router counts another's
    routes by when it heard of them, as its own by when it made them: until the
    engine's counts were made after them (its cut: a report after the one after the
    route, ``estimates.by_report``). Its own ended requests still stand for everyone's."""
    clock = FakeClock(100.0)
    a, b = pair(clock)
    t0 = 1_000_000

    def report(at_s: float, version: int, running: int) -> None:
        clock.t = at_s + 0.01  # published 10 ms after, adopted at once
        ms = t0 + round((at_s - 100.0) * 1000)
        s = make_snapshot({"e0": (0, running), "e1": (0, 0)}, version=version, time_ms=ms + 10,
                          reported_ms=ms)  # fmt: skip
        for r in (a, b):
            r.apply_snapshot(s)

    report(100.0, 1, 0)
    b.hear(a.told())  # a heartbeat: b has heard from everyone
    assert b.told_routes.live and b.pending_weight == 1.0
    clock.t = 100.02
    ds = [a.route(engine_id="e0"), a.route(engine_id="e0")]
    b.hear(a.told())  # the first message about e0 sets a's base: its earlier routes
    ds.append(a.route(engine_id="e0"))  # are of unknown times, and not counted
    clock.t = 100.03
    b.hear(a.told())
    e0 = b.by_id["e0"]
    assert e0.others == 1.0
    report(100.05, 2, 3)  # counts made after the route, before the engine's next step
    assert e0.others == 1.0  # the engine takes it at that step: still on its way
    report(100.09, 3, 3)  # made after the step that followed the route
    assert e0.others == 0.0 and "e0" not in b.told_routes.times
    # a route taken back is no longer on its way
    clock.t = 100.1
    ds.append(a.route(engine_id="e0"))
    b.hear(a.told())
    assert e0.others == 1.0
    back = a.route(engine_id="e0")
    b.hear(a.told())
    assert e0.others == 2.0
    a.unroute(back)
    b.hear(a.told())
    assert e0.others == 1.0
    # at most what a still has open there
    for d in ds:
        a.finished(d)
    b.hear(a.told())
    assert e0.others == 0.0
    # b's own routes count 1, its ended ones the share: 2 each (others' ends are not told)
    own = b.route(engine_id="e0")
    report(100.15, 4, 4)
    report(100.2, 5, 4)  # own is in these counts
    clock.t = 100.25
    b.finished(own)
    assert (e0.done, e0.aged) == (1, 2.0)


def test_an_other_router_not_heard_from_brings_the_share_back() -> None:
    clock = FakeClock()
    a, b, c = pair(clock, 3)
    for r in (a, b, c):
        r.apply_snapshot(snap(1, {"e0": (0, 0, 0)}))
    a.route(engine_id="e0")
    c.hear(a.told())
    assert not c.told_routes.live  # b was never heard from
    assert c.by_id["e0"].others == 0.0
    c.hear(b.told())  # a heartbeat: nothing changed
    assert c.told_routes.live and c.by_id["e0"].others == 1.0
    clock.t += FRESH_S + 0.1
    c.apply_snapshot(snap(2, {"e0": (0, 0, 0)}))
    assert not c.told_routes.live and c.by_id["e0"].others == 0.0
    assert c.pending_weight == pytest.approx(3.0)


def test_a_router_whose_feed_is_lost_stops_counting_what_was_told() -> None:
    """With the feed down nothing told can change while the routes it counts end (in
    an outage they stood still and kept an engine from being chosen at all): the
    share comes back at once, and the told routes count again with the feed."""
    clock = FakeClock()
    a, b = pair(clock)
    for r in (a, b):
        r.apply_snapshot(snap(1, {"e0": (0, 0), "e1": (0, 0)}))
    for _ in range(3):
        a.route(engine_id="e0")
    b.hear(a.told())
    assert b.told_routes.live and b.by_id["e0"].others == 3.0
    b.set_connected(False)  # (the feed lost)
    assert not b.told_routes.live and b.by_id["e0"].others == 0.0
    assert b.pending_weight == pytest.approx(2.0)
    assert {b.route().engine_id for _ in range(4)} == {"e0", "e1"}
    b.set_connected(True)  # (and connected again)
    assert b.told_routes.live and b.by_id["e0"].others == 3.0


def test_routes_to_an_earlier_process_or_ended_unadmitted_do_not_count() -> None:
    clock = FakeClock()
    a, b = pair(clock)
    inc = {"e0": "p1"}
    for r in (a, b):
        r.apply_snapshot(snap(1, {"e0": (0, 0)}, incarnation=inc))
    d = a.route(engine_id="e0")
    a.route(engine_id="e0")
    b.hear(a.told())
    assert b.by_id["e0"].others == 2.0
    a.finished(d)  # one ended without the engine admitting it: refused, say
    b.hear(a.told())
    assert b.by_id["e0"].others == 1.0  # at most what a still has open there
    b.apply_snapshot(snap(2, {"e0": (0, 0)}, incarnation={"e0": "p2"}))  # a restart
    assert b.by_id["e0"].others == 0.0


PROMPT = chain_hashes(list(range(16 * 32)))  # a 512-token prompt: 32 blocks, 8 anchors
# a prompt sharing PROMPT's first 24 blocks
FOLLOW_UP = [*PROMPT[:24], *chain_hashes(list(range(7, 7 + 128)), parent=PROMPT[23])]


def learning_pair(clock: FakeClock) -> list[RouterCore]:
    """Two routers learning their routes, on 8 idle engines, each heard by the other."""
    cores = pair(clock, learn_routes=64)
    for core in cores:
        core.apply_snapshot(snap(1, {f"e{i}": (0, 0) for i in range(8)}))
    a, b = cores
    b.hear(a.told())
    a.hear(b.told())
    assert a.told_routes.live and b.told_routes.live
    return cores


def test_routers_that_learn_their_routes_tell_each_other_the_prefixes_they_sent() -> None:
    """Without KV events, a prefix one router sent an engine is in every router's view:
    the other sends a prompt sharing it there too, though that engine is now the busier
    one; told only the counts, it sends it elsewhere by load."""
    clock = FakeClock()
    a, b = learning_pair(clock)
    first = a.route(blocks=PROMPT, prompt_tokens=512).engine_id
    msg = a.told()
    told = orjson.loads(msg)
    assert told["l"] == {first: [anchors(PROMPT)]}
    assert orjson.loads(a.told()) == {"i": 0, "e": {}}  # told once
    b.hear(msg)
    assert b.cache_view.engines[first] == set(anchors(PROMPT))
    assert b.by_id[first].others == 1.0
    d = b.route(blocks=FOLLOW_UP, prompt_tokens=512)
    assert d.engine_id == first and d.cached == 24
    # the same message without the learned route: b knows only the counts
    _, c = learning_pair(clock)
    del told["l"]
    c.hear(orjson.dumps(told))
    d = c.route(blocks=FOLLOW_UP, prompt_tokens=512)
    assert d.engine_id != first and d.cached == 0


def test_learned_routes_are_told_only_to_routers_heard_from_and_kept_only_where_learning() -> None:
    clock = FakeClock()
    lone = RouterCore(0, 2, clock=clock, learn_routes=64)
    lone.connected = True
    lone.apply_snapshot(snap(1, {"e0": (0, 0)}))
    lone.route(blocks=PROMPT, prompt_tokens=512)
    assert not lone.told_routes.live and "l" not in orjson.loads(lone.told())  # no one heard
    a, _ = learning_pair(clock)
    blind = RouterCore(1, 2, clock=clock)  # learning off: told chains are not kept
    blind.connected = True
    blind.apply_snapshot(snap(1, {f"e{i}": (0, 0) for i in range(8)}))
    a.route(blocks=PROMPT, prompt_tokens=512)
    blind.hear(a.told())
    assert blind.told_routes.messages == 1 and not blind.cache_view.engines


def test_a_chain_longer_than_a_message_takes_is_told_by_its_first_anchors() -> None:
    """A gateway hashing more of a prompt than a message takes (``--prefix-max-tokens``
    raised) tells its prefix: the others would refuse the whole message, counts too."""
    teller, hearer = ToldRoutes(), ToldRoutes()
    teller.live = True
    teller.learned("e0", list(range(MAX_CHAIN + 5)))
    heard: list[list[int]] = []
    known = {"e0": EngineView("e0")}
    ids = hearer.hear(teller.message(known, 0), 1, 0.0, known, lambda e, c: heard.append(c))
    assert ids == [] and hearer.malformed == 0
    assert heard == [list(range(MAX_CHAIN))]


def test_learned_routes_are_told_as_any_64_bit_hashes_signed_or_not() -> None:
    """route(blocks=...) takes any integers: the simulator's hashes are signed. Those of
    64 bits are told as they are; a larger one sends the counts without the chains."""
    teller, hearer = ToldRoutes(), ToldRoutes()
    teller.live = True
    chain = [-(1 << 63), -1, 0, (1 << 64) - 1]
    teller.learned("e0", chain)
    known = {"e0": EngineView("e0")}
    heard: list[list[int]] = []
    hearer.hear(teller.message(known, 0), 1, 0.0, known, lambda e, c: heard.append(c))
    assert heard == [chain]
    teller.learned("e0", [1 << 64])
    teller.mark("e0", True)
    msg = orjson.loads(teller.message(known, 0))
    assert "l" not in msg and msg["e"] == {"e0": [None, 0, 0]}


def test_bad_messages_are_counted_and_change_nothing() -> None:
    clock = FakeClock()
    b = RouterCore(1, 2, clock=clock)
    b.connected = True
    b.apply_snapshot(snap(1, {"e0": (0, 0)}))
    for bad in (
        b"not json",
        b"[]",
        b'{"i": -1}',
        b'{"i": true}',
        b'{"i": 0, "e": {"e0": [null, 1]}}',
        b'{"i": 0, "e": {"e0": [null, -1, 0]}}',
        b'{"i": 0, "e": {"e0": [3, 1, 1]}}',
        b'{"i": 0, "e": []}',
        b'{"i": 0, "e": {}, "l": []}',
        b'{"i": 0, "e": {}, "l": {"e0": [1, 2]}}',  # chains, not anchors
        b'{"i": 0, "e": {}, "l": {"e0": [[1, "2"]]}}',
        b'{"i": 0, "e": {}, "l": {"e0": [[true]]}}',
        b'{"i": 0, "e": {}, "l": {"e0": [[18446744073709551616]]}}',  # past 64 bits
    ):
        b.hear(bad)
    assert b.told_routes.malformed == 13 and b.told_routes.messages == 0
    assert not b.told_routes.live and b.by_id["e0"].others == 0.0
    b.hear(b.told())  # its own message, read back from the channel
    assert b.told_routes.messages == 0


def test_the_tables_keep_only_engines_still_known() -> None:
    p = ToldRoutes()
    known = {"a": EngineView("a", exact=True), "b": EngineView("b", exact=True)}
    known |= {"x": EngineView("x"), "y": EngineView("y")}  # no admitted counts: by time
    msg = b'{"i": 0, "e": {"a": [null, 1, 1], "b": [null, 1, 1], "c": [null, 1, 1], '
    assert p.hear(msg + b'"x": [null, 1, 1], "y": [null, 1, 1]}}', 1, 0.0, known) == [
        "a", "b", "x", "y"
    ]  # c: not known here  # fmt: skip
    p.hear(b'{"i": 0, "e": {"x": [null, 2, 2], "y": [null, 2, 2]}}', 1, 0.1, known)
    assert list(p.told) == ["a", "b"] and list(p.times) == ["x", "y"]
    p.forget(["a", "x"])
    assert (list(p.told), list(p.last), list(p.times)) == (["a"], ["x"], ["x"])


async def test_two_gateways_routers_hear_each_other_through_redis(redis_url: str) -> None:
    """The feed subscribes to the routes channel and tells what changed within a few
    milliseconds, and a heartbeat while idle: each router is live for the other."""
    a = AsyncRouter(redis_url, "exch", 0, 2, engines=["e0", "e1"], poll_s=30)
    b = AsyncRouter(redis_url, "exch", 1, 2, engines=["e0", "e1"], poll_s=30)
    async with a, b:
        await await_until(
            lambda: a.core.told_routes.live and b.core.told_routes.live, what="heartbeats"
        )
        before = b.core.told_routes.messages
        a.route(engine_id="e0")
        await await_until(lambda: b.core.told_routes.messages > before, what="a's route told")
        assert b.core.told_routes.last["e0"][0][1:] == (1, 1)  # (no snapshot: by time)


async def test_two_learning_routers_share_what_they_sent_through_redis(redis_url: str) -> None:
    """A learned route crosses the channel with its counts: the other router's view
    holds the prompt's anchors at the engine it went to."""
    a, b = (
        AsyncRouter(redis_url, "exch-learn", i, 2, engines=["e0", "e1"], poll_s=30, learn_routes=64)
        for i in range(2)
    )
    async with a, b:
        await await_until(
            lambda: a.core.told_routes.live and b.core.told_routes.live, what="heartbeats"
        )
        a.route(engine_id="e1", blocks=PROMPT, prompt_tokens=512)
        await await_until(lambda: "e1" in b.core.cache_view.engines, what="a's route learned")
        assert b.core.cache_view.engines["e1"] == set(anchors(PROMPT))
        assert "e0" not in b.core.cache_view.engines


async def test_a_router_gone_stops_counting_and_brings_the_share_back(redis_url: str) -> None:
    """No message and no snapshot says a router is gone: the other notices that it has
    not heard from it within FRESH_S by itself."""
    a = AsyncRouter(redis_url, "exch-gone", 0, 2, engines=["e0"], poll_s=30)
    b = AsyncRouter(redis_url, "exch-gone", 1, 2, engines=["e0"], poll_s=30)
    async with b:
        async with a:
            await await_until(lambda: b.core.told_routes.live, what="a heard")
            assert b.core.pending_weight == 1.0
        await await_until(lambda: not b.core.told_routes.live, what="a taken as gone")
        assert b.core.pending_weight == pytest.approx(2.0)


def test_a_route_is_told_soon_and_an_end_goes_with_the_next_message() -> None:
    a = RouterCore(0, 2, clock=FakeClock())
    a.set_engines(["e0", "e1"])
    owed: list[int] = []
    a.told_routes.on_change = lambda: owed.append(1)
    d = a.route(engine_id="e0")
    a.route(engine_id="e1")
    assert owed == [1]  # one message owed for both routes
    assert orjson.loads(a.told())["e"] == {"e0": [None, 1, 1], "e1": [None, 1, 1]}
    a.finished(d)
    assert owed == [1]  # an end owes no message of its own ...
    assert orjson.loads(a.told())["e"] == {"e0": [None, 1, 0]}  # ... it goes with the next
    a.route(engine_id="e1")
    assert owed == [1, 1]


async def test_a_router_told_not_to_tell_neither_tells_nor_hears(redis_url: str) -> None:
    import redis.asyncio as aioredis

    a = AsyncRouter(redis_url, "exch-off", 0, 2, engines=["e0"], poll_s=30, tell_routes=False)
    b = AsyncRouter(redis_url, "exch-off", 1, 2, engines=["e0"], poll_s=30)
    watcher = aioredis.from_url(redis_url)
    ps = watcher.pubsub()
    await ps.subscribe(b.keys.routes)
    try:
        async with a, b:
            a.route(engine_id="e0")
            seen: list[bytes] = []

            async def two_heartbeats() -> bool:
                msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.1)
                if msg is not None:
                    seen.append(msg["data"])
                return len(seen) >= 2

            while not await two_heartbeats():
                pass
            # a told nothing in that time (b did, twice), and listens to no routes
            assert all(orjson.loads(m)["i"] == 1 for m in seen)
            assert b.core.told_routes.messages == 0 and not b.core.told_routes.live
            numsub = dict(await watcher.pubsub_numsub(b.keys.routes))
            assert list(numsub.values()) == [2]  # b and this test's watcher
    finally:
        await ps.aclose()
        await watcher.aclose()
