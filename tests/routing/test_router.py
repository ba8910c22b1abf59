"""Routers on a real Redis: the snapshot feed (invariant 4) and the I/O-free hot path
(invariant 8), for AsyncRouter and its threaded twin Router."""

from __future__ import annotations

import logging
import socket
from collections import Counter
from typing import Any

import orjson
import pytest
import redis
import redis.asyncio
from support.helpers import Barrier, await_until, io_of_this_thread, wait_until

from redisbal import AsyncRouter, Router, UnknownEngine
from redisbal.barrier.snapshot import Rosters
from redisbal.keys import DeploymentKeys
from redisbal.routing.cache_view import CacheView, anchors, chain_hashes, unpack_hashes
from redisbal.sim.embedded import RedisServer


@pytest.fixture
def bar(r: redis.Redis, keys: DeploymentKeys) -> Barrier:
    b = Barrier(r, keys)
    b.configure()
    b.register("e0", "e1")
    return b


def step_all(bar: Barrier, step: int, engines: tuple[str, ...] = ("e0", "e1")) -> int:
    """Every engine reports step; returns the version that published."""
    version = 0
    for i, e in enumerate(engines):
        version = bar.report(e, step, waiting=i, running=step)[1] or version
    assert version > 0
    return version


# -- invariant 4: the feed ------------------------------------------------------------------------


async def test_feed_gets_the_stored_snapshot_then_follows_pubsub(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    v1 = step_all(bar, 1)
    router = AsyncRouter(redis_url, keys.deployment, poll_s=30)
    await router.start(wait=5)
    try:
        assert router.snapshot is not None and router.snapshot.version == v1
        assert not router.degraded
        v2 = step_all(bar, 2)
        await await_until(lambda: router.snapshot.version == v2)  # type: ignore[union-attr]
        assert router.snapshot.cut == (0, 2)  # type: ignore[union-attr]
    finally:
        await router.aclose()


async def test_router_ignores_older_versions_and_adopts_a_new_epoch(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    step_all(bar, 1)
    old_raw = bar.snapshot_raw()
    router = AsyncRouter(redis_url, keys.deployment, poll_s=30)
    await router.start(wait=5)
    try:
        v2 = step_all(bar, 2)
        await await_until(lambda: router.snapshot.version == v2)  # type: ignore[union-attr]
        r.publish(keys.channel, old_raw)  # type: ignore[arg-type]
        v3 = step_all(bar, 3)
        # messages arrive in order: by the time v3 is in, the old one was seen and ignored
        await await_until(lambda: router.snapshot.version == v3)  # type: ignore[union-attr]
        assert router.core.counters["ignored_old"] >= 1
        old_epoch = router.snapshot.epoch  # type: ignore[union-attr]
        # state lost: a new epoch restarts versions at 1; the router must follow
        r.delete(*keys.all_keys())
        bar.epoch = "fresh"
        bar.configure()
        bar.register("e0", "e1")
        assert step_all(bar, 1) == 1
        await await_until(lambda: router.snapshot.epoch == "fresh")  # type: ignore[union-attr]
        assert router.snapshot.version == 1 and old_epoch != "fresh"  # type: ignore[union-attr]
        assert router.core.counters["epochs"] == 1
    finally:
        await router.aclose()


async def test_a_late_message_of_the_epoch_left_never_takes_the_router_back(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    """The feed reads the channel and GETs on two connections: a GET can return the new
    epoch's snapshot while a message the old epoch published just before it is still
    unread. That message is newer than anything the router adopted in the old epoch,
    yet older than the epoch the router is in: it must not be adopted."""
    v1 = step_all(bar, 1)
    router = AsyncRouter(redis_url, keys.deployment, poll_s=30)
    await router.start(wait=5)
    try:
        late = orjson.loads(bar.snapshot_raw())  # type: ignore[arg-type]
        late["version"] = v1 + 1  # the old epoch's next snapshot, published before...
        bar.scripts.call("new_epoch", "e2")  # ...the coordinator's new epoch
        await await_until(lambda: router.snapshot.epoch == "e2")  # type: ignore[union-attr]
        r.publish(keys.channel, orjson.dumps(late))  # ...and read after it
        v_next = step_all(bar, 2)
        await await_until(lambda: router.snapshot.version == v_next)  # type: ignore[union-attr]
        # messages arrive in order: the late one came before v_next
        assert router.core.counters["epochs"] == 1, "the router went back to the epoch it left"
        assert router.core.counters["ignored_old"] >= 1
    finally:
        await router.aclose()


# a field of the wrong type for each part of a snapshot a router reads: (where: "" the
# header, an engine id its counts; field; value)
UNADOPTABLE: list[tuple[str, str, Any]] = [
    ("", "suspect", {"e0": "soon"}),
    ("", "time_ms", "now"),
    ("", "version", "9"),
    ("", "forced", "no"),
    ("", "epoch", 7),
    ("", "laggards", {"e0": None}),
    ("", "stalled", {"e0": [1]}),
    ("", "gone", {"e0": 1}),
    ("", "joining", [3]),
    ("", "probing", "e0"),
    ("e0", "waiting", "x"),
    ("e0", "running", -4),
    ("e0", "kv", 7.5),
    ("e0", "t", "1"),
    ("e0", "step", None),
    ("e0", "adm", ["1"]),
    ("e0", "tot", "3"),
    ("e0", "inc", 5),
]


@pytest.mark.parametrize(
    ("where", "field", "value"), UNADOPTABLE, ids=[f"{w}.{f}" for w, f, _ in UNADOPTABLE]
)
async def test_a_snapshot_that_cannot_be_adopted_does_not_stop_the_feed(
    r: redis.Redis,
    redis_url: str,
    keys: DeploymentKeys,
    bar: Barrier,
    where: str,
    field: str,
    value: Any,
) -> None:
    """A message that parses as JSON but holds a field of the wrong type (another
    client's, or another version's) is ignored before any of it is adopted: the feed
    stays up, and every path that reads the counts (routes, their ends reconciled by
    time: estimates.held_ended, loads) keeps working on the snapshot held. A field let
    through to the adoption failed there or later, in whichever path met it first."""
    v1 = step_all(bar, 1)
    router = AsyncRouter(redis_url, keys.deployment, poll_s=30)
    await router.start(wait=5)
    try:
        doc = orjson.loads(bar.snapshot_raw()) | {"version": v1 + 1}  # type: ignore[arg-type]
        (doc["engines"][where] if where else doc)[field] = value
        r.publish(keys.channel, orjson.dumps(doc))
        core = router.core
        await await_until(lambda: core.counters["malformed"] == 1, 5, "the message read")
        # nothing of it adopted, and the feed never failed (no reconnect: not degraded)
        assert router.snapshot.version == v1 and core.counters["snapshots"] == 1  # type: ignore[union-attr]
        assert not router.degraded and router.last_error is None
        assert all(type(e.waiting) is int and type(e.running) is int for e in core.known)
        for _ in range(20):  # the paths that read the counts: route, end, loads
            d = router.route()
            router.finished(d)  # (ends reconciled by time: estimates.held_ended)
        assert set(core.loads()) == {"e0", "e1"}
        v2 = step_all(bar, 2)
        await await_until(lambda: router.snapshot.version == v2, 5, "a later snapshot")  # type: ignore[union-attr]
        assert router.snapshot.raw == bar.snapshot_raw()  # type: ignore[union-attr]
        assert not router.degraded
        assert {router.route().engine_id for _ in range(20)} == {"e0", "e1"}
    finally:
        await router.aclose()


async def test_a_malformed_stored_snapshot_is_counted_at_every_read_and_said_once(
    r: redis.Redis,
    redis_url: str,
    keys: DeploymentKeys,
    bar: Barrier,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The poll reads the stored snapshot again and again: a malformed one is ignored
    each time, counted each time, and logged once."""
    v1 = step_all(bar, 1)
    router = AsyncRouter(redis_url, keys.deployment, poll_s=0.05)
    await router.start(wait=5)
    try:
        doc = orjson.loads(bar.snapshot_raw())  # type: ignore[arg-type]
        doc["engines"]["e1"]["waiting"] = "x"
        with caplog.at_level(logging.WARNING, "redisbal.routing.router"):
            r.set(keys.snapshot, orjson.dumps({**doc, "version": v1 + 1}))
            await await_until(lambda: router.core.counters["malformed"] >= 3, 10, "3 polls")
        said = [m for m in caplog.messages if "malformed snapshot" in m]
        assert len(said) == 1 and "'e1': waiting" in said[0], said
        assert router.snapshot.version == v1 and not router.degraded  # type: ignore[union-attr]
    finally:
        await router.aclose()


async def test_poll_recovers_a_snapshot_whose_message_was_lost(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    """Pub/sub loses messages across disconnects; the periodic GET catches up."""
    v1 = step_all(bar, 1)
    router = AsyncRouter(redis_url, keys.deployment, poll_s=0.1)
    await router.start(wait=5)
    try:
        doc = orjson.loads(bar.snapshot_raw())  # type: ignore[arg-type]
        doc["version"] = v1 + 5
        doc["engines"]["e0"]["waiting"] = 99
        r.set(keys.snapshot, orjson.dumps(doc))  # stored, never published
        await await_until(lambda: router.snapshot.version == v1 + 5)  # type: ignore[union-attr]
        assert router.core.by_id["e0"].waiting == 99
    finally:
        await router.aclose()


async def test_departed_engine_is_not_routed_to_after_the_next_snapshot(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    step_all(bar, 1)
    router = AsyncRouter(redis_url, keys.deployment, poll_s=30)
    await router.start(wait=5)
    try:
        assert router.route("e1").engine_id == "e1"
        _, version = bar.leave("e1")
        await await_until(lambda: router.snapshot.version == version)  # type: ignore[union-attr]
        assert {router.route().engine_id for _ in range(50)} == {"e0"}
        with pytest.raises(UnknownEngine, match=r"'e1'.*it left"):
            router.route("e1")
    finally:
        await router.aclose()


# -- invariant 8: no I/O on the hot path ---------------------------------------------------------


async def test_route_does_no_io(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    """route()/finished() touch no socket and issue no Redis command, and keep working
    once the router's client is closed."""
    step_all(bar, 1)
    router = AsyncRouter(redis_url, keys.deployment, poll_s=30, stale_after_s=0.5)
    await router.start(wait=5)
    calls: Counter[str] = Counter()

    def trap(name: str) -> Any:
        def boom(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            raise AssertionError(f"I/O on the hot path: {name}")

        return boom

    with monkeypatch.context() as m:
        for meth in ("send", "sendall", "sendto", "recv", "recv_into", "connect", "sendmsg"):
            m.setattr(socket.socket, meth, trap(f"socket.{meth}"))
        m.setattr(redis.Redis, "execute_command", trap("Redis.execute_command"))
        m.setattr(redis.asyncio.Redis, "execute_command", trap("asyncio.Redis.execute_command"))
        decisions = [router.route() for _ in range(2000)]
        for d in decisions:
            router.finished(d)
    assert not calls  # what it costs is scripts/bench_core.py's to measure
    assert Counter(d.engine_id for d in decisions).keys() == {"e0", "e1"}
    await router.aclose()  # feed stopped, client closed: local state only
    assert router.route().engine_id in ("e0", "e1")
    # without a feed the snapshot ages: within stale_after_s routing says it is degraded
    await await_until(lambda: router.degraded, timeout=5)
    assert router.route().degraded


def test_blocking_router_keeps_routing_degraded_with_redis_stopped_and_resyncs(
    fresh_server: RedisServer,
) -> None:
    c = fresh_server.client()
    keys = DeploymentKeys("dep")
    bar = Barrier(c, keys)
    bar.configure()
    bar.register("e0", "e1")
    step_all(bar, 1)
    router = Router(fresh_server.url, "dep", poll_s=0.2)
    router.start(wait=5)
    try:
        assert router.snapshot is not None and not router.degraded
        epoch = router.snapshot.epoch
        fresh_server.kill()
        wait_until(lambda: router.degraded, timeout=5)
        with io_of_this_thread() as io:  # the router's poll thread keeps trying
            decisions = [router.route() for _ in range(1000)]
        assert not io, f"route() touched the network with Redis down: {io}"
        assert all(d.degraded for d in decisions)
        got = Counter(d.engine_id for d in decisions)
        assert abs(got["e0"] - got["e1"]) <= 2 and got.total() == 1000  # kept balancing
        assert router.route("e1").engine_id == "e1"
        # Redis back, empty: engines re-register, a new epoch starts, the router follows
        fresh_server.start()
        c2 = fresh_server.client()
        bar2 = Barrier(c2, keys, epoch="after-restart")
        bar2.configure()
        bar2.register("e0", "e1")
        step_all(bar2, 1)
        wait_until(lambda: router.snapshot.epoch == "after-restart", timeout=10)  # type: ignore[union-attr]
        assert router.snapshot.epoch != epoch  # type: ignore[union-attr]
        wait_until(lambda: not router.degraded, timeout=5)
        assert not router.route().degraded
        c2.close()
    finally:
        router.close()
        c.close()


def test_router_starts_and_routes_balanced_with_redis_unreachable(
    fresh_server: RedisServer,
) -> None:
    fresh_server.kill()
    router = Router(fresh_server.url, "dep", engines=["a", "b", "c"])
    router.start()  # returns (pytest's timeout guards a hang) though Redis is gone
    try:
        assert router.degraded and router.snapshot is None
        got = Counter(router.route().engine_id for _ in range(30))
        assert got == {"a": 10, "b": 10, "c": 10}
    finally:
        router.close()


# -- compact snapshots ----------------------------------------------------------------------------


async def test_feed_adopts_compact_snapshots_and_reads_a_roster_it_missed(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    """Past compact_from engines the channel carries ids only when the roster changes:
    a router routes on those counts, and one that has not seen a message's roster
    reads the stored snapshot (which has it) instead of dropping the update."""
    bar.configure(compact_from=0)
    step_all(bar, 1)
    router = AsyncRouter(redis_url, keys.deployment, poll_s=30)
    await router.start(wait=5)
    try:
        snap = router.snapshot
        assert snap is not None and snap.roster is not None
        assert sorted(snap.engines) == ["e0", "e1"]
        v2 = step_all(bar, 2)  # the same roster: a message without ids
        await await_until(lambda: router.snapshot.version == v2)  # type: ignore[union-attr]
        assert router.core.counters["roster_fetches"] == 0
        assert (router.core.by_id["e1"].waiting, router.core.by_id["e1"].running) == (1, 2)
        router._rosters = Rosters()  # as if the message that named it had been missed
        v3 = step_all(bar, 3)
        await await_until(lambda: router.snapshot.version == v3)  # type: ignore[union-attr]
        assert router.core.counters["roster_fetches"] == 1
        assert router.core.by_id["e1"].running == 3
        # a join is a new roster, named in the message itself
        bar.register("e2")
        step_all(bar, 4, ("e0", "e1", "e2"))  # (e2 joins ahead of this cut: in the next)
        v5 = step_all(bar, 5, ("e0", "e1", "e2"))
        await await_until(lambda: router.snapshot.version == v5)  # type: ignore[union-attr]
        assert sorted(router.snapshot.engines) == ["e0", "e1", "e2"]  # type: ignore[union-attr]
        assert router.core.counters["roster_fetches"] == 1
        assert {router.route().engine_id for _ in range(6)} == {"e0", "e1", "e2"}
    finally:
        await router.aclose()


# -- the cache view's reader ----------------------------------------------------------------------


async def test_the_reader_keeps_the_cache_view_fresh_and_restarts_after_an_error(
    r: redis.Redis, redis_url: str, keys: DeploymentKeys, bar: Barrier
) -> None:
    """A reader given as cache_sync is called again and again with the cursor it gave
    back, and what it reads from Redis shows in the view the policy reads; a reader
    that fails is called again from a None cursor (a whole read)."""
    prompt = chain_hashes(list(range(16 * 8)))
    held = f"{{{keys.deployment}}}:test-cache"  # this test's own record: engine -> anchors
    r.hset(held, "e1", b"".join(a.to_bytes(8, "big") for a in anchors(prompt)))
    cursors: list[Any] = []
    fail = [True]

    async def read(client: Any, k: DeploymentKeys, view: CacheView, cursor: Any) -> Any:
        cursors.append(cursor)
        if cursor == 2 and fail[0]:
            fail[0] = False
            raise redis.exceptions.ConnectionError("dropped")
        for eid, data in (await client.hgetall(held)).items():
            view.replace(eid.decode(), unpack_hashes(data))
        return (cursor or 0) + 1

    step_all(bar, 1)
    router = AsyncRouter(redis_url, keys.deployment, cache_sync=read, cache_refresh_s=0.01)
    await router.start(wait=5)
    try:
        await await_until(lambda: len(cursors) >= 5)
        assert cursors[:4] == [None, 1, 2, None]  # the failed read starts over
        assert router.core.cache_view.engines == {"e1": set(anchors(prompt))}
        d = router.route(blocks=prompt, prompt_tokens=len(prompt) * 16)
        assert d.engine_id == "e1" and d.cached == len(prompt)
    finally:
        await router.aclose()
    plain = AsyncRouter(redis_url, keys.deployment)
    await plain.refresh_cache_view()  # no reader: nothing to do, not even started
    assert plain.core.cache_view.engines == {}
